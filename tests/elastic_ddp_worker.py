"""One torchrun worker of examples/train.py ``--engine ddp --elastic``, with a record of what it saw (for
tests/test_elastic_ddp.py).

    torchrun ... -m tests.elastic_ddp_worker OUTDIR [train.py arguments ...]

Runs ``setup``, ``resume`` and ``train`` as ``train.main`` does. Each process (one per torchrun start) writes
``OUTDIR/events/<hostname>-<pid>.json`` as soon as its first optimizer step has completed: the wall-clock time,
its rank, world size, torchrun's restart count and the step it resumed from (the test measures the recovery
from a fault to the next completed step with it). A worker that finishes writes ``OUTDIR/rank<r>.json``: rank,
world size, hostname, the final step, the final test accuracy and a SHA-256 of the model's parameters and
buffers (tests.multihost_worker.model_digest). Exits with train.py's status.
Needs ``examples/`` on PYTHONPATH (train.py imports its sibling modules by name).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import List

import torch.distributed as dist

import train  # examples/train.py
from tests.multihost_worker import model_digest


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def main(argv: List[str]) -> int:
    """Train, recording the first completed step and the end; returns train.py's exit status."""
    start = time.time()
    outdir, train_argv = Path(argv[0]), argv[1:]
    args = train.parse_args(train_argv)
    host = socket.gethostname()
    try:
        job = train.setup(args, start)
        progress = train.resume(job)
        resumed_from = progress.step
        engine_step = job.engine.step

        def step(*a, **kw):  # the job's own step, then (once) the record of its completion
            engine_step(*a, **kw)
            if not getattr(step, "done", False):
                step.done = True
                _write(outdir / "events" / f"{host}-{os.getpid()}.json",
                       {"host": host, "pid": os.getpid(), "rank": job.rank, "world": job.world,
                        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "process_start": start,
                        "resumed_from": resumed_from, "first_step_done": time.time()})

        job.engine.step = step
        train.train(job, progress)
    except train.JobFailed as failed:
        return failed.status
    _write(outdir / f"rank{dist.get_rank()}.json",
           {"rank": dist.get_rank(), "world": dist.get_world_size(), "hostname": host, "step": progress.step,
            "test_accuracy": job.last_record.get("test_accuracy"), "digest": model_digest(job.model)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
