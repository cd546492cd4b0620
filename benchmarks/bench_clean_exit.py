"""Every rank exits 0: launch each example and the training job N times back to back under load, count failures.

The problem: a rank that finished its work sometimes aborted at interpreter exit ("terminate called without an
active exception", SIGABRT): a Gloo worker thread still dropping the last collective when the interpreter
finalized (horovod_adtopk/ddp/teardown.py, docs/troubleshooting.md). A scheduler marks such a job failed. This
script launches, as a user would, with tiny settings (seconds each):

- ``accelerate``: ``accelerate launch --multi_gpu --num_processes 2 examples/frameworks/accelerate_ddp.py``
- ``transformers``: ``torchrun --nproc_per_node 2 examples/frameworks/transformers_trainer.py``
- ``lightning``: ``python examples/frameworks/lightning_ddp.py`` (``Trainer(devices=2)`` starts the ranks)
- ``job-ddp``: ``torchrun --standalone --nproc-per-node 2 examples/train.py --engine ddp`` (ADTopk hook)
- ``job-ddp-none``, ``job-ddp-powersgd``: the same with plain DDP (no hook) and PyTorch's PowerSGD hook
- ``job-horovod``: ``horovodrun -np 2 --gloo python examples/train.py --engine horovod``

each ``--runs`` times (default 50) while ``--hog`` busy processes (default: one per core) keep the CPUs
loaded as the test suite does, and counts per target the launches that exited non-zero, those whose log
holds the abort's message, and those killed by the timeout. Prints a table; writes JSON (the command, git
commit, date, machine, every failing launch's log tail) to ``--out`` (default
``docs/clean_exit/clean_exit.json``). Targets whose framework is not installed are skipped, with the reason.

    python benchmarks/bench_clean_exit.py                      # 50 launches of each target
    python benchmarks/bench_clean_exit.py --runs 5 --targets transformers job-ddp
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

import common

REPO = common.REPO_ROOT
BIN = os.path.dirname(sys.executable)
FRAMEWORKS = REPO / "examples" / "frameworks"
TRAIN = str(REPO / "examples" / "train.py")
ABORT = "terminate called without an active exception"
ENV = {"GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "HOROVOD_CYCLE_TIME": "1", "PYTHONPATH": str(REPO)}
JOB = ["--dataset", "fashion-mnist", "--ratio", "0.01", "--no-warmup", "--max-steps", "4", "--test-batches", "1",
       "--no-progress", "--log-every", "0"]


def _exe(name: str) -> str:
    path = os.path.join(BIN, name)
    return path if os.path.exists(path) else name


def targets(tmp: str) -> Dict[str, dict]:
    """name -> {"cmd": [...], "needs": [modules], "env": {...}} (``tmp``: a scratch folder for outputs)."""
    torchrun = [_exe("torchrun"), "--standalone", "--nproc-per-node", "2"]
    return {
        "accelerate": {"needs": ["accelerate"], "env": {"HF_HOME": os.path.join(tmp, "hf")},
                       "cmd": [_exe("accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
                               "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                               str(FRAMEWORKS / "accelerate_ddp.py"), "--epochs", "1"]},
        "transformers": {"needs": ["transformers", "accelerate"],
                         "cmd": [*torchrun, str(FRAMEWORKS / "transformers_trainer.py"), "--epochs", "1",
                                 "--out", os.path.join(tmp, "trainer")]},
        "lightning": {"needs": ["pytorch_lightning"],
                      "cmd": [sys.executable, str(FRAMEWORKS / "lightning_ddp.py"), "--epochs", "1"]},
        "job-ddp": {"needs": [], "cmd": [*torchrun, TRAIN, "--engine", "ddp", "--compressor", "adtopk", *JOB]},
        "job-ddp-none": {"needs": [], "cmd": [*torchrun, TRAIN, "--engine", "ddp", "--compressor", "none", *JOB]},
        "job-ddp-powersgd": {"needs": [], "cmd": [*torchrun, TRAIN, "--engine", "ddp", "--compressor", "powersgd",
                                                  *JOB]},
        "job-horovod": {"needs": ["horovod"],
                        "cmd": [common.HOROVODRUN, "-np", "2", "--gloo", sys.executable, TRAIN, "--engine", "horovod",
                                "--compressor", "adtopk", *JOB]},
    }


def start_hogs(n: int) -> List[subprocess.Popen]:
    """``n`` busy-looping processes (each ends itself after an hour if this script is killed)."""
    code = "import time\nend = time.monotonic() + 3600\nwhile time.monotonic() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def stop(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="launches of each target (default 50)")
    parser.add_argument("--targets", nargs="+", help="which (default: all installed); names as in the docstring")
    parser.add_argument("--hog", type=int, default=os.cpu_count() or 2, help="busy processes beside the launches "
                        "(default: one per core; 0: none)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch before it is killed")
    parser.add_argument("--out", default=str(REPO / "docs" / "clean_exit" / "clean_exit.json"))
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="hat-clean-exit-")
    every = targets(tmp)
    chosen = args.targets or list(every)
    unknown = [t for t in chosen if t not in every]
    if unknown:
        parser.error(f"unknown targets {unknown}; choose from {list(every)}")
    results, skipped = {}, {}
    hogs = start_hogs(args.hog)
    started = time.time()
    try:
        for name in chosen:
            spec = every[name]
            missing = [m for m in spec["needs"] if importlib.util.find_spec(m) is None]
            if missing:
                skipped[name] = f"not installed: {', '.join(missing)}"
                continue
            entry = results[name] = {"command": " ".join(os.path.relpath(c, REPO) if c.startswith(str(REPO)) else
                                                         os.path.basename(c) if os.path.isabs(c) else c
                                                         for c in spec["cmd"]),
                                     "runs": 0, "nonzero": 0, "aborts": 0, "timeouts": 0, "seconds": [],
                                     "failures": []}
            for i in range(args.runs):
                shutil.rmtree(os.path.join(tmp, "trainer"), ignore_errors=True)  # no resume from a previous launch
                rc, log, seconds = common.run_command(spec["cmd"], timeout=args.timeout,
                                                      env={**ENV, **spec.get("env", {})}, cwd=tmp)
                entry["runs"] += 1
                entry["seconds"].append(round(seconds, 1))
                if rc != 0:
                    entry["nonzero"] += 1
                    entry["timeouts"] += rc is None
                    entry["aborts"] += ABORT in log
                    entry["failures"].append({"launch": i, "rc": rc, "log_tail": log[-3000:]})
                print(f"{name} {i + 1}/{args.runs}: exit {rc} in {seconds:.1f} s" + (" (abort)" if ABORT in log else ""),
                      flush=True)
    finally:
        stop(hogs)
        shutil.rmtree(tmp, ignore_errors=True)

    rows = [[n, str(r["runs"]), str(r["nonzero"]), str(r["aborts"]), str(r["timeouts"]),
             f"{sum(r['seconds']) / max(len(r['seconds']), 1):.1f}"] for n, r in results.items()]
    print(common.table(["target", "launches", "non-zero exits", "aborts", "timeouts", "mean s"], rows))
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    report = {"started_unix": started, "hog_processes": args.hog, "runs_per_target": args.runs,
              "targets": results, "skipped": skipped}
    # write_record adds the command, the commit, the date and the machine (report.py reads them)
    path = common.write_record(args.out, report, None if argv is None else
                               ["python", "benchmarks/bench_clean_exit.py", *argv])
    print(f"wrote {os.path.relpath(path, REPO)}")
    return 1 if any(r["nonzero"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
