"""The optimizer surface of local steps, shared by both engines: a subclass of the user's optimizer class whose
``step()`` runs the inner step and, every ``sync_every``-th step, the outer exchange of
:class:`horovod_adtopk.local_steps.LocalSteps`; checkpoints, elastic hooks and ``stats()``.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import torch

from . import elastic, state as layout
from .local_steps import STATE_BLOCK, LocalSteps


class _LocalStepsOptimizer(torch.optim.Optimizer):
    # Methods copied into a class made per wrapped optimizer type (as Horovod does): ``super(self.__class__, ...)``.

    def __init__(self, params, local: LocalSteps, check_config, world, description: dict) -> None:
        super(self.__class__, self).__init__(params)
        self._local, self._check_config_fn, self._world_fn = local, check_config, world
        self._description, self._config_checked = description, False
        # Horovod elastic (horovod_adtopk.elastic): the world size the residuals are scaled for.
        self._members = elastic.Membership(local.comm.size(), os.environ.get("HOROVOD_ELASTIC") == "1"
                                           and description.get("engine") == "horovod")

    def _check_config(self) -> None:
        if self._members.changed_without_sync(self._local.comm.size()):
            self._new_world()  # hosts removed: Horovod skipped sync(); every survivor sees the same change
        if not self._config_checked:
            self._config_checked = True
            if self._local.comm.size() > 1:
                self._check_config_fn(self._description)

    def step(self, closure=None):
        """The inner optimizer's step on this rank's gradients; every ``sync_every``-th step also the outer
        exchange and step (a collective: every rank must call ``step()`` equally often)."""
        self._check_config()
        self._local.begin()
        loss = super(self.__class__, self).step(closure)
        self._local.after_step()
        return loss

    def outer_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer of the outer step (``torch.optim.SGD`` for the built-in settings, the
        one ``Outer.custom`` builds otherwise), over the outer parameters: e.g. for a learning-rate schedule of
        the outer step. Rebuilt, with its state, when the outer parameters are replaced (a checkpoint is loaded,
        an elastic reset): ask for it again afterwards rather than keeping it."""
        return self._local.outer_optimizer()

    def sync_now(self, average: bool = False) -> bool:
        """Collective: the outer exchange and step now, in the middle of an interval (its pseudo-gradient covers
        the steps since the last sync), so that every rank holds the same parameters; for the end of training,
        or before evaluating or exporting the model. Every rank must call it at the same step. The next
        interval starts here (``sync_every`` steps later).

        ``average=True`` applies the averaged pseudo-gradient as it is (lr 1, no momentum step; the momentum
        is kept): with a dense exchange every rank then holds the mean of the ranks' parameters, which is
        what a final model should be (on the job's GPT it scored better than the outer Nesterov step and
        than any rank's own parameters). Otherwise the outer optimizer steps as at any sync.

        Returns whether it synced: False right after a sync or before the first step, where there is nothing
        to exchange (no collective runs)."""
        if not isinstance(average, bool):
            raise TypeError(f"average must be True or False, got {average!r}")
        if self._local.step == 0:
            return False
        self._check_config()
        return self._local.sync_now(average)

    def synchronize(self) -> None:
        """Nothing to do: gradients stay local (Horovod's API kept so clipping code runs unchanged)."""

    @contextmanager
    def skip_synchronize(self):
        yield

    def _wrap(self, ranks: dict) -> dict:
        ours = layout.wrap(self._local.syncs, self._world_fn(), self._description["compression"], ranks, None)
        ours[STATE_BLOCK] = self._local.shared_state()
        return ours

    def state_dict(self):
        """The inner optimizer's state plus, under ``"horovod_adtopk"``, the outer state and this rank's residuals."""
        sd = super(self.__class__, self).state_dict()
        sd[layout.STATE_KEY] = self._wrap({self._local.comm.rank(): self._local.local_entry()})
        return sd

    def gather_state_dict(self):
        """Collective: like ``state_dict()`` with every rank's private state: residuals, the inner optimizer's
        state (each rank's moments differ: its own gradients) and, mid-interval, its parameters; one file
        written by rank 0 restores every rank exactly."""
        sd = super(self.__class__, self).state_dict()
        mine = dict(self._local.local_entry(), inner_optimizer=sd)
        comm = self._local.comm
        entries = comm.allgather_object(mine, "hat.outer.gather_state") if comm.size() > 1 else [mine]
        sd = dict(sd)
        sd[layout.STATE_KEY] = self._wrap(dict(enumerate(entries)))
        return sd

    def load_state_dict(self, state_dict):
        """Load the model's state first. Validated before anything changes. The outer state is restored
        whatever the world size; this rank's residuals, inner optimizer state and mid-interval parameters
        where the checkpoint holds this rank's entry of the same world size (else the file's top-level inner
        state, empty residuals and a restart of the interval from the outer parameters, with a warning)."""
        state_dict = dict(state_dict)
        ours = state_dict.pop(layout.STATE_KEY, None)
        local = self._local
        entry = None
        if ours is not None:
            local.check_shared(ours.get(STATE_BLOCK))
            entry = layout.unwrap(ours, self._description["compression"], local.comm.rank(), self._world_fn(),
                                  local.memory, {n: i.shape for n, i in local.infos.items()})
        inner = entry.get("inner_optimizer") if entry is not None else None
        super(self.__class__, self).load_state_dict(inner if inner is not None else state_dict)
        if ours is None:
            return
        local.load_shared(ours[STATE_BLOCK])
        local.restore_local(entry)
        local.restore_owner(entry)
        if entry is None:
            if local.memory is not None:
                local.memory.reset()
            if local.sparse:
                local.compression.reset_state()
            return
        layout.restore(entry, local.memory, local.compression if local.sparse else None,
                       {n: p.device for n, p in local.params})

    # --- Horovod elastic (horovod_adtopk.elastic) ----------------------------------------------------------------
    def _elastic_snapshot(self) -> dict:
        """``state.commit()``: the inner optimizer's state, the outer state and this rank's residuals, copied."""
        local = self._local
        return {"inner": elastic.deep(super(self.__class__, self).state_dict()), "shared": local.shared_state(),
                "memory": local.memory.state_dict() if local.memory is not None else None,
                "compressor": elastic.deep(local.compression.state_dict()) if local.sparse else None,
                "owner": {n: t.clone() for n, t in local.owner.items()}, "world": self._members.world}

    def _elastic_restore(self, snap: dict) -> None:
        """After a failed collective: back to the last commit (the model's handler restores the parameters)."""
        local = self._local
        super(self.__class__, self).load_state_dict(elastic.deep(snap["inner"]))
        local.load_shared(snap["shared"])
        if local.memory is not None:
            local.memory.load_state_dict(snap["memory"], {n: p.device for n, p in local.params})
        if local.sparse:
            local.compression.load_state_dict(elastic.deep(snap["compressor"]))
        local.owner = {n: t.clone() for n, t in snap.get("owner", {}).items()}
        self._members.world = snap["world"]

    def _elastic_sync(self) -> None:
        """After a membership change (collective): rank 0's inner optimizer state, outer parameters, outer
        momentum and step within the interval on every rank (the model's handler sent rank 0's parameters);
        residuals kept and rescaled."""
        local = self._local
        inner = local.comm.broadcast_object(super(self.__class__, self).state_dict(), "hat.elastic.inner")
        shared = local.comm.broadcast_object(local.shared_state(), "hat.elastic.outer")
        if local.comm.rank() != 0:
            super(self.__class__, self).load_state_dict(inner)
            local.load_shared(shared)
        self._new_world(force=self._members.synced())

    def _new_world(self, force: bool = True) -> None:
        world = self._local.comm.size()
        self._members.moved_to(world, self._local.memory, force)
        self._local.plan()
        self._config_checked = False
        self._description = dict(self._description, process_set=world)

    def reset_compression_state(self) -> None:
        """For Horovod elastic's reset callbacks: drop the residuals, the outer momentum and the interval, and
        start a fresh interval from the (re-broadcast) parameters at the next step; check the configuration
        again with the new members."""
        self._local.reset()
        self._config_checked = False
        self._description = dict(self._description, process_set=self._local.comm.size())

    def stats(self) -> dict:
        """Counters of this rank: ``bytes_dense`` is what a dense allreduce at *every* step would have sent."""
        local = self._local
        out = local.stats.as_dict()
        out.update(compressor=self._description["compression"], world_size=local.comm.size(), round=local.syncs,
                   local_steps=local.report(), elastic=self._members.report(),
                   memory={"residual_norm": local.memory.norm() if local.memory is not None else 0.0,
                           "tensors": len(local.memory.residuals) if local.memory is not None else 0})
        return out


def wrap_optimizer(optimizer: torch.optim.Optimizer, local: LocalSteps, check_config, world, description: dict,
                   module: Optional[str] = None) -> torch.optim.Optimizer:
    """A subclass of ``optimizer``'s class whose ``step()`` adds the outer exchange (no gradient hooks).

    ``check_config(description)`` is the engine's collective configuration check (run at the first step),
    ``world()`` its world size; ``module``, when given, becomes the class's ``__module__`` (Horovod's
    ``broadcast_optimizer_state`` then steps the inner optimizer, never the outer exchange)."""
    namespace = dict(_LocalStepsOptimizer.__dict__)
    if module is not None:
        namespace["__module__"] = module
    elastic.register()
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, elastic.ElasticAware), namespace)
    return cls(optimizer.param_groups, local, check_config, world, description)
