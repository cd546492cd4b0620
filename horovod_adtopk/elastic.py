"""Horovod elastic: what ``hvd.elastic.TorchState(model=..., optimizer=opt)`` does with our optimizers.

Horovod keeps an elastic job's state in handlers chosen by type from a registry
(``horovod.torch.elastic.state``): ``save()`` at every ``state.commit()``, ``restore()`` after a failed
collective (back to the last commit), ``sync()`` after a membership change (rank 0's state to everyone).
Horovod's own optimizer handler is wrong for an optimizer with error feedback in three ways, so
:func:`register` puts :class:`OptimizerHandler` ahead of it for every optimizer made by
``hat.DistributedOptimizer`` (with or without ``sync_every``):

1. Residuals are rank-private. ``sync()`` never copies rank 0's onto another rank; ``save()`` /
   ``restore()`` snapshot and roll back this rank's residuals together with the model and the wrapped
   optimizer, so after a failed collective no gradient mass is applied twice and none is dropped.
2. A survivor keeps its residuals across a membership change, scaled by ``W_new / W_old``. The update the
   ranks still owe is ``sum_i r_i / W`` (each rank's residual is in units of its own gradient and the
   exchange averages); after the change the survivors' share of it, ``sum_{i in S} r_i / W_old``, is
   delivered exactly once by residuals ``r_i * W_new / W_old`` averaged over ``W_new``. A new rank starts
   empty. What a lost rank held (``r_lost / W_old`` of an update) is lost with it.
3. Horovod's ``broadcast_optimizer_state`` calls ``step()`` with zero gradients where a rank has no state
   yet (a new worker): with decoupled weight decay (AdamW) that moves the new rank's parameters after they
   were broadcast, so the ranks silently differ. ``sync()`` here sends rank 0's wrapped optimizer state as
   one object and every rank loads it; nothing steps.

``sync()`` also sends rank 0's round counter (it drives the warm-up, ADTopk-I's alternation and Random-k's
seeds: a new rank at round 0 would send dense while the others send sparse) and, with local steps, the
outer parameters, the outer momentum and the step within the interval. Then every rank re-plans the
sparse/dense paths for the new world size and runs the configuration check again at its next exchange.
Horovod skips ``sync()`` when hosts were only removed; the optimizer then notices the new world size at
its next exchange (:func:`world_changed`) and does the same locally (every survivor sees the same change).
"""
from __future__ import annotations

import copy
from typing import Optional

_REGISTERED = False


class ElasticAware:
    """Marker base of the optimizer classes made by ``hat.DistributedOptimizer``: they implement
    ``_elastic_snapshot()``, ``_elastic_restore(snapshot)`` and ``_elastic_sync()``."""


def register() -> None:
    """Put :class:`OptimizerHandler` first in Horovod's elastic handler registry (once per process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    try:
        from horovod.torch.elastic import state as elastic_state
    except ImportError:  # the DDP engine without Horovod: nothing to register with
        return
    registry = list(elastic_state.get_handler_registry())
    if not any(handler is OptimizerHandler for _, handler in registry):
        elastic_state.set_handler_registry([(ElasticAware, OptimizerHandler)] + registry)
    _REGISTERED = True


class OptimizerHandler:
    """Horovod's ``StateHandler`` protocol (``value``, ``save``, ``restore``, ``sync``, ``set_value``) for
    our optimizers; see the module docstring."""

    def __init__(self, optimizer) -> None:
        self.value = optimizer
        self._saved = optimizer._elastic_snapshot()

    def save(self) -> None:
        self._saved = self.value._elastic_snapshot()

    def restore(self) -> None:
        self.value._elastic_restore(self._saved)

    def sync(self) -> None:
        self.value._elastic_sync()

    def set_value(self, value) -> None:
        self.value = value
        self.save()


def deep(obj):
    """A snapshot that later in-place updates cannot reach (tensors cloned)."""
    return copy.deepcopy(obj)


def rescale(memory, old_world: Optional[int], new_world: int) -> float:
    """Scale a survivor's residuals (and momentum-correction velocities) by ``new_world / old_world``
    (module docstring, point 2); returns the factor applied."""
    if memory is None or not old_world or old_world == new_world:
        return 1.0
    factor = new_world / old_world
    memory.scale_(factor)
    return factor


def world_changed(seen: Optional[int], now: int) -> bool:
    """The world size the residuals are scaled for differs from the current one (a change without sync)."""
    return seen is not None and seen != now


class Membership:
    """One optimizer's elastic bookkeeping, the same for both optimizer classes (per step and local steps):
    the world size its residuals are scaled for, and the record ``stats()["elastic"]`` reports
    (``membership_changes``, ``syncs``, ``world_sizes``, ``residual_scale``).

    Args:
        world: the world size at construction.
        enabled: a Horovod elastic job (``HOROVOD_ELASTIC=1``): a world size that changed without ``sync()``
            (hosts only removed) is noticed at the next exchange (:meth:`changed_without_sync`).
    """

    def __init__(self, world: int, enabled: bool) -> None:
        self.enabled = enabled
        self.world = world  # what the residuals are scaled for
        self.record = {"membership_changes": 0, "syncs": 0, "world_sizes": [world], "residual_scale": []}

    def changed_without_sync(self, now: int) -> bool:
        """An elastic job whose world size differs from the residuals' (Horovod skipped ``sync()``)."""
        return self.enabled and world_changed(self.world, now)

    def synced(self) -> bool:
        """Count a ``sync()``; whether it follows a membership change (the first one starts the job)."""
        self.record["syncs"] += 1
        return self.record["syncs"] > 1

    def moved_to(self, now: int, memory, force: bool = True) -> None:
        """The world is now ``now`` ranks: record the change (if ``force`` or the size differs) and rescale
        ``memory``'s residuals by ``now / world`` (module docstring, point 2)."""
        if force or now != self.world:
            self.record["membership_changes"] += 1
            self.record["world_sizes"].append(now)
            self.record["residual_scale"].append(rescale(memory, self.world, now))
        self.world = now

    def report(self) -> dict:
        return deep(self.record)
