"""Horovod's ``hvd.join()`` with sparse payloads: a per-round query whether any member has joined.

Horovod cannot allgather while a rank is joined (the joined rank's background loop crashes, and under MPI
the others hang), but joined ranks take part in allreduces with zeros. So once per round, at its first
sparse tensor, every rank starts a 1-element allreduce of ones; a sum below the size means someone
joined, and that round travels dense, as ``hvd.DistributedOptimizer`` would. Gradient hooks only poll
the query, so its round trip overlaps the backward pass.
"""
from __future__ import annotations

import warnings
from typing import List, Optional



class JoinQuery:
    """This round's answer to "has a member joined?" (``reset()`` at the end of every round)."""

    def __init__(self, comm) -> None:
        self.comm = comm
        self.joined: Optional[bool] = None
        self._handle = None

    def answer(self, wait: bool) -> Optional[bool]:
        """Start the query if needed; its answer, or None while it is in flight and ``wait`` is False."""
        if self.joined is None:
            if self._handle is None:
                self._handle = self.comm.active_members_async("hat.active")
            if not wait and not self.comm.poll(self._handle):
                return None
            active = int(self.comm.wait(self._handle).item())
            self._handle = None
            self.joined = active < self.comm.size()
            if self.joined:
                warnings.warn("horovod_adtopk: a rank has called hvd.join(); gradients travel dense (allreduce) "
                              "while ranks are joined, since Horovod cannot allgather with joined ranks.")
        return self.joined

    def reset(self) -> None:
        self.joined, self._handle = None, None


class JoinGate:
    """This round's :class:`JoinQuery` and the tensors waiting for its answer.

    A gradient hook that must know the answer (its tensor would be allgathered) but finds the query still in
    flight :meth:`hold`-s its tensor instead of blocking; a later hook, or ``synchronize()``, sends the held
    tensors once the answer is in (:meth:`release`)."""

    def __init__(self, comm) -> None:
        self.query = JoinQuery(comm)
        self.waiting: List[object] = []

    def answer(self, wait: bool) -> Optional[bool]:
        return self.query.answer(wait)

    def hold(self, item) -> None:
        self.waiting.append(item)

    def release(self) -> List[object]:
        """The held items, once the query has answered (they leave the gate); else nothing."""
        if not self.waiting or self.query.answer(wait=False) is None:
            return []
        items, self.waiting = self.waiting, []
        return items

    def reset(self) -> None:
        self.query.reset()
        self.waiting.clear()
