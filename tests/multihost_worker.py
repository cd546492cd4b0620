"""One rank of examples/train.py's job, plus a record of what this rank saw (for tests/test_multihost.py).

    python -m tests.multihost_worker OUTDIR [train.py arguments ...]

runs the same steps as ``train.main`` (``setup``, ``resume``, ``train``, which train.py re-exports: Horovod is initialised by train.py
itself, ``hvd.init()`` under horovodrun and ``hvd.init(comm=MPI.COMM_WORLD)`` under mpirun / srun), then writes
``OUTDIR/rank<r>.json``: rank, size, local and cross rank and size, the hostname, the init mode, the final step
and a SHA-256 of the model's parameters and buffers (bytes, in state-dict order), so a test can check that
every rank ends bitwise identical and that Horovod's topology matches the hosts. Exits with train.py's status.
Needs ``examples/`` on PYTHONPATH (train.py imports its sibling modules by name).
"""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import List

import horovod.torch as hvd

import train  # examples/train.py
from job.elastic import model_digest  # the job's own digest (examples/job/elastic.py)


def main(argv: List[str]) -> int:
    """Train, then record this rank's view; returns train.py's exit status."""
    start = time.time()
    outdir, train_argv = Path(argv[0]), argv[1:]
    args = train.parse_args(train_argv)
    try:
        job = train.setup(args, start)
        progress = train.resume(job)
        train.train(job, progress)
    except train.JobFailed as failed:
        return failed.status
    record = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
              "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
              "hostname": socket.gethostname(), "init_mode": getattr(job.engine, "init_mode", None),
              "step": progress.step,
              "digest": model_digest(job.model)}
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"rank{record['rank']}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
