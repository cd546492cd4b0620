"""Selection kernels: the hot path of every sparse rule, with one API for every backend.

Pure tensor functions (no Horovod). Every function takes a *contiguous* floating tensor (float16, bfloat16,
float32 or float64) and ranks entries by ``|x|`` with NaN and +-Inf above every finite magnitude (so a
non-finite entry is always selected). Three implementations give the same selected set (where magnitudes
tie, any valid choice):

- ``"native-cpu"``: the C++ extension ``horovod_adtopk._C`` (CPU tensors), unless the environment sets
  ``HOROVOD_ADTOPK_NATIVE=0``. It selects exactly without sorting (block maxima give a threshold that is a
  proven lower bound of the k-th largest magnitude), fuses the error-feedback add and the zeroing of sent
  entries into its passes, and breaks ties towards the lower index (deterministic). Given a ``hint`` (per
  fiber, a threshold carried from the last call), the entries reaching it are the candidates when there are
  at least k of them, with the same result.
- ``"triton"``: ``horovod_adtopk.triton_kernels`` (CUDA tensors), imported lazily when present. Where the
  H200 measurement (BENCHMARKS 1f) found ``torch.topk`` faster, a CUDA tensor takes the torch path instead:
  global top-k (:func:`topk_select`) and fibers longer than ``CUDA_TRITON_MAX_FIBER``. The environment's
  ``HOROVOD_ADTOPK_CUDA_SELECT`` (``auto``, the default; ``triton``; ``torch``) overrides that rule.
- ``"torch"``: the pure-PyTorch fallback below (any device).

Threshold comparisons are exact: ``|x| >= t`` is decided as on real numbers, not after rounding ``t`` to the
tensor's dtype. Positions are returned in ascending order.

:func:`backend` tells which implementation a tensor would use.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

__all__ = ["adtopk_select", "new_hint", "topk_select", "threshold_select", "fiber_threshold_select", "count_at_least",
           "backend", "describe", "native_available"]

try:  # built by setup.py when a compiler and torch were available at install time
    from . import _C as _native
except ImportError:  # pragma: no cover - depends on the build
    _native = None

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_UNSET = object()
_triton_module = _UNSET


def native_available() -> bool:
    """Whether the C++ extension was built and imports."""
    return _native is not None


def _triton():
    """``horovod_adtopk.triton_kernels`` or None; imported once, on first use with a CUDA tensor."""
    global _triton_module
    if _triton_module is _UNSET:
        try:
            from . import triton_kernels as module
        except Exception:  # missing module, no triton, no GPU driver: use the torch fallback
            module = None
        _triton_module = module
    return _triton_module


# On one H200 (docs/gpu/bench.json): the Triton per-fiber path with error feedback took 0.15-0.27 ms against
# the torch path's 0.19-0.55 ms on fibers of 2,304-3,072, but 1.88 ms against 1.34 ms on GPT-2's wte
# (fibers of 50,257); the Triton global top-k took 0.80 ms and 6.1 ms where torch.topk took 0.18 ms and
# 0.93 ms (2.4 M and 38.6 M entries). The crossover for fibers lies between the two lengths measured.
CUDA_TRITON_MAX_FIBER = 16384
_CUDA_CHOICES = ("auto", "triton", "torch")


def _cuda_choice() -> str:
    choice = os.environ.get("HOROVOD_ADTOPK_CUDA_SELECT", "auto").strip().lower() or "auto"
    if choice not in _CUDA_CHOICES:
        raise ValueError(f"HOROVOD_ADTOPK_CUDA_SELECT={choice!r}: use one of {', '.join(_CUDA_CHOICES)} "
                         "(auto: Triton, with torch.topk for global top-k and fibers longer than "
                         f"{CUDA_TRITON_MAX_FIBER})")
    return choice


def _select_impl(a: torch.Tensor, fiber_len: Optional[int]) -> str:
    """The implementation of a top-k selection: :func:`backend`, then on CUDA the measured rule
    (``fiber_len`` None: a global top-k)."""
    impl = backend(a)
    if impl != "triton":
        return impl
    choice = _cuda_choice()
    if choice == "auto":
        return "torch" if fiber_len is None or fiber_len > CUDA_TRITON_MAX_FIBER else "triton"
    return choice


def backend(a: torch.Tensor) -> str:
    """Which implementation the kernels use for ``a``: ``"native-cpu"``, ``"triton"`` or ``"torch"`` (on
    CUDA, a top-k selection may still take the torch path: see the module's note)."""
    if a.device.type == "cpu":
        if _native is not None and os.environ.get("HOROVOD_ADTOPK_NATIVE", "1") != "0":
            return "native-cpu"
        return "torch"
    if a.device.type == "cuda" and _triton() is not None:
        return "triton"
    return "torch"


def describe() -> dict:
    """Which implementation runs per device type (reported in ``opt.stats()["kernels"]``)."""
    out = {"cpu": backend(torch.empty(0))}
    if torch.cuda.is_available():
        out["cuda"] = "triton" if _triton() is not None else "torch"
        if out["cuda"] == "triton" and _cuda_choice() != "triton":
            out["cuda_torch_topk"] = ("every top-k selection" if _cuda_choice() == "torch" else
                                      f"global top-k, fibers longer than {CUDA_TRITON_MAX_FIBER}")
    return out


# --- argument checks --------------------------------------------------------------------------------------


def _check_tensor(a, name: str = "a") -> None:
    if not isinstance(a, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(a).__name__}")
    if a.dtype not in _FLOATING:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {a.dtype}")
    if not a.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got shape {tuple(a.shape)}, strides {a.stride()}); "
                         f"pass {name}.contiguous() (selection works in place on the tensor's memory)")


def _check_grad(a: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    if grad is None:
        return
    _check_tensor(grad, "grad")
    if grad.dtype != a.dtype or grad.device != a.device or grad.numel() != a.numel():
        raise ValueError(f"grad must match a in dtype, device and size: a is {a.dtype} {tuple(a.shape)} on "
                         f"{a.device}, grad is {grad.dtype} {tuple(grad.shape)} on {grad.device}")


def _check_matrix(a: torch.Tensor, rows: int, cols: int, axis: int) -> Tuple[int, int]:
    """Validate the ``rows x cols`` view and ``axis``; return ``(num_fibers, fiber_len)``."""
    rows, cols = int(rows), int(cols)
    if rows < 0 or cols < 0 or rows * cols != a.numel():
        raise ValueError(f"rows * cols must equal a.numel(): {rows} * {cols} != {a.numel()}")
    if isinstance(axis, bool) or axis not in (0, 1):
        raise ValueError(f"axis must be 0 (column fibers) or 1 (row fibers), got {axis!r}")
    return (rows, cols) if axis == 1 else (cols, rows)


def _check_k(k: int, n: int, what: str) -> int:
    """``1 <= k <= n``, or ``k == 0`` for an empty ``n == 0`` (nothing to select)."""
    if isinstance(k, bool) or int(k) != k or not (1 <= int(k) <= n or int(k) == n == 0):
        raise ValueError(f"k must be an integer with 1 <= k <= {what} ({n}), got {k!r}")
    return int(k)


def _nothing(a: torch.Tensor, grad: Optional[torch.Tensor], fibers: int = 0):
    """The selection from an empty fiber (``k == 0``): no values, no positions (after the add)."""
    if grad is not None:
        a.add_(grad)
    return (torch.empty(fibers, 0, dtype=a.dtype, device=a.device),
            torch.empty(fibers, 0, dtype=torch.int64, device=a.device))


# --- pure-PyTorch fallback ---------------------------------------------------------------------------------


def _keys(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with NaN -> +inf (in x's dtype: exact)."""
    mag = x.abs()
    return mag.masked_fill_(torch.isnan(mag), float("inf"))


_SAME_SIZE_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
                  torch.float64: torch.int64}


def _ceil_to_dtype(t: float, dtype: torch.dtype) -> torch.Tensor:
    """The smallest value of ``dtype`` that is >= t (a 0-dim tensor), so that ``|x| >= result`` in ``dtype``
    decides ``|x| >= t`` exactly. NaN stays NaN; beyond the largest finite value it is +inf."""
    t = float(t)
    r = torch.tensor(t, dtype=torch.float64).to(dtype)  # round to nearest
    if float(r) < t:  # rounded down: step to the neighbour towards +inf
        bits = r.view(_SAME_SIZE_INT[dtype])
        r = (bits + (1 if float(r) >= 0 else -1)).view(dtype)
    return r


def _passes(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``|x| >= t`` or non-finite (t in x's dtype or broadcastable)."""
    return (x.abs() >= t) | ~torch.isfinite(x)


def _torch_adtopk_select(a, rows, cols, axis, k, grad=None, zero_sent=False):
    with torch.no_grad():
        if grad is not None:
            a.add_(grad.view(a.shape))
        m = a.view(rows, cols)
        mt = m if axis == 1 else m.t().contiguous()
        _, local = torch.topk(_keys(mt), k, dim=1, largest=True, sorted=False)
        local, _ = torch.sort(local, dim=1)
        values = torch.gather(mt, 1, local)
        if zero_sent:
            if axis == 1:
                m.scatter_(1, local, 0)
            else:
                m.scatter_(0, local.t(), 0)
        return values, local


def _torch_topk_select(a, k, grad=None, zero_sent=False):
    with torch.no_grad():
        if grad is not None:
            a.add_(grad.view(a.shape))
        flat = a.view(-1)
        _, idx = torch.topk(_keys(flat), k, sorted=False)
        idx, _ = torch.sort(idx)
        values = flat[idx]
        if zero_sent:
            flat[idx] = 0
        return values, idx


def _torch_threshold_select(a, t):
    with torch.no_grad():
        flat = a.view(-1)
        idx = _passes(flat, _ceil_to_dtype(t, a.dtype).to(a.device)).nonzero().view(-1)
        return flat[idx], idx


def _torch_fiber_threshold_select(a, rows, cols, axis, thresholds):
    with torch.no_grad():
        m = a.view(rows, cols)
        thr = torch.stack([_ceil_to_dtype(float(t), a.dtype) for t in thresholds.tolist()]) if thresholds.numel() \
            else torch.empty(0, dtype=a.dtype)
        thr = thr.to(a.device)
        thr = thr.view(-1, 1) if axis == 1 else thr.view(1, -1)
        idx = _passes(m, thr).view(-1).nonzero().view(-1)
        return a.view(-1)[idx], idx


def _torch_count_at_least(a, t):
    with torch.no_grad():
        return int(_passes(a.view(-1), _ceil_to_dtype(t, a.dtype).to(a.device)).sum())


# --- public API ---------------------------------------------------------------------------------------------


def adtopk_select(a: torch.Tensor, rows: int, cols: int, axis: int, k: int, grad: Optional[torch.Tensor] = None,
                  zero_sent: bool = False, hint: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact per-fiber top-k of ``|a|`` with ``a`` viewed as ``[rows, cols]``.

    Fibers are rows (``axis=1``, length ``cols``) or columns (``axis=0``, length ``rows``). If ``grad`` is
    given, ``a += grad`` happens first, in place (error feedback: ``a`` is the residual). Returns ``values``
    (signed entries of ``a``, a's dtype) and ``local`` (int64 positions inside the fiber, ascending within
    each fiber), both ``[num_fibers, k]`` fiber-major. With ``zero_sent``, the selected entries of ``a`` are
    set to 0 after being read.

    ``hint``: optional thresholds carried from one call to the next on the same memory (a float64 CPU tensor
    of ``num_fibers`` entries, zeros at first, updated in place; see :func:`new_hint`). It only makes the
    native CPU kernel faster, where a fiber's k-th key moves little from step to step (the entries reaching
    the hint are the candidates, with no block maxima or sample); the result is the same with or without it,
    bit for bit. The other backends, and the native kernel's tiled walk for short column fibers, ignore it.
    """
    _check_tensor(a)
    _check_grad(a, grad)
    fibers, n = _check_matrix(a, rows, cols, axis)
    k = _check_k(k, n, "fiber length")
    _check_hint(hint, fibers)
    if k == 0:
        return _nothing(a, grad, fibers)
    rows, cols, axis = int(rows), int(cols), int(axis)
    impl = _select_impl(a, n)
    if impl == "native-cpu":
        values, local = _native.adtopk_select(a, rows, cols, axis, k, grad, bool(zero_sent), hint)
        return values, local
    if impl == "triton":
        return _triton().adtopk_select(a, rows, cols, axis, k, grad=grad, zero_sent=zero_sent)
    return _torch_adtopk_select(a, rows, cols, axis, k, grad, zero_sent)


def new_hint(num_fibers: int) -> torch.Tensor:
    """A fresh ``hint`` for :func:`adtopk_select`: no threshold known yet for any fiber."""
    return torch.zeros(int(num_fibers), dtype=torch.float64)


def _check_hint(hint: Optional[torch.Tensor], fibers: int) -> None:
    if hint is None:
        return
    if (not isinstance(hint, torch.Tensor) or hint.dtype != torch.float64 or hint.device.type != "cpu"
            or not hint.is_contiguous() or hint.numel() != fibers):
        got = (f"{hint.dtype} {tuple(hint.shape)} on {hint.device}" if isinstance(hint, torch.Tensor)
               else type(hint).__name__)
        raise ValueError(f"hint must be a contiguous float64 CPU tensor with one entry per fiber ({fibers}), "
                         f"got {got}; make one with kernels.new_hint({fibers}) and pass it back on every call")


def topk_select(a: torch.Tensor, k: int, grad: Optional[torch.Tensor] = None,
                zero_sent: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of ``|a|`` over the flattened tensor: ``(values, flat)``, 1-D, flat int64 ascending.

    ``grad`` and ``zero_sent`` as in :func:`adtopk_select`.
    """
    _check_tensor(a)
    _check_grad(a, grad)
    k = _check_k(k, a.numel(), "a.numel()")
    if k == 0:
        values, flat = _nothing(a, grad)
        return values.view(-1), flat.view(-1)
    impl = _select_impl(a, None)
    if impl == "native-cpu":
        values, flat = _native.topk_select(a, k, grad, bool(zero_sent))
        return values, flat
    if impl == "triton":
        return _triton().topk_select(a, k, grad=grad, zero_sent=zero_sent)
    return _torch_topk_select(a, k, grad, zero_sent)


def threshold_select(a: torch.Tensor, t: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Entries with ``|a| >= t`` plus every non-finite entry: ``(values, flat)``, flat int64 ascending."""
    _check_tensor(a)
    t = float(t)
    impl = backend(a)
    if impl == "native-cpu":
        values, flat = _native.threshold_select(a, t)
        return values, flat
    if impl == "triton":
        return _triton().threshold_select(a, t)
    return _torch_threshold_select(a, t)


def fiber_threshold_select(a: torch.Tensor, rows: int, cols: int, axis: int,
                           thresholds: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Entries whose ``|a|`` reaches their own fiber's threshold, plus every non-finite entry.

    ``thresholds``: ``[num_fibers]`` (float64). Returns ``(values, flat)``, flat int64 ascending.
    """
    _check_tensor(a)
    nf, _ = _check_matrix(a, rows, cols, axis)
    rows, cols, axis = int(rows), int(cols), int(axis)
    if not isinstance(thresholds, torch.Tensor):
        thresholds = torch.as_tensor(thresholds, dtype=torch.float64)
    if thresholds.numel() != nf:
        raise ValueError(f"thresholds must have one entry per fiber ({nf}), got {thresholds.numel()}")
    impl = backend(a)
    if impl == "native-cpu":
        thr = thresholds.detach().to(device="cpu", dtype=torch.float64).contiguous().view(-1)
        values, flat = _native.fiber_threshold_select(a, rows, cols, axis, thr)
        return values, flat
    if impl == "triton":
        thr = thresholds.detach().to(device=a.device, dtype=torch.float64).contiguous().view(-1)
        return _triton().fiber_threshold_select(a, rows, cols, axis, thr)
    return _torch_fiber_threshold_select(a, rows, cols, axis, thresholds.detach().to(torch.float64).view(-1))


def count_at_least(a: torch.Tensor, t: float) -> int:
    """Number of entries with ``|a| >= t``, non-finite entries included (no ``|a|`` temporary)."""
    _check_tensor(a)
    t = float(t)
    impl = backend(a)
    if impl == "native-cpu":
        return int(_native.count_at_least(a, t))
    if impl == "triton":
        return int(_triton().count_at_least(a, t))
    return _torch_count_at_least(a, t)
