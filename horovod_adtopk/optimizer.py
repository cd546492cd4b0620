"""``DistributedOptimizer``: a drop-in for ``hvd.DistributedOptimizer`` that carries sparse gradients.

Per parameter and communication round (``backward_passes_per_step`` backward passes), as soon as the
gradient is ready (a post-accumulate-grad hook, overlapping the rest of the backward pass):

1. dense path (1-D, small, or not worth sparsifying; see ``SparseCompressor.choose_path``): Horovod
   allreduce, exactly as ``hvd.DistributedOptimizer`` does (fused by Horovod's tensor fusion);
2. sparse path: ``a = g + r`` (error feedback), selection, one packed ``uint8`` payload, an allgather
   (or an allreduce of values for rules whose positions every rank knows), then ``r <- a - D(C(a))``.

``step()`` / ``synchronize()`` wait for the collectives, scatter-add every rank's payload into a dense
gradient on the parameter's device (in rank order, so every rank computes bitwise the same sum), apply
``op`` (Average divides by the process set's size; ``gradient_predivide_factor`` splits it as Horovod
does) and hand the result to the wrapped optimizer.

The optimizer's ``state_dict()`` carries this rank's error-feedback memory, the adaptive compressor state
and the round counter under the key ``"horovod_adtopk"``; ``gather_state_dict()`` (a collective) carries
every rank's, for a checkpoint written by rank 0 alone.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import time
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import horovod.torch as hvd
from horovod.torch.compression import Compressor, NoneCompressor

from .communicator import Communicator
from .compressors import SharedCodec, SparseCompressor, TensorInfo, is_sparse
from .memory import ErrorFeedback
from .stats import Stats
from .wire import pack, payload_bytes, unpack

STATE_KEY = "horovod_adtopk"
STATE_FORMAT = 1


class _Pending:
    """One in-flight collective: what to wait for and how to turn its result into gradients."""

    __slots__ = ("kind", "handle", "count_handle", "ctx", "codec", "wire_dtype", "info", "params")

    def __init__(self, kind, handle, params, ctx=None, count_handle=None, codec=None, wire_dtype=None, info=None):
        self.kind, self.handle, self.params, self.ctx = kind, handle, params, ctx
        self.count_handle, self.codec, self.wire_dtype, self.info = count_handle, codec, wire_dtype, info


def _describe_compression(compression) -> dict:
    if is_sparse(compression):
        return compression.config()
    name = getattr(compression, "__name__", type(compression).__name__)
    return {"compressor": name}


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods are copied into a class created per wrapped optimizer type (as Horovod does), hence the
    # explicit ``super(self.__class__, self)``.

    def __init__(self, params, named_parameters, compression, backward_passes_per_step=1, op=hvd.Average,
                 gradient_predivide_factor=1.0, groups=None, process_set=hvd.global_process_set,
                 partial_sparsification=False, profile_rounds=5):
        super(self.__class__, self).__init__(params)
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(self.param_groups)
                                for j, v in enumerate(group["params"])]
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, usually "
                             "model.named_parameters()")
        counts = collections.Counter(k for k, _ in named_parameters)
        dups = sorted(n for n, c in counts.items() if c > 1)
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
        all_ids = {id(v) for group in self.param_groups for v in group["params"]}
        unnamed = all_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters were not named "
                             f"(python ids {', '.join(map(str, sorted(unnamed)))}); pass model.named_parameters()")

        self._compression = compression
        self._sparse = is_sparse(compression)
        self._dense_compression = NoneCompressor if self._sparse else compression
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0]) if id(v) in all_ids}
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self._comm = Communicator(process_set)
        self._memory = (ErrorFeedback(compression.momentum)
                        if self._sparse and compression.error_feedback else None)
        self._allreduce_delay = {p: backward_passes_per_step for p in self._parameter_names}
        self._handles: Dict[object, Optional[_Pending]] = {}
        self._requires_update = set()
        self._hook_handles = []
        self._synchronized = False
        self._should_synchronize = True
        self._config_checked = False
        self._round = 0
        self._stats = Stats()
        self._nonfinite_flags: List[Tuple[str, torch.Tensor]] = []
        # Partial sparsification (ADTopk-P): per sparse tensor, seconds spent compressing / decompressing
        # during the first ``profile_rounds`` rounds; then a decision shared by every rank.
        self._partial = bool(partial_sparsification) and self._sparse
        self._profile_rounds = int(profile_rounds)
        self._profile: Dict[str, List[float]] = {}
        self._partial_report: Optional[dict] = None

        self._infos: Dict[str, TensorInfo] = {}
        for p, name in self._parameter_names.items():
            if not p.requires_grad:
                continue
            if not p.is_floating_point():
                raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be "
                                "trained with horovod_adtopk")
            self._infos[name] = TensorInfo(name, tuple(p.shape), p.numel(), p.dtype)
        self._sparse_path: Dict[str, bool] = {}
        self._plan_paths()

        self._groups = self._make_groups(groups)
        self._group_ready: Dict[tuple, int] = {g: 0 for g in set(self._groups.values())}

        if self._comm.included() and (hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1"):
            self._register_hooks()

    # --- set-up ---------------------------------------------------------------------------------------------
    def _plan_paths(self) -> None:
        """Dense or sparse for every parameter, for the current world size (and a partial-sparsification
        decision, if one was taken)."""
        world = self._comm.size() if self._comm.included() else 1
        decided = (self._partial_report or {}).get("tensors", {})
        for name, info in self._infos.items():
            if not self._sparse:
                sparse, reason = False, "dense compressor"
            elif not decided.get(name, {}).get("sparse", True):
                sparse, reason = False, "partial sparsification"
            else:
                sparse, reason = self._compression.choose_path(info, world)
            self._sparse_path[name] = sparse
            self._stats.set_path(name, info.numel, sparse, reason)

    def _make_groups(self, groups) -> Dict[torch.Tensor, tuple]:
        """Map dense-path parameters to their explicit allreduce group (Horovod's ``groups`` argument)."""
        if groups is None:
            return {}
        dense = [p for p, n in sorted(self._parameter_names.items(), key=lambda kv: kv[1])
                 if n in self._infos and not self._sparse_path[n]]
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
            group = tuple(sorted(members, key=lambda q: self._parameter_names[q]))
            if len(group) > 1:
                for p in group:
                    out[p] = group
        return out

    def _register_hooks(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.add(p)
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

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
                self._handles[p] = self._submit(p)
                return
            self._group_ready[group] += 1
            self._handles[p] = None
            if self._group_ready[group] == len(group):
                self._submit_group(group)
        return hook

    # --- helpers --------------------------------------------------------------------------------------------
    def _scales(self) -> Tuple[float, float]:
        if self.op == hvd.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _grad(self, p) -> torch.Tensor:
        if p.grad is None:
            # Not computed on this rank (unused in this forward pass): other ranks may have it, so send zeros.
            p.grad = torch.zeros_like(p)
        g = p.grad
        if g.is_sparse:
            raise TypeError(f"parameter {self._parameter_names[p]!r} has a sparse gradient; horovod_adtopk needs "
                            "dense gradients (use nn.Embedding(..., sparse=False))")
        if not g.is_floating_point():
            raise TypeError(f"gradient of {self._parameter_names[p]!r} has dtype {g.dtype}; a floating dtype is needed")
        return g

    def _describe(self) -> dict:
        return {"compression": _describe_compression(self._compression),
                "op": str(self.op), "backward_passes_per_step": self.backward_passes_per_step,
                "gradient_predivide_factor": self.gradient_predivide_factor,
                "params": {n: [list(i.shape), str(i.dtype)] for n, i in sorted(self._infos.items())}}

    def _check_config(self) -> None:
        """Every member rank must share the compression config and parameter list; else all of them raise."""
        if self._config_checked:
            return
        self._config_checked = True
        desc = self._describe()
        digest = int.from_bytes(hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()[:7], "big")
        digests = self._comm.allgather(torch.tensor([digest], dtype=torch.int64), "hat.config.digest").tolist()
        if len(set(digests)) == 1:
            return
        descs = self._comm.allgather_object(desc, "hat.config.describe")
        raise RuntimeError("horovod_adtopk: ranks disagree on the optimizer configuration, so their collectives "
                           "would not match. " + _explain_mismatch(descs) +
                           " Build the model and hat.DistributedOptimizer identically on every rank.")

    # --- submitting ---------------------------------------------------------------------------------------------
    def _submit(self, p) -> _Pending:
        self._check_config()
        name = self._parameter_names[p]
        if self._sparse and self._sparse_path[name]:
            return self._submit_sparse(p, name)
        return self._submit_dense(p, name)

    def _dense_tensor(self, p, name) -> torch.Tensor:
        grad = self._grad(p)
        if self._memory is not None and name in self._memory.residuals:
            # The tensor switched to the dense path: send what its memory still holds.
            grad.copy_(self._memory.flush(name, grad))
        return grad

    def _submit_dense(self, p, name) -> _Pending:
        tensor, ctx = self._dense_compression.compress(self._dense_tensor(p, name))
        prescale, postscale = self._scales()
        handle = self._comm.allreduce_async_(tensor, f"hat.dense.{name}", self.op, prescale, postscale)
        self._stats.record(name, p.numel(), p.numel(), payload_bytes(tensor))
        return _Pending("dense", handle, (p,), ctx=ctx)

    def _submit_group(self, group: tuple) -> None:
        self._check_config()
        compressed = [self._dense_compression.compress(self._dense_tensor(p, self._parameter_names[p])) for p in group]
        prescale, postscale = self._scales()
        handle = self._comm.grouped_allreduce_async_([t for t, _ in compressed],
                                                     f"hat.group.{self._parameter_names[group[0]]}",
                                                     self.op, prescale, postscale)
        for p, (t, _) in zip(group, compressed):
            self._stats.record(self._parameter_names[p], p.numel(), p.numel(), payload_bytes(t))
            self._handles.pop(p, None)
        self._handles[group] = _Pending("group", handle, group, ctx=[c for _, c in compressed])
        self._group_ready[group] = 0

    def _submit_sparse(self, p, name) -> _Pending:
        start = time.perf_counter()
        compression: SparseCompressor = self._compression
        info = self._infos[name]
        grad = self._grad(p)
        a = self._memory.compensate(name, grad) if self._memory is not None else grad.detach()
        s = compression.select(a, info, self._round)
        wire_dtype = compression.wire_value_dtype(grad.dtype)
        prescale, postscale = self._scales()
        values = s.values * prescale if prescale != 1.0 else s.values
        wire_values = values.to(wire_dtype)
        if self._memory is not None:
            carried = wire_values.to(a.dtype)
            if prescale != 1.0:
                carried = carried / prescale
            remainder = torch.nan_to_num(s.values - carried, nan=0.0, posinf=0.0, neginf=0.0)
            self._memory.update(name, s.flat, remainder)
            self._nonfinite_flags.append((name, torch.isfinite(s.values).all()))
        payload = pack(wire_values, s.wire_index, wire_dtype, s.codec.index_dtype)
        tag = f"hat.sparse.{name}"
        count_handle = None
        if isinstance(s.codec, SharedCodec):
            handle = self._comm.allreduce_async_(payload, tag, self.op, 1.0, postscale)
        else:
            if s.codec.count is None:
                count_handle = self._comm.allgather_async(torch.tensor([s.values.numel()], dtype=torch.int64),
                                                          f"hat.count.{name}")
            handle = self._comm.allgather_async(payload, tag)
        sent = payload_bytes(payload) + (8 if count_handle is not None else 0)
        self._stats.record(name, info.numel, s.values.numel(), sent)
        elapsed = time.perf_counter() - start
        self._stats.compress_seconds += elapsed
        if self._profiling():
            self._profile.setdefault(name, [0.0, 0.0])[0] += elapsed
        return _Pending("sparse", handle, (p,), count_handle=count_handle, codec=s.codec, wire_dtype=wire_dtype,
                        info=info)

    # --- finishing ------------------------------------------------------------------------------------------
    def _finish(self, pend: _Pending) -> None:
        if pend.kind == "group":
            outputs = self._comm.wait(pend.handle)
            for p, out, ctx in zip(pend.params, outputs, pend.ctx):
                p.grad.set_(self._dense_compression.decompress(out, ctx))
            return
        p = pend.params[0]
        if pend.kind == "dense":
            out = self._comm.wait(pend.handle)
            p.grad.set_(self._dense_compression.decompress(out, pend.ctx))
            return
        start = time.perf_counter()
        gathered = self._comm.wait(pend.handle)
        grad = p.grad
        # The local gradient was consumed when the payload was built (copied into the memory or the
        # payload), so its storage takes the aggregate: no gradient-sized allocation per step.
        dense = grad.view(-1) if grad.is_contiguous() else torch.empty(pend.info.numel, dtype=grad.dtype,
                                                                         device=grad.device)
        dense.zero_()
        codec = pend.codec
        if isinstance(codec, SharedCodec):
            dense[codec.flat] = gathered.to(grad.dtype)  # already summed (and averaged) by allreduce
        else:
            if codec.count is None:
                counts = self._comm.wait(pend.count_handle).tolist()
            else:
                counts = [codec.count] * self._comm.size()
            values, index = unpack(gathered, counts, pend.wire_dtype, codec.index_dtype)
            values = values.to(grad.dtype)
            flat = codec.to_flat(index)
            if dense.device.type == "cpu":
                dense.index_add_(0, flat, values)  # sequential on CPU: rank order, identical on every rank
            else:
                offset = 0  # one launch per rank: indices are unique within a rank, so no atomics race
                for c in counts:
                    dense.index_add_(0, flat[offset:offset + c], values[offset:offset + c])
                    offset += c
            if self.op == hvd.Average:
                dense.mul_(self.gradient_predivide_factor / self._comm.size())
        if dense.data_ptr() != grad.data_ptr():
            grad.set_(dense.view(grad.shape))
        elapsed = time.perf_counter() - start
        self._stats.decompress_seconds += elapsed
        if self._profiling():
            self._profile.setdefault(pend.info.name, [0.0, 0.0])[1] += elapsed

    # --- Horovod's optimizer surface ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        if not self._comm.included():
            self._synchronized = True
            return
        if not self._requires_update:  # one process, nothing to communicate
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
            if group is not None:
                if group not in self._handles:
                    self._submit_group(group)
            else:
                self._handles[p] = self._submit(p)
        for key in sorted(self._handles, key=self._handle_order):
            self._finish(self._handles[key])
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for group in self._group_ready:
            self._group_ready[group] = 0
        self._handles.clear()
        self._scrub_nonfinite()
        self._round += 1
        self._stats.steps += 1
        if self._profiling() and self._round >= self._profile_rounds:
            self._decide_partial()
        self._synchronized = True

    # --- partial sparsification ---------------------------------------------------------------------------
    def _profiling(self) -> bool:
        return self._partial and self._partial_report is None

    def _probe(self, kind: str, nbytes: int, repeats: int = 3) -> float:
        """Seconds for one synchronous collective of ``nbytes`` (per rank for allgather), best of ``repeats``."""
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        best = float("inf")
        for i in range(repeats):
            start = time.perf_counter()
            if kind == "allreduce":
                self._comm.wait(self._comm.allreduce_async_(buf.clone(), f"hat.probe.ar.{nbytes}.{i}", hvd.Sum))
            else:
                self._comm.allgather(buf, f"hat.probe.ag.{nbytes}.{i}")
            best = min(best, time.perf_counter() - start)
        return best

    def _decide_partial(self) -> None:
        """ADTopk-P: send densely every tensor whose sparse path (compress + allgather + decompress) is
        predicted to cost at least its dense allreduce.

        Costs come from this run: compress/decompress seconds measured per tensor during the profiling
        rounds, and a linear fit ``t(bytes) = alpha + bytes * beta`` of a small and a large synchronous
        allreduce and allgather on the process set. Every number is averaged over the ranks (allreduce)
        before deciding, so the decision is identical everywhere.
        """
        names = sorted(n for n, sparse in self._sparse_path.items() if sparse)
        small, large = 4096, 4 << 20
        probes = [self._probe("allreduce", small), self._probe("allreduce", large),
                  self._probe("allgather", small), self._probe("allgather", large)]
        rounds = max(self._round, 1)
        local = [v / rounds for n in names for v in self._profile.get(n, [0.0, 0.0])] + probes
        shared = self._comm.wait(self._comm.allreduce_async_(torch.tensor(local, dtype=torch.float64),
                                                             "hat.partial.decide", hvd.Average)).tolist()
        ar_small, ar_large, ag_small, ag_large = shared[-4:]
        ar_beta = max(ar_large - ar_small, 0.0) / (large - small)
        ag_beta = max(ag_large - ag_small, 0.0) / (large - small)
        report = {}
        compression: SparseCompressor = self._compression
        for i, name in enumerate(names):
            info = self._infos[name]
            comp, decomp = shared[2 * i], shared[2 * i + 1]
            payload, dense = compression.nominal_bytes(info)
            dense_s = ar_small + dense * ar_beta
            sparse_s = comp + decomp + ag_small + payload * ag_beta
            keep_sparse = sparse_s < dense_s
            report[name] = {"sparse": keep_sparse, "compress_s": comp, "decompress_s": decomp,
                            "predicted_sparse_s": sparse_s, "predicted_dense_s": dense_s}
            if not keep_sparse:
                self._sparse_path[name] = False
                self._stats.set_path(name, info.numel, False,
                                     f"partial sparsification: sparse {sparse_s * 1e3:.3f} ms >= dense "
                                     f"{dense_s * 1e3:.3f} ms")
        self._partial_report = {"rounds_profiled": rounds,
                                "link": {"allreduce_alpha_s": ar_small, "allreduce_beta_s_per_byte": ar_beta,
                                         "allgather_alpha_s": ag_small, "allgather_beta_s_per_byte": ag_beta},
                                "tensors": report}

    def _handle_order(self, key) -> str:
        return self._parameter_names[key[0] if isinstance(key, tuple) else key]

    def _scrub_nonfinite(self) -> None:
        """Zero NaN/Inf left in the memory of tensors that sent a non-finite value this round."""
        if not self._nonfinite_flags:
            return
        names = [n for n, _ in self._nonfinite_flags]
        finite = torch.stack([f.to("cpu") for _, f in self._nonfinite_flags]).tolist()
        self._nonfinite_flags.clear()
        bad = [n for n, ok in zip(names, finite) if not ok]
        if bad:
            self._stats.nonfinite_steps += 1
            for n in bad:
                self._memory.scrub(n)

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
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.")
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                                 "or optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    # --- state --------------------------------------------------------------------------------------------------
    def _local_compression_state(self) -> dict:
        return {"memory": self._memory.state_dict() if self._memory is not None else {},
                "compressor": self._compression.state_dict() if self._sparse else {}}

    def _compression_state(self, ranks: dict) -> dict:
        return {"format": STATE_FORMAT, "round": self._round,
                "world_size": self._comm.size() if self._comm.included() else 1,
                "compression": _describe_compression(self._compression), "ranks": ranks,
                "partial_sparsification": self._partial_report}

    def state_dict(self):
        """The wrapped optimizer's state plus this rank's compression state (key ``"horovod_adtopk"``)."""
        sd = super(self.__class__, self).state_dict()
        rank = self._comm.rank() if self._comm.included() else 0
        sd[STATE_KEY] = self._compression_state({rank: self._local_compression_state()})
        return sd

    def gather_state_dict(self):
        """Collective: like ``state_dict()`` but with every member rank's compression state, so that one
        file written by rank 0 restores every rank exactly. Call it on every rank."""
        sd = super(self.__class__, self).state_dict()
        if self._comm.included() and self._comm.size() > 1:
            states = self._comm.allgather_object(self._local_compression_state(), "hat.gather_state")
        else:
            states = [self._local_compression_state()]
        sd[STATE_KEY] = self._compression_state(dict(enumerate(states)))
        return sd

    def load_state_dict(self, state_dict):
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        state_dict = dict(state_dict)
        ours = state_dict.pop(STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        if ours is not None:
            self._load_compression_state(ours)

    def _load_compression_state(self, ours: dict) -> None:
        if ours.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown horovod_adtopk state format {ours.get('format')!r}; expected {STATE_FORMAT}")
        saved, current = ours.get("compression"), _describe_compression(self._compression)
        if saved != current:
            raise ValueError(f"checkpoint was written with compression {saved}, but this optimizer uses {current}; "
                             "resume with the same compressor settings")
        self._round = int(ours["round"])
        report = ours.get("partial_sparsification")
        if self._partial and report is not None:
            self._partial_report = report
            self._plan_paths()
        rank = self._comm.rank() if self._comm.included() else 0
        size = self._comm.size() if self._comm.included() else 1
        entry = {int(k): v for k, v in ours["ranks"].items()}.get(rank)
        if entry is None or int(ours["world_size"]) != size:
            self.reset_compression_state()
            if self._sparse and self._memory is not None:
                warnings.warn(f"horovod_adtopk: the state dict holds compression state for ranks "
                              f"{sorted(ours['ranks'])} of {ours['world_size']}, not for rank {rank} of {size}; "
                              "this rank's error-feedback memory starts empty. Save with opt.gather_state_dict() "
                              "to keep every rank's memory.")
            return
        if self._memory is not None:
            devices = {self._parameter_names[p]: p.device for p in self._parameter_names}
            self._memory.load_state_dict(entry["memory"], devices)
        if self._sparse:
            self._compression.load_state_dict(entry["compressor"])

    def reset_compression_state(self) -> None:
        """Forget every rank-private memory (residuals, velocities, adaptive thresholds) and re-plan for the
        current world size. Register it as a Horovod elastic reset callback
        (``state.register_reset_callbacks([opt.reset_compression_state])``): after a membership change a
        residual belongs to a data partition that no longer exists, the dense/sparse rule depends on the
        world size, and the configuration check must run again with the new members."""
        if self._memory is not None:
            self._memory.reset()
        if self._sparse:
            self._compression.reset_state()
        self._handles = {}
        self._nonfinite_flags.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._config_checked = False
        self._plan_paths()

    def stats(self) -> dict:
        """Cumulative counters of this rank (see :mod:`horovod_adtopk.stats`)."""
        out = self._stats.as_dict()
        out["compressor"] = _describe_compression(self._compression)
        out["world_size"] = self._comm.size() if self._comm.included() else 1
        out["round"] = self._round
        if self._partial:
            out["partial_sparsification"] = self._partial_report
        return out


def _explain_mismatch(descs: List[dict]) -> str:
    ref = descs[0]
    parts = []
    for rank, d in enumerate(descs[1:], start=1):
        for key in ("compression", "op", "backward_passes_per_step", "gradient_predivide_factor"):
            if d[key] != ref[key]:
                parts.append(f"{key}: rank 0 has {ref[key]}, rank {rank} has {d[key]}")
        p0, p1 = ref["params"], d["params"]
        only0, only1 = sorted(set(p0) - set(p1)), sorted(set(p1) - set(p0))
        if only0:
            parts.append(f"parameters only on rank 0 (not rank {rank}): {only0[:5]}")
        if only1:
            parts.append(f"parameters only on rank {rank}: {only1[:5]}")
        shapes = [n for n in sorted(set(p0) & set(p1)) if p0[n] != p1[n]]
        for n in shapes[:5]:
            parts.append(f"parameter {n!r}: rank 0 has shape/dtype {p0[n]}, rank {rank} has {p1[n]}")
    return "; ".join(parts) if parts else "(configurations differ)"


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=NoneCompressor, backward_passes_per_step: int = 1, op=hvd.Average,
                         gradient_predivide_factor: float = 1.0, groups=None,
                         process_set=hvd.global_process_set, partial_sparsification: bool = False,
                         profile_rounds: int = 5):
    """Wrap ``optimizer`` so gradients are averaged across ranks, sparsely where ``compression`` says so.

    Same arguments and behaviour as ``hvd.DistributedOptimizer`` (hooks, ``backward_passes_per_step``,
    ``synchronize()`` / ``skip_synchronize()``, ``process_set``, ``groups``), plus sparse compressors from
    :class:`horovod_adtopk.Compression`. ``op`` must be ``hvd.Average`` or ``hvd.Sum``.

    ``partial_sparsification=True`` (ADTopk-P): for the first ``profile_rounds`` rounds every eligible tensor
    is sent sparse while its compression cost is measured; then tensors whose sparse path costs more than a
    dense allreduce switch to dense for the rest of training (their residual is sent with the next dense
    gradient). The decision is the same on every rank and reported in ``opt.stats()["partial_sparsification"]``.

    Example::

        opt = hat.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=0.01))
    """
    if op == hvd.Adasum:
        raise ValueError("op=hvd.Adasum is not supported by horovod_adtopk.DistributedOptimizer (Adasum combines "
                         "dense gradients pairwise); use op=hvd.Average or hvd.Sum, or hvd.DistributedOptimizer")
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError(f"op must be hvd.Average or hvd.Sum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not (gradient_predivide_factor > 0):
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor!r}")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be an int > 0")
    if not (isinstance(compression, SparseCompressor) or
            (isinstance(compression, type) and issubclass(compression, Compressor)) or
            isinstance(compression, Compressor)):
        raise TypeError(f"compression must be a horovod_adtopk.Compression entry or a Horovod compressor, got "
                        f"{compression!r}")
    if isinstance(profile_rounds, bool) or not isinstance(profile_rounds, int) or profile_rounds < 1:
        raise ValueError(f"profile_rounds must be an int >= 1, got {profile_rounds!r}")
    if isinstance(compression, type) and issubclass(compression, SparseCompressor):
        raise TypeError(f"pass a configured compressor, e.g. compression=hat.Compression.{compression.name}(ratio=0.01)")
    namespace = dict(_DistributedOptimizer.__dict__)
    # hvd.broadcast_optimizer_state() initialises a fresh optimizer by stepping the *wrapped* class when the
    # optimizer comes from Horovod's optimizer module; claim that module so it never communicates there.
    namespace["__module__"] = hvd.DistributedOptimizer.__module__
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), namespace)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, process_set, partial_sparsification, profile_rounds)
