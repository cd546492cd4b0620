"""ADTopk selection of a whole bucket of tensors at once.

The tensors of a bucket (DDP's bucket, or any group of gradients ready together) live back to back in one
1-D buffer: the residuals ``a`` (error feedback) and, in another buffer, the gradients. :func:`select` runs,
for every tensor, what :func:`horovod_adtopk.kernels.adtopk_select` runs for it alone (``a += grad``, the
per-fiber top-k, the zeroing of sent entries) and writes every tensor's values and fiber-local positions
contiguously, tensor after tensor, into one values buffer and one positions buffer.

- CUDA tensors with Triton (``impl="auto"``): the tensors that the per-tensor path would give to the Triton
  fiber kernel are selected by one launch per launch configuration (a bucket of a transformer needs a few)
  over a table of fibers (each tensor's offsets, first fiber, fiber count and length, ``k``). The table is
  built on the host from the shapes alone, cached per bucket layout and uploaded once; nothing in the path
  reads a size from the device, so the selection issues no host synchronisation. The other tensors (fibers
  that the per-tensor path gives to ``torch.topk``, and few long columns, which it selects on a transposed
  copy) take exactly the per-tensor call.
- Anywhere else (CPU tensors, no Triton): a loop over :func:`kernels.adtopk_select`.

Either way the result is, bit for bit, the per-tensor path's: the same kernel body selects every fiber
(exact top-k of ``|a|``, NaN and +-Inf above every finite value, ties to the lower position, positions
ascending).

With a wire dtype in the plan (``plan(..., wire_dtype=...)``), :func:`select` also writes what travels: one
``uint8`` buffer holding every tensor's block of :mod:`horovod_adtopk.wire` (values cast to the wire dtype,
padding, fiber-local indices in the narrowest integer type, padding), bit for bit what ``wire.pack`` makes
of the per-tensor path's selection; the flat positions (for the memory) instead of the local ones; and per
tensor whether a sent value is NaN or +-Inf. With ``zero_sent``, an inexact wire (a narrower dtype) leaves in
``a`` what its rounding did not carry (``nan_to_num(a - a.to(wire).to(a.dtype))``, the memory's update after
the send) instead of 0, and NaN / +-Inf left unsent in ``a`` become 0: the error-feedback memory's scrub of a
tensor that sent a non-finite value (``Sparsifier.scrub_nonfinite``), done before any host reads the flag. On CUDA all of it happens in the fused launches: the error-feedback add, the
selection, the zeroing, the packing and the finiteness check, with no host synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import kernels
from .selection import FiberGeometry
from .wire import WIRE_VALUE_DTYPES, _padded, block_bytes, dtype_bytes, index_dtype_for

__all__ = ["FiberSpec", "BucketPlan", "BucketWire", "plan", "select", "split", "split_wire", "decode"]

_IMPLS = ("auto", "triton", "loop")
MODES = ("auto", "off", "loop", "triton")


def env_mode() -> str:
    """``HOROVOD_ADTOPK_BUCKET_SELECT`` (auto, off, loop or triton; default auto): when the engines select their
    ADTopk tensors together (``"auto"``: CUDA gradients; ``"loop"`` / ``"triton"``: any device, as ``impl``)."""
    import os

    mode = os.environ.get("HOROVOD_ADTOPK_BUCKET_SELECT", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"HOROVOD_ADTOPK_BUCKET_SELECT={mode!r}: use auto, off, loop or triton")
    return mode


@dataclass(frozen=True)
class FiberSpec(FiberGeometry):
    """One tensor of a bucket: its ``[rows, cols]`` view, fiber axis and ``k`` (as in ``adtopk_select``)."""

    rows: int
    cols: int
    axis: int
    k: int


class BucketPlan:
    """Host-side plan of one bucket layout: output offsets, which tensors a fused launch selects and its
    fiber table (on the device, uploaded once). Build it with :func:`plan` (cached)."""

    def __init__(self, specs: Sequence[FiberSpec], a_offsets: Sequence[int], g_offsets: Sequence[int],
                 dtype: torch.dtype, device: torch.device, impl: str,
                 wire_dtype: Optional[torch.dtype] = None) -> None:
        self.specs = tuple(specs)
        self.a_offsets, self.g_offsets = tuple(int(o) for o in a_offsets), tuple(int(o) for o in g_offsets)
        self.dtype, self.device, self.impl, self.wire_dtype = dtype, device, impl, wire_dtype
        out, self.out_offsets = 0, []
        for s in self.specs:
            self.out_offsets.append(out)
            out += s.count
        self.total = out
        # The wire: each tensor's block (values | pad | indices | pad) at a byte offset of one buffer.
        self.index_dtypes: Tuple[torch.dtype, ...] = ()
        self.block_offsets: List[int] = []
        self.wire_bytes = 0
        self.codecs: list = []  # FiberCodec per tensor (wire only): local -> flat positions, the rank-order sum
        if wire_dtype is not None:
            from .compressors.base import FiberCodec
            from .selection import FiberLayout

            self.codecs = [FiberCodec(FiberLayout((s.rows, s.cols), s.rows, s.cols, s.axis, s.k)) for s in self.specs]
            self.index_dtypes = tuple(c.index_dtype for c in self.codecs)
            for s, idt in zip(self.specs, self.index_dtypes):
                self.block_offsets.append(self.wire_bytes)
                self.wire_bytes += block_bytes(s.count, wire_dtype, idt)
        self.fused: List[int] = []  # tensors of the fused launches
        self.single: List[int] = []  # tensors selected by the per-tensor call
        self.groups: list = []
        self.table: Optional[torch.Tensor] = None
        tk = _fused_module(device, impl, dtype)
        entries = []
        for i, s in enumerate(self.specs):
            config = None
            if tk is not None and s.k > 0 and s.num_fibers > 0:
                if impl == "triton" or kernels._select_impl(torch.empty(0, device=device), s.fiber_len) == "triton":
                    config = tk.fused_config(s.rows, s.cols, s.axis)
            if config is None:
                self.single.append(i)
            else:
                self.fused.append(i)
                entry = (config, self.a_offsets[i], self.g_offsets[i], self.out_offsets[i], s.rows, s.cols,
                         s.axis, s.k)
                if wire_dtype is not None:
                    entry += (self.index_dtypes[i], *self._wire_elements(i), i)
                entries.append(entry)
        if entries:
            rows, self.groups = tk.bucket_table(entries)
            self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self._tk = tk
        self._decode = None

    def _decode_tables(self, device: torch.device):
        """:func:`decode`'s tables on ``device`` (built from the shapes once, cached)."""
        if self._decode is None or self._decode[0] != device:
            entries = []
            for i, s in enumerate(self.specs):
                entries.append((self.index_dtypes[i], *self._wire_elements(i), s.count, self.g_offsets[i], s.k,
                                s.axis, s.cols))
            rows, groups, zero_rows = self._tk.decode_tables(entries, [s.numel for s in self.specs])
            self._decode = (device, torch.tensor(rows, dtype=torch.int64).reshape(-1, 8).to(device), groups,
                            torch.tensor(zero_rows, dtype=torch.int64).reshape(-1, 3).to(device))
        return self._decode[1:]

    def _wire_elements(self, i: int) -> Tuple[int, int]:
        """Tensor ``i``'s values and indices in the wire buffer, in elements of its value and index views."""
        vo, io = self.wire_regions(i)
        return vo // dtype_bytes(self.wire_dtype), io // dtype_bytes(self.index_dtypes[i])

    def wire_regions(self, i: int) -> Tuple[int, int]:
        """Byte offsets of tensor ``i``'s values and indices in the wire buffer."""
        o, s = self.block_offsets[i], self.specs[i]
        return o, o + _padded(s.count * dtype_bytes(self.wire_dtype))

    @property
    def launches(self) -> int:
        """Kernel launches of the fused part (one per launch configuration)."""
        return len(self.groups)


_PLANS: Dict[tuple, BucketPlan] = {}
#: Plans kept (least recently used dropped first).
MAX_PLANS = 256


def _fused_module(device: torch.device, impl: str, dtype: torch.dtype):
    """``triton_kernels`` where fused launches run: CUDA with Triton (``auto``/``triton``), or CPU tensors under
    the Triton interpreter when ``impl="triton"``; else None (the per-tensor loop)."""
    if impl == "loop":
        return None
    tk = kernels._triton() if device.type == "cuda" else None
    if device.type == "cpu" and impl == "triton":
        try:
            from . import triton_kernels as tk
        except Exception:  # pragma: no cover - Triton absent
            return None
        if not tk.interpreted():
            return None
    if tk is None or not tk.available() or dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return None
    return tk


def plan(specs: Sequence[FiberSpec], a_offsets: Sequence[int], g_offsets: Optional[Sequence[int]] = None,
         dtype: torch.dtype = torch.float32, device="cpu", impl: str = "auto",
         wire_dtype: Optional[torch.dtype] = None) -> BucketPlan:
    """The (cached) :class:`BucketPlan` of a bucket layout: ``specs`` and each tensor's offset in the residual
    buffer (``a_offsets``) and in the gradient buffer (``g_offsets``; default: the same); ``wire_dtype``: also
    pack the wire blocks (see the module docstring)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {', '.join(_IMPLS)}, got {impl!r}")
    if wire_dtype is not None and wire_dtype not in WIRE_VALUE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_VALUE_DTYPES}, got {wire_dtype}")
    specs = tuple(s if isinstance(s, FiberSpec) else FiberSpec(*s) for s in specs)
    g_offsets = tuple(a_offsets) if g_offsets is None else tuple(g_offsets)
    if len(a_offsets) != len(specs) or len(g_offsets) != len(specs):
        raise ValueError("one a offset and one grad offset per tensor")
    for s in specs:
        if s.axis not in (0, 1) or s.rows < 0 or s.cols < 0 or not (1 <= s.k <= s.fiber_len or s.k == s.fiber_len == 0):
            raise ValueError(f"invalid fiber spec {s}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors name it
        device = torch.device("cuda", torch.cuda.current_device())
    key = (specs, tuple(a_offsets), g_offsets, dtype, device, impl, wire_dtype)
    p = _PLANS.pop(key, None)
    if p is None:
        p = BucketPlan(specs, a_offsets, g_offsets, dtype, device, impl, wire_dtype)
        while len(_PLANS) >= MAX_PLANS:  # a density warm-up changes k every step: keep the recent layouts
            del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = p  # most recently used last
    return p


def _check_buffer(t: torch.Tensor, offsets, specs, name: str) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1-D tensor")
    for o, s in zip(offsets, specs):
        if o < 0 or o + s.numel > t.numel():
            raise ValueError(f"{name}: a tensor at offset {o} with {s.numel} entries exceeds its {t.numel()}")


class BucketWire(NamedTuple):
    """:func:`select`'s result with a wire: ``values`` and ``flat`` positions (1-D, ``p.total`` entries each,
    tensor ``i``'s at ``p.out_offsets[i]``), the ``uint8`` wire buffer (tensor ``i``'s block at
    ``p.block_offsets[i]``) and ``finite`` (bool per tensor: every sent value finite)."""

    values: torch.Tensor
    flat: torch.Tensor
    wire: torch.Tensor
    finite: torch.Tensor


def select(a: torch.Tensor, p: BucketPlan, grad: Optional[torch.Tensor] = None, zero_sent: bool = False,
           hints: Optional[Sequence[Optional[torch.Tensor]]] = None):
    """Select every tensor of the bucket ``p`` (see the module docstring).

    ``a``: the residual buffer (1-D, each tensor at ``p.a_offsets``), updated in place; ``grad``: the gradient
    buffer (``p.g_offsets``) added first, or None. Returns ``(values, local)``, 1-D of ``p.total`` entries:
    tensor ``i``'s ``[num_fibers, k]`` block at ``p.out_offsets[i]`` (:func:`split` cuts them); with a wire in
    the plan a :class:`BucketWire` (:func:`split_wire` cuts it). ``hints``: per tensor, the native CPU kernel's
    hint (speed only, see ``kernels.adtopk_select``)."""
    if a.dtype != p.dtype or a.device != p.device:
        raise ValueError(f"a is {a.dtype} on {a.device}, the plan is for {p.dtype} on {p.device}")
    _check_buffer(a, p.a_offsets, p.specs, "a")
    if grad is not None:
        if grad.dtype != a.dtype or grad.device != a.device:
            raise ValueError("grad must have a's dtype and device")
        _check_buffer(grad, p.g_offsets, p.specs, "grad")
    wdt = p.wire_dtype
    remainder = wdt is not None and wdt != a.dtype
    values = torch.empty(p.total, dtype=a.dtype, device=a.device)
    local = torch.empty(p.total, dtype=torch.int64, device=a.device)
    wire = flags = None
    if wdt is not None:
        wire = torch.zeros(p.wire_bytes, dtype=torch.uint8, device=a.device)  # the padding: zero bytes
        flags = torch.zeros(len(p.specs), dtype=torch.int32, device=a.device)
    if p.fused:
        p._tk.bucket_adtopk_select(a, grad, values, local, p.table, p.groups, zero_sent, wire=wire, wire_dtype=wdt,
                                   flags=flags, remainder=remainder)
    for i in p.single:
        s = p.specs[i]
        n, ao, go, oo = s.numel, p.a_offsets[i], p.g_offsets[i], p.out_offsets[i]
        g = None if grad is None else grad[go:go + n]
        zero = zero_sent and not remainder
        if p._tk is not None and p.impl == "triton":  # the per-tensor Triton call (transposed route)
            v, l = p._tk.adtopk_select(a[ao:ao + n], s.rows, s.cols, s.axis, s.k, grad=g, zero_sent=zero)
        else:
            hint = None if hints is None else hints[i]
            v, l = kernels.adtopk_select(a[ao:ao + n], s.rows, s.cols, s.axis, s.k, g, zero, hint=hint)
        values[oo:oo + s.count].copy_(v.reshape(-1))
        if wdt is None:
            local[oo:oo + s.count].copy_(l.reshape(-1))
            continue
        flat = p.codecs[i].to_flat(l.reshape(-1))
        local[oo:oo + s.count].copy_(flat)
        v = v.reshape(-1)
        vo, io = p.wire_regions(i)
        sent = wire[vo:vo + s.count * dtype_bytes(wdt)].view(wdt)
        sent.copy_(v)
        wire[io:io + s.count * dtype_bytes(p.index_dtypes[i])].view(p.index_dtypes[i]).copy_(l.reshape(-1))
        flags[i] = (~torch.isfinite(v)).any()
        if zero_sent and remainder:  # what the rounding wire did not carry stays (the memory's update)
            rem = torch.nan_to_num(v - sent.to(a.dtype), nan=0.0, posinf=0.0, neginf=0.0)
            a[ao:ao + n][flat] = rem
        if zero_sent:  # the unsent NaN / Inf too, as the fused launches do (the memory's scrub)
            torch.nan_to_num_(a[ao:ao + n], nan=0.0, posinf=0.0, neginf=0.0)
    if wdt is not None:
        return BucketWire(values, local, wire, flags == 0)
    return values, local


def split(p: BucketPlan, values: torch.Tensor, local: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Tensor by tensor, ``(values [num_fibers, k], local [num_fibers, k])`` views of :func:`select`'s output."""
    out = []
    for s, o in zip(p.specs, p.out_offsets):
        out.append((values[o:o + s.count].view(s.num_fibers, s.k), local[o:o + s.count].view(s.num_fibers, s.k)))
    return out


def split_wire(p: BucketPlan, r: BucketWire) -> List[Tuple[torch.Tensor, ...]]:
    """Tensor by tensor, views of :func:`select`'s :class:`BucketWire`: ``(values [num_fibers, k], flat
    [count], wire values, wire indices, block, finite)``: the block is what ``wire.pack(wire values, wire
    indices, wire_dtype, index dtype)`` gives, and ``finite`` a 0-d bool."""
    out = []
    vsize = dtype_bytes(p.wire_dtype)
    for i, (s, o, b) in enumerate(zip(p.specs, p.out_offsets, p.block_offsets)):
        vo, io = p.wire_regions(i)
        idt = p.index_dtypes[i]
        out.append((r.values[o:o + s.count].view(s.num_fibers, s.k), r.flat[o:o + s.count],
                    r.wire[vo:vo + s.count * vsize].view(p.wire_dtype),
                    r.wire[io:io + s.count * dtype_bytes(idt)].view(idt),
                    r.wire[b:b + block_bytes(s.count, p.wire_dtype, idt)], r.finite[i]))
    return out


def decode(p: BucketPlan, rows: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Every rank's blocks of a packed bucket (``rows``: ``uint8 [world, p.wire_bytes]``, each row the wire buffer
    of :func:`select` from one rank, e.g. an allgather of it) summed into ``out`` at each tensor's gradient
    offset (``p.g_offsets``: the bucket buffer the gradients came from), times ``scale``: each tensor's region of
    ``out`` becomes ``sum over ranks, in rank order, of value.to(out.dtype) * scale`` at the sent positions and 0
    elsewhere, bit for bit :func:`horovod_adtopk.sparsify.sum_in_rank_order` tensor by tensor; the rest of
    ``out`` is left alone. With fused launches (CUDA): one launch for the zeroing and one per rank (and index
    width), no host synchronisation; elsewhere a loop over the tensors."""
    if p.wire_dtype is None:
        raise ValueError("decode needs a plan with a wire_dtype")
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != p.wire_bytes:
        raise ValueError(f"rows must be uint8 [world, {p.wire_bytes}], got {rows.dtype} {tuple(rows.shape)}")
    _check_buffer(out, p.g_offsets, p.specs, "out")
    if out.device != rows.device:
        raise ValueError("out and rows must be on one device")
    world = rows.shape[0]
    if p._tk is not None and out.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tabs = p._decode_tables(out.device)
        sc = None
        if scale != 1.0:
            sc = torch.tensor([scale], dtype=torch.float64 if out.dtype == torch.float64 else torch.float32,
                              device=out.device)
        p._tk.bucket_decode(rows.contiguous(), p.wire_dtype, out, tabs[0], tabs[1], tabs[2], sc)
        return out
    from .sparsify import sum_in_rank_order

    for i, s in enumerate(p.specs):
        vo, io = p.wire_regions(i)
        idt = p.index_dtypes[i]
        values = rows[:, vo:vo + s.count * dtype_bytes(p.wire_dtype)].contiguous().view(p.wire_dtype).reshape(-1)
        index = rows[:, io:io + s.count * dtype_bytes(idt)].contiguous().view(idt).reshape(-1)
        sum_in_rank_order(out[p.g_offsets[i]:p.g_offsets[i] + s.numel], values, index, [s.count] * world,
                          p.codecs[i], scale)
    return out
