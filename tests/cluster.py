"""An emulated multi-host cluster on this machine: real network stacks, hostnames, sshd and links, no wires.

    with Cluster(hosts=2, name="hat", link="1gbit") as c:
        c.run("hat-h0", ["horovodrun", *c.horovodrun_args(slots=2), "python", "train.py"], timeout=300)

    python -m tests.cluster up --hosts 2 [--name hat] [--link 1gbit|10gbit|none] [--latency MS] [--debian-hosts]
    python -m tests.cluster run --name hat hat-h0 -- hostname
    python -m tests.cluster down [--name hat]

Each host ``<name>-h<i>`` is a Linux network namespace (``ip netns``) whose processes also get their own UTS
namespace (their own hostname). Every host has one veth, called ``eth1`` inside every host, into a bridge
``<name>br`` in the root namespace, and an address ``10.231.<X>.<i+1>/24`` of a subnet that only this
cluster uses (``X`` is derived from the name, so several clusters can run at once; the bridge itself has
``.254`` so the root namespace reaches the hosts too). A host has no other route: traffic goes only to the
cluster's addresses or to the host's own loopback (intra-host traffic never crosses its veth).

The filesystem is shared (namespaces of network and hostname only), as on a cluster with a shared home:
the repository and the .venv are at the same path on every host. Names resolve through a per-host hosts
file, ``/etc/netns/<netns>/hosts``, bound over /etc/hosts (a private mount namespace, as ``ip netns exec``
does it) for everything started on that host (sshd and thus every ssh session too). With ``loopback_names`` (``--debian-hosts``) a host's own
name resolves to 127.0.1.1, as Debian and Ubuntu install it; otherwise to its cluster address. The root
namespace resolves the names through tagged lines in /etc/hosts.

Each host runs Debian's OpenSSH server (``openssh-server``, installed with apt-get when /usr/sbin/sshd is
missing), key-only (one throw-away ed25519 client key, root login), listening on the host's address and
127.0.1.1 inside its namespace only. Its host key is listed (tagged lines) in /etc/ssh/ssh_known_hosts, so
plain ``ssh -i KEY host`` as horovodrun and mpirun run it needs no prompt and writes nothing to
~/.ssh/known_hosts; ``ssh -F <dir>/ssh_config host`` needs nothing else. A drop-in
``/etc/ssh/ssh_config.d/hat-cluster-<name>.conf`` gives that plain ssh a keepalive to the cluster's hosts
(``ServerAliveInterval 2``, ``ServerAliveCountMax 3``), so a session to a host whose link went down ends
within about 6 s instead of the TCP retransmission timeout (Horovod elastic's driver waits on it).

Links: ``link`` caps every host's veth in both directions with ``tc tbf`` (``1gbit``, ``10gbit``, any tc rate,
or None); ``latency_ms`` adds a one-way host-to-host delay with ``tc netem`` (where the kernel has it).

Teardown (``stop``, the context manager's exit, ``down``, or the next ``up`` of the same name after a crash)
kills every process inside the cluster's namespaces by pid, deletes namespaces, veths and bridge, the
per-host hosts files, the tagged lines and the ssh drop-in. All state (keys, configs, logs, ``state.json`` with the pids) is
in ``<tmpdir>/hat-clusters/<name>``. ``ClusterUnavailable`` says why a cluster cannot be made here (not root,
no namespaces, no sshd and no apt-get).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import psutil

IFACE = "eth1"
SUBNET_PREFIX = "10.231"
LOOPBACK_NAME_ADDR = "127.0.1.1"
HOSTS_FILE = Path("/etc/hosts")
KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
SSH_CONFIG_D = Path("/etc/ssh/ssh_config.d")  # Debian's /etc/ssh/ssh_config includes *.conf here
NETNS_ETC = Path("/etc/netns")
SSHD = "/usr/sbin/sshd"
STATE_ROOT = Path(tempfile.gettempdir()) / "hat-clusters"
NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
RATE_RE = re.compile(r"^\d+(\.\d+)?([kmgt]?bit|[kmgt]?bps)$")
LINKS = {"1gbit": "1gbit", "10gbit": "10gbit", "none": None}
APT_TIMEOUT = 600


class ClusterError(RuntimeError):
    """Setting up, using or tearing down the cluster failed; the message says what and what to do."""


class ClusterUnavailable(ClusterError):
    """No cluster can be made on this machine (not root, no network namespaces, no sshd to install)."""


@dataclass
class Host:
    """One emulated host: its hostname (also its netns name), index, cluster address and root-side veth."""
    name: str
    index: int
    address: str
    veth: str

    @property
    def netns(self) -> str:
        return self.name


def _sh(cmd: Sequence[str], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    """Run a set-up command; with ``check`` a non-zero exit raises ClusterError with its stderr."""
    try:
        r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {exc}") from None
    if check and r.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r


def unavailable_reason() -> Optional[str]:
    """Why no cluster can be made here (None: it can): root, ip/unshare/tc and a network namespace needed."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces, veths and /etc/hosts entries needs root (CAP_NET_ADMIN)"
    missing = [p for p in ("ip", "nsenter", "unshare", "tc", "ssh", "ssh-keygen") if shutil.which(p) is None]
    if missing:
        return f"missing programs: {' '.join(missing)} (Debian: iproute2 util-linux openssh-client)"
    r = _sh(["unshare", "--net", "--uts", "--mount", "true"], check=False)
    if r.returncode != 0:
        return f"cannot create network/UTS namespaces here: {r.stderr.strip()}"
    return None


def ensure_sshd(install: bool = True) -> str:
    """The path of Debian's sshd; installs ``openssh-server`` with apt-get when it is missing (root)."""
    if Path(SSHD).exists():
        return SSHD
    if not install or shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"{SSHD} is missing and apt-get is not available to install openssh-server")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "openssh-server"]):
        r = _sh(cmd, timeout=APT_TIMEOUT, check=False, env=env)
        if r.returncode != 0:
            raise ClusterUnavailable(f"`{' '.join(cmd)}` exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
    if not Path(SSHD).exists():
        raise ClusterUnavailable(f"apt-get install openssh-server did not provide {SSHD}")
    return SSHD


# ---------------------------------------------------------------------------------------------------------
# Tagged lines in shared files, processes, state
# ---------------------------------------------------------------------------------------------------------

def _marker(name: str) -> str:
    return f"#hat-cluster:{name}"


def edit_tagged(path: Path, name: str, lines: Iterable[str] = ()) -> None:
    """Drop the lines of ``path`` tagged for cluster ``name`` and append ``lines`` with that tag.

    The file is rewritten in place (same inode: /etc/hosts is often a bind mount in containers)."""
    tag = _marker(name)
    old = path.read_text().splitlines() if path.exists() else []
    kept = [ln for ln in old if not (ln.split() and ln.split()[-1] == tag)]
    new = kept + [f"{ln} {tag}" for ln in lines]
    if new == old:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write("\n".join(new) + ("\n" if new else ""))


def netns_pids(netns: str) -> List[int]:
    """Every process inside network namespace ``netns`` (``ip netns pids``); [] when there is none."""
    r = _sh(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()] if r.returncode == 0 else []


def kill_pids(pids: Iterable[int], grace: float = 3.0) -> List[int]:
    """SIGTERM the given pids, SIGKILL what is left after ``grace`` s; returns the pids that were signalled."""
    procs = []
    for pid in set(pids) - {os.getpid()}:
        try:
            p = psutil.Process(pid)
            p.terminate()
            procs.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in procs]


def _state_dir(name: str) -> Path:
    return STATE_ROOT / name


def _read_state(name: str) -> Optional[dict]:
    try:
        return json.loads((_state_dir(name) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _start_ticks(pid: int) -> Optional[int]:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22); None if gone.

    A stamp that the wall clock cannot move. ``psutil.Process.create_time()`` (psutil 7) adds the boot time,
    re-read from ``/proc/stat`` at every call, and that moves when the clock is stepped (NTP on a VM): a
    listener compared by it within 1 s can look dead and be reaped with a job's leftovers, which fits the
    CI run where every run after test_elastic_hosts' reference met "Connection refused" on all 3 hosts."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _pid_alive(pid: Optional[int], started: Optional[int]) -> bool:
    """The recorded process still runs (same pid *and* start tick, so a reused pid does not count)."""
    return bool(pid) and started is not None and _start_ticks(pid) == started


def _subnet_index(name: str, taken: Iterable[int]) -> int:
    """``X`` of 10.231.X.0/24: from the name's CRC, the next free one if a live cluster or address has it."""
    used = set(taken)
    addrs = _sh(["ip", "-o", "-4", "addr"], check=False).stdout
    used |= {int(m) for m in re.findall(rf"inet {re.escape(SUBNET_PREFIX)}\.(\d+)\.", addrs)}
    start = zlib.crc32(name.encode()) % 200 + 20
    for k in range(250):
        x = (start + k - 1) % 250 + 1
        if x not in used:
            return x
    raise ClusterError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16")


def live_clusters() -> Dict[str, dict]:
    """State of every cluster whose state file is present (live or left by a crash)."""
    found = {}
    if STATE_ROOT.is_dir():
        for d in STATE_ROOT.iterdir():
            state = _read_state(d.name)
            if state is not None:
                found[d.name] = state
    return found


def teardown(name: str) -> List[str]:
    """Remove everything of cluster ``name`` (from its state file, else from the names it derives).

    Kills every process in its namespaces by pid, deletes namespaces, veths, bridge, per-host hosts files,
    tagged /etc/hosts and ssh_known_hosts lines and the state directory. Returns what it removed."""
    state = _read_state(name) or {}
    hosts = [Host(**h) for h in state.get("hosts", [])]
    known = {h.name for h in hosts}
    listed = _sh(["ip", "netns", "list"], check=False).stdout.split()
    known |= {ns for ns in listed if re.fullmatch(rf"{re.escape(name)}-h\d+", ns)}
    done = []
    for ns in sorted(known):
        killed = kill_pids(netns_pids(ns))
        if killed:
            done.append(f"{len(killed)} process(es) on {ns}")
        if ns in listed:
            _sh(["ip", "netns", "del", ns], check=False)
            done.append(f"netns {ns}")
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    links = _sh(["ip", "-o", "link"], check=False).stdout
    for dev in sorted(set(re.findall(rf"^\d+: ({re.escape(name)}(?:br|v\d+|p\d+))[@:]", links, re.M))):
        _sh(["ip", "link", "del", dev], check=False)
        done.append(f"link {dev}")
    for path in (HOSTS_FILE, KNOWN_HOSTS):
        if path.exists() and _marker(name) in path.read_text():
            edit_tagged(path, name)
            done.append(f"lines in {path}")
    keepalive = _keepalive_file(name)
    if keepalive.exists():
        keepalive.unlink()
        done.append(str(keepalive))
    shutil.rmtree(_state_dir(name), ignore_errors=True)
    for empty in (NETNS_ETC, STATE_ROOT):  # only when no other cluster uses them
        try:
            empty.rmdir()
        except OSError:
            pass
    return done


def _keepalive_file(name: str) -> Path:
    return SSH_CONFIG_D / f"hat-cluster-{name}.conf"


def write_keepalive(name: str, interval_s: int = 2, count: int = 3) -> Optional[Path]:
    """Make plain ``ssh`` to this cluster's hosts (as horovodrun and mpirun run it) give up on a host that
    stopped answering after ``interval_s x count`` seconds (``ServerAliveInterval``): without it an ssh
    session to a host whose link silently died lives for the kernel's TCP retransmission timeout (about
    15 minutes), and Horovod elastic's driver waits for that host's worker all that time. Returns the file,
    or None where the system ssh config has no drop-in folder."""
    if not SSH_CONFIG_D.is_dir():
        return None
    path = _keepalive_file(name)
    path.write_text(f"# {_marker(name)}: written by tests/cluster.py, removed at teardown\n"
                    f"Host {name}-h*\n    ServerAliveInterval {interval_s}\n    ServerAliveCountMax {count}\n")
    return path


def reap_crashed() -> List[str]:
    """Tear down clusters started by a test session (``owner``) whose owning process is gone."""
    gone = []
    for name, state in live_clusters().items():
        owner = state.get("owner")
        if owner and not _pid_alive(owner.get("pid"), owner.get("started")):
            teardown(name)
            gone.append(name)
    return gone


def _rate_bits(rate: str) -> float:
    """bits/s of a tc rate such as ``1gbit``, ``100mbit``, ``10mbps`` (tc: k/m/g = 1000s, bps = bytes/s)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)", rate)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    return float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)


def parse_link(link: Optional[str]) -> Optional[str]:
    """``1gbit`` / ``10gbit`` / ``none`` / None / any tc rate -> the tc rate (None: uncapped)."""
    if link is None or link in LINKS:
        return LINKS.get(link) if link else None
    if not RATE_RE.fullmatch(link):
        raise ClusterError(f"--link {link!r}: use 1gbit, 10gbit, none or a tc rate such as 100mbit")
    return link


# ---------------------------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------------------------

class Hosts:
    """The hosts of a running cluster: running commands on them, launcher options, their processes.

    The base of ``Cluster`` (which sets the attributes: ``name``, ``hosts``, ``iface``, ``dir``, ``daemons``, ...)."""

    # --- names -------------------------------------------------------------------------------------------
    @property
    def key(self) -> Path:
        """The throw-away ssh client key every host accepts (for ``ssh -i`` / ``--ssh-identity-file``)."""
        return self.dir / "id_ed25519"

    @property
    def ssh_config(self) -> Path:
        """An ssh client config with key, user and known hosts: ``ssh -F <this> <host> cmd`` just works."""
        return self.dir / "ssh_config"

    def host(self, which: Union[str, int, Host]) -> Host:
        """A host by index, hostname or Host."""
        if isinstance(which, Host):
            return which
        for h in self.hosts:
            if which in (h.index, h.name):
                return h
        raise ClusterError(f"cluster {self.name} has no host {which!r} (hosts: {[h.name for h in self.hosts]})")

    # --- use ---------------------------------------------------------------------------------------------
    def on_host(self, host: Union[str, int, Host], cmd: Sequence[str]) -> List[str]:
        """``cmd`` as run on ``host``: inside its network namespace (and hosts file), under its hostname."""
        h = self.host(host)
        # nsenter, not `ip netns exec`: that one remounts /sys, which hides the cgroup mounts (slurmd needs them).
        # The private mount namespace of unshare binds the host's hosts file over /etc/hosts, as `ip netns exec`
        # would (the same file, so set_loopback_names reaches running hosts).
        script = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--mount", "--propagation", "private", "--uts",
                "--", "sh", "-c", script, h.name, str(NETNS_ETC / h.netns / "hosts"), *map(str, cmd)]

    def run(self, host: Union[str, int, Host], cmd: Sequence[str], timeout: float,
            env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
            settle: float = 10.0) -> Tuple[Optional[int], str, float]:
        """Run ``cmd`` on ``host`` under a timeout (tests.harness.run_command: its process tree is killed at
        the end). Then waits up to ``settle`` s for the processes it started on any host to end, keeps what is
        still there in ``self.left_behind`` ({host: [pid: cmdline]}) and kills it.
        Returns ``(returncode or None on timeout, output, seconds)``."""
        from tests.harness import run_command
        self.check_daemons()
        try:
            return run_command(self.on_host(host, cmd), timeout=timeout, env=env, cwd=cwd)
        finally:
            deadline = time.monotonic() + settle
            self.left_behind = self.leftovers()
            while self.left_behind and time.monotonic() < deadline:
                time.sleep(0.2)
                self.left_behind = self.leftovers()
            self.reap()

    def popen(self, host: Union[str, int, Host], cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` in its own session (``kw`` go to Popen); the caller waits and reaps."""
        kw.setdefault("start_new_session", True)
        self.check_daemons()
        return subprocess.Popen(self.on_host(host, cmd), **kw)

    def host_list(self, slots: int = 1, hosts: Optional[Sequence[Union[str, int]]] = None) -> str:
        """``h0:S,h1:S`` for ``-H`` of horovodrun and mpirun."""
        chosen = [self.host(h) for h in hosts] if hosts is not None else self.hosts
        return ",".join(f"{h.name}:{slots}" for h in chosen)

    def hostfile(self, path: Path, slots: int = 1, style: str = "mpi") -> Path:
        """Write a hostfile: ``h slots=S`` lines (Open MPI, ``style='mpi'``) or ``h:S`` (horovodrun)."""
        fmt = "{h} slots={s}" if style == "mpi" else "{h}:{s}"
        Path(path).write_text("".join(fmt.format(h=h.name, s=slots) + "\n" for h in self.hosts))
        return Path(path)

    def horovodrun_args(self, slots: int = 1) -> List[str]:
        """horovodrun options for this cluster: host list, interface and the ssh key."""
        return ["-np", str(slots * self.n), "-H", self.host_list(slots), "--network-interface", self.iface,
                "--ssh-identity-file", str(self.key)]

    def mpirun_args(self, slots: int = 1) -> List[str]:
        """Open MPI mpirun options: host list, ssh through this cluster's config, TCP on ``iface``."""
        return ["-np", str(slots * self.n), "-H", self.host_list(slots),
                "--mca", "plm_rsh_args", f"-F {self.ssh_config}",
                "--mca", "btl_tcp_if_include", self.iface, "--mca", "oob_tcp_if_include", self.iface]

    def ssh(self, host: Union[str, int, Host], cmd: Sequence[str]) -> List[str]:
        """An ssh command line (from the root namespace) that runs ``cmd`` on ``host``."""
        return ["ssh", "-F", str(self.ssh_config), self.host(host).name, *map(str, cmd)]

    def _daemon_pids(self) -> set:
        return {pid for pid, started in self.daemons.values() if _pid_alive(pid, started)}

    def check_daemons(self) -> None:
        """Raise ClusterError (with its log) if a host's sshd listener is gone: a run would only meet
        "Connection refused" from every ssh, far from the cause."""
        for name, (pid, started) in self.daemons.items():
            if not _pid_alive(pid, started):
                log = self.dir / name.split("@")[1] / "sshd.log"
                tail = log.read_text(errors="replace")[-2000:] if log.is_file() else "(no log)"
                raise ClusterError(f"{name} (pid {pid}) is no longer running; its log:\n{tail}")

    def processes(self, host: Union[str, int, Host, None] = None) -> List[psutil.Process]:
        """The processes on ``host`` (all hosts if None) other than its sshd listener."""
        chosen = [self.host(host)] if host is not None else self.hosts
        keep = self._daemon_pids()
        procs = []
        for h in chosen:
            for pid in netns_pids(h.netns):
                if pid not in keep:
                    try:
                        procs.append(psutil.Process(pid))
                    except psutil.Error:
                        pass
        return procs

    def leftovers(self, needle: str = "") -> Dict[str, List[str]]:
        """``{host: [cmdline, ..]}`` of the processes (``needle`` in their command line) still on each host,
        not counting sshd (listener and its sessions)."""
        found: Dict[str, List[str]] = {}
        for h in self.hosts:
            for p in self.processes(h):
                try:
                    line = " ".join(p.cmdline())
                except psutil.Error:
                    continue
                if needle in line and not line.startswith(("sshd:", SSHD)):
                    found.setdefault(h.name, []).append(f"{p.pid}: {line[:200]}")
        return found

    def reap(self) -> List[int]:
        """Kill (by pid) every process on the hosts but their sshd listeners; returns the pids."""
        return kill_pids([p.pid for p in self.processes()])

    def set_link(self, host: Union[str, int, Host], up: bool) -> None:
        """``ip link set eth1 up|down`` inside ``host``: its link to every other host goes (or comes back)."""
        h = self.host(host)
        _sh(["ip", "netns", "exec", h.netns, "ip", "link", "set", self.iface, "up" if up else "down"])

    def describe(self) -> str:
        """What is up and how to use it, for people."""
        link = self.rate or "uncapped"
        if self.latency_ms:
            link += f", +{self.latency_ms} ms one-way"
        rows = "\n".join(f"  {h.name:<12} {h.address:<15} netns {h.netns}, veth {h.veth} <-> {self.iface}"
                         for h in self.hosts)
        first = self.hosts[0].name
        return (f"cluster {self.name}: {self.n} host(s) on {SUBNET_PREFIX}.{self.subnet}.0/24 via bridge "
                f"{self.bridge} ({link}); own name -> "
                f"{LOOPBACK_NAME_ADDR if self.loopback_names else 'own address'}\n{rows}\n"
                f"run on a host:  python -m tests.cluster run --name {self.name} {first} -- CMD ...\n"
                f"ssh:            ssh -F {self.ssh_config} {first}\n"
                f"horovodrun:     horovodrun {' '.join(self.horovodrun_args(2))} python ...\n"
                f"mpirun:         mpirun {' '.join(a if ' ' not in a else repr(a) for a in self.mpirun_args(2))} "
                f"python ...\n"
                f"stop:           python -m tests.cluster down --name {self.name}")




class Cluster(Hosts):
    """N emulated hosts ``<name>-h0 ..``; see the module docstring. Use as a context manager or start/stop."""

    def __init__(self, hosts: int = 2, name: str = "hat", link: Optional[str] = None,
                 latency_ms: Optional[float] = None, loopback_names: bool = False, iface: str = IFACE,
                 owned: bool = True, install_sshd: bool = True, start_timeout: float = 60.0) -> None:
        if not NAME_RE.fullmatch(name):
            raise ClusterError(f"cluster name {name!r}: 1-8 characters, a-z then a-z/0-9 (it prefixes "
                               f"interface names, which Linux limits to 15 characters)")
        if not 1 <= hosts <= 32:
            raise ClusterError(f"--hosts {hosts}: between 1 and 32")
        if latency_ms is not None and latency_ms < 0:
            raise ClusterError(f"--latency {latency_ms}: milliseconds >= 0")
        self.name, self.n, self.iface = name, hosts, iface
        self.rate, self.latency_ms = parse_link(link), latency_ms
        self.loopback_names, self.owned, self.install_sshd = loopback_names, owned, install_sshd
        self.start_timeout = start_timeout
        self.dir = _state_dir(name)
        self.bridge = f"{name}br"
        self.hosts: List[Host] = []
        self.subnet: Optional[int] = None
        self.daemons: Dict[str, Tuple[int, int]] = {}
        self.left_behind: Dict[str, List[str]] = {}

    def _save(self) -> None:
        owner = None
        if self.owned:
            owner = {"pid": os.getpid(), "started": _start_ticks(os.getpid())}
        state = {"name": self.name, "subnet": self.subnet, "bridge": self.bridge, "iface": self.iface,
                 "rate": self.rate, "latency_ms": self.latency_ms, "loopback_names": self.loopback_names,
                 "owner": owner, "hosts": [asdict(h) for h in self.hosts],
                 "daemons": {k: list(v) for k, v in self.daemons.items()}}
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.dir / "state.json")

    @classmethod
    def attach(cls, name: str) -> "Cluster":
        """The running cluster ``name`` (started by ``up`` or by another process), from its state file."""
        state = _read_state(name)
        if state is None or not state.get("hosts"):
            raise ClusterError(f"no cluster {name!r} is up (no {_state_dir(name)}/state.json); "
                               f"start one with `python -m tests.cluster up --name {name}`")
        c = cls(hosts=len(state["hosts"]), name=name, link=state["rate"], latency_ms=state["latency_ms"],
                loopback_names=state["loopback_names"], iface=state["iface"], owned=False)
        c.hosts = [Host(**h) for h in state["hosts"]]
        c.subnet = state["subnet"]
        c.daemons = {k: tuple(v) for k, v in state["daemons"].items()}
        return c

    # --- start -------------------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        """Create namespaces, links, names, keys and sshds; raise ClusterUnavailable / ClusterError."""
        why = unavailable_reason()
        if why:
            raise ClusterUnavailable(why)
        ensure_sshd(self.install_sshd)
        reap_crashed()
        old = _read_state(self.name)
        if old and any(_pid_alive(*v) for v in old.get("daemons", {}).values()):
            raise ClusterError(f"cluster {self.name!r} is already up; stop it with "
                               f"`python -m tests.cluster down --name {self.name}` or pick another --name")
        teardown(self.name)  # leftovers of a crash under this name
        taken = [s.get("subnet") for n, s in live_clusters().items() if n != self.name]
        self.subnet = _subnet_index(self.name, [t for t in taken if t])
        self.dir.mkdir(parents=True, mode=0o700)
        self.hosts = [Host(f"{self.name}-h{i}", i, f"{SUBNET_PREFIX}.{self.subnet}.{i + 1}", f"{self.name}v{i}")
                      for i in range(self.n)]
        try:
            self._save()
            self._make_keys()
            self._make_network()
            self._write_names()
            for h in self.hosts:
                self._start_sshd(h)
            self._save()
            self._wait_for_ssh()
        except BaseException:
            self.stop()
            raise
        return self

    def _make_keys(self) -> None:
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hat-cluster-{self.name}", "-f", str(self.key)])
        shutil.copy(self.key.with_suffix(".pub"), self.dir / "authorized_keys")
        known = []
        for h in self.hosts:
            hk = self.dir / h.name / "ssh_host_ed25519_key"
            hk.parent.mkdir(mode=0o700)
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(hk)])
            kind, blob = hk.with_suffix(".pub").read_text().split()[:2]
            known.append(f"{h.name},{h.address} {kind} {blob}")
        (self.dir / "known_hosts").write_text("\n".join(known) + "\n")
        edit_tagged(KNOWN_HOSTS, self.name, known)
        write_keepalive(self.name)
        self.ssh_config.write_text(
            "Host *\n    User root\n    Port 22\n"
            f"    IdentityFile {self.key}\n    IdentitiesOnly yes\n    BatchMode yes\n"
            f"    UserKnownHostsFile {self.dir / 'known_hosts'}\n    StrictHostKeyChecking yes\n"
            "    CheckHostIP no\n    ConnectTimeout 10\n    ServerAliveInterval 5\n    ServerAliveCountMax 3\n"
            "    LogLevel ERROR\n")

    def _make_network(self) -> None:
        _sh(["ip", "link", "add", self.bridge, "type", "bridge"])
        _sh(["ip", "addr", "add", f"{SUBNET_PREFIX}.{self.subnet}.254/24", "dev", self.bridge])
        _sh(["ip", "link", "set", self.bridge, "up"])
        for h in self.hosts:
            peer = f"{self.name}p{h.index}"
            _sh(["ip", "netns", "add", h.netns])
            _sh(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", peer])
            _sh(["ip", "link", "set", peer, "netns", h.netns])
            inside = ["ip", "netns", "exec", h.netns]
            _sh([*inside, "ip", "link", "set", peer, "name", self.iface])
            _sh([*inside, "ip", "addr", "add", f"{h.address}/24", "dev", self.iface])
            _sh([*inside, "ip", "link", "set", self.iface, "up"])
            _sh([*inside, "ip", "link", "set", "lo", "up"])
            _sh(["ip", "link", "set", h.veth, "master", self.bridge])
            _sh(["ip", "link", "set", h.veth, "up"])
            self._cap(h)

    def _cap(self, h: Host) -> None:
        """tbf at ``rate`` on both ends of the host's veth; netem delay (one-way) on the host's end."""
        if self.rate:
            burst = max(int(_rate_bits(self.rate) / 8 / 100), 131072)  # 10 ms of traffic, >= a 64k GSO frame
            _sh(["tc", "qdisc", "replace", "dev", h.veth, "root", "tbf", "rate", self.rate, "burst", str(burst),
                 "latency", "100ms"])
        inside = ["ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", self.iface, "root"]
        if self.latency_ms:
            rate = ["rate", self.rate] if self.rate else []
            r = _sh([*inside, "netem", "delay", f"{self.latency_ms}ms", *rate, "limit", "100000"], check=False)
            if r.returncode != 0:
                raise ClusterError(f"--latency needs tc's netem qdisc (kernel module sch_netem), which this kernel "
                                   f"does not offer: {r.stderr.strip()}; run without --latency")
        elif self.rate:
            _sh([*inside, "tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"])

    def hosts_file_text(self, h: Host) -> str:
        """The hosts file of host ``h``: its own name on 127.0.1.1 with ``loopback_names`` (Debian's way)."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if self.loopback_names:
            lines.append(f"{LOOPBACK_NAME_ADDR}\t{h.name}")
        lines += [f"{o.address}\t{o.name}" for o in self.hosts if not (self.loopback_names and o is h)]
        return "\n".join(lines) + "\n"

    def _write_names(self) -> None:
        for h in self.hosts:
            path = NETNS_ETC / h.netns / "hosts"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a+") as f:  # in place: running hosts have this inode bound over /etc/hosts
                f.seek(0)
                f.truncate()
                f.write(self.hosts_file_text(h))
        edit_tagged(HOSTS_FILE, self.name, [f"{h.address}\t{h.name}" for h in self.hosts])

    def set_loopback_names(self, on: bool) -> None:
        """Switch every host's own name between 127.0.1.1 (Debian) and its address, for running hosts too."""
        self.loopback_names = on
        self._write_names()
        self._save()

    def _start_sshd(self, h: Host) -> None:
        d = self.dir / h.name
        cfg = d / "sshd_config"
        cfg.write_text(
            f"Port 22\nListenAddress {h.address}\nListenAddress {LOOPBACK_NAME_ADDR}\n"
            f"HostKey {d / 'ssh_host_ed25519_key'}\nPidFile {d / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
            "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\nUseDNS no\nPrintMotd no\n"
            "PermitUserEnvironment no\nClientAliveInterval 5\nClientAliveCountMax 3\n"
            "MaxStartups 200:30:400\nMaxSessions 200\nLogLevel ERROR\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        with open(d / "sshd.log", "ab") as log:
            p = subprocess.Popen(self.on_host(h, [SSHD, "-D", "-e", "-f", str(cfg)]), stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons[f"sshd@{h.name}"] = (p.pid, _start_ticks(p.pid))
        self._save()

    def _wait_for_ssh(self) -> None:
        """Every host reaches every host (itself by name too) over ssh, and sees the right hostname."""
        deadline = time.monotonic() + self.start_timeout
        pending = [(a, b) for a in self.hosts for b in self.hosts]
        last = ""
        while pending and time.monotonic() < deadline:
            a, b = pending[0]
            r = _sh(self.on_host(a, ["ssh", "-F", str(self.ssh_config), b.name, "hostname"]), check=False)
            if r.returncode == 0 and r.stdout.strip() == b.name:
                pending.pop(0)
                continue
            last = f"ssh {a.name} -> {b.name}: exit {r.returncode} {r.stdout.strip()} {r.stderr.strip()}"
            self.check_daemons()
            time.sleep(0.3)
        if pending:
            raise ClusterError(f"hosts not reachable over ssh after {self.start_timeout:.0f}s; last: {last}")

    # --- stop --------------------------------------------------------------------------------------------
    def stop(self) -> List[str]:
        """Kill every process on the hosts, remove namespaces, links, names and the state directory."""
        return teardown(self.name)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def main(argv: Optional[List[str]] = None) -> int:
    """``up`` / ``down`` / ``status`` / ``run HOST -- CMD`` (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m tests.cluster", description="emulated multi-host cluster")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create and start a cluster (stays up until `down`)")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--link", default="none", help="1gbit, 10gbit, none or a tc rate (per host veth)")
    up.add_argument("--latency", type=float, default=None, metavar="MS", help="one-way host-to-host delay")
    up.add_argument("--debian-hosts", action="store_true", help="each host's own name resolves to 127.0.1.1")
    for sp in (up, sub.add_parser("down", help="stop a cluster and remove all it made"),
               sub.add_parser("status", help="describe a running cluster")):
        sp.add_argument("--name", default="hat", help="cluster name (prefix of hosts, netns, links)")
    run = sub.add_parser("run", help="run a command on a host: run HOST -- CMD ...")
    run.add_argument("--name", default="hat")
    run.add_argument("host")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        if args.cmd == "up":
            c = Cluster(args.hosts, args.name, args.link, args.latency, args.debian_hosts, owned=False).start()
            print(c.describe())
        elif args.cmd == "down":
            done = teardown(args.name)
            print(f"cluster {args.name}: removed " + (", ".join(done) if done else "nothing (was not up)"))
        elif args.cmd == "status":
            print(Cluster.attach(args.name).describe())
        else:
            cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not cmd:
                p.error("run: give the command after `--`")
            return subprocess.call(Cluster.attach(args.name).on_host(args.host, cmd))
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


def module_cluster(hosts: int, name: str, **kwargs):
    """The body of a module-scoped pytest fixture: a started cluster, skipped (with the reason) where none
    can be made here, stopped afterwards. ``yield from module_cluster(3, f"ea{os.getpid() % 10 ** 6}")``."""
    import pytest

    why = unavailable_reason()
    if why:
        pytest.skip(f"no emulated cluster here: {why}")
    try:
        c = Cluster(hosts=hosts, name=name, **kwargs).start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no emulated cluster here: {exc}")
    try:
        yield c
    finally:
        c.stop()
