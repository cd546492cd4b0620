"""``DistributedOptimizer``: a drop-in for ``hvd.DistributedOptimizer`` that carries sparse gradients.

One step, per parameter (Horovod's shape: hooks start the communication while the backward pass runs)::

    gradient hook -> path? --dense--> DenseExchange / GroupExchange (Horovod allreduce, fused)
                          \\--sparse-> SparseSender.send: memory (a = g + r) -> compressor.select
                                       -> wire.pack -> communicator allgather -> SparseExchange
    step() / synchronize() -> exchange.advance() -> exchange.finish(): wait, unpack, scatter-add,
                              average into p.grad -> the wrapped optimizer's step

CUDA gradients of plain ADTopk with plain error feedback wait in a group (up to ``exchange.GROUP_CAP_BYTES``,
the rest until ``synchronize()``) and are selected together (:meth:`SparseSender.send`, ``BUCKET_SELECT``), bit
for bit as one by one.

A parameter goes dense when it is 1-D, small, or not worth sparsifying (``SparseCompressor.choose_path``),
during the first ``warmup_steps`` rounds, or when partial sparsification decided so
(:mod:`horovod_adtopk.partial`). The configuration check (:mod:`horovod_adtopk.config_check`) runs before
the first exchange; checkpoint state is laid out by :mod:`horovod_adtopk.state`.
"""
from __future__ import annotations

import math
import os
import numbers
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import horovod.torch as hvd
import horovod.torch.optimizer as _horovod_optimizer
from horovod.torch.compression import Compressor, NoneCompressor

from . import advice, communicator, config_check, elastic, hierarchical as hier, netcost, overlap as overlap_, paths
from . import sharded, state
from .communicator import Communicator
from .compressors import SparseCompressor, TensorInfo, is_sparse
from .exchange import DenseExchange, Exchange, GroupExchange, SparseGradExchange, SparseSender
from .intake import GradientIntake
from .join import JoinGate
from .memory import ErrorFeedback
from .partial import PartialSparsification
from .optimizer_state import OptimizerState, describe_compression as _describe_compression
from .stats import Stats

STATE_KEY = state.STATE_KEY
# Horovod's own messages, word for word (users and tests match them).
_STEP_AFTER_SYNCHRONIZE = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                           "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                           "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                           "your code.")
_ZERO_GRAD_IN_ROUND = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                       "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods are copied into a class created per wrapped optimizer type (as Horovod does), hence the
    # explicit ``super(self.__class__, self)``.

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, partial_sparsification,
                 profile_rounds, warmup_steps, hierarchical=False, overlap=False, exchange="allgather",
                 exchange_when_alone=False):
        super(self.__class__, self).__init__(params)
        self._exchange_when_alone = exchange_when_alone
        named = _check_named_parameters(named_parameters, self.param_groups)
        self._compression = compression
        self._sparse = is_sparse(compression)
        self._dense_compression = NoneCompressor if self._sparse else compression
        self._parameter_names = {v: k for k, v in sorted(named, key=lambda kv: kv[0])}
        self.backward_passes_per_step, self.op, self.gradient_predivide_factor = backward_passes_per_step, op, \
            gradient_predivide_factor
        self.sparse_as_dense, self.process_set, self.warmup_steps = sparse_as_dense, process_set, warmup_steps
        self._comm = Communicator(process_set)
        self._stats = Stats()
        # Rank-private memory of what was not sent; every rule with error feedback has one.
        self._memory = ErrorFeedback(compression.momentum) if self._sparse and compression.error_feedback else None
        self._sender = (SparseSender(compression, self._memory, self._comm, self._stats, op, hvd.Sum, op == hvd.Average,
                                     *self._scales()) if self._sparse else None)
        if self._sender is not None:
            self._sender.exchange = exchange
            # plain-ADTopk gradients selected in groups (exchange.BUCKET_SELECT); synchronize() flushes them
            self._sender.grouping = True
        self._exchange = exchange
        self._overlap = overlap_.attach(self._sender, overlap, communicator.local_size())
        self._partial = PartialSparsification(profile_rounds) if partial_sparsification and self._sparse else None
        self._hierarchical_setting = hierarchical if self._sparse else False
        self._hier: Optional[hier.Hierarchical] = None  # the hierarchical exchange kind (dense in a host)
        # In-flight exchanges per parameter (or group); ``None``: gradient accumulating locally this round.
        self._handles: Dict[object, Optional[Exchange]] = {}
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._synchronized, self._should_synchronize, self._config_checked = False, True, False
        self._round = 0  # communication rounds completed: drives ADTopk-I, Random-k seeds, warm-ups
        # Horovod elastic (horovod_adtopk.elastic): the world size the residuals are scaled for.
        self._members = elastic.Membership(self._comm.size() if self._comm.included() else 1,
                                           os.environ.get("HOROVOD_ELASTIC") == "1")
        self._join = JoinGate(self._comm)  # has a member called hvd.join()? asked once per round
        self._intake = GradientIntake(self._parameter_names, sparse_as_dense, self._memory)
        self._infos = {name: TensorInfo(name, tuple(p.shape), p.numel(), p.dtype)
                       for p, name in self._parameter_names.items() if p.requires_grad and _floating(p, name)}
        self._sparse_path: Dict[str, bool] = {}  # per name: on the sparse path (horovod_adtopk.paths)
        self._plan_paths()
        self._groups_given = groups is not None
        self._set_groups(groups)
        if self._hierarchical_setting is not False and self._comm.included():
            self._start_hierarchical(groups)
        # With one process nothing is communicated (as Horovod) unless ``exchange_when_alone``; elastic jobs may
        # grow, so they hook anyway.
        self._communicating = self._comm.included() and (communicator.world_size() > 1 or exchange_when_alone
                                                         or os.environ.get("HOROVOD_ELASTIC") == "1")
        self._requires_update = ({p for group in self.param_groups for p in group["params"] if p.requires_grad}
                                 if self._communicating else set())
        for p in self._requires_update:
            p.register_post_accumulate_grad_hook(self._make_hook(p))

    # --- set-up ---------------------------------------------------------------------------------------------
    def _world(self) -> int:
        return self._comm.size() if self._comm.included() else 1

    def _start_hierarchical(self, groups) -> None:
        """Agree on the configuration first (a rank without ``hierarchical`` would not join the layout's
        collectives), then build the process sets and re-plan with the hierarchical exchange kind. Under
        Horovod elastic it falls back to flat without a collective: a worker that joins later builds its
        optimizer alone, outside ``hvd.elastic.run``, and would wait for the others forever."""
        if not self._members.enabled:
            config_check.check(self._comm, self._description)
        self._hier = self._intake.hierarchical = hier.Hierarchical(
            self._hierarchical_setting, self._compression, self._comm, self.op, hvd.Sum, self.op == hvd.Average,
            *self._scales(), elastic=self._members.enabled)
        self._plan_paths()
        self._set_groups(groups)

    def _set_groups(self, groups) -> None:
        """Explicit groups of the dense-path tensors (they depend on the paths), then the description."""
        self._groups = _make_groups(groups, self._parameter_names, self._infos, self._sparse_path)
        self._group_ready = {g: 0 for g in set(self._groups.values())}
        self._description = self._describe()

    def _plan_paths(self) -> None:
        paths.plan(self._sparse_path, self._infos, self._compression if self._sparse else None, self._partial,
                   self._hier, self._world(), self._stats, self._sender)

    def _describe(self) -> dict:
        return dict(self._describe_base(), exchange=self._exchange, exchange_when_alone=self._exchange_when_alone)

    def _describe_base(self) -> dict:
        return config_check.describe(
            _describe_compression(self._compression), self.op, self.backward_passes_per_step,
            self.gradient_predivide_factor, self._groups if self._groups_given else None, self._parameter_names,
            self.sparse_as_dense, self._partial, self.warmup_steps,
            self._comm.size() if self._comm.included() else None, self._infos,
            self._hier.describe() if self._hier is not None else {"setting": str(self._hierarchical_setting)})

    def _make_hook(self, p):
        def hook(*_):
            if self._handles.get(p) is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call "
                                     "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            if self._allreduce_delay[p] > 0:
                self._handles[p] = None
                return
            group = self._groups.get(p)
            if group is None:
                self._handles[p] = self._submit(p, wait=False)
                if self._handles[p] is None:  # waits for this round's join query (horovod_adtopk.join)
                    self._join.hold(p)
                for q in self._join.release():
                    self._handles[q] = self._submit(q)
                return
            self._group_ready[group] += 1
            self._handles[p] = None
            if self._group_ready[group] == len(group):
                self._submit_group(group)
        return hook

    # --- submitting -----------------------------------------------------------------------------------------
    def _scales(self):
        """Horovod's pre/post-scaling: ``(1/f, f)`` for Average with predivide factor ``f``."""
        f = self.gradient_predivide_factor
        return (1.0 / f, f) if self.op == hvd.Average else (1.0, 1.0)

    def _submit(self, p, wait: bool = True) -> Optional[Exchange]:
        """The exchange of ``p`` for this round. From a hook (``wait=False``) a sparse tensor may get None:
        it waits for this round's join query (:mod:`horovod_adtopk.join`) and is sent by a later hook or by
        ``synchronize()``."""
        self._check_config()
        name = self._parameter_names[p]
        sparse = self._sparse and self._sparse_path.get(name) and self._round >= self.warmup_steps
        gathers_sparse_grad = self._intake.gathers_sparse(p)
        if sparse or gathers_sparse_grad:  # both allgather, which no member may do while one has joined
            joined = self._join.answer(wait)
            if joined is None:
                return None
            sparse, gathers_sparse_grad = sparse and not joined, gathers_sparse_grad and not joined
        if gathers_sparse_grad:
            exchange = SparseGradExchange(self._comm, p, name, self.op)
            # Horovod's sparse allreduce allgathers indices and values (two allgathers)
            self._stats.record(name, p.numel(), exchange.elements, exchange.bytes,
                               wire=netcost.allgather(exchange.bytes, self._comm.size()), world=self._comm.size())
            return exchange
        grad = self._intake.take(p)
        if sparse and self._hier is not None and self._hier.owns(name):
            elements, payload, wire = self._hier.traffic(self._infos[name])
            self._stats.record(name, p.numel(), elements, payload, wire=wire, world=self._comm.size())
            return self._hier.send(p, grad, self._infos[name], self._round)
        if sparse:
            return self._sender.send(p, grad, self._infos[name], self._round)
        grad = self._intake.dense(name, p, grad, self._sparse_path.get(name, False))
        exchange = DenseExchange(self._comm, p, grad, self._dense_compression, name, self.op, self._scales())
        self._stats.record(name, p.numel(), p.numel(), exchange.bytes, wire=exchange.wire, world=self._comm.size())
        return exchange

    def _submit_group(self, group: tuple) -> None:
        self._check_config()
        names = [self._parameter_names[p] for p in group]
        grads = [self._intake.dense(n, p, self._intake.take(p), self._sparse_path.get(n, False))
                 for n, p in zip(names, group)]
        exchange = GroupExchange(self._comm, group, grads, self._dense_compression, names, self.op, self._scales())
        for n, p, nbytes, wire in zip(names, group, exchange.bytes, exchange.wire):
            self._stats.record(n, p.numel(), p.numel(), nbytes, wire=wire, world=self._comm.size())
            self._handles.pop(p, None)
        self._handles[group] = exchange
        self._group_ready[group] = 0

    def _check_config(self) -> None:
        """Every member must share the configuration; else all of them raise (before any exchange)."""
        if self._members.changed_without_sync(self._world()):
            self._new_world()  # hosts removed: Horovod skipped sync(); every survivor sees the same change
        if not self._config_checked:
            self._config_checked = True
            config_check.check(self._comm, self._description)

    # --- Horovod's optimizer surface ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        if not self._communicating:
            self._synchronized = True
            return
        self._check_config()
        covered = set()
        for key in self._handles:
            covered.update(key) if isinstance(key, tuple) else covered.add(key)
        todo = [p for p in self._requires_update if p not in covered]
        todo += [p for p, h in list(self._handles.items()) if h is None and not isinstance(p, tuple)]
        for p in sorted(set(todo), key=lambda q: self._parameter_names[q]):
            group = self._groups.get(p)
            if group is None:
                self._handles[p] = self._submit(p)
            elif group not in self._handles:
                self._submit_group(group)
        if self._sender is not None:
            self._sender.flush()  # the selection groups not yet full, before anything is waited for
        first_name = lambda k: self._parameter_names[k[0] if isinstance(k, tuple) else k]  # noqa: E731
        exchanges = [self._handles[k] for k in sorted(self._handles, key=first_name)]
        for exchange in exchanges:
            exchange.advance()
        for exchange in exchanges:
            exchange.finish()
        self._intake.restore()  # as Horovod: a sparse gradient comes back sparse (e.g. for SparseAdam)
        self._end_round()

    def _end_round(self) -> None:
        self._reset_round()
        self._group_ready = dict.fromkeys(self._group_ready, 0)
        if self._sender is not None and self._sender.scrub_nonfinite() + (self._hier.end_round() if self._hier else 0):
            self._stats.nonfinite_steps += 1
        self._round += 1
        self._stats.steps += 1
        if self._partial is not None and self._partial.decide_after(self._round, self._comm, self._compression,
                                                                    self._infos, self._sparse_path, hvd.Sum, hvd.Average):
            self._plan_paths()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (gradient clipping, AMP unscale) so ``step()`` does not
        communicate again."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(_ZERO_GRAD_IN_ROUND)
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._allreduce_delay = dict.fromkeys(self._allreduce_delay, passes)

    def _reset_round(self) -> None:
        """No exchange in flight (nor being built by the overlap worker), no join query, full delays."""
        if self._overlap is not None and self._handles:
            self._overlap.drain()
        self._handles = {}
        if self._sender is not None:
            self._sender.discard()
        self._join.reset()
        self._allreduce_delay = dict.fromkeys(self._allreduce_delay, self.backward_passes_per_step)

# --- construction helpers ---------------------------------------------------------------------------------------

def _floating(p, name: str) -> bool:
    if not p.is_floating_point():
        raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be trained "
                        "with horovod_adtopk")
    return True


def _check_named_parameters(named_parameters, param_groups) -> List[tuple]:
    """Horovod's checks: (name, tensor) pairs, unique names, every optimizer parameter named."""
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(param_groups)
                 for j, v in enumerate(group["params"])]
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                         "model.named_parameters()")
    seen, dups = set(), set()
    for k, _ in named:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(sorted(dups))}")
    all_ids = {id(v) for group in param_groups for v in group["params"]}
    unnamed = all_ids - {id(v) for _, v in named}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named "
                         f"(python ids {', '.join(map(str, sorted(unnamed)))}); pass model.named_parameters()")
    return [(k, v) for k, v in named if id(v) in all_ids]


def _make_groups(groups, names: dict, infos: dict, sparse_path: dict) -> Dict[torch.Tensor, tuple]:
    """Map dense-path parameters to their explicit allreduce group (Horovod's ``groups`` argument)."""
    if groups is None:
        return {}
    dense = [p for p, n in sorted(names.items(), key=lambda kv: kv[1]) if n in infos and not sparse_path[n]]
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a positive integer or a list of lists of parameters")
    if isinstance(groups, int):
        per = max(1, -(-len(dense) // groups))
        lists = [dense[i:i + per] for i in range(0, len(dense), per)]
    else:
        seen, lists = set(), []
        for g in groups:
            members = []
            for p in g:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor parameters")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
                if any(p is d for d in dense):
                    members.append(p)
            lists.append(members)
    out = {}
    for members in lists:
        group = tuple(sorted(members, key=lambda q: names[q]))
        if len(group) > 1:
            for p in group:
                out[p] = group
    return out


def _check_arguments(op, gradient_predivide_factor, backward_passes_per_step, compression, profile_rounds,
                     warmup_steps, sparse_as_dense, partial_sparsification, hierarchical=False, overlap=False,
                     exchange_when_alone=False) -> None:
    overlap_.check_setting(overlap)
    if not isinstance(exchange_when_alone, bool):
        raise TypeError(f"exchange_when_alone must be True or False, got {exchange_when_alone!r}")
    if not (hierarchical is True or hierarchical is False or hierarchical == "auto"):
        raise ValueError(f"hierarchical must be False, True or \"auto\", got {hierarchical!r}")
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported by horovod_adtopk.DistributedOptimizer (Adasum combines "
                         "dense gradients pairwise); use op=hvd.Average or hvd.Sum, or hvd.DistributedOptimizer")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    if isinstance(gradient_predivide_factor, bool) or not isinstance(gradient_predivide_factor, numbers.Real) \
            or not (0 < gradient_predivide_factor < math.inf):
        raise ValueError(f"gradient_predivide_factor must be a finite number > 0, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    for name, value, minimum in (("backward_passes_per_step", backward_passes_per_step, 1),
                                 ("profile_rounds", profile_rounds, 1), ("warmup_steps", warmup_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    for name, value in (("sparse_as_dense", sparse_as_dense), ("partial_sparsification", partial_sparsification)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if isinstance(compression, type) and issubclass(compression, SparseCompressor):
        raise TypeError(f"pass a configured compressor, e.g. compression=hat.Compression.{compression.name}(ratio=0.01)")
    if not (isinstance(compression, Compressor) or (isinstance(compression, type) and issubclass(compression, Compressor))):
        raise TypeError(f"compression must be a horovod_adtopk.Compression entry or a Horovod compressor, got "
                        f"{compression!r}")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression=NoneCompressor,
                         backward_passes_per_step: int = 1, op=hvd.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups=None, sparse_as_dense: bool = False,
                         process_set=hvd.global_process_set, *, partial_sparsification: bool = False,
                         profile_rounds: int = 5, warmup_steps: int = 0, hierarchical=False, overlap=False,
                         sync_every: Optional[int] = None, outer=None, exchange: str = "allgather",
                         exchange_when_alone: bool = False):
    """Wrap ``optimizer`` so gradients are averaged across ranks, sparsely where ``compression`` says so.

    The arguments of ``hvd.DistributedOptimizer``, in Horovod's order and with its meaning (hooks,
    ``backward_passes_per_step``, ``synchronize()`` / ``skip_synchronize()``, ``num_groups`` / ``groups``
    for the dense tensors, ``sparse_as_dense`` to send sparse gradients such as ``nn.Embedding(sparse=True)``'s
    densely, ``process_set``), plus sparse compressors from :class:`horovod_adtopk.Compression` and
    (keyword-only):

    - ``warmup_steps``: the first N rounds send every gradient dense (allreduce), as PyTorch's PowerSGD hook
      does with ``start_powerSGD_iter``.
    - ``partial_sparsification=True`` (ADTopk-P): profile ``profile_rounds`` rounds, then send densely every
      tensor whose sparse path costs more than a dense allreduce (see :mod:`horovod_adtopk.partial`).
    - ``hierarchical=True``: sparse tensors are summed densely inside each host and only blocks of whole
      fibers travel sparsely between hosts (:mod:`horovod_adtopk.hierarchical`; needs
      ``HOROVOD_DYNAMIC_PROCESS_SETS=1``); ``"auto"``: where the cost model predicts it faster. Falls back to
      the flat exchange, with the reason in ``opt.stats()["hierarchical"]``, on one host, one rank per host
      or hosts of different sizes.
    - ``overlap=True``: error feedback, selection and packing of CPU tensors run on a worker thread while the
      backward pass goes on (:mod:`horovod_adtopk.overlap`; bitwise the same result); ``"auto"``: where the
      rank has a core beyond its torch threads.
    - ``sync_every=H`` (local steps, DiLoCo / SparseLoCo style): no gradient hooks; each rank steps
      ``optimizer`` on its own gradients and every H-th ``step()`` exchanges the pseudo-gradient
      ``theta_outer - theta`` through ``compression`` and applies ``outer`` (default
      ``hat.Outer.nesterov(lr=0.7, momentum=0.9)``, DiLoCo's; with a sparse compressor SparseLoCo's
      ``hat.Outer.sgd(lr=1.0, feedback_decay=0.95)`` measured better); ``warmup_steps`` then counts syncs
      (:mod:`horovod_adtopk.local_steps`).

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap; its ``step()`` runs on the averaged gradients.
        named_parameters: ``model.named_parameters()``; names key the residuals, checkpoints and ``stats()``.
            Default ``None``: ``allreduce.noname.<group>.<index>``, as Horovod names them.
        compression: a configured compressor, e.g. ``hat.Compression.adtopk(ratio=0.01)`` (ratio: fraction of a
            tensor's entries sent), or Horovod's ``Compression.none`` / ``fp16``. Default: none (dense).
        backward_passes_per_step: backward passes accumulated locally per exchange. Default 1.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, scale by ``1 / factor`` before the sum and by
            ``factor / size`` after, as Horovod (a number, no unit). Default 1.0.
        num_groups: deprecated Horovod name of ``groups`` (an int). Default 0.
        groups: fusion groups of the dense tensors, an int or lists of parameters. Default ``None``.
        sparse_as_dense: send sparse gradients (``nn.Embedding(sparse=True)``) densely. Default False.
        process_set: the Horovod process set to average over. Default: every rank.
        partial_sparsification: measure each tensor's sparse and dense paths, then keep the faster. Default False.
        profile_rounds: rounds (communicating steps) profiled for ``partial_sparsification``. Default 5.
        warmup_steps: the first N rounds travel dense (with ``sync_every``: the first N syncs). Default 0.
        hierarchical: ``True``, ``False`` (default) or ``"auto"``: dense inside a host, sparse between hosts.
        overlap: ``True``, ``False`` (default) or ``"auto"``: selection of CPU tensors on a worker thread.
        sync_every: local steps: steps between syncs (an int H >= 1). Default ``None``: every step communicates.
        outer: the outer optimizer of local steps (``hat.Outer``). Default ``None``: ``hat.Outer.nesterov(lr=0.7,
            momentum=0.9)`` when ``sync_every`` is given.
        exchange: how the per-step sparse payloads of an ADTopk rule travel. ``"allgather"`` (default): every
            rank's payload to every rank, ``(W-1) x P`` per rank. ``"sharded"``: the owner-sharded two-stage
            exchange (:mod:`horovod_adtopk.sharded`): an all-to-all of fiber shards, each owner averages its shard,
            adds its own residual, keeps k per fiber again and re-sends it, an allgather of the owners' blocks:
            about ``2 (W-1)/W x P`` per rank whatever ``W`` is, at the price of a second selection (error feedback
            on the owner). ``"auto"``: per tensor, whichever of allgather, sharded and allreduce the cost model
            (:mod:`horovod_adtopk.netcost`) finds cheapest at this world size. With ``sync_every`` set it on
            ``hat.Outer(exchange=...)`` instead (local steps default to ``"auto"``).
        exchange_when_alone: with one process, run the whole exchange anyway (compression, error feedback, the
            collectives over a world of one: per step in the gradient hooks, with ``sync_every`` at every sync)
            instead of passing gradients through untouched, as ``hat.ddp.CompressionState(exchange_when_alone=...)``
            does; for checking a backend end to end on one device (``scripts/gpu_check.sh``'s ``horovod`` stage
            runs it over NCCL). At one rank the average is the rank's own decompressed selection, and the
            residuals keep the rest. Default False.

    ``op`` must be ``hvd.Average`` or ``hvd.Sum``. Example::

        opt = hat.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=0.01))
    """
    sharded.check_exchange(exchange)
    if sync_every is not None or outer is not None:
        if exchange != "allgather":
            raise ValueError(f"exchange={exchange!r} is the per-step setting; with sync_every set it on the outer "
                             f"optimizer: outer=hat.Outer.sgd(..., exchange={exchange!r})")
        return _local_steps_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                                      gradient_predivide_factor, num_groups or groups, sparse_as_dense, process_set,
                                      partial_sparsification, warmup_steps, hierarchical, overlap, sync_every, outer,
                                      exchange_when_alone)
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in a future "
                      "version of Horovod; horovod_adtopk accepts it with the same meaning.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    _check_arguments(op, gradient_predivide_factor, backward_passes_per_step, compression, profile_rounds,
                     warmup_steps, sparse_as_dense, partial_sparsification, hierarchical, overlap, exchange_when_alone)
    # Adam-family optimizer + per-step sparse compression with error feedback: one warning on rank 0 naming the
    # setting the documentation's decision table gives for this world size (horovod_adtopk.advice)
    advice.advise(optimizer, compression, world_size=process_set.size(), rank=communicator.global_rank())
    # the class's methods and its state methods (horovod_adtopk.optimizer_state), copied as Horovod copies its own
    namespace = {k: v for part in (OptimizerState, _DistributedOptimizer) for k, v in part.__dict__.items()
                 if k not in ("__dict__", "__weakref__")}
    # hvd.broadcast_optimizer_state() initialises a fresh optimizer by stepping the *wrapped* class when the
    # optimizer comes from Horovod's optimizer module; claim that module so it never communicates there. The
    # module itself, not whatever ``hvd.DistributedOptimizer`` is bound to now: after the common monkeypatch
    # ``hvd.DistributedOptimizer = hat.DistributedOptimizer`` that would name this module, and ranks whose
    # optimizer has no state yet would start a collective the others never join (a silent hang).
    namespace["__module__"] = _horovod_optimizer.__name__
    elastic.register()  # hvd.elastic.TorchState(optimizer=...) then uses horovod_adtopk.elastic's handler
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, elastic.ElasticAware), namespace)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, partial_sparsification,
               profile_rounds, warmup_steps, hierarchical, overlap, exchange, exchange_when_alone)


def _local_steps_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, sparse_as_dense, process_set, partial_sparsification,
                           warmup_steps, hierarchical, overlap, sync_every, outer, exchange_when_alone=False):
    """``DistributedOptimizer(..., sync_every=H)``: the inner optimizer plus the outer exchange over Horovod."""
    from . import local_optimizer, local_steps

    if sync_every is None:
        raise ValueError("outer= needs sync_every=H (the local steps between syncs), e.g. sync_every=10")
    _check_arguments(op, gradient_predivide_factor, backward_passes_per_step, compression, 5, warmup_steps,
                     sparse_as_dense, partial_sparsification, hierarchical, overlap, exchange_when_alone)
    refused = [(backward_passes_per_step != 1, "backward_passes_per_step (accumulate gradients before step() "
                "yourself: nothing is communicated between syncs anyway)"),
               (op != hvd.Average, "op=hvd.Sum (the pseudo-gradients are averaged)"),
               (gradient_predivide_factor != 1.0, "gradient_predivide_factor"),
               (groups is not None and groups != 0, "groups / num_groups"),
               (partial_sparsification, "partial_sparsification"),
               (hierarchical is True, "hierarchical=True"), (overlap is True, "overlap=True")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"sync_every does not combine with {what}; leave it at its default")
    local_steps.check_settings(sync_every, local_steps.Outer.nesterov() if outer is None else outer, compression)
    comm = Communicator(process_set)
    if not comm.included():
        raise ValueError("sync_every: this rank is not a member of process_set; build the optimizer with a process "
                         "set this rank belongs to")
    named = _check_named_parameters(named_parameters, optimizer.param_groups)
    named = [(n, p) for n, p in named if p.requires_grad and _floating(p, n)]
    local = local_steps.LocalSteps(named, sync_every, local_steps.Outer.nesterov() if outer is None else outer,
                                   compression, warmup_steps, comm, exchange_when_alone=exchange_when_alone)
    description = {"compression": _describe_compression(compression), "op": str(op), "engine": "horovod",
                   "sparse_as_dense": sparse_as_dense, "process_set": comm.size(),
                   "params": {n: [list(i.shape), str(i.dtype)] for n, i in sorted(local.infos.items())},
                   **local.describe()}
    return local_optimizer.wrap_optimizer(optimizer, local, lambda d: config_check.check(comm, d), comm.size,
                                      description, module=_horovod_optimizer.__name__)
