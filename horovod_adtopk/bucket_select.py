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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import kernels
from .selection import FiberGeometry

__all__ = ["FiberSpec", "BucketPlan", "plan", "select", "split"]

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
                 dtype: torch.dtype, device: torch.device, impl: str) -> None:
        self.specs = tuple(specs)
        self.a_offsets, self.g_offsets = tuple(int(o) for o in a_offsets), tuple(int(o) for o in g_offsets)
        self.dtype, self.device, self.impl = dtype, device, impl
        out, self.out_offsets = 0, []
        for s in self.specs:
            self.out_offsets.append(out)
            out += s.count
        self.total = out
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
                entries.append((config, self.a_offsets[i], self.g_offsets[i], self.out_offsets[i], s.rows, s.cols,
                                s.axis, s.k))
        if entries:
            rows, self.groups = tk.bucket_table(entries)
            self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self._tk = tk

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
         dtype: torch.dtype = torch.float32, device="cpu", impl: str = "auto") -> BucketPlan:
    """The (cached) :class:`BucketPlan` of a bucket layout: ``specs`` and each tensor's offset in the residual
    buffer (``a_offsets``) and in the gradient buffer (``g_offsets``; default: the same)."""
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {', '.join(_IMPLS)}, got {impl!r}")
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
    key = (specs, tuple(a_offsets), g_offsets, dtype, device, impl)
    p = _PLANS.pop(key, None)
    if p is None:
        p = BucketPlan(specs, a_offsets, g_offsets, dtype, device, impl)
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


def select(a: torch.Tensor, p: BucketPlan, grad: Optional[torch.Tensor] = None, zero_sent: bool = False,
           hints: Optional[Sequence[Optional[torch.Tensor]]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Select every tensor of the bucket ``p`` (see the module docstring).

    ``a``: the residual buffer (1-D, each tensor at ``p.a_offsets``), updated in place; ``grad``: the gradient
    buffer (``p.g_offsets``) added first, or None. Returns ``(values, local)``, 1-D of ``p.total`` entries:
    tensor ``i``'s ``[num_fibers, k]`` block at ``p.out_offsets[i]`` (:func:`split` cuts them). ``hints``: per
    tensor, the native CPU kernel's hint (speed only, see ``kernels.adtopk_select``)."""
    if a.dtype != p.dtype or a.device != p.device:
        raise ValueError(f"a is {a.dtype} on {a.device}, the plan is for {p.dtype} on {p.device}")
    _check_buffer(a, p.a_offsets, p.specs, "a")
    if grad is not None:
        if grad.dtype != a.dtype or grad.device != a.device:
            raise ValueError("grad must have a's dtype and device")
        _check_buffer(grad, p.g_offsets, p.specs, "grad")
    values = torch.empty(p.total, dtype=a.dtype, device=a.device)
    local = torch.empty(p.total, dtype=torch.int64, device=a.device)
    if p.fused:
        p._tk.bucket_adtopk_select(a, grad, values, local, p.table, p.groups, zero_sent)
    for i in p.single:
        s = p.specs[i]
        n, ao, go, oo = s.numel, p.a_offsets[i], p.g_offsets[i], p.out_offsets[i]
        g = None if grad is None else grad[go:go + n]
        if p._tk is not None and p.impl == "triton":  # the per-tensor Triton call (transposed route)
            v, l = p._tk.adtopk_select(a[ao:ao + n], s.rows, s.cols, s.axis, s.k, grad=g, zero_sent=zero_sent)
        else:
            hint = None if hints is None else hints[i]
            v, l = kernels.adtopk_select(a[ao:ao + n], s.rows, s.cols, s.axis, s.k, g, zero_sent, hint=hint)
        values[oo:oo + s.count].copy_(v.reshape(-1))
        local[oo:oo + s.count].copy_(l.reshape(-1))
    return values, local


def split(p: BucketPlan, values: torch.Tensor, local: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Tensor by tensor, ``(values [num_fibers, k], local [num_fibers, k])`` views of :func:`select`'s output."""
    out = []
    for s, o in zip(p.specs, p.out_offsets):
        out.append((values[o:o + s.count].view(s.num_fibers, s.k), local[o:o + s.count].view(s.num_fibers, s.k)))
    return out
