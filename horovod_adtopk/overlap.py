"""Compression off the main thread: sparse exchanges built by a worker while the backward pass goes on.

Without it a sparse tensor's error feedback, selection and packing run inside its gradient hook, in series
with the rest of the backward pass. With ``overlap=True`` the hook only hands the gradient to one worker
thread per optimizer (``hat-compress``), which builds the exchange (and starts its allgather) while the main
thread computes the next layers' gradients; ``synchronize()`` waits for it. The kernels and every torch
operator release the GIL, so this buys time only where the rank has a core to spare for the worker
(``torch.get_num_threads()`` below the cores the rank may use); on a saturated machine it is neutral at best.

Results are bitwise those of ``overlap=False``: the worker runs the same code on the same tensors, one
tensor after the other in hook order, and Horovod matches collectives by name, not by submission order.
Only CPU tensors are overlapped: a CUDA tensor's selection stays on the hook's thread and stream.

An error in the worker is raised on the main thread by ``synchronize()`` (the payload was never sent, so the
peers fail on the lost collective as they would if the hook itself had raised).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, Optional

from .exchange import Exchange


class DeferredExchange(Exchange):
    """An exchange the worker is still building; ``finish`` waits for it, then finishes it."""

    def __init__(self, future: Future, params: tuple, on_wait: Callable[[float], None],
                 account: Callable[[tuple], None]) -> None:
        self.future, self.params, self.on_wait, self.account = future, params, on_wait, account
        self._exchange: Optional[Exchange] = None

    def _built(self) -> Exchange:
        if self._exchange is None:
            start = time.perf_counter()
            exchange, accounting = self.future.result()
            self.on_wait(time.perf_counter() - start)
            self.account(accounting)
            self._exchange = exchange
        return self._exchange

    def advance(self) -> None:
        self._built().advance()

    def finish(self) -> None:
        self._built().finish()


class Overlap:
    """One worker thread that builds sparse exchanges in submission order."""

    def __init__(self) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: List[Future] = []  # submitted builds not yet seen done
        self.wait_seconds = 0.0  # main-thread time spent waiting for the worker in synchronize()
        self.submitted = 0

    def applies(self, grad) -> bool:
        return grad is None or grad.device.type == "cpu"

    def submit(self, build: Callable[[], tuple], params: tuple, account: Callable[[tuple], None]) -> DeferredExchange:
        """Run ``build`` (returning ``(exchange, accounting)``) on the worker; ``account(accounting)`` runs on
        the calling thread once the exchange is waited for."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hat-compress")
        self.submitted += 1
        self._pending = [f for f in self._pending if not f.done()]
        future = self._pool.submit(build)
        self._pending.append(future)
        return DeferredExchange(future, params, self._waited, account)

    def _waited(self, seconds: float) -> None:
        self.wait_seconds += seconds

    def report(self) -> dict:
        return {"enabled": True, "exchanges": self.submitted, "wait_seconds": self.wait_seconds}

    def drain(self) -> None:
        """Wait until every submitted build has ended (before a round's exchanges are dropped: reset,
        load_state_dict); free when they all have, as after every ``synchronize()``."""
        wait(self._pending)
        self._pending = []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def spare_cores(local_size: int) -> int:
    """Cores this rank may use beyond its torch threads: the process's CPU affinity shared by the host's
    ranks, minus ``torch.get_num_threads()``."""
    import torch
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores // max(local_size, 1) - torch.get_num_threads()


def check_setting(overlap) -> None:
    if not (overlap is True or overlap is False or overlap == "auto"):
        raise ValueError(f"overlap must be False, True or \"auto\", got {overlap!r}")


def make(overlap, local_size: int) -> Optional[Overlap]:
    """The worker for ``overlap``: True, False, or "auto" (on where :func:`spare_cores` is at least 1)."""
    if overlap is True or (overlap == "auto" and spare_cores(local_size) >= 1):
        return Overlap()
    return None


def attach(sender, overlap, local_size: int) -> Optional[Overlap]:
    """Give ``sender`` (a :class:`~horovod_adtopk.exchange.SparseSender`, or None) its worker, if any."""
    worker = make(overlap, local_size) if sender is not None else None
    if worker is not None:
        sender.overlap = worker
    return worker
