"""Multi-rank test harness: run a worker function on N real Horovod ranks and collect every rank's result.

    results = run_ranks("smoke_collectives", np=3, controller="gloo", args={...})

launches ``horovodrun -np N --gloo|--mpi python -m tests._rank_main <worker> <args.json> <outdir>``. Each
rank runs ``tests.workers.<worker>(args, outdir)`` after ``hvd.init()`` and writes its return value (JSON)
to ``outdir/rank<r>.json``. Any rank failing fails the test with every rank's log. The whole job runs in
its own session under a timeout; on expiry every process it started (found through the process tree,
since horovodrun's launcher puts ranks in their own process groups) is killed with SIGKILL, so a hung
collective fails the test in bounded time instead of hanging CI.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOROVODRUN = str(BIN / "horovodrun") if (BIN / "horovodrun").exists() else "horovodrun"


class RanksFailed(AssertionError):
    pass


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every descendant (by process id, collected before anything dies)."""
    try:
        victims = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        victims = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for v in victims:
        try:
            v.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)


def run_command(cmd: List[str], timeout: float, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None):
    """Run any command (horovodrun, mpirun, a script) in its own session under a timeout.

    Returns ``(returncode, output, seconds)``; returncode is None when the timeout killed the process tree.
    """
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")})
    full_env.update(env or {})
    start = time.monotonic()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=cwd or str(REPO), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        kill_tree(proc)
        log.seek(0)
        output = log.read().decode(errors="replace")
    return rc, output, time.monotonic() - start


def launch(worker: str, np: int = 2, controller: str = "gloo", args: Optional[Dict[str, Any]] = None,
           timeout: float = 120.0, extra_horovodrun: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None,
           workdir: Optional[str] = None):
    """Run the job; return ``(returncode, log, outdir, seconds)`` without judging it (returncode None on timeout)."""
    if workdir is None:
        workdir = tempfile.mkdtemp(prefix="hat-ranks-")
        atexit.register(shutil.rmtree, workdir, True)
    outdir = workdir
    Path(outdir, "args.json").write_text(json.dumps(args or {}))
    cmd = [HOROVODRUN, "-np", str(np), f"--{controller}", *(extra_horovodrun or []),
           sys.executable, "-m", "tests._rank_main", worker, str(Path(outdir, "args.json")), outdir]
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + full_env.get("PYTHONPATH", ""),
                     "PYTHONUNBUFFERED": "1", "HOROVOD_CYCLE_TIME": full_env.get("HOROVOD_CYCLE_TIME", "1")})
    full_env.update(env or {})
    log_path = Path(outdir, "job.log")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            rc = None
        else:
            kill_tree(proc)  # nothing should be left; make sure
    return rc, log_path.read_text(errors="replace"), outdir, time.monotonic() - start


def run_ranks(worker: str, np: int = 2, controller: str = "gloo", args: Optional[Dict[str, Any]] = None,
              timeout: float = 120.0, **kwargs) -> List[Any]:
    """Run ``worker`` on ``np`` ranks; return the list of rank results (rank order) or fail with the logs."""
    rc, log, outdir, seconds = launch(worker, np, controller, args, timeout, **kwargs)
    if rc is None:
        raise RanksFailed(f"{worker} on {np} ranks ({controller}) timed out after {timeout:.0f}s and was killed.\n"
                          f"--- log ---\n{log[-20000:]}")
    results = []
    for r in range(np):
        path = Path(outdir, f"rank{r}.json")
        if not path.exists():
            raise RanksFailed(f"{worker} on {np} ranks ({controller}): rank {r} wrote no result (exit {rc}).\n"
                              f"--- log ---\n{log[-20000:]}")
        results.append(json.loads(path.read_text()))
    if rc != 0:
        raise RanksFailed(f"{worker} on {np} ranks ({controller}) exited {rc}.\n--- log ---\n{log[-20000:]}")
    return results


def example_module(path: str):
    """``examples/<path>.py`` loaded by its location and registered under its file name (``"frameworks/ray_train"``
    -> module ``ray_train``), as ``python examples/<path>.py`` would name its siblings; no import-path edits."""
    from benchmarks.common import register_module

    name = Path(path).name
    return sys.modules[name] if name in sys.modules else register_module(name, REPO / "examples" / f"{path}.py")
