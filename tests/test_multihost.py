"""Every launcher across 2 emulated hosts x 2 ranks (tests/cluster.py), and faults across hosts.

One cluster for the module: hosts ``<name>-h0`` and ``<name>-h1`` (own network namespace, hostname, sshd,
``eth1`` capped at 1 Gbit/s), each host's own name on 127.0.1.1 as Debian installs it. Every job is
examples/train.py (Fashion-MNIST, ADTopk at ratio 0.01) run through tests/multihost_worker.py, which records
each rank's hostname, ``hvd.local_rank()``, ``local_size()``, ``cross_rank()``, ``cross_size()`` and a digest of
its final parameters: the tests assert the topology of every rank, one ``Final test accuracy`` line, and
bitwise identical ranks.

* ``horovodrun -H h0:2,h1:2 --gloo --network-interface eth1`` with the hosts' names on loopback: this is the
  test of scripts/patch_horovod.sh's Gloo process-set fix. Horovod 0.28.1 without it dies in ``hvd.init()``
  with ``gloo::IoException ... connect [127.0.1.1]:PORT: Connection refused`` (the process-set context
  resolves the hostname instead of using eth1).
* ``horovodrun --mpi`` and plain ``mpirun --hostfile`` (train.py then calls ``hvd.init(comm=MPI.COMM_WORLD)``).
* Faults mid-training (after the step-10 checkpoint): SIGKILL of one host's ranks, and ``ip link set eth1
  down`` on one host. Every rank still alive must be gone within 60 s with horovodrun exiting non-zero and
  saying why, nothing left on any host; the checkpoint resumes to the uninterrupted run's parameters bit for
  bit on the same 2x2 layout and is refused with the reason on 2 ranks.

* Slurm: ``sbatch -N 2 --ntasks-per-node=2 examples/slurm_train.sbatch`` with srun (PMIx) and with mpirun
  on a 2-node Slurm cluster over the same hosts (tests/slurm_cluster.py ``MultiHostSlurmCluster``), COMPLETED
  and the same per-rank checks.
* A second cluster beside the module's (other name, subnet, no route between them) and its teardown.

Skipped only where namespaces cannot be made (not root, no CAP_NET_ADMIN); sshd (openssh-server) is
installed by the cluster with apt-get if missing, slurm-wlm and munge by tests/test_slurm.py's installer.
Measured: 11 min for the module on 2 shared cores at load average 10 (before the MPI jobs yielded when
idle, which took them from 138 s to 40-46 s); each job is mostly Python, torch and Horovod start-up of 4
ranks on 2 cores (a 2x2 Gloo job took 31 s at load 1).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest

from tests.cluster import LOOPBACK_NAME_ADDR, Cluster, module_cluster
from tests.harness import HOROVODRUN, REPO

SLOTS = 2
STEPS = 40
TIMEOUT = 240  # one training job, launch to exit, on a loaded 2-core machine
FAULT_LIMIT = 60  # seconds from the fault until every surviving rank is gone
TRAIN_ARGS = ["--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01", "--max-steps", str(STEPS),
              "--test-batches", "2", "--no-progress", "--log-every", "0", "--checkpoint-every", "10"]
WORKER = [sys.executable, "-m", "tests.multihost_worker"]
ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'examples'}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       # 4 ranks on 2 cores: Open MPI's waiting ranks yield the CPU instead of spinning
       "OMPI_MCA_mpi_yield_when_idle": "1"}
# Horovod's tensor fusion packs the dense-path tensors into one buffer whose layout depends on timing; with more
# than 2 ranks the ring allreduce then sums an element in an order that depends on its offset, so two runs
# differ in the last bits (measured: 2 runs x 4 ranks, 2 digests). Runs compared with each other across runs
# (the reference, the faulted and the resumed one) therefore run without fusion; ranks of one run agree anyway.
NO_FUSION = {**ENV, "HOROVOD_FUSION_THRESHOLD": "0"}
MPI_FORWARD = [a for v in ("PATH", "PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED") for a in ("-x", v)]


@pytest.fixture(scope="module")
def cluster():
    yield from module_cluster(2, f"t{os.getpid() % 10 ** 6}", link="1gbit", loopback_names=True)


def train_cmd(outdir: Path, *extra: str) -> List[str]:
    return [*WORKER, str(outdir), *TRAIN_ARGS, "--checkpoint-dir", str(outdir / "ckpt"), *extra]


def horovodrun(c: Cluster, mode: str, outdir: Path, *extra: str, slots: int = SLOTS) -> List[str]:
    return [HOROVODRUN, *c.horovodrun_args(slots), f"--{mode}", *train_cmd(outdir, *extra)]


def records(outdir: Path, n: int) -> List[dict]:
    return [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(n)
            if (outdir / f"rank{r}.json").is_file()]


def check_records(c: Cluster, outdir: Path, init_mode: str, steps: int, out: str) -> List[dict]:
    """Every rank's record: on the right host with the right local/cross rank and size; all bitwise equal."""
    recs = records(outdir, SLOTS * c.n)
    assert len(recs) == SLOTS * c.n, f"only {len(recs)} ranks wrote their record\n{out[-8000:]}"
    for r, rec in enumerate(recs):
        host = c.hosts[r // SLOTS].name  # -H h0:2,h1:2, the hostfile and Slurm put ranks 0,1 on h0, 2,3 on h1
        want = {"rank": r, "size": SLOTS * c.n, "hostname": host, "local_rank": r % SLOTS, "local_size": SLOTS,
                "cross_rank": r // SLOTS, "cross_size": c.n, "step": steps, "init_mode": init_mode}
        assert {k: rec[k] for k in want} == want, f"rank {r}: {rec}"
    digests = {rec["digest"] for rec in recs}
    assert len(digests) == 1, f"ranks differ at the end: {[rec['digest'][:12] for rec in recs]}"
    return recs


def check_job(c: Cluster, rc: Optional[int], out: str, outdir: Path, init_mode: str,
              left_behind: Optional[dict] = None) -> List[dict]:
    """A finished 2x2 job: exit 0, one final line, every rank's topology right, ranks bitwise identical,
    nothing left on the hosts (``left_behind``: what the job's ``Cluster.run`` found, default the last one)."""
    assert rc is not None, f"timed out after {TIMEOUT}s and was killed\n{out[-8000:]}"
    assert rc == 0, f"exited {rc}\n{out[-8000:]}"
    finals = [ln for ln in out.splitlines() if "Final test accuracy" in ln]
    assert len(finals) == 1, f"expected one 'Final test accuracy' line, got {len(finals)}\n{out[-8000:]}"
    recs = check_records(c, outdir, init_mode, STEPS, out)
    left_behind = c.left_behind if left_behind is None else left_behind
    assert left_behind == {}, f"processes left on the hosts after the job: {left_behind}"
    return recs


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory) -> Dict[str, object]:
    """The uninterrupted Gloo job (also the loopback-hostname test); its final digest is the resume target."""
    for h in cluster.hosts:
        r = subprocess.run(cluster.on_host(h, ["getent", "hosts", h.name]), capture_output=True, text=True,
                           timeout=30)
        assert r.stdout.split()[:1] == [LOOPBACK_NAME_ADDR], f"{h.name} does not resolve to loopback: {r.stdout}"
    outdir = tmp_path_factory.mktemp("gloo")
    rc, out, seconds = cluster.run(0, horovodrun(cluster, "gloo", outdir), timeout=TIMEOUT, env=NO_FUSION)
    return {"rc": rc, "out": out, "outdir": outdir, "seconds": seconds, "left_behind": dict(cluster.left_behind)}


def test_hosts(cluster: Cluster):
    """Each host has its hostname, eth1 address, its own name on 127.0.1.1, the others' on their address."""
    for h in cluster.hosts:
        script = "hostname; ip -o -4 addr show dev eth1; " + "; ".join(
            f"getent hosts {o.name}" for o in cluster.hosts)
        r = subprocess.run(cluster.on_host(h, ["sh", "-c", script]), capture_output=True, text=True, timeout=30)
        lines = r.stdout.splitlines()
        assert lines[0] == h.name and f"inet {h.address}/24" in lines[1], r.stdout
        for o, line in zip(cluster.hosts, lines[2:]):
            assert line.split() == [LOOPBACK_NAME_ADDR if o is h else o.address, o.name], r.stdout
        ssh = subprocess.run(cluster.on_host(h, cluster.ssh(cluster.hosts[-1 - h.index], ["hostname"])),
                             capture_output=True, text=True, timeout=60)
        assert ssh.stdout.strip() == cluster.hosts[-1 - h.index].name, ssh.stderr


def test_horovodrun_gloo_with_hostnames_on_loopback(cluster: Cluster, reference):
    print(f"horovodrun --gloo 2x2: {reference['seconds']:.1f} s")
    check_job(cluster, reference["rc"], reference["out"], reference["outdir"], "horovod", reference["left_behind"])


def test_horovodrun_mpi(cluster: Cluster, tmp_path: Path):
    rc, out, seconds = cluster.run(0, horovodrun(cluster, "mpi", tmp_path), timeout=TIMEOUT, env=ENV)
    print(f"horovodrun --mpi 2x2: {seconds:.1f} s")
    check_job(cluster, rc, out, tmp_path, "mpi4py")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_mpirun_hostfile(cluster: Cluster, tmp_path: Path):
    hostfile = cluster.hostfile(tmp_path / "hostfile", slots=SLOTS)
    mpirun = ["mpirun", "--hostfile", str(hostfile), "-np", str(SLOTS * cluster.n), "--bind-to", "none",
              *cluster.mpirun_args(SLOTS)[4:], *MPI_FORWARD]  # [4:]: the hostfile instead of -np/-H
    rc, out, seconds = cluster.run(0, [*mpirun, *train_cmd(tmp_path)], timeout=TIMEOUT, env=ENV)
    print(f"mpirun --hostfile 2x2: {seconds:.1f} s")
    check_job(cluster, rc, out, tmp_path, "mpi4py")


# --------------------------------------------------------------------------------------------------------
# Faults across hosts
# --------------------------------------------------------------------------------------------------------

def ranks_on(c: Cluster, host) -> List[psutil.Process]:
    """The rank processes (python -m tests.multihost_worker) on ``host``."""
    found = []
    for p in c.processes(host):
        try:
            if p.cmdline()[1:3] == ["-m", "tests.multihost_worker"]:
                found.append(p)
        except psutil.Error:
            pass
    return found


def start_until_checkpoint(c: Cluster, outdir: Path):
    """Start the 2x2 Gloo job on h0; return it once the step-10 checkpoint exists and all 4 ranks run."""
    log = open(outdir / "job.log", "wb")
    proc = c.popen(0, horovodrun(c, "gloo", outdir), stdout=log, stderr=subprocess.STDOUT,
                   env={**os.environ, **NO_FUSION})
    log.close()
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"job ended (exit {proc.returncode}) before the fault\n{(outdir / 'job.log').read_text()}")
        ranks = [p for h in c.hosts for p in ranks_on(c, h)]
        if (outdir / "ckpt" / "ckpt-step10.pt").is_file() and len(ranks) == SLOTS * c.n:
            return proc
        time.sleep(0.2)
    pytest.fail(f"no step-10 checkpoint after {TIMEOUT}s\n{(outdir / 'job.log').read_text()[-6000:]}")


def watch_until_gone(proc: subprocess.Popen, survivors: List[psutil.Process], t0: float) -> Dict[str, float]:
    """Seconds from the fault (``t0``) until each surviving rank and horovodrun were gone (inf: still there)."""
    gone: Dict[str, float] = {}
    names = {p.pid: f"rank pid {p.pid}" for p in survivors}
    while time.monotonic() - t0 < FAULT_LIMIT + 30 and (len(gone) < len(survivors) + 1):
        for p in survivors:
            if names[p.pid] in gone:
                continue
            try:
                dead = not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                dead = True
            if dead:
                gone[names[p.pid]] = time.monotonic() - t0
        if "horovodrun" not in gone and proc.poll() is not None:
            gone["horovodrun"] = time.monotonic() - t0
        time.sleep(0.1)
    for name in list(names.values()) + ["horovodrun"]:
        gone.setdefault(name, float("inf"))
    return gone


def check_fault(proc: subprocess.Popen, times: Dict[str, float], leftovers: dict, outdir: Path, what: str) -> str:
    """Every surviving rank and horovodrun gone within FAULT_LIMIT, non-zero exit, nothing left on any host."""
    out = (outdir / "job.log").read_text(errors="replace")
    said = [ln for ln in out.splitlines() if any(w in ln for w in ("rror", "xception", "exit", "erminat", "ailed"))]
    print(f"{what}: gone after " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(times.items()))
          + f"; horovodrun exit {proc.returncode}; the log says:\n  " + "\n  ".join(said[-12:]))
    late = {k: v for k, v in times.items() if v > FAULT_LIMIT}
    assert not late, f"{what}: still running {FAULT_LIMIT} s after the fault: {late}\n{out[-8000:]}"
    assert proc.returncode not in (0, None), f"{what}: horovodrun exited {proc.returncode}\n{out[-8000:]}"
    assert leftovers == {}, f"{what}: ranks left behind on the hosts: {leftovers}\n{out[-8000:]}"
    # a rank says that it lost a peer (horovod_adtopk's PeerLostError), or horovodrun ended the survivors first
    # (it terminates the remaining workers as soon as one exits non-zero: a race that a SIGKILL often wins);
    # either way horovodrun says which rank failed first
    assert "a peer rank was probably lost" in out or "Terminating remaining workers" in out, \
        f"{what}: no rank said why it stopped\n{out[-8000:]}"
    assert "exited with non-zero status" in out, f"{what}: horovodrun did not say why\n{out[-8000:]}"
    return out


def resume_checks(c: Cluster, reference, outdir: Path) -> None:
    """The fault's checkpoint resumes bitwise on 2x2; on 2 ranks it is refused with the reason."""
    ref = records(reference["outdir"], SLOTS * c.n)
    assert ref, "the reference run failed (see test_horovodrun_gloo_with_hostnames_on_loopback)"
    for f in outdir.glob("rank*.json"):
        f.unlink()
    rc, out, seconds = c.run(0, horovodrun(c, "gloo", outdir, "--resume", slots=1), timeout=TIMEOUT,
                            env=NO_FUSION)
    print(f"resume on 2 ranks (refused): {seconds:.1f} s")
    assert rc not in (0, None), f"resuming a 4-rank checkpoint on 2 ranks exited {rc}\n{out[-6000:]}"
    assert "cannot resume" in out and "world_size: checkpoint 4, now 2" in out, out[-6000:]
    rc, out, seconds = c.run(0, horovodrun(c, "gloo", outdir, "--resume"), timeout=TIMEOUT, env=NO_FUSION)
    print(f"resume 2x2: {seconds:.1f} s")
    recs = check_job(c, rc, out, outdir, "horovod")
    assert "resumed from" in out, out[-6000:]
    assert recs[0]["digest"] == ref[0]["digest"], "the resumed run ends with other parameters than the reference"


def test_sigkill_one_host_then_resume(cluster: Cluster, reference, tmp_path: Path):
    proc = start_until_checkpoint(cluster, tmp_path)
    try:
        victims, survivors = ranks_on(cluster, 1), ranks_on(cluster, 0)
        t0 = time.monotonic()
        for p in victims:
            p.send_signal(signal.SIGKILL)
        times = watch_until_gone(proc, survivors, t0)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        leftovers = cluster.leftovers("multihost_worker")
        cluster.reap()
    check_fault(proc, times, leftovers, tmp_path, "SIGKILL of h1's ranks")
    resume_checks(cluster, reference, tmp_path)


def test_link_down_mid_training(cluster: Cluster, tmp_path: Path):
    proc = start_until_checkpoint(cluster, tmp_path)
    try:
        survivors = [p for h in cluster.hosts for p in ranks_on(cluster, h)]
        t0 = time.monotonic()
        cluster.set_link(1, up=False)
        times = watch_until_gone(proc, survivors, t0)
    finally:
        cluster.set_link(1, up=True)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        leftovers = cluster.leftovers("multihost_worker")
        cluster.reap()
    check_fault(proc, times, leftovers, tmp_path, "eth1 of h1 down")


# --------------------------------------------------------------------------------------------------------
# Slurm across the 2 hosts
# --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def slurm(cluster: Cluster):
    from tests.slurm_cluster import ClusterUnavailable as SlurmUnavailable, MultiHostSlurmCluster
    from tests.test_slurm import ensure_slurm_installed
    ensure_slurm_installed()
    try:
        s = MultiHostSlurmCluster(cluster).start()
    except SlurmUnavailable as exc:
        pytest.fail(f"the 2-node Slurm cluster did not start: {exc}")
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_two_nodes(cluster: Cluster, slurm, tmp_path: Path, launcher: str):
    from tests.test_slurm import SBATCH, job_env
    env = job_env(tmp_path, launcher)
    # the job's "$PYTHON examples/train.py ARGS" runs each rank through tests/multihost_worker.py instead
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} -m tests.multihost_worker {tmp_path / "ranks"} "$@"\n')
    python.chmod(0o755)
    env.update(PYTHON=str(python), OMPI_MCA_mpi_yield_when_idle="1", OMPI_MCA_oob_tcp_if_include=cluster.iface, OMPI_MCA_btl_tcp_if_include=cluster.iface,
               PYTHONPATH=ENV["PYTHONPATH"])
    out = tmp_path / "job-%j.out"
    start = time.monotonic()
    job = slurm.sbatch(["-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=00:05:00",
                        f"--job-name=hat-2n-{launcher}", f"--output={out}", str(SBATCH),
                        "--max-steps", "30", "--test-batches", "2"], env=env, cwd=str(REPO))
    info = slurm.wait(job, timeout=TIMEOUT)
    print(f"sbatch -N 2 ({launcher}): {time.monotonic() - start:.1f} s")
    out_file = Path(info.get("StdOut") or str(out).replace("%j", job))
    text = out_file.read_text(errors="replace") if out_file.is_file() else f"(no output file {out_file})"
    detail = f"job {job}: {info}\n--- job output ---\n{text[-6000:]}\n{slurm.logs(1500)}"
    assert "TimedOut" not in info, f"job did not finish within {TIMEOUT}s\n{detail}"
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", detail
    assert info.get("NumNodes") == "2", detail
    finals = [line for line in text.splitlines() if "Final test accuracy" in line]
    assert len(finals) == 1, f"expected one 'Final test accuracy' line\n{detail}"
    check_records(cluster, tmp_path / "ranks", "mpi4py", 30, detail)


def test_second_cluster_beside_and_teardown_leaves_nothing(cluster: Cluster):
    """Another cluster (other name) runs beside the module's on its own subnet; its stop removes all it made."""
    from tests.cluster import HOSTS_FILE, KNOWN_HOSTS, NETNS_ETC, netns_pids
    other = Cluster(hosts=1, name=f"u{os.getpid() % 10 ** 6}").start()
    try:
        h = other.hosts[0]
        assert other.subnet != cluster.subnet and h.name not in [x.name for x in cluster.hosts]
        sshd = [psutil.Process(pid) for pid, _ in other.daemons.values()]
        r = subprocess.run(other.on_host(h, ["hostname"]), capture_output=True, text=True, timeout=30)
        assert r.stdout.strip() == h.name
        # no route from one cluster's host to the other's
        r = subprocess.run(other.on_host(h, ["ip", "route", "get", cluster.hosts[0].address]), capture_output=True,
                           text=True, timeout=30)
        assert r.returncode != 0, r.stdout
    finally:
        other.stop()
    assert h.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert netns_pids(h.netns) == [] and not any(p.is_running() for p in sshd)
    tag = f"#hat-cluster:{other.name}"
    assert tag not in HOSTS_FILE.read_text() and tag not in KNOWN_HOSTS.read_text()
    assert not (NETNS_ETC / h.netns).exists() and not other.dir.exists()
    assert f"#hat-cluster:{cluster.name}" in HOSTS_FILE.read_text()  # the module's cluster is untouched
