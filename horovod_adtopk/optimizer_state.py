"""What ``hat.DistributedOptimizer`` saves, restores, commits and reports: its checkpoint methods, the Horovod
elastic hooks (:mod:`horovod_adtopk.elastic`), ``reset_compression_state()`` and ``stats()``.

:class:`OptimizerState` is a mixin of methods only: :func:`horovod_adtopk.optimizer.DistributedOptimizer`
copies them, with the optimizer's own, into the class it makes per wrapped optimizer type (as Horovod does),
where ``super(self.__class__, self)`` is the wrapped optimizer's class.
"""
from __future__ import annotations

import warnings

from . import elastic, hierarchical as hier, sharded, state
from .compressors import is_sparse

STATE_KEY = state.STATE_KEY


def kernel_backends() -> dict:
    """Which selection kernels run (native, Triton, torch), for ``stats()``."""
    try:
        from . import kernels
    except ImportError:
        return {"cpu": "torch"}
    return kernels.describe()


def describe_compression(compression) -> dict:
    """A compressor's settings as every rank must agree on them (sparse: its config; dense: its name)."""
    if is_sparse(compression):
        return compression.config()
    return {"compressor": getattr(compression, "__name__", type(compression).__name__)}


class OptimizerState:
    """Checkpoint, elastic, reset and stats methods of ``hat.DistributedOptimizer`` (they use its fields)."""

    # --- checkpoints --------------------------------------------------------------------------------------------
    def _wrap_state(self, ranks: dict) -> dict:
        return state.wrap(self._round, self._world(), describe_compression(self._compression), ranks,
                          self._partial.report if self._partial is not None else None)

    def state_dict(self):
        """The wrapped optimizer's state plus this rank's compression state (key ``"horovod_adtopk"``)."""
        sd = super(self.__class__, self).state_dict()
        sd[STATE_KEY] = self._wrap_state({self._comm.rank() if self._comm.included() else 0: self._local_entry()})
        return sd

    def _local_entry(self) -> dict:
        entry = state.local_entry(self._memory, self._compression, self._sparse, self._hier)
        if self._sender is not None and self._sender.owner:  # the owners' residuals of the sharded exchange
            entry["owner"] = {n: t.detach().clone() for n, t in self._sender.owner.items()}
        return entry

    def gather_state_dict(self):
        """Collective: like ``state_dict()`` but with every member rank's compression state, so that one
        file written by rank 0 restores every rank exactly. Call it on every rank."""
        sd = super(self.__class__, self).state_dict()
        mine = self._local_entry()
        entries = self._comm.allgather_object(mine, "hat.gather_state") if self._world() > 1 else [mine]
        sd[STATE_KEY] = self._wrap_state(dict(enumerate(entries)))
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        entry = None if ours is None else state.unwrap(  # validated before anything changes
            ours, describe_compression(self._compression), self._comm.rank() if self._comm.included() else 0,
            self._world(), self._memory, {n: i.shape for n, i in self._infos.items()})
        super(self.__class__, self).load_state_dict(state_dict)
        self._synchronized, self._should_synchronize = False, True
        self._reset_round()
        if ours is None:
            return
        self._round = int(ours["round"])
        self._members.world = self._world()
        if self._partial is not None and ours.get("partial_sparsification") is not None:
            self._partial.report = ours["partial_sparsification"]
            self._plan_paths()
        if entry is None:
            self.reset_compression_state()
            return
        devices = {n: p.device for p, n in self._parameter_names.items()}
        state.restore(entry, self._memory, self._compression if self._sparse else None, devices)
        hier.load_state(self._hier, entry.get("hierarchical"), devices)
        if self._sender is not None:
            self._sender.owner, dropped = sharded.restore(entry.get("owner"), entry.get("owner_full"),
                                                          self._sender.shard_plans, self._comm.rank(), devices)
            if dropped:
                warnings.warn(f"horovod_adtopk: the owners' residuals of {sorted(dropped)} do not fit this world's "
                              "shards and are dropped (the update they held is lost once)")

    # --- Horovod elastic (horovod_adtopk.elastic) ----------------------------------------------------------------
    def _elastic_snapshot(self) -> dict:
        """``state.commit()``: the wrapped optimizer's state and this rank's private state, copied."""
        return {"inner": elastic.deep(super(self.__class__, self).state_dict()), "round": self._round,
                "memory": self._memory.state_dict() if self._memory is not None else None,
                "compressor": elastic.deep(self._compression.state_dict()) if self._sparse else None,
                "world": self._members.world,
                "owner": {n: t.clone() for n, t in self._sender.owner.items()} if self._sender is not None else {},
                "partial": elastic.deep(self._partial.report) if self._partial is not None else None}

    def _elastic_restore(self, snap: dict) -> None:
        """After a failed collective: back to the last commit, residuals with the model (nothing in flight)."""
        super(self.__class__, self).load_state_dict(elastic.deep(snap["inner"]))
        self._synchronized, self._should_synchronize = False, True
        self._reset_round()
        self._round = snap["round"]
        if self._memory is not None:
            self._memory.load_state_dict(snap["memory"], {n: p.device for p, n in self._parameter_names.items()})
        if self._sparse:
            self._compression.load_state_dict(elastic.deep(snap["compressor"]))
        if self._partial is not None:
            self._partial.report = elastic.deep(snap["partial"])
        if self._sender is not None:
            self._sender.owner = {n: t.clone() for n, t in snap.get("owner", {}).items()}
        self._members.world = snap["world"]

    def _elastic_sync(self) -> None:
        """After a membership change (collective): rank 0's wrapped-optimizer state, round and partial
        sparsification report on every rank, residuals kept and rescaled, paths re-planned."""
        if not self._comm.included():
            return
        inner = self._comm.broadcast_object(super(self.__class__, self).state_dict(), "hat.elastic.inner")
        shared = self._comm.broadcast_object({"round": self._round,
                                              "partial": self._partial.report if self._partial is not None else None},
                                             "hat.elastic.shared")
        if self._comm.rank() != 0:
            super(self.__class__, self).load_state_dict(inner)
        self._synchronized, self._should_synchronize = False, True
        self._reset_round()
        self._round = int(shared["round"])
        if self._partial is not None:
            self._partial.report = shared["partial"]
        self._new_world(force=self._members.synced())

    def _new_world(self, force: bool = True) -> None:
        """Rescale the residuals to the current world size, re-plan, check the configuration again."""
        self._members.moved_to(self._world(), self._memory, force)
        if self._hier is not None:
            self._hier.reset()
        if self._sender is not None:
            self._sender.owner = {}  # the shards moved with the world size: the owners' residuals are dropped
        self._config_checked = False
        self._plan_paths()
        self._description = self._describe()

    def reset_compression_state(self) -> None:
        """Forget every rank-private memory (residuals, velocities, adaptive thresholds) and re-plan for the
        current world size. Register it as a Horovod elastic reset callback
        (``state.register_reset_callbacks([opt.reset_compression_state])``): after a membership change a
        residual belongs to a data partition that no longer exists, the dense/sparse rule depends on the
        world size, and the configuration check must run again with the new members."""
        if self._memory is not None:
            self._memory.reset()
        if self._hier is not None:
            self._hier.reset()
        if self._sparse:
            self._compression.reset_state()
            self._sender.nonfinite.clear()
            self._sender.owner = {}
        self._reset_round()
        self._config_checked = False
        self._members.world = self._world()
        self._plan_paths()
        self._description = self._describe()  # the process set's size may have changed

    def stats(self) -> dict:
        """Cumulative counters of this rank (see :mod:`horovod_adtopk.stats`)."""
        out = self._stats.as_dict()
        out.update(compressor=describe_compression(self._compression), world_size=self._world(), round=self._round,
                   kernels=kernel_backends())
        if self._partial is not None:
            out["partial_sparsification"] = self._partial.report
        if self._hier is not None:
            out["hierarchical"] = self._hier.report()
        out["overlap"] = self._overlap.report() if self._overlap is not None else {"enabled": False}
        out["memory"] = {"residual_norm": self._memory.norm() if self._memory is not None else 0.0,
                         "tensors": len(self._memory.residuals) if self._memory is not None else 0}
        out["elastic"] = self._members.report()
        return out
