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
per-step path. With one process nothing is communicated; the outer step still runs on the local delta.

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
return is :func:`wrap_optimizer`.
"""
from __future__ import annotations

import functools
import math
import numbers
import os
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import elastic, lowrank, netcost, payload, sharded, state as layout
from .compressors import FlatCodec, TensorInfo, is_sparse
from .memory import ErrorFeedback
from .quantize import QuantizedWire, check_value_bits, check_value_group
from .sparsify import Sparsifier, dense_contribution
from .stats import Stats
from .wire import index_dtype_for

#: key of the local-steps block in ``opt.state_dict()[horovod_adtopk.state.STATE_KEY]``
STATE_BLOCK = "local_steps"


class Outer:
    """Settings of the outer optimizer: SGD with optional (Nesterov) momentum on the averaged pseudo-gradient.

    ``Outer.nesterov(lr=0.7, momentum=0.9)`` is DiLoCo's; ``Outer.sgd(lr=1.0)`` applies the average as it is
    (with ``sync_every=1`` and a dense exchange this is ordinary data parallelism: ``theta_outer - mean(delta)``
    is the mean of the ranks' parameters after their step)."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, feedback_decay: float = 1.0,
                 value_bits: Optional[int] = None, value_group: Optional[int] = None, exchange: str = "auto",
                 optimizer: Optional[Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = None) -> None:
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (0 < float(lr) < math.inf):
            raise ValueError(f"outer lr must be a finite number > 0, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"outer momentum must be a number in [0, 1), got {momentum!r}")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be True or False, got {nesterov!r}")
        if nesterov and momentum == 0:
            raise ValueError("Nesterov needs an outer momentum > 0; use Outer.sgd(lr) for none")
        if (isinstance(feedback_decay, bool) or not isinstance(feedback_decay, numbers.Real)
                or not 0.0 < float(feedback_decay) <= 1.0):
            raise ValueError(f"feedback_decay must be a number in (0, 1] (1: lossless error feedback), "
                             f"got {feedback_decay!r}")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), nesterov
        self.feedback_decay = float(feedback_decay)
        self.value_bits = check_value_bits(value_bits)
        self.value_group = check_value_group(value_group, self.value_bits)
        self.exchange = sharded.check_exchange(exchange)
        if optimizer is not None and not callable(optimizer):
            raise TypeError(f"Outer.custom(optimizer) takes a callable that builds a torch.optim.Optimizer from a "
                            f"list of tensors, e.g. functools.partial(torch.optim.Adam, lr=1e-3); got {optimizer!r}")
        self.optimizer = optimizer

    @classmethod
    def custom(cls, optimizer: Callable[[List[torch.Tensor]], torch.optim.Optimizer], feedback_decay: float = 1.0,
               value_bits: Optional[int] = None, value_group: Optional[int] = None, exchange: str = "auto") -> "Outer":
        """Any ``torch.optim`` optimizer as the outer step (torchft's ``local_sgd`` model): ``optimizer(params)``
        builds it over the outer parameters (one tensor per trainable parameter, in the model's order), the
        averaged pseudo-gradient is their ``.grad``, and one ``step()`` per sync applies it. E.g.
        ``hat.Outer.custom(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))`` is
        ``Outer.nesterov()``; its state (``optimizer.state``, per parameter name) is saved in checkpoints and
        kept identical on every rank. Learning-rate schedules: call them on the built optimizer through
        ``opt.outer_optimizer()``. The other arguments as in :meth:`sgd`."""
        outer = cls(1.0, 0.0, False, feedback_decay, value_bits, value_group, exchange, optimizer=optimizer)
        outer.build([torch.zeros(1)])  # refuse a factory that does not build an optimizer now, not at the first sync
        return outer

    def build(self, params: List[torch.Tensor]) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer of the outer step over ``params``: the custom one, or ``torch.optim.SGD``
        with this setting's lr, momentum and Nesterov flag (the same arithmetic as DiLoCo's outer step)."""
        if self.optimizer is None:
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        opt = self.optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"Outer.custom(optimizer): optimizer(params) returned {type(opt).__name__}, not a "
                            "torch.optim.Optimizer")
        return opt

    @classmethod
    def nesterov(cls, lr: float = 0.7, momentum: float = 0.9, feedback_decay: float = 1.0,
                 value_bits: Optional[int] = None, value_group: Optional[int] = None, exchange: str = "auto") -> "Outer":
        """DiLoCo's outer optimizer (defaults from the paper)."""
        return cls(lr, momentum, nesterov=True, feedback_decay=feedback_decay, value_bits=value_bits,
                   value_group=value_group, exchange=exchange)

    @classmethod
    def momentum_sgd(cls, lr: float, momentum: float, feedback_decay: float = 1.0,
                     value_bits: Optional[int] = None, value_group: Optional[int] = None,
                     exchange: str = "auto") -> "Outer":
        """Heavy-ball momentum: ``theta <- theta - lr b``."""
        return cls(lr, momentum, nesterov=False, feedback_decay=feedback_decay, value_bits=value_bits,
                   value_group=value_group, exchange=exchange)

    @classmethod
    def sgd(cls, lr: float = 1.0, feedback_decay: float = 1.0, value_bits: Optional[int] = None,
            value_group: Optional[int] = None, exchange: str = "auto") -> "Outer":
        """No momentum: ``theta <- theta - lr Delta`` (SparseLoCo's choice: error feedback replaces momentum;
        ``feedback_decay`` < 1 makes the error-feedback memory forget, as SparseLoCo's does; ``value_bits=2``
        sends its values as 2-bit codes, :mod:`horovod_adtopk.quantize`; ``value_group=64`` lets whole fibers
        share their levels until a set serves at least 64 entries). ``value_bits`` also works on a dense
        exchange (``Compression.none``): every entry then travels as a code, with error feedback.

        ``exchange``: how a sparse or low-bit payload travels. ``"auto"`` (default) picks per tensor, by the cost
        model at the current world size, the cheapest of an allgather, an allreduce of the dense tensor and the
        owner-sharded two-stage exchange (:mod:`horovod_adtopk.sharded`: all-to-all of fiber shards, the owner
        averages, re-selects and re-encodes with its own error feedback, allgather of the owners' blocks; about
        2 payloads per rank at any world size, where an allgather moves W - 1). ``"allgather"``: never sharded;
        ``"sharded"``: every tensor that can be sharded is (ADTopk rules; dense low-bit tensors of 2 or more
        row groups)."""
        return cls(lr, 0.0, nesterov=False, feedback_decay=feedback_decay, value_bits=value_bits,
                   value_group=value_group, exchange=exchange)

    def config(self) -> dict:
        # the built-in settings' keys as before (their checkpoints keep their layout); a custom optimizer instead
        head = ({"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov} if self.optimizer is None
                else {"optimizer": _describe_factory(self.optimizer)})
        return {**head, "feedback_decay": self.feedback_decay, "value_bits": self.value_bits,
                "value_group": self.value_group, "exchange": self.exchange}

    def __repr__(self) -> str:
        if self.optimizer is not None:
            return (f"Outer.custom({_describe_factory(self.optimizer)}, feedback_decay={self.feedback_decay}, "
                    f"value_bits={self.value_bits}, value_group={self.value_group}, exchange={self.exchange!r})")
        return (f"Outer(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov}, "
                f"feedback_decay={self.feedback_decay}, value_bits={self.value_bits}, value_group={self.value_group}, "
                f"exchange={self.exchange!r})")



def _describe_factory(factory) -> str:
    """A rank-independent description of an outer optimizer factory (for the configuration check)."""
    if isinstance(factory, functools.partial):
        args = [repr(a) for a in factory.args] + [f"{k}={v!r}" for k, v in sorted(factory.keywords.items())]
        return f"{_describe_factory(factory.func)}({', '.join(args)})"
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', type(factory).__qualname__)}"


def check_settings(sync_every, outer, compression) -> None:
    """Refuse settings the outer exchange cannot run (before anything is built)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1 (the number of local steps between syncs), got {sync_every!r}")
    if not isinstance(outer, Outer):
        raise TypeError(f"outer must be a horovod_adtopk.Outer, e.g. hat.Outer.nesterov(lr=0.7, momentum=0.9), "
                        f"got {outer!r}")
    low_bit_dense = outer.value_bits is not None and is_plain(compression)
    if outer.feedback_decay != 1.0 and not (is_sparse(compression) and compression.error_feedback) and not low_bit_dense:
        raise ValueError(f"feedback_decay={outer.feedback_decay} decays the error-feedback memory of a sparse "
                         f"compressor or of low-bit values, and {compression!r} keeps none; use adtopk or topk, "
                         "value_bits with Compression.none, or feedback_decay=1")
    if outer.value_bits is not None and not is_sparse(compression) and not low_bit_dense:
        raise ValueError(f"value_bits={outer.value_bits} quantizes the values of the outer exchange, and "
                         f"{compression!r} already sets its own; use value_bits with adtopk, topk or Compression.none "
                         "(every entry as a low-bit code), or value_bits=None")
    if outer.exchange == "sharded" and not (low_bit_dense or (is_sparse(compression) and hasattr(compression, "layout"))):
        raise ValueError(f"Outer(exchange=\"sharded\") shards the fibers of an ADTopk payload or the rows of a dense "
                         f"low-bit one, and {compression!r} has neither; use adtopk / adtopk_i, value_bits with "
                         "Compression.none, or exchange=\"auto\"")
    if is_sparse(compression):
        if lowrank.runs_own_rounds(compression) or not compression.gathers:
            raise ValueError(f"{compression!r} cannot compress the pseudo-gradient (it needs its own collective "
                             "rounds or shared positions); with sync_every use adtopk, adtopk_i, topk, fp16 or none")
        if compression.variable_count:
            raise ValueError(f"{compression!r} sends a variable number of entries, which the outer exchange does "
                             "not carry; with sync_every use a fixed-size rule: adtopk, adtopk_i or topk")


def is_plain(compression) -> bool:
    """A dense exchange in the tensors' own dtype: None or Horovod's ``Compression.none``."""
    return compression is None or getattr(compression, "__name__", None) == "NoneCompressor"


class LocalSteps:
    """The outer state of one rank: outer parameters, outer momentum, pseudo-gradient residuals, counters.

    Args:
        named_parameters: ``(name, tensor)`` pairs of the trainable parameters (unique names).
        sync_every: H, the inner steps per sync.
        outer: the outer optimizer's settings.
        compression: a fixed-size sparse compressor, a dense Horovod-style one (``compress``/``decompress``,
            e.g. ``Compression.fp16``) or None (dense).
        warmup_syncs: the first N syncs travel dense.
        comm: the engine's communicator (module docstring).
    """

    def __init__(self, named_parameters, sync_every: int, outer: Outer, compression, warmup_syncs: int, comm) -> None:
        check_settings(sync_every, outer, compression)
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

    # --- set-up -----------------------------------------------------------------------------------------------
    def plan(self) -> None:
        """Each tensor's path, by the compressor's per-step rule at the current world size."""
        world = self.comm.size()
        self.half_gather: Dict[str, bool] = {}
        self.shard_plans = {}
        if world != self.owner_world:  # the shards moved: the owners' residuals are dropped (module docstring)
            self.owner, self.owner_world = {}, world
        for name, info in self.infos.items():
            path = None
            if self.sparse:
                sparse, reason = self.compression.choose_path(info, world, payload=self.payload_bytes(info))
                plan = self._shard_plan(info, world)
                if plan is not None:
                    choice, why = self._pick(plan, info, world, self._gather_bytes(info) if sparse else None)
                    if choice == "sharded":
                        sparse, reason, path = True, why, "sharded"
                        self.shard_plans[name] = plan
                if not sparse and self.outer.value_bits is not None:
                    self.half_gather[name] = self._gathers(2 * info.numel, info, world)
                    reason += "; bfloat16 allgather" if self.half_gather[name] else "; exact allreduce"
            elif self.low_bit_dense:
                sparse = False
                block = QuantizedWire.dense(self.outer.value_bits, info.shape, self.outer.value_group).block_bytes
                gather = self._gathers(block, info, world)
                self.half_gather[name] = gather
                reason = (f"dense, {self.outer.value_bits}-bit values" if gather else
                          f"dense, exact allreduce ({self.outer.value_bits}-bit codes gathered from {world} ranks "
                          "would move more)")
                plan = self._shard_plan(info, world)
                if plan is not None:
                    choice, why = self._pick(plan, info, world, block if gather else None)
                    if choice == "sharded":
                        self.shard_plans[name], self.half_gather[name] = plan, True
                        reason, path = f"dense, {self.outer.value_bits}-bit values, {why}", "sharded"
            else:
                sparse, reason = False, "dense compressor"
            self.sparse_path[name] = sparse
            self.stats.set_path(name, info.numel, sparse, reason, path=path)

    def _shard_plan(self, info: TensorInfo, world: int, layout=None) -> Optional[sharded.Plan]:
        """The owner-sharded plan of a tensor (None: it cannot be sharded, or ``exchange="allgather"``)."""
        if self.outer.exchange == "allgather" or world < 2:
            return None
        bits, group = self.outer.value_bits, self.outer.value_group
        if self.low_bit_dense:
            return sharded.plan_dense(info.name, info.shape, bits, group, world)
        c = self.compression
        if not self.sparse or len(info.shape) < c.min_dims or info.numel < c.min_numel or not hasattr(c, "codec"):
            return None
        layout = layout if layout is not None else getattr(c.codec(info), "layout", None)
        if layout is None:
            return None
        return sharded.plan_sparse(info.name, layout, bits, group, world, c.wire_value_dtype(info.dtype),
                                   index_dtype_for(layout.fiber_len - 1))

    def _gather_bytes(self, info: TensorInfo) -> int:
        """One rank's sparse payload for an allgather (low-bit block, or values and indices)."""
        quantized = self.payload_bytes(info)
        if quantized is not None:
            return quantized
        c = self.compression
        codec = c.codec(info)
        return sharded.PlainWire(codec.count, c.wire_value_dtype(info.dtype), codec.index_dtype).block_bytes

    def _pick(self, plan: sharded.Plan, info: TensorInfo, world: int, gather: Optional[int]):
        if self.outer.exchange == "sharded":
            return "sharded", f"sharded (forced: {sharded.worst(plan.block_sizes(), world).received} B per rank)"
        return sharded.pick(plan, gather, info.numel * info.dtype.itemsize, world)

    def payload_bytes(self, info: TensorInfo) -> Optional[int]:
        """One rank's bytes per sync for a sparse tensor where the wire differs from the per-step one
        (``value_bits``: the low-bit block of :mod:`horovod_adtopk.quantize`), else None."""
        bits, c = self.outer.value_bits, self.compression
        if bits is None or len(info.shape) < c.min_dims or info.numel < c.min_numel:
            return None  # dense by the shape rules whatever the payload
        count = c.nominal_count(info)
        if count < 1:
            return None
        codec = c.codec(info) if hasattr(c, "codec") else FlatCodec(info.numel, count)
        return QuantizedWire.for_codec(bits, codec, info.numel, self.outer.value_group).block_bytes

    @staticmethod
    def _gathers(block: int, info: TensorInfo, world: int) -> bool:
        """Whether gathering a ``block``-byte rendering of a dense tensor (bfloat16, or low-bit codes; its
        rounding kept in e_r) moves fewer bytes than an fp32 allreduce of it (bfloat16: up to 3 ranks)."""
        return netcost.allgather(block, world).received < netcost.allreduce(4 * info.numel, world).received

    def describe(self) -> dict:
        """What every rank must agree on (for the configuration check)."""
        return {"sync_every": self.sync_every, "outer": self.outer.config(), "warmup_steps": self.warmup_syncs}

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
        active = self.comm.active_members("hat.outer.active") if world > 1 else 1
        dense_round = self.syncs < self.warmup_syncs or active < world or world == 1
        if self.memory is not None and self.outer.feedback_decay != 1.0:
            self.memory.scale_(self.outer.feedback_decay, velocities=False)  # e_r <- beta e_r, before delta is added
        with torch.no_grad():
            groups = self._kinds(world, active)
            for name, p in self.params:
                kind, data = self._route(name, self.theta[name] - p.detach(), dense_round, world, active)
                groups[kind][1].append(payload.Item(name, self.infos[name], data))
            if world == 1:
                averages = {it.name: it.data[0].view(it.info.shape) for it in groups["dense"][1]}
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

    def _route(self, name: str, delta: torch.Tensor, dense_round: bool, world: int, active: int):
        """(kind, what it encodes) of one tensor's pseudo-gradient at this sync."""
        low_bit = self.outer.value_bits is not None and world > 1 and active == world
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
        wire, ctx = (released if released is not None else delta), None
        if self.dense_compression is not None and world > 1:
            wire, ctx = self.dense_compression.compress(wire)
        return "dense", (wire, ctx)

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

    # --- state ------------------------------------------------------------------------------------------------
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


# --- the optimizer surface, shared by both engines ----------------------------------------------------------------

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
