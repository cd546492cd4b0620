"""A clean exit for Gloo jobs: every rank of a complete run exits 0 (issue 56).

The abort this module prevents: a rank finishes its work, and at interpreter exit prints ``terminate called
without an active exception`` and dies of SIGABRT (exit -6; torchrun then reports the whole job failed). It is
PyTorch's, with or without this package (plain DDP, PyTorch's PowerSGD hook, a bare ``all_gather`` loop):

- ``ProcessGroupGloo`` runs every collective on its worker threads (``pt_gloo_runloop``), and the worker that
  ran a collective also drops it once it is complete, on its own time, after the caller's ``wait()`` returned.
  Dropping the collective's tensors calls into Python (they have Python objects), so the worker takes the GIL.
- Those workers outlive ``destroy_process_group()``: DDP imports ``torch.distributed.nn.functional``, whose
  functions keep the default group as a default argument, so the group (and its threads) is freed only when
  the interpreter clears its modules.
- A thread that asks for the GIL once the main thread has started finalizing the interpreter is ended by
  CPython with ``pthread_exit``; its unwinding crosses ``ProcessGroupGloo::AsyncWork``'s ``noexcept``
  destructor, and the C++ runtime calls ``std::terminate``.

So a worker that is slow to drop the last collective (a loaded machine: it waits for a core) kills a
process that has nothing left to do. The workaround is to let every worker finish before the interpreter
finalizes: :func:`wait_for_gloo_workers` waits (a bounded time) until each ``pt_gloo_runloop`` thread of this
process sleeps and stays asleep while the GIL is free; :func:`shutdown` is the whole teardown of a script
that owns its process group (barrier, destroy, wait). Importing :mod:`horovod_adtopk.ddp` registers
:func:`wait_for_gloo_workers` to run at exit (``atexit``), so a script using the hook, or one of the
framework integrations, needs nothing more, unless an exit handler it registers before that import runs
collectives. docs/troubleshooting.md has a reproducer without this package.

The threads are found by name under ``/proc/self/task`` (Linux; PyTorch names them since 2.x): elsewhere, or
with no Gloo group, these functions return at once.
"""
from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta
from typing import Dict, Tuple

_TASKS = "/proc/self/task"
_WORKER_NAME = "pt_gloo_runloop"


def _gloo_workers() -> Dict[str, Tuple[str, int]]:
    """Every Gloo worker thread of this process: ``{tid: (scheduler state, context switches)}``."""
    found = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != _WORKER_NAME:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"{_TASKS}/{tid}/status") as f:
                switches = sum(int(line.split()[1]) for line in f if "ctxt_switches:" in line)
        except (OSError, IndexError, ValueError):  # the thread ended meanwhile
            continue
        found[tid] = (state, switches)
    return found


def wait_for_gloo_workers(timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Wait until every Gloo worker thread of this process is idle; True once seen idle, False after
    ``timeout`` seconds (or True at once where there are none, or no ``/proc``).

    Idle: asleep (state ``S``) and not woken once during two consecutive ``interval`` sleeps of this thread,
    which hold no GIL, so a worker waiting for the GIL to drop a finished collective gets it and shows
    activity. A worker still running a collective (a peer has not joined) also sleeps: call this after the
    last collective has completed on every rank (:func:`shutdown` runs a barrier first).
    """
    deadline = time.monotonic() + timeout
    before = _gloo_workers()
    if not before:
        return True
    quiet = 0
    while True:
        time.sleep(interval)  # releases the GIL
        now = _gloo_workers()
        if not now:
            return True
        asleep = all(state == "S" for state, _ in now.values())
        quiet = quiet + 1 if asleep and now == before else 0
        if quiet >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        before = now


def shutdown(process_group=None, timeout: float = 30.0) -> None:
    """The end of a script that owns its process group: wait for every rank (``timeout`` seconds at most;
    a monitored barrier on Gloo), destroy ``process_group`` (None: the default group, and with it every
    group), then :func:`wait_for_gloo_workers`. Safe to call when nothing is initialised, and when a peer is
    already gone (the barrier's error is swallowed: the group is destroyed anyway)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            if str(dist.get_backend(process_group)).lower() == "gloo":
                dist.monitored_barrier(group=process_group, timeout=timedelta(seconds=timeout))
            else:
                dist.barrier(group=process_group)
        except Exception:  # noqa: BLE001 (a peer is gone: destroy anyway, the job has failed elsewhere)
            pass
        dist.destroy_process_group(process_group)
    wait_for_gloo_workers(timeout=timeout)


_REGISTERED = []


def wait_at_exit() -> None:
    """Register :func:`wait_for_gloo_workers` (5 s at most) to run at interpreter exit (once per process).
    ``atexit`` runs it before the interpreter starts finalizing, after the handlers registered later."""
    if not _REGISTERED:
        _REGISTERED.append(True)
        atexit.register(wait_for_gloo_workers, 5.0)


def gloo_worker_count() -> int:
    """How many Gloo worker threads this process has now (0 where ``/proc`` is missing)."""
    return len(_gloo_workers())


__all__ = ["gloo_worker_count", "shutdown", "wait_at_exit", "wait_for_gloo_workers"]
