"""How the ranks of a ``bench_step.py`` cell agree and gather results, with or without Horovod.

Not run by hand: ``_bench_step_worker.py`` uses it. :class:`HvdComm` goes through Horovod's collectives;
:class:`FileComm` goes through small JSON files in a directory shared by the ranks of one job (all ranks run
on this machine), so that a mode can run before ``hvd.init()`` or after ``hvd.shutdown()``, i.e. without
Horovod's background thread (which wakes every ``HOROVOD_CYCLE_TIME`` to negotiate with the other ranks
and so takes CPU from the step even when nothing is communicated).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, List


class HvdComm:
    """Rank agreement through Horovod (after ``hvd.init()``)."""

    uses_horovod = True

    def __init__(self, hvd) -> None:
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def barrier(self, name: str) -> None:
        """Every rank reaches this point before any leaves it."""
        import torch
        self.hvd.allreduce(torch.zeros(1), name=name)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        return self.hvd.allgather_object(obj, name=name)

    def broadcast_int(self, value: int, name: str) -> int:
        """Rank 0's ``value`` on every rank."""
        import torch
        return int(self.hvd.broadcast(torch.tensor([value]), root_rank=0, name=name).item())


class FileComm:
    """Rank agreement through files in ``directory`` (no Horovod): each call writes ``name.rank.json`` and
    waits (polling every 2 ms, at most ``timeout`` seconds, then raises) until every rank's file is there."""

    uses_horovod = False

    def __init__(self, directory: str, rank: int, size: int, timeout: float = 600.0) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"FileComm: bad rank {rank} of size {size}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.size, self.timeout = rank, size, timeout

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in rank order."""
        tmp = self.dir / f".{name}.{self.rank}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, self.dir / f"{name}.{self.rank}.json")  # atomic: readers never see a partial file
        paths = [self.dir / f"{name}.{r}.json" for r in range(self.size)]
        deadline = time.monotonic() + self.timeout
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                raise RuntimeError(f"FileComm: ranks {missing} did not reach {name!r} within {self.timeout:.0f}s")
            time.sleep(0.002)
        return [json.loads(p.read_text()) for p in paths]

    def barrier(self, name: str) -> None:
        """Every rank reaches this point before any leaves it."""
        self.allgather_object(None, name)

    def broadcast_int(self, value: int, name: str) -> int:
        """Rank 0's ``value`` on every rank."""
        return int(self.allgather_object(value, name)[0])
