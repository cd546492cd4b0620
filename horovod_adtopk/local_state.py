"""What a rank of local steps saves and restores (:class:`horovod_adtopk.local_steps.LocalSteps`'s checkpoint and
reset methods, a mixin): its private entry (residuals, owner residuals, mid-interval parameters), the block
every rank shares (outer parameters, the outer optimizer's state, counters) and the checks a loaded block
must pass.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from . import elastic, sharded, state as layout


class LocalStepsState:
    """Checkpoint and reset methods of :class:`horovod_adtopk.local_steps.LocalSteps` (they use its fields)."""

    def local_entry(self) -> dict:
        """This rank's private state (residuals, adaptive compressor state), in :mod:`horovod_adtopk.state`'s
        per-rank layout; in the middle of an interval also this rank's own parameters, which then differ from
        every other rank's (so that one file written by rank 0 restores every rank exactly)."""
        entry = layout.local_entry(self.memory, self.compression, self.sparse)
        if self.owner:  # this rank's shards of the owners' residuals (fiber-major rows [fibers, fiber_len])
            entry["owner"] = {n: t.detach().clone() for n, t in self.owner.items()}
        if self.step > 0:
            entry["local_params"] = {n: p.detach().clone() for n, p in self.params}
        return entry

    def restore_owner(self, entry: Optional[dict]) -> None:
        """The owners' residuals from this rank's entry: its own shards (same world size), or its slice of every
        owner's residuals joined in fiber order (``owner_full``: a gathered checkpoint resumed at another world
        size, :func:`horovod_adtopk.state.fold`). Shards that do not fit this world's plan are dropped with a
        warning; without an entry the owners start empty."""
        entry = entry or {}
        self.owner, dropped = sharded.restore(entry.get("owner"), entry.get("owner_full"), self.shard_plans,
                                              self.comm.rank(), {n: p.device for n, p in self.params})
        self.owner_world = self.comm.size()
        if dropped:
            warnings.warn(f"horovod_adtopk: the owners' residuals of {sorted(dropped)} do not fit this world's shards "
                          "and are dropped (the update they held is lost once)")

    def restore_local(self, entry: Optional[dict]) -> None:
        """After :meth:`load_shared`: a checkpoint written mid-interval puts this rank's own parameters back
        (so load the model's state *before* the optimizer's). Without this rank's entry (another world size, or
        another rank's ``state_dict()``) the interval restarts from the outer parameters, with a warning."""
        if self.step == 0:
            return
        local = (entry or {}).get("local_params")
        if local is None:
            warnings.warn(f"horovod_adtopk: the checkpoint was written {self.step} steps into an interval but holds no "
                          "local parameters for this rank (another world size, or another rank's state_dict()); the "
                          "interval restarts from the outer parameters. Save with opt.gather_state_dict() to resume "
                          "exactly.")
            self.step, local = 0, self.theta or {}
        for n, t in local.items():
            if n not in self.infos or tuple(t.shape) != self.infos[n].shape:
                raise ValueError(f"local parameters of {n!r} in the checkpoint do not fit the model")
        with torch.no_grad():
            for n, p in self.params:
                p.copy_(local[n])

    def shared_state(self) -> dict:
        """State every rank holds identically: settings, counters, outer parameters and momentum."""
        clone = lambda v: v.detach().clone() if torch.is_tensor(v) else v  # noqa: E731
        out = {"sync_every": self.sync_every, "outer": self.outer.config(), "step": self.step, "syncs": self.syncs,
               "outer_params": {n: t.detach().clone() for n, t in (self.theta or {}).items()},
               "momentum": {}}
        if self.outer.optimizer is None:  # the built-in SGD's buffers under "momentum", the layout checkpoints had
            out["momentum"] = {n: clone(t) for n, t in self.momentum.items()}
        else:  # Outer.custom: its optimizer's state per name (and its settings)
            out["outer_optimizer"] = {n: {k: clone(v) for k, v in s.items()} for n, s in self.outer_state.items()}
            if self._outer_opt is not None:
                out["outer_param_groups"] = [{k: v for k, v in g.items() if k != "params"}
                                             for g in self._outer_opt.param_groups]
        return out

    def check_shared(self, block: Optional[dict]) -> None:
        """Refuse a saved block that does not fit these settings or this model (nothing changes)."""
        if block is None:
            raise ValueError("the checkpoint has no local-steps state (it was written without sync_every); "
                             "resume with the settings it was written with")
        saved_outer = block.get("outer")
        if isinstance(saved_outer, dict):  # written before feedback_decay / value_bits / value_group: their defaults
            saved_outer = {"feedback_decay": 1.0, "value_bits": None, "value_group": None, "exchange": "auto",
                           **saved_outer}
        saved = {"sync_every": block.get("sync_every"), "outer": saved_outer}
        mine = {"sync_every": self.sync_every, "outer": self.outer.config()}
        if saved != mine:
            raise ValueError(f"checkpoint was written with local steps {saved}, but this optimizer uses {mine}; "
                             "resume with the same sync_every and outer settings")
        for n in block.get("outer_optimizer", {}):
            if n not in self.infos:
                raise ValueError(f"local-steps outer_optimizer entry {n!r} does not fit the model")
        for store in ("outer_params", "momentum"):
            for n, t in block[store].items():
                if n not in self.infos or tuple(t.shape) != self.infos[n].shape:
                    raise ValueError(f"local-steps {store} entry {n!r} (shape {tuple(t.shape)}) does not fit the model")

    def load_shared(self, block: dict) -> None:
        devices = {n: p.device for n, p in self.params}
        place = lambda n, t: t.detach().to(devices[n], copy=True).contiguous()  # noqa: E731
        self.step, self.syncs = int(block["step"]), int(block["syncs"])
        self.theta = {n: place(n, t) for n, t in block["outer_params"].items()} or None
        keep = lambda n, v: place(n, v) if torch.is_tensor(v) and v.dim() else v  # noqa: E731
        self.outer_state = {n: {k: keep(n, v) for k, v in s.items()}
                            for n, s in block.get("outer_optimizer", {}).items()}
        self.outer_state.update({n: {"momentum_buffer": place(n, t)} for n, t in block["momentum"].items()})
        self._outer_opt = None
        groups = block.get("outer_param_groups")
        if groups and self.theta is not None:  # e.g. a learning rate a schedule had changed
            for group, saved in zip(self.outer_optimizer().param_groups, groups):
                group.update(saved)

    def reset(self) -> None:
        """Forget everything rank-private and start a fresh interval from the current parameters (an elastic
        membership change: the residuals belong to data partitions that no longer exist, a new member has no
        outer state; the momentum is dropped so that every member starts from the same outer state)."""
        if self.memory is not None:
            self.memory.reset()
        if self.sparse:
            self.compression.reset_state()
            self.sparsifier.nonfinite.clear()
        self.theta, self.step = None, 0
        self.outer_state, self._outer_opt = {}, None
        self.owner = {}
        self.plan()

    def report(self) -> dict:
        return {"sync_every": self.sync_every, "outer": self.outer.config(), "step_in_interval": self.step,
                "syncs": self.syncs, "warmup_syncs": self.warmup_syncs, "sync_seconds": self.sync_seconds,
                "memory_bytes": self.memory_bytes()}
