"""The engine-free half of a sparse exchange: what both engines (the Horovod optimizer and the DDP hook) do
around their collectives.

- :class:`Sparsifier`: error feedback around the compressor's selection, for one gradient::

      a = g + r                          (memory.buffer / memory.compensate)
      s = C(a)                           (compressor.select; the kernels fuse the add and the zeroing)
      wire values = s.values * prescale, cast to the wire dtype (finite float16 overflow clamped)
      r <- a - D(C(a))                   (what the wire really carried)

- :func:`dense_contribution`: what a tensor of the sparse path sends on a dense round (warm-up): ``g + r``,
  its residual released, through the memory (momentum correction keeps applying its momentum).
- :func:`aggregate_blocks`: every rank's gathered block summed rank by rank (bitwise the same on every
  rank), scaled, into a dense 1-D tensor.

Nothing here imports Horovod or ``torch.distributed``: the engines own their collectives.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .compressors import ADTopkCompressor, SparseCompressor, TensorInfo
from .compressors.base import Selection
from .memory import ErrorFeedback
from .wire import FP16_MAX, unpack


class Sparsifier:
    """Error feedback around one compressor's selection (see the module docstring).

    Args:
        compression: the sparse compressor.
        memory: this rank's error-feedback memory (None: no error feedback).
        prescale: factor applied to the sent values before the wire cast (Horovod's predivide; 1.0 else).
    """

    def __init__(self, compression: SparseCompressor, memory: Optional[ErrorFeedback], prescale: float = 1.0) -> None:
        self.compression, self.memory, self.prescale = compression, memory, prescale
        self.nonfinite: List[tuple] = []  # (name, 0-d bool tensor: every sent value finite, memory scrubbed already)
        self._pending: List[tuple] = []  # (host flags, CUDA event): flags of scrubbed memory, copied without waiting
        self._warned_overflow = False
        self._flats: Dict[Tuple[str, ...], torch.Tensor] = {}  # select_bucket's residual buffers

    def empty(self, info: TensorInfo, step: int, device: torch.device) -> Selection:
        """The selection of a rank without a gradient (nothing, or zeros of the agreed count); memory kept."""
        s = self.compression.empty_selection(info, step, device)
        s.wire_values = s.values.to(self.compression.wire_value_dtype(info.dtype))
        return s

    def select(self, grad: torch.Tensor, info: TensorInfo, step: int) -> Selection:
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
        return self._to_wire(s, a, info, wire_dtype, exact_wire)

    def batches(self, info: TensorInfo) -> bool:
        """Whether :meth:`select_bucket` selects ``info``'s tensor with others: plain ADTopk (not its -I / -T
        variants) with plain error feedback."""
        return (type(self.compression) is ADTopkCompressor
                and self.memory is not None and self.memory.momentum is None)

    def select_bucket(self, buffer: torch.Tensor, items: Sequence[tuple], step: int,
                      impl: str = "auto") -> List[Selection]:
        """:meth:`select` of several gradients at once (each a contiguous view into the 1-D ``buffer``, e.g.
        DDP's bucket buffer; every ``info`` one that :meth:`batches`), bit for bit the same selections,
        residuals and wire values: their residuals become views of one buffer per group (kept from step to
        step; a residual replaced elsewhere is copied back in), then :func:`horovod_adtopk.bucket_select.select`
        adds, selects and zeroes them all (on CUDA in a few launches; ``impl`` as there). Where the values travel
        unscaled (no prescale) and need no float16 clamping, the selection also packs each tensor's wire block
        (``Selection.block``, bit for bit ``wire.pack``'s; indices travel as the narrow ``wire_index``) and
        leaves in the memory what a rounding wire did not carry, so nothing runs per tensor after it."""
        from . import bucket_select

        c, memory = self.compression, self.memory
        out: List[Optional[Selection]] = [None] * len(items)
        groups: dict = {}
        for i, (grad, info) in enumerate(items):
            wire_dtype = c.wire_value_dtype(info.dtype)
            exact_wire = wire_dtype == info.dtype and self.prescale == 1.0
            groups.setdefault((grad.dtype, wire_dtype, exact_wire), []).append(i)
        size = buffer.element_size()
        for (dtype, wire_dtype, exact_wire), idx in groups.items():
            names = tuple(items[i][1].name for i in idx)
            codecs = [c.codec(items[i][1], step) for i in idx]
            specs = [bucket_select.FiberSpec(cd.layout.rows, cd.layout.cols, cd.layout.axis, cd.layout.k)
                     for cd in codecs]
            g_offsets = [(items[i][0].data_ptr() - buffer.data_ptr()) // size for i in idx]
            flat, a_offsets = self._flat_residuals(names, [items[i][0] for i in idx])
            # The wire packed by the selection itself: unscaled values, and no float16 clamping to report.
            packed = self.prescale == 1.0 and not (wire_dtype == torch.float16 and dtype != torch.float16)
            p = bucket_select.plan(specs, a_offsets, g_offsets, dtype=dtype, device=buffer.device, impl=impl,
                                   wire_dtype=wire_dtype if packed else None)
            hints = [cd.hint(flat) for cd in codecs] if p.fused == [] else None
            if packed:
                r = bucket_select.select(flat, p, buffer, zero_sent=True, hints=hints)
                for j, (i, cd, (v, pos, wv, wi, block, finite)) in enumerate(zip(idx, codecs,
                                                                              bucket_select.split_wire(p, r))):
                    s = Selection(v.reshape(-1), pos, wi, cd, finite=finite, wire_values=wv, block=block,
                                  packed=(p, j))
                    self.nonfinite.append((items[i][1].name, finite, True))
                    out[i] = s
                continue
            values, local = bucket_select.select(flat, p, buffer, zero_sent=exact_wire, hints=hints)
            for j, (i, cd, (v, loc)) in enumerate(zip(idx, codecs, bucket_select.split(p, values, local))):
                s = Selection(v.reshape(-1), cd.to_flat(loc), loc.reshape(-1), cd)
                s.finite = torch.isfinite(s.values).all()
                info = items[i][1]
                a = memory.residuals[info.name]
                out[i] = self._to_wire(s, a, info, c.wire_value_dtype(info.dtype), exact_wire)
        return out

    def _flat_residuals(self, names: Tuple[str, ...], grads: Sequence[torch.Tensor]):
        """One 1-D residual buffer for ``names`` (their memory's residuals are views of it) and their offsets."""
        memory = self.memory
        offsets, n = [], 0
        for g in grads:
            offsets.append(n)
            n += g.numel()
        flat = self._flats.get(names)
        ok = flat is not None and flat.dtype == grads[0].dtype and flat.device == grads[0].device
        if ok:
            for name, g, o in zip(names, grads, offsets):
                r = memory.residuals.get(name)
                if r is None or r.shape != g.shape or r.data_ptr() != flat.data_ptr() + o * flat.element_size():
                    ok = False
                    break
        if not ok:
            flat = torch.zeros(n, dtype=grads[0].dtype, device=grads[0].device)
            for name, g, o in zip(names, grads, offsets):
                r = memory.residuals.get(name)
                view = flat[o:o + g.numel()].view(g.shape)
                if r is not None:
                    view.copy_(r.view(g.shape))
                memory.residuals[name] = view
            for other in [o for o in self._flats if set(o) & set(names)]:  # buffers these names have left
                del self._flats[other]
            self._flats[names] = flat
        return flat, offsets

    def _to_wire(self, s: Selection, a: torch.Tensor, info: TensorInfo, wire_dtype: torch.dtype,
                 exact_wire: bool) -> Selection:
        """The sent values scaled and cast to the wire; the memory of what the wire did not carry."""
        memory = self.memory
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
            self.nonfinite.append((info.name, s.finite, False))
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
        many tensors had one.

        One device-to-host copy per device reads the flags. Flags of tensors whose selection scrubbed their
        memory itself (the bucket selection's packed path) are only counted: on CUDA they are copied without
        waiting and counted at a later call, once the copy is done (a round late at most, as a rule), so the
        round ends with no host synchronisation."""
        entries = list(self.nonfinite)
        self.nonfinite.clear()  # in place: the Horovod engine's sender shares the list
        bad = 0
        now = [(n, f) for n, f, scrubbed in entries if not (scrubbed and f.device.type == "cuda")]
        later = [(n, f) for n, f, scrubbed in entries if scrubbed and f.device.type == "cuda"]
        for names, flags in _by_device(now):
            finite = torch.stack([f.to(torch.bool) for f in flags]).cpu().tolist()
            for n, ok in zip(names, finite):
                if not ok:
                    self.memory.scrub(n)
                    bad += 1
        for names, flags in _by_device(later):
            host = torch.empty(len(flags), dtype=torch.bool, pin_memory=True)
            host.copy_(torch.stack([f.to(torch.bool) for f in flags]), non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags[0].device))
            self._pending.append((host, event))
        waiting = []
        for host, event in self._pending:
            if event.query():
                bad += sum(not ok for ok in host.tolist())
            else:
                waiting.append((host, event))
        self._pending = waiting
        return bad


def _by_device(entries):
    """``[(name, flag)]`` grouped by the flags' device: ``[(names, flags)]``."""
    groups: dict = {}
    for n, f in entries:
        names, flags = groups.setdefault(f.device, ([], []))
        names.append(n)
        flags.append(f)
    return list(groups.values())


def dense_contribution(memory: Optional[ErrorFeedback], name: str, grad: torch.Tensor, on_sparse_path: bool):
    """What ``grad`` sends on the dense path: ``g + r`` (the residual released) for a tensor of the sparse
    path or one that still holds memory, else ``grad`` itself (None when nothing changes)."""
    if memory is not None and (on_sparse_path or memory.holds(name)):
        return memory.dense(name, grad)
    return None


def aggregate_blocks(dense: torch.Tensor, gathered: torch.Tensor, counts: Sequence[int], codec,
                     value_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Sum every rank's block of an allgathered sparse payload, times ``scale``, into ``dense`` (1-D,
    overwritten). The scale (the average's ``1 / size``) is applied to the gathered values, not to the
    dense result: a pass over the payload instead of two over the gradient.

    Rank by rank, so every rank computes bitwise the same sum: on the CPU ``index_add_`` is sequential in
    rank order; on CUDA (atomics) one launch per rank, where indices are unique within a rank's block.
    """
    values, index = unpack(gathered, counts, value_dtype, codec.index_dtype)
    return sum_in_rank_order(dense, values, index, counts, codec, scale)


def sum_in_rank_order(dense: torch.Tensor, values: torch.Tensor, index: torch.Tensor, counts: Sequence[int], codec,
                      scale: float = 1.0) -> torch.Tensor:
    """Every rank's entries (values and wire indices concatenated in rank order, ``counts`` per rank), times
    ``scale``, summed into ``dense`` (1-D, overwritten) rank by rank (see :func:`aggregate_blocks`)."""
    dense.zero_()
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
