"""In-flight gradient exchanges: what one parameter (or one group) sends, and how the result comes back.

The optimizer turns every gradient into one :class:`Exchange` as soon as it is ready; ``synchronize()``
calls :meth:`Exchange.advance` on all of them (a second collective round, only PowerSGD uses it) and
then :meth:`Exchange.finish`, which waits and writes the aggregated gradient into ``p.grad``.

- :class:`DenseExchange` / :class:`GroupExchange`: Horovod allreduce (fused by Horovod's tensor fusion),
  exactly as ``hvd.DistributedOptimizer`` does, for tensors on the dense path.
- :class:`SparseExchange`: one packed ``uint8`` payload per rank, allgathered (plus an 8-byte count for
  variable-size rules), unpacked and scatter-added by :func:`aggregate_blocks`.
- :class:`SharedExchange`: values at positions every rank knows (Random-k), summed by allreduce.
- :class:`SparseGradExchange`: a sparse (COO) gradient, e.g. ``nn.Embedding(sparse=True)``'s, aggregated
  as Horovod does it (values and indices allgathered, averaged for ``hvd.Average``), handed back sparse.

:class:`SparseSender` builds the sparse ones: error feedback -> selection -> wire -> collective.
"""
from __future__ import annotations

import time
import warnings
from typing import List, Optional, Sequence

import torch

from .compressors import SharedCodec, SparseCompressor, TensorInfo
from .memory import ErrorFeedback
from .stats import Stats
from .wire import COUNT_BYTES, FP16_MAX, pack, payload_bytes, unpack

#: dtypes Horovod's collectives cannot reduce on the CPU: carried as float32 and cast back.
UPCAST = {torch.bfloat16: torch.float32}


def aggregate_blocks(dense: torch.Tensor, gathered: torch.Tensor, counts: Sequence[int], codec,
                     value_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Sum every rank's block of an allgathered sparse payload, times ``scale``, into ``dense`` (1-D,
    overwritten). The scale (the average's ``1 / size``) is applied to the gathered values, not to the
    dense result: a pass over the payload instead of two over the gradient.

    Rank by rank, so every rank computes bitwise the same sum: on the CPU ``index_add_`` is sequential in
    rank order; on CUDA (atomics) one launch per rank, where indices are unique within a rank's block.
    """
    dense.zero_()
    values, index = unpack(gathered, counts, value_dtype, codec.index_dtype)
    values = values.to(dense.dtype)
    if scale != 1.0:
        values = values * scale
    flat = codec.to_flat(index)
    if dense.device.type == "cpu":
        dense.index_add_(0, flat, values)
    else:
        offset = 0
        for c in counts:
            dense.index_add_(0, flat[offset:offset + c], values[offset:offset + c])
            offset += c
    return dense


def _store(grad: torch.Tensor, result: torch.Tensor) -> None:
    """Write ``result`` into the gradient's own storage (keeps its dtype and memory format)."""
    if result.data_ptr() != grad.data_ptr() or result.dtype != grad.dtype:
        grad.copy_(result.view(grad.shape) if result.is_contiguous() else result.reshape(grad.shape))


class Exchange:
    """One in-flight collective for ``params``."""

    params: tuple = ()

    def advance(self) -> None:
        """Optional second round (called on every exchange before any :meth:`finish`)."""

    def finish(self) -> None:
        raise NotImplementedError


def _wire_tensor(grad: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of a dtype Horovod reduces (channels_last and bfloat16 gradients included)."""
    t = grad if grad.is_contiguous() else grad.contiguous()
    up = UPCAST.get(t.dtype)
    return t.to(up) if up is not None else t


class DenseExchange(Exchange):
    def __init__(self, comm, p, grad: torch.Tensor, compression, name: str, op, scales) -> None:
        self.params, self.comm, self.compression = (p,), comm, compression
        tensor, self.ctx = compression.compress(_wire_tensor(grad))
        self.bytes = payload_bytes(tensor)
        self.handle = comm.allreduce_async_(tensor, f"hat.dense.{name}", op, *scales)

    def finish(self) -> None:
        out = self.compression.decompress(self.comm.wait(self.handle), self.ctx)
        _store(self.params[0].grad, out)


class GroupExchange(Exchange):
    def __init__(self, comm, group: tuple, grads: List[torch.Tensor], compression, name: str, op, scales) -> None:
        self.params, self.comm, self.compression = group, comm, compression
        compressed = [compression.compress(_wire_tensor(g)) for g in grads]
        self.ctx = [c for _, c in compressed]
        self.bytes = [payload_bytes(t) for t, _ in compressed]
        self.handle = comm.grouped_allreduce_async_([t for t, _ in compressed], f"hat.group.{name}", op, *scales)

    def finish(self) -> None:
        outputs = self.comm.wait(self.handle)
        for p, out, ctx in zip(self.params, outputs, self.ctx):
            _store(p.grad, self.compression.decompress(out, ctx))


class SparseGradExchange(Exchange):
    """A sparse (COO) gradient through Horovod's own sparse allreduce, exactly as ``hvd.DistributedOptimizer``
    carries it without ``sparse_as_dense`` (so the result, and e.g. ``torch.optim.SparseAdam``'s update, is
    bitwise the stock one). No compressor or memory applies: the gradient is already sparse."""

    def __init__(self, comm, p, name: str, op) -> None:
        self.params, self.comm = (p,), comm
        grad = p.grad
        self.elements = grad._values().numel()
        self.bytes = payload_bytes(grad._indices()) + payload_bytes(grad._values())
        self.handle = comm.sparse_allreduce_async(grad, f"hat.sparsegrad.{name}", op)

    def finish(self) -> None:
        aggregated = self.comm.wait(self.handle)
        self.params[0].grad.zero_().add_(aggregated)  # sparse tensors have no set_(): Horovod's equivalent


class SparseExchange(Exchange):
    """An allgathered sparse payload (fixed count, or variable with a count allgather alongside)."""

    def __init__(self, sender: "SparseSender", p, info: TensorInfo, codec, wire_dtype, handle, count_handle) -> None:
        self.params, self.sender, self.info = (p,), sender, info
        self.codec, self.wire_dtype, self.handle, self.count_handle = codec, wire_dtype, handle, count_handle

    def finish(self) -> None:
        start = time.perf_counter()
        comm = self.sender.comm
        gathered = comm.wait(self.handle)
        counts = comm.wait(self.count_handle).tolist() if self.count_handle is not None else \
            [self.codec.count] * comm.size()
        grad = self.params[0].grad
        # The local gradient was consumed when the payload was built, so its storage takes the aggregate.
        dense = grad.view(-1) if grad.is_contiguous() else torch.empty(self.info.numel, dtype=grad.dtype,
                                                                         device=grad.device)
        aggregate_blocks(dense, gathered, counts, self.codec, self.wire_dtype, self.sender.average_scale())
        _store(grad, dense)
        self.sender.timed(self.info.name, 1, time.perf_counter() - start)


class SharedExchange(Exchange):
    """Values at positions every rank drew identically (Random-k), summed (and averaged) by allreduce."""

    def __init__(self, sender: "SparseSender", p, info: TensorInfo, flat: torch.Tensor, handle) -> None:
        self.params, self.sender, self.info, self.flat, self.handle = (p,), sender, info, flat, handle

    def finish(self) -> None:
        start = time.perf_counter()
        summed = self.sender.comm.wait(self.handle)
        grad = self.params[0].grad
        dense = grad.view(-1) if grad.is_contiguous() else torch.empty(self.info.numel, dtype=grad.dtype,
                                                                         device=grad.device)
        dense.zero_()
        dense[self.flat] = summed.to(grad.dtype)
        _store(grad, dense)
        self.sender.timed(self.info.name, 1, time.perf_counter() - start)


class SparseSender:
    """Builds sparse exchanges: ``a = g + r`` -> selection -> wire -> collective -> ``r <- a - D(C(a))``.

    A rank without a gradient for a parameter (frozen, or unused in this forward pass) contributes nothing
    and keeps its memory: it sends an all-zero payload of the agreed size, so the collective still matches.
    """

    def __init__(self, compression: SparseCompressor, memory: Optional[ErrorFeedback], comm, stats: Stats,
                 op, sum_op, op_is_average: bool, prescale: float, postscale: float) -> None:
        self.compression, self.memory, self.comm, self.stats = compression, memory, comm, stats
        self.op, self.sum_op, self.op_is_average = op, sum_op, op_is_average
        self.prescale, self.postscale = prescale, postscale
        self.nonfinite: List[tuple] = []  # (name, 0-d bool tensor: every sent value finite)
        self.profile = None  # a PartialSparsification while it profiles
        self._warned_overflow = False

    def timed(self, name: str, which: int, seconds: float) -> None:
        """Account ``seconds`` of compression (``which=0``) or decompression (1) work on ``name``."""
        self.stats.add_seconds(name, which, seconds)
        if self.profile is not None:
            self.profile.record(name, which, seconds)

    def average_scale(self) -> float:
        """What the summed payloads are multiplied by: ``predivide / size`` for Average, 1 for Sum."""
        return self.postscale / self.comm.size() if self.op_is_average else 1.0

    def send(self, p, grad: Optional[torch.Tensor], info: TensorInfo, step: int) -> Exchange:
        c = self.compression
        if hasattr(c, "make_exchange"):  # rules with their own collectives (PowerSGD)
            return c.make_exchange(self, p, grad, info, step)
        start = time.perf_counter()
        wire_dtype = c.wire_value_dtype(info.dtype)
        if grad is None:
            s = c.empty_selection(info, step, p.device)
            s.wire_values = s.values.to(wire_dtype)
        else:
            s = self._select(grad, info, step)
        tag = f"hat.sparse.{info.name}"
        if isinstance(s.codec, SharedCodec):
            # Summed in float32 at least: each rank's rounding to the wire dtype is fed back by the memory,
            # and a float16 sum over ranks can neither overflow nor round.
            values = s.wire_values.to(torch.promote_types(s.wire_values.dtype, torch.float32))
            handle = self.comm.allreduce_async_(values, tag, self.op, 1.0, self.postscale)
            exchange = SharedExchange(self, p, info, s.flat, handle)
            sent = payload_bytes(values)
        else:
            payload = pack(s.wire_values, s.wire_index, wire_dtype, s.codec.index_dtype)
            count_handle = None
            if s.codec.count is None:
                count_handle = self.comm.allgather_async(torch.tensor([s.values.numel()], dtype=torch.int64),
                                                         f"hat.count.{info.name}")
            handle = self.comm.allgather_async(payload, tag)
            exchange = SparseExchange(self, p, info, s.codec, wire_dtype, handle, count_handle)
            sent = payload_bytes(payload) + (COUNT_BYTES if count_handle is not None else 0)
        self.stats.record(info.name, info.numel, s.values.numel(), sent)
        self.timed(info.name, 0, time.perf_counter() - start)
        return exchange

    def _select(self, grad: torch.Tensor, info: TensorInfo, step: int):
        """Error feedback around the compressor's selection; sets ``s.wire_values`` (scaled, wire dtype)."""
        c, memory = self.compression, self.memory
        wire_dtype = c.wire_value_dtype(info.dtype)
        exact_wire = wire_dtype == info.dtype and self.prescale == 1.0
        if memory is not None and memory.momentum is None:
            # Plain error feedback: the kernels add the gradient into the residual while they read it, and
            # zero what they send when the wire carries it exactly.
            a = memory.buffer(info.name, grad)
            s = c.select(a, info, step, grad=grad, zero_sent=exact_wire)
        else:
            a = memory.compensate(info.name, grad) if memory is not None else grad.detach()
            s = c.select(a, info, step)
        values = s.values * self.prescale if self.prescale != 1.0 else s.values
        if wire_dtype == torch.float16 and values.dtype != torch.float16:
            values = self._clamp_fp16(values, info.name)
        s.wire_values = values.to(wire_dtype)
        if memory is not None:
            if not exact_wire:
                carried = s.wire_values.to(a.dtype)
                if self.prescale != 1.0:
                    carried = carried / self.prescale
                remainder = torch.nan_to_num(s.values - carried, nan=0.0, posinf=0.0, neginf=0.0)
                memory.update(info.name, s.flat, remainder)
            elif memory.momentum is not None:
                memory.update(info.name, s.flat, torch.zeros_like(s.values))
            self.nonfinite.append((info.name, s.finite))
        return s

    def _clamp_fp16(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """Finite values beyond float16's range travel as +-65504; the rest stays in the memory."""
        big = values.abs() > FP16_MAX
        if not bool(torch.logical_and(big, torch.isfinite(values)).any()):
            return values
        if not self._warned_overflow:
            self._warned_overflow = True
            warnings.warn(f"horovod_adtopk: {name}: values beyond float16's range (65504) were clamped on the "
                          "wire; the excess stays in the error-feedback memory. Use value_dtype=torch.bfloat16 "
                          "or float32 for gradients this large.")
        return torch.where(torch.isfinite(values), values.clamp(-FP16_MAX, FP16_MAX), values)

    def scrub_nonfinite(self) -> int:
        """Zero NaN/Inf left in the memory of tensors that sent a non-finite value this round; returns how
        many tensors had one."""
        if not self.nonfinite:
            return 0
        names = [n for n, _ in self.nonfinite]
        finite = torch.stack([f.to("cpu") for _, f in self.nonfinite]).tolist()
        self.nonfinite.clear()
        bad = [n for n, ok in zip(names, finite) if not ok]
        for n in bad:
            self.memory.scrub(n)
        return len(bad)
