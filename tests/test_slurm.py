"""`sbatch examples/slurm_train.sbatch` on a real (one-node, throw-away) Slurm cluster.

The module fixture installs Debian's slurm-wlm and munge when they are missing (apt-get, root only), starts
munged + slurmctld + slurmd on 127.0.0.1 with everything in a temporary directory (tests/slurm_cluster.py)
and always stops them again. The test submits the example job script itself, 2 tasks, a short
Fashion-MNIST run (20 steps), polls `scontrol show job` (no accounting, so no sacct) and checks that the job COMPLETED
with ExitCode 0:0 and printed the final accuracy. Skipped, with the reason and the daemons' logs, where the
cluster cannot be installed or started (not root, no apt, daemons refuse to start).

About 35 s per launcher on 2 idle CPU cores (70 s on a loaded machine), most of it Python/Horovod start-up.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm_cluster import ClusterUnavailable, SlurmCluster, missing_programs

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "examples" / "slurm_train.sbatch"
JOB_TIMEOUT = 150  # seconds, submission to end state
APT_TIMEOUT = 600
TRAIN_ARGS = ["--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01",
              "--epochs", "1", "--max-steps", "20", "--test-batches", "2"]


def ensure_slurm_installed() -> None:
    missing = missing_programs()
    if not missing:
        return
    why = f"Slurm/munge programs missing ({' '.join(missing)})"
    if os.geteuid() != 0:
        pytest.skip(f"{why} and not root, so cannot apt-get install slurm-wlm munge")
    if shutil.which("apt-get") is None:
        pytest.skip(f"{why} and no apt-get to install slurm-wlm munge")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    log = []
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]):
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"{why}; `{' '.join(cmd)}` failed: {exc}")
        log.append(r.stdout[-2000:] + r.stderr[-2000:])
        if r.returncode != 0:
            pytest.skip(f"{why}; `{' '.join(cmd)}` exited {r.returncode}:\n{log[-1]}")
    still = missing_programs()
    if still:
        pytest.skip(f"apt-get install slurm-wlm munge did not provide: {' '.join(still)}")


@pytest.fixture(scope="module")
def cluster():
    ensure_slurm_installed()
    try:
        c = SlurmCluster().start()
    except ClusterUnavailable as exc:
        pytest.skip(f"could not start a one-node Slurm cluster here: {exc}")
    try:
        yield c
    finally:
        c.stop()


def job_env(tmp_path: Path, launcher: str) -> dict:
    """Variables for sbatch to export into the job: the interpreter, launcher and a run dir outside the repo."""
    bindir = str(Path(sys.executable).parent)
    env = {
        "PYTHON": sys.executable,
        "LAUNCHER": launcher,
        "RUN_DIR": str(tmp_path / "run"),
        "PATH": bindir + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        "OMP_NUM_THREADS": "1",
        # loopback only, for Open MPI's run-time and TCP transport
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "OMPI_MCA_btl_tcp_if_include": "lo",
    }
    if os.geteuid() == 0:  # mpirun refuses root without these (srun-launched ranks do not care)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # The job must import the installed package; only if it is not installed (import fails outside the
    # repository) does the job get the repository on PYTHONPATH.
    probe = subprocess.run([sys.executable, "-c", "import horovod_adtopk"], cwd=str(tmp_path),
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        env["PYTHONPATH"] = str(REPO)
    return env


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_sbatch_example_job(cluster: SlurmCluster, tmp_path: Path, launcher: str):
    if launcher == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("no mpirun on PATH")
    out = tmp_path / "job-%j.out"
    job = cluster.sbatch(["--nodes=1", "--ntasks=2", "--cpus-per-task=1", "--time=00:05:00",
                          f"--job-name=hat-test-{launcher}", f"--output={out}", str(SBATCH), *TRAIN_ARGS],
                         env=job_env(tmp_path, launcher), cwd=str(REPO))
    info = cluster.wait(job, timeout=JOB_TIMEOUT)
    out_file = Path(info.get("StdOut") or str(out).replace("%j", job))
    text = out_file.read_text(errors="replace") if out_file.is_file() else f"(no output file {out_file})"
    detail = f"job {job}: {info}\n--- job output ---\n{text[-6000:]}\n{cluster.logs(1500)}"
    assert "TimedOut" not in info, f"job did not finish within {JOB_TIMEOUT}s\n{detail}"
    assert info.get("JobState") == "COMPLETED", detail
    assert info.get("ExitCode") == "0:0", detail
    finals = [line for line in text.splitlines() if line.startswith("Final test accuracy")]
    # exactly one: ranks that failed to wire up through the launcher would each be a rank 0 of a 1-rank job
    assert len(finals) == 1, f"expected one 'Final test accuracy' line (rank 0 of 2)\n{detail}"
    assert (tmp_path / "run" / "metrics.jsonl").is_file(), detail
