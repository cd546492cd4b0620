"""Local steps with an outer exchange (DiLoCo / SparseLoCo style): the engine-free layer above the exchanges.

Every rank runs ``H = sync_every`` steps of its own optimizer (the *inner* optimizer) without communicating.
At every H-th step, per trainable tensor (in sorted-name order, identically on every rank)::

    delta_r      = theta_outer - theta_r                 the pseudo-gradient of rank r (W ranks)
    a_r          = delta_r + beta e_r                    error feedback (rank-private residual e_r; beta 1 by default)
    e_r         <- a_r - D(C(a_r))                       C: any of our fixed-size compressors, or dense
    Delta        = (1/W) sum_r D(C(a_r))                 allgather of sparse payloads / allreduce of dense
    b           <- mu b + Delta                          outer momentum (Outer.nesterov / Outer.momentum)
    theta_outer <- theta_outer - lr (Delta + mu b)       Nesterov; plain momentum: lr b; Outer.sgd: lr Delta
    theta_r     <- theta_outer                           every rank continues from the same bits

(DiLoCo: dense, ``Outer.nesterov(lr=0.7, momentum=0.9)``, AdamW inside. SparseLoCo's recipe is error feedback
on a sparse pseudo-gradient *instead of* outer momentum: a sparse compressor with ``Outer.sgd(lr)``, its
residual decayed by ``beta = feedback_decay < 1`` at every sync, so that the memory acts as a momentum that
forgets. With ``beta = 1`` nothing is dropped: ``sum of deltas = sent + e_r``; with ``beta < 1`` the part of
a residual that waits ``n`` syncs is sent scaled by ``beta**n`` or not at all. ``Outer(value_bits=b)``: the sparse
values travel as b-bit codes and the indices bit-packed, :mod:`horovod_adtopk.quantize`; D(C(a_r)) is then what
the codes carry, and the rest stays in e_r; ``value_group=n`` shares one set of levels among whole fibers, at
least n entries; the tensors that always travel dense, 1-D ones and those under ``min_numel``, then travel as
bfloat16 with their rounding in e_r, gathered and summed in rank order. ``value_bits`` with a dense exchange
(``compression=None`` or ``Compression.none``): every entry of ``a_r`` travels as a b-bit code, no indices,
levels per row of the tensor's ``[d0, -1]`` view (a 1-D tensor: one set) or per run of whole rows holding at
least ``value_group`` entries; the rounding stays in e_r (an error-feedback memory for every tensor), and the
warm-up syncs send ``a_r`` in full.)

A tensor takes the per-step rules of its compressor unchanged (``choose_path``: 1-D tensors, ``min_numel``,
the hybrid cost rule, the axis); it travels dense during the first ``warmup_syncs`` syncs and on a sync at
which a member has joined (Horovod's ``hvd.join()``: joined members add zeros, so the sum is divided by the
number of active members). A dense tensor of the sparse path sends ``a_r`` (its residual released), as on the
per-step path. With one process nothing is communicated, the outer step still runs on the local delta, unless
``exchange_when_alone``: then a sync runs as at any world size (selection or low-bit coding, error feedback,
the collectives over a world of one), for checking a backend end to end on one device.

``sync_now()`` syncs at any step (a shorter interval; the next starts there), so that a run that stops
mid-interval ends with one model on every rank; ``sync_now(average=True)`` applies that sync's average as it
is (``theta_outer -= Delta``, no momentum step): the mean of the ranks' parameters with a dense exchange.

Between syncs nothing is communicated. A sync costs, per rank: the sparse payloads (one allgather per
tensor), the dense tensors (one allreduce each, fused by the engine) and, on Horovod, a 4-byte join query.
An allgather delivers W - 1 payloads to every rank; ``Outer(exchange="auto")`` (the default) sends a tensor by
the owner-sharded exchange instead (:mod:`horovod_adtopk.sharded`: one all-to-all of fiber shards for all such
tensors, each owner averages its shard, re-selects it with its own residual and re-encodes it, then an
allgather of the owners' blocks; about two payloads per rank whatever W is) wherever the cost model
(:mod:`horovod_adtopk.netcost`) says it moves fewer bytes: from 3 ranks on, and at large W also where the
allgather would lose to a dense allreduce. The owners' residuals are rank-private state, saved in
checkpoints; a gathered checkpoint resumed at another world size re-cuts them among the new owners; an
elastic membership change or ``reset()`` drops them.

Memory: the outer parameters (one copy of every trainable parameter, in its dtype), the outer momentum
buffer (another copy, when ``momentum > 0``) and the residuals of the sparse-path tensors (error feedback; of
every tensor with a dense low-bit exchange):
``LocalSteps.memory_bytes()`` counts what is held.

This module owns the outer state and its math; it imports neither Horovod nor ``torch.distributed``. The
engines hand it a communicator with ``size()``, ``rank()``, ``sum_tensors(tensors, names)``,
``gather_tensors(tensors, names)`` (blocking; each rank's tensors have the same sizes on every rank) and
``active_members(name)`` (:class:`horovod_adtopk.communicator.Communicator` and
:class:`horovod_adtopk.ddp.communicator.ProcessGroupComm` have them). The optimizer surface both engines
return is :func:`horovod_adtopk.local_optimizer.wrap_optimizer`.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import torch

from . import payload, sharded
from .compressors import TensorInfo, is_sparse
from .local_plan import LocalStepsPlan
from .local_state import LocalStepsState
from .memory import ErrorFeedback
from .outer import Outer, check_settings, is_plain  # noqa: F401  (the local-steps API: hat.Outer and its checks)
from .sparsify import Sparsifier, dense_contribution
from .stats import Stats

#: key of the local-steps block in ``opt.state_dict()[horovod_adtopk.state.STATE_KEY]``
STATE_BLOCK = "local_steps"


class LocalSteps(LocalStepsPlan, LocalStepsState):
    """The outer state of one rank: outer parameters, outer momentum, pseudo-gradient residuals, counters.

    Args:
        named_parameters: ``(name, tensor)`` pairs of the trainable parameters (unique names).
        sync_every: H, the inner steps per sync.
        outer: the outer optimizer's settings.
        compression: a fixed-size sparse compressor, a dense Horovod-style one (``compress``/``decompress``,
            e.g. ``Compression.fp16``) or None (dense).
        warmup_syncs: the first N syncs travel dense.
        comm: the engine's communicator (module docstring).
        exchange_when_alone: with one process, sync through the exchange anyway (module docstring). Default False.
    """

    def __init__(self, named_parameters, sync_every: int, outer: Outer, compression, warmup_syncs: int, comm,
                 exchange_when_alone: bool = False) -> None:
        check_settings(sync_every, outer, compression)
        self.exchange_when_alone = exchange_when_alone  # checked by the engines' factories
        self.sync_every, self.outer, self.comm = int(sync_every), outer, comm
        self.warmup_syncs = int(warmup_syncs)
        self.params: List[Tuple[str, torch.Tensor]] = sorted(
            ((n, p) for n, p in named_parameters if p.requires_grad), key=lambda kv: kv[0])
        self.compression = compression
        self.sparse = is_sparse(compression)
        self.dense_compression = None if self.sparse else compression
        # the dense low-bit exchange (value_bits with Compression.none): every entry as a b-bit code, the rest in e_r
        self.low_bit_dense = outer.value_bits is not None and not self.sparse
        if self.sparse and compression.error_feedback:
            self.memory: Optional[ErrorFeedback] = ErrorFeedback(compression.momentum)
        else:
            self.memory = ErrorFeedback() if self.low_bit_dense else None
        self.sparsifier = Sparsifier(compression, self.memory) if self.sparse else None
        self.infos = {n: TensorInfo(n, tuple(p.shape), p.numel(), p.dtype) for n, p in self.params}
        self.stats = Stats()
        self.step = 0  # inner steps done in the current interval
        self.syncs = 0  # syncs completed (drives the warm-up, the density warm-up, ADTopk-I)
        self.theta: Optional[Dict[str, torch.Tensor]] = None  # outer parameters, taken at the first step
        # the outer optimizer's state per name: the very dicts its ``state`` holds (it updates them in place), so
        # that checkpoints, resets and the memory report need no copy back; SGD's "momentum_buffer" for the built-ins
        self.outer_state: Dict[str, dict] = {}
        self._outer_opt: Optional[torch.optim.Optimizer] = None  # built over self.theta when first needed
        self.sync_seconds = 0.0
        self.sparse_path: Dict[str, bool] = {}
        # the owner-sharded exchange (horovod_adtopk.sharded): each tensor's plan, and this rank's owner residuals
        self.shard_plans: Dict[str, sharded.Plan] = {}
        self.owner: Dict[str, torch.Tensor] = {}
        self.owner_world = comm.size()
        self.plan()

    def describe(self) -> dict:
        """What every rank must agree on (for the configuration check)."""
        return {"sync_every": self.sync_every, "outer": self.outer.config(), "warmup_steps": self.warmup_syncs,
                "exchange_when_alone": self.exchange_when_alone}

    def begin(self) -> None:
        """Before the first inner step (after the initial broadcast): the outer parameters are a copy of the
        parameters."""
        if self.theta is None:
            self.theta = {n: p.detach().clone(memory_format=torch.contiguous_format) for n, p in self.params}
            self._outer_opt = None

    @property
    def momentum(self) -> Dict[str, torch.Tensor]:
        """The built-in outer SGD's momentum buffers by name (held in :attr:`outer_state`)."""
        return {n: s["momentum_buffer"] for n, s in self.outer_state.items() if s.get("momentum_buffer") is not None}

    def memory_bytes(self) -> dict:
        """Bytes held beyond the model: outer parameters, outer momentum, residuals (and DGC velocities)."""
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        state = [v for s in self.outer_state.values() for v in s.values() if torch.is_tensor(v)]
        out = {"outer_params": size((self.theta or {}).values()), "outer_momentum": size(state),
               "residuals": 0, "owner_residuals": size(self.owner.values())}
        if self.memory is not None:
            out["residuals"] = size(self.memory.residuals.values()) + size(self.memory.velocities.values())
        out["total"] = sum(out.values())
        return out

    # --- the interval -----------------------------------------------------------------------------------------
    def after_step(self) -> bool:
        """Count one inner step; at the H-th, sync. Returns whether this step synced."""
        self.begin()
        self.step += 1
        world = self.comm.size()
        for name, info in self.infos.items():  # the per-step dense baseline of "bytes sent vs dense"
            self.stats.baseline(name, info.numel, world)
        self.stats.steps += 1
        if self.step < self.sync_every:
            return False
        return self.sync_now()

    def sync_now(self, average: bool = False) -> bool:
        """Sync at the current step, whatever the step within the interval (a shorter last interval); the next
        interval starts here. Nothing to do (False) at the start of an interval."""
        if self.step == 0:
            return False
        start = time.perf_counter()
        self.sync(average)
        self.sync_seconds += time.perf_counter() - start
        self.step = 0
        return True

    def sync(self, average: bool = False) -> None:
        """The outer exchange and step (module docstring); every rank calls it at the same step. ``average``:
        the averaged pseudo-gradient is applied as it is (lr 1, the outer momentum left as it was)."""
        world = self.comm.size()
        alone = self._alone(world)
        active = self.comm.active_members("hat.outer.active") if not alone else 1
        dense_round = self.syncs < self.warmup_syncs or active < world or alone
        if self.memory is not None and self.outer.feedback_decay != 1.0:
            self.memory.scale_(self.outer.feedback_decay, velocities=False)  # e_r <- beta e_r, before delta is added
        with torch.no_grad():
            groups = self._kinds(world, active)
            for name, p in self.params:
                kind, data = self._route(name, self.theta[name] - p.detach(), dense_round, world, active)
                groups[kind][1].append(payload.Item(name, self.infos[name], data))
            if alone:
                averages = {it.name: it.data.view(it.info.shape) for it in groups["dense"][1]}
            else:
                averages = payload.run(self.comm, self.stats, list(groups.values()))
            if average:  # the average as it is; the outer optimizer's state is left as it was
                for name, p in self.params:
                    self.theta[name].sub_(averages[name])
                    p.copy_(self.theta[name])
            else:
                self._outer_step(averages)
        if self.sparsifier is not None and self.sparsifier.scrub_nonfinite():
            self.stats.nonfinite_steps += 1
        self.syncs += 1

    def _kinds(self, world: int, active: int) -> Dict[str, tuple]:
        """This sync's wire kinds (:mod:`horovod_adtopk.payload`), each with the list of its tensors, in the order
        they travel."""
        bits, group, memory = self.outer.value_bits, self.outer.value_group, self.memory
        gather = (payload.SparseGather(world, self.compression) if bits is None else
                  payload.LowBitSparseGather(world, bits, group, memory))
        return {"dense": (payload.DenseSum(world, active, self.dense_compression), []), "sparse": (gather, []),
                "sharded": (payload.OwnerSharded(world, bits, memory, self.owner), []),
                "bf16": (payload.Bfloat16Gather(world, memory), []),
                "codes": (payload.LowBitDenseGather(world, bits, group, memory), [])}

    def _alone(self, world: int) -> bool:
        """One process and no ``exchange_when_alone``: nothing to exchange, the local delta is the average."""
        return world == 1 and not self.exchange_when_alone

    def _route(self, name: str, delta: torch.Tensor, dense_round: bool, world: int, active: int):
        """(kind, what it encodes) of one tensor's pseudo-gradient at this sync."""
        low_bit = self.outer.value_bits is not None and not self._alone(world) and active == world
        if self.sparse_path[name] and not dense_round:
            s = self.sparsifier.select(delta, self.infos[name], self.syncs)
            plan = self._fitting_plan(name, s, world)
            return ("sharded", (plan, s)) if plan is not None else ("sparse", s)
        if low_bit and self.low_bit_dense and not dense_round and self.half_gather[name]:
            plan = self.shard_plans.get(name)
            return ("sharded", (plan, delta)) if plan is not None else ("codes", delta)
        if low_bit and self.sparse and not self.sparse_path[name] and self.half_gather[name]:
            return "bf16", delta
        released = dense_contribution(self.memory, name, delta, self.sparse_path[name])
        return "dense", released if released is not None else delta

    def _fitting_plan(self, name: str, selection, world: int) -> Optional[sharded.Plan]:
        """The owner-sharded plan of a selection (re-cut for a density warm-up's k), or None: it is gathered (no
        plan, or a codec without fibers this sync, e.g. ADTopk-I's global rounds)."""
        layout = getattr(selection.codec, "layout", None)
        if name not in self.shard_plans or layout is None:
            return None
        plan = self.shard_plans[name]
        return plan if plan.fits(layout) else self._shard_plan(self.infos[name], world, layout)

    def outer_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer of the outer step, over the outer parameters in the model's order (built
        when first needed, with the saved state; rebuilt whenever the outer parameters are replaced)."""
        if self._outer_opt is None:
            self.begin()
            order = [self.theta[n] for n, _ in self.params]
            opt = self.outer.build(order)
            for n, _ in self.params:
                opt.state[self.theta[n]] = self.outer_state.setdefault(n, {})
            self._outer_opt = opt
        return self._outer_opt

    def _outer_step(self, averages: Dict[str, torch.Tensor]) -> None:
        """``theta.grad = average``, one ``step()`` of the outer optimizer, the parameters set to ``theta``."""
        opt = self.outer_optimizer()
        for name, _ in self.params:
            self.theta[name].grad = averages[name].to(self.theta[name].dtype).reshape(self.theta[name].shape)
        opt.step()  # updates self.outer_state's dicts in place
        for name, p in self.params:
            self.theta[name].grad = None
            p.copy_(self.theta[name])

