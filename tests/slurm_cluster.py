"""A throw-away one-node Slurm cluster on this machine, for tests (``with SlurmCluster() as c: ...``).

It runs Debian's ``munged``, ``slurmctld`` and ``slurmd`` in the foreground as child processes of the test
(root only), listening on 127.0.0.1 only, with every config, key, socket, state, spool, log and pid file in a
fresh temporary directory. No systemd, no cgroups (proctrack/linuxproc, task/none), no accounting.
On exit it cancels the cluster's jobs, stops the daemons by process id, ends any job process that is still
left over (found by this cluster's own SLURM_CONF path in its environment) and removes the directory.

``MultiHostSlurmCluster(cluster)`` spreads the same cluster over the hosts of an emulated multi-host
``tests.cluster.Cluster``: slurmctld on its first host, one slurmd per host (each on its own address, with its
own spool, pid and log file, ``%n`` in slurm.conf) and one munged per host, all with the same key.

``ClusterUnavailable`` is raised (with the daemons' logs in the message) when the cluster does not come up.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo", "munge", "unmunge")


class ClusterUnavailable(RuntimeError):
    """The cluster could not be started here; the message says why (and holds the daemons' logs)."""


def missing_programs() -> List[str]:
    return [p for p in DAEMONS + CLIENTS if shutil.which(p) is None]


def free_ports(n: int) -> List[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def free_port_range(width: int, lo: int = 40000, hi: int = 60000) -> range:
    """A run of ``width`` consecutive ports that are all free on 127.0.0.1 right now."""
    for start in range(lo + (os.getpid() % 97) * 100, hi - width, width):
        socks = []
        try:
            for port in range(start, start + width):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return range(start, start + width)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise ClusterUnavailable(f"no {width} consecutive free ports between {lo} and {hi}")


class SlurmCluster:
    """One node (``hostname -s``, NodeAddr=127.0.0.1, CPUs = ``os.cpu_count()``), one partition ``debug``."""

    def __init__(self, cpus: Optional[int] = None, start_timeout: float = 60.0, keep_dir: bool = False):
        self.cpus = cpus or os.cpu_count() or 1
        self.start_timeout = start_timeout
        self.keep_dir = keep_dir
        self.node = socket.gethostname().split(".")[0]
        self.nodes: List[Tuple[str, str]] = [(self.node, "127.0.0.1")]  # (NodeName, NodeAddr)
        self.ctld_host, self.ctld_addr = self.node, "127.0.0.1"
        self.dir: Optional[Path] = None
        self.procs: Dict[str, subprocess.Popen] = {}
        self.env: Dict[str, str] = {}
        self.submitted: List[str] = []

    # ---------------------------------------------------------------------------------------------------
    # set-up
    # ---------------------------------------------------------------------------------------------------

    def _write_config(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log", "run", "tmpfs"):
            (d / sub).mkdir(mode=0o700)
        for node, _ in self.nodes:
            (d / "spool" / f"slurmd-{node}").mkdir(mode=0o755)
        os.chmod(d, 0o711)  # munged wants its socket's directories searchable by everyone
        os.chmod(d / "munge", 0o711)
        key = d / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        self.munge_socket = d / "munge" / "munge.socket"
        ctld_port, slurmd_port = free_ports(2)
        srun_ports = free_port_range(20)
        self.conf = d / "slurm.conf"
        node_lines = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} CPUs={self.cpus} State=UNKNOWN"
                               for n, a in self.nodes)
        self.conf.write_text(f"""\
# test cluster; its own addresses only; nothing outside {d}
ClusterName=hattest
SlurmctldHost={self.ctld_host}({self.ctld_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SrunPortRange={srun_ports.start}-{srun_ports.stop - 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/slurmd-%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS={d}/tmpfs
# no systemd, no cgroups
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# no accounting (so no sacct: poll scontrol / squeue)
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
KillWait=5
MinJobAge=600
{node_lines}
PartitionName=debug Nodes={",".join(n for n, _ in self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        for var in list(self.env):  # stale job variables from an enclosing allocation would confuse sbatch
            if var.startswith(("SLURM_", "SBATCH_", "SRUN_")) and var != "SLURM_CONF":
                del self.env[var]

    def _where(self, name: str, cmd: List[str]) -> List[str]:
        """The command line that starts daemon ``name`` (here: as it is; on emulated hosts: on its host)."""
        return cmd

    def _spawn(self, name: str, cmd: List[str]) -> None:
        cmd = self._where(name, cmd)
        log = open(self.dir / "log" / f"{name}.stdout", "wb")
        try:
            self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                env=self.env, cwd=self.dir, start_new_session=True)
        finally:
            log.close()

    def _wait_for(self, what: str, check, daemon: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            proc = self.procs[daemon]
            if proc.poll() is not None:
                raise ClusterUnavailable(f"{daemon} exited with status {proc.returncode} while waiting for {what}")
            if check():
                return
            time.sleep(0.5)
        raise ClusterUnavailable(f"timed out after {self.start_timeout:.0f}s waiting for {what}")

    def _quiet(self, cmd: List[str], timeout: float = 20, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("env", self.env)
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)

    def _munge_dirs(self) -> List[Tuple[str, Path]]:
        """(daemon name, directory with its key and socket) of every munged to start."""
        return [("munged", self.dir / "munge")]

    def _munge_ok(self, socket_path: Optional[Path] = None) -> bool:
        sock = str(socket_path or self.munge_socket)
        try:
            cred = self._quiet(["munge", "-n", "-S", sock], timeout=5)
            if cred.returncode != 0:
                return False
            return self._quiet(["unmunge", "-S", sock], input=cred.stdout, timeout=5).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _ctld_ok(self) -> bool:
        try:
            r = self._quiet(["scontrol", "ping"], timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return r.returncode == 0 and "UP" in r.stdout

    def node_state(self) -> str:
        try:
            r = self._quiet(["sinfo", "-h", "-N", "-o", "%T"], timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        return r.stdout.strip().lower()

    def _all_idle(self) -> bool:
        states = self.node_state().split()
        return len(states) == len(self.nodes) and all(st.startswith("idle") for st in states)

    def start(self) -> "SlurmCluster":
        if os.geteuid() != 0:
            raise ClusterUnavailable("the test cluster runs its daemons as root; not root here")
        missing = missing_programs()
        if missing:
            raise ClusterUnavailable(f"missing programs: {' '.join(missing)}")
        self.dir = Path(tempfile.mkdtemp(prefix="hat-slurm-"))
        try:
            self._write_config()
            d = self.dir
            for name, mdir in self._munge_dirs():
                self._spawn(name, ["munged", "--foreground", "--force", f"--socket={mdir}/munge.socket",
                                   f"--key-file={mdir}/munge.key", f"--log-file={d}/log/{name}.log",
                                   f"--pid-file={d}/run/{name}.pid", f"--seed-file={mdir}/munged.seed"])
                self._wait_for(f"{name} to answer on its socket", lambda: self._munge_ok(mdir / "munge.socket"),
                               name)
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(self.conf)])
            self._wait_for("slurmctld to answer `scontrol ping`", self._ctld_ok, "slurmctld")
            for node, _ in self.nodes:
                self._spawn(f"slurmd@{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
            names = " ".join(n for n, _ in self.nodes)
            self._wait_for(f"node(s) {names} to become idle", self._all_idle, f"slurmd@{self.nodes[-1][0]}")
        except BaseException as exc:
            logs = self.logs()
            self.stop()
            if isinstance(exc, ClusterUnavailable):
                raise ClusterUnavailable(f"{exc}\n{logs}") from None
            if isinstance(exc, (OSError, subprocess.SubprocessError)):
                raise ClusterUnavailable(f"{type(exc).__name__}: {exc}\n{logs}") from None
            raise
        return self

    # ---------------------------------------------------------------------------------------------------
    # use
    # ---------------------------------------------------------------------------------------------------

    def sbatch(self, args: List[str], env: Optional[Dict[str, str]] = None, cwd=None) -> str:
        """Submit; return the job id (``sbatch --parsable``)."""
        r = self._quiet(["sbatch", "--parsable", *map(str, args)], timeout=30, env={**self.env, **(env or {})},
                        cwd=cwd)
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr.strip()}\n{self.logs()}")
        job = r.stdout.strip().split(";")[0]
        self.submitted.append(job)
        return job

    def job_info(self, job: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, ...); {} once the record is gone."""
        r = self._quiet(["scontrol", "show", "job", "-o", job], timeout=15)
        info: Dict[str, str] = {}
        if r.returncode != 0:
            return info
        for field in r.stdout.split():
            if "=" in field:
                k, v = field.split("=", 1)
                info.setdefault(k, v)
        return info

    def wait(self, job: str, timeout: float, poll: float = 2.0) -> Dict[str, str]:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING (no sacct without accounting)."""
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job)
            state = info.get("JobState", "")
            if state and state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
                return info
            time.sleep(poll)
        info["TimedOut"] = f"still {info.get('JobState', '?')} after {timeout:.0f}s"
        return info

    def logs(self, tail: int = 3000) -> str:
        if self.dir is None:
            return ""
        parts = []
        for path in sorted((self.dir / "log").glob("*")) if (self.dir / "log").is_dir() else []:
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            if text.strip():
                parts.append(f"--- {path.name} (last {tail} chars) ---\n{text[-tail:]}")
        return "\n".join(parts)

    # ---------------------------------------------------------------------------------------------------
    # tear-down
    # ---------------------------------------------------------------------------------------------------

    def _leftover_job_pids(self) -> List[int]:
        """Processes that carry this cluster's SLURM_CONF (job scripts, srun, ranks, slurmstepd)."""
        conf = getattr(self, "conf", None)
        if self.dir is None or conf is None:
            return []
        marker = f"SLURM_CONF={conf}".encode()
        tmp = str(self.dir).encode()
        mine = {os.getpid()} | {p.pid for p in self.procs.values()}
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in mine:
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read()
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if marker in environ.split(b"\0") or (b"slurmstepd" in cmdline and tmp in environ):
                pids.append(int(entry))
        return pids

    def stop(self) -> None:
        """Cancel jobs, stop the daemons (by pid, newest first), end stray job processes, remove the dir."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None and self.submitted:
            try:
                self._quiet(["scancel", *self.submitted], timeout=15)
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    r = self._quiet(["squeue", "-h", "-o", "%i"], timeout=10)
                    if r.returncode != 0 or not r.stdout.strip():
                        break
                    time.sleep(1)
            except (OSError, subprocess.SubprocessError):
                pass
        for name in sorted(self.procs, key=lambda n: DAEMONS.index(n.split("@")[0]), reverse=True):
            proc = self.procs[name]
            if proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid in self._leftover_job_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if self.dir is not None and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class MultiHostSlurmCluster(SlurmCluster):
    """A Slurm cluster over the hosts of an emulated ``tests.cluster.Cluster``: slurmctld on the first host,
    one slurmd per host (NodeName = hostname, NodeAddr = its cluster address), and a munged per host with the
    same key, as on a real cluster (one munged shared by two slurmds rejects the second decode of a step's
    launch credential as "Replayed credential"). Every daemon on a host sees that host's munge directory and
    its own TmpFS at the paths slurm.conf names (bind mounts in its private mount namespace). Clients (sbatch, scontrol) run
    here, in the root namespace, with the first munged; it reaches the hosts through the cluster's bridge."""

    def __init__(self, cluster, cpus: Optional[int] = None, start_timeout: float = 90.0,
                 keep_dir: bool = False) -> None:
        super().__init__(cpus=cpus, start_timeout=start_timeout, keep_dir=keep_dir)
        self.cluster = cluster
        self.nodes = [(h.name, h.address) for h in cluster.hosts]
        self.ctld_host, self.ctld_addr = cluster.hosts[0].name, cluster.hosts[0].address

    def _munge_dirs(self) -> List[Tuple[str, Path]]:
        dirs = super()._munge_dirs()
        for h in self.cluster.hosts:
            mdir = self.dir / f"munge-{h.name}"
            if not mdir.is_dir():
                mdir.mkdir(mode=0o711)
                shutil.copy2(dirs[0][1] / "munge.key", mdir / "munge.key")
            dirs.append((f"munged@{h.name}", mdir))
        return dirs

    def _where(self, name: str, cmd: List[str]) -> List[str]:
        host = self.cluster.hosts[0].name if name == "slurmctld" else name.split("@", 1)[1] \
            if name.startswith("slurmd@") else None
        if host is None:
            return cmd
        # this host's munged and its own TmpFS (PMIx puts per-step directories there that would collide)
        tmpfs = self.dir / f"tmpfs-{host}"
        tmpfs.mkdir(mode=0o755, exist_ok=True)
        bind = 'mount --bind "$0" "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"'
        return self.cluster.on_host(host, ["sh", "-c", bind, str(self.dir / f"munge-{host}"), str(self.dir / "munge"),
                                           str(tmpfs), str(self.dir / "tmpfs"), *cmd])
