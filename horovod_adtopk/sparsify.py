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
from typing import List, Optional, Sequence

import torch

from .compressors import SparseCompressor, TensorInfo
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
        self.nonfinite: List[tuple] = []  # (name, 0-d bool tensor: every sent value finite)
        self._warned_overflow = False

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
