"""Selection rules: which gradient entries a rank sends (layouts, counts, threshold estimators).

Pure tensor functions, no Horovod. Every rule takes the error-compensated gradient ``a`` (any shape,
any floating dtype, any device) and returns the signed values it keeps and where they sit. Nothing here
keeps state or touches the global RNG; randomness comes from a caller-owned ``torch.Generator``.

All-dimension top-k (ADTopk, Ming et al., HPDC 2024)
---------------------------------------------------
A tensor with two or more dims is viewed as the matrix ``M = a.reshape(d0, -1)`` (rows = output units or
channels). A *fiber* is one row (``axis=1``) or one column (``axis=0``) of ``M``. Every fiber keeps its own

    k = max(1, floor(ratio * fiber_len))

entries of largest ``|M|``, so no output unit is left without an update ("dimension missing" in the
paper), the payload size ``num_fibers * k`` is the same on every rank, and the work is many small
independent partial sorts instead of one large one.

``axis="auto"`` prefers contiguous row fibers (``axis=1``): it takes them whenever their effective density
``k / cols`` stays within ``AUTO_DENSITY_TOLERANCE`` (5%, relative) of ``ratio``, i.e. whenever the
``floor`` and the ``k >= 1`` floor do not move the budget by more than that; otherwise fibers run along
the longer axis of ``M`` (1 on ties), as before. Rows are contiguous in memory, so their selection streams
through the tensor, while column fibers walk it with a stride (several times slower per entry). The
authors select along dim 1 of the
*native* shape: for a conv weight ``[Cout, Cin, kh, kw]`` that is one fiber of length ``Cin`` per
``(cout, kh, kw)``, and for the first conv (``Cin=3``) ``k >= 1`` inflates the density to 33%. Viewing
``[d0, -1]`` gives fibers of length ``Cin*kh*kw``, and picking the longer axis keeps an embedding
``[V, E]`` from sending ``k`` entries for every vocabulary row (it sends per embedding column instead).
Both keep the effective density close to ``ratio``; ``opt.stats()`` reports it per tensor.

Global top-k keeps ``k = max(1, floor(ratio * numel))`` entries of the flattened tensor. Threshold rules
keep ``|a| >= t`` with ``t`` estimated per call (DGC, Gaussian-k, RedSync, SIDCo) or given (threshold);
they send a variable number of entries.

The selections themselves (per-fiber and global top-k, threshold passes) live in
:mod:`horovod_adtopk.kernels`: a native CPU kernel, a Triton kernel for CUDA and an exact pure-PyTorch
fallback behind one API. Non-finite values rank above every finite magnitude there, so a non-finite entry
is always among those sent; the aggregated gradient then carries the NaN/Inf to the user's code, as a
dense allreduce would.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

Axis = Union[int, str]


def check_ratio(ratio: float) -> float:
    """Validate a density ``ratio`` in (0, 1]; return it as float."""
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise ValueError(f"ratio must be a number in (0, 1] (e.g. 0.01), got {ratio!r}")
    value = float(ratio)
    if not (0.0 < value <= 1.0):  # also rejects NaN
        raise ValueError(f"ratio must be in (0, 1] (e.g. 0.01 keeps 1% of each fiber), got {ratio!r}")
    return value


def keep_count(ratio: float, n: int) -> int:
    """``max(1, floor(ratio * n))`` for ``n >= 1`` (0 for ``n == 0``): entries kept out of ``n``."""
    if n <= 0:
        return 0
    return max(1, int(math.floor(ratio * n)))


class FiberGeometry:
    """What follows from ``rows``, ``cols``, ``axis`` and ``k`` (fields of the dataclasses that mix it in:
    :class:`FiberLayout`, :class:`horovod_adtopk.bucket_select.FiberSpec`)."""

    rows: int
    cols: int
    axis: int
    k: int

    @property
    def num_fibers(self) -> int:
        return self.rows if self.axis == 1 else self.cols

    @property
    def fiber_len(self) -> int:
        return self.cols if self.axis == 1 else self.rows

    @property
    def count(self) -> int:
        """Entries kept per rank: ``num_fibers * k``."""
        return self.num_fibers * self.k

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class FiberLayout(FiberGeometry):
    """How a tensor is cut into fibers for all-dimension top-k.

    ``rows x cols`` is the matrix view ``a.reshape(rows, cols)``; ``axis`` is the axis fibers run along
    (1: each row is a fiber, 0: each column is a fiber); ``k`` entries are kept per fiber.
    """

    shape: Tuple[int, ...]
    rows: int
    cols: int
    axis: int
    k: int

    @property
    def stride(self) -> int:
        """Distance in the flat tensor between neighbours along a fiber."""
        return 1 if self.axis == 1 else self.cols


def matrix_view_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    """``(d0, prod(rest))``: the matrix view of a tensor of 2 or more dims."""
    if len(shape) < 2:
        raise ValueError(f"all-dimension top-k needs a tensor of 2 or more dims, got shape {tuple(shape)}")
    rows = int(shape[0])
    cols = int(math.prod(shape[1:]))
    return rows, cols


#: "auto" keeps contiguous row fibers while ``|k / cols - ratio| <= AUTO_DENSITY_TOLERANCE * ratio``.
AUTO_DENSITY_TOLERANCE = 0.05


def resolve_axis(rows: int, cols: int, axis: Axis, ratio: Optional[float] = None) -> int:
    """Turn ``axis`` (0, 1 or "auto") into 0 or 1.

    "auto": row fibers (1) when ``ratio`` is given and their effective density ``keep_count(ratio, cols) /
    cols`` is within ``AUTO_DENSITY_TOLERANCE`` of ``ratio`` (relative); else fibers along the longer axis
    (1 on ties).
    """
    if isinstance(axis, str):
        if axis != "auto":
            raise ValueError(f"axis must be 0, 1 or 'auto', got {axis!r}")
        if ratio is not None and cols > 0:
            density = keep_count(ratio, cols) / cols
            if abs(density - ratio) <= AUTO_DENSITY_TOLERANCE * ratio:
                return 1
        return 1 if cols >= rows else 0
    if isinstance(axis, bool) or not isinstance(axis, int) or axis not in (0, 1):
        raise ValueError(f"axis must be 0, 1 or 'auto', got {axis!r}")
    return int(axis)


#: How ``min_fiber_len`` joins short fibers: whole adjacent rows, or whole columns (see :func:`fiber_layout`).
FIBER_JOINS = ("rows", "columns")


def check_min_fiber_len(min_fiber_len: Optional[int], axis: Axis, join: str = "rows") -> Optional[int]:
    """Validate ``min_fiber_len`` (``None``, or an int >= 1) and ``join`` ("rows": with ``axis`` "auto" or
    1; "columns": with ``axis`` "auto" or 0, and only with ``min_fiber_len``)."""
    if join not in FIBER_JOINS:
        raise ValueError(f"join must be 'rows' or 'columns', got {join!r}")
    if min_fiber_len is None:
        if join != "rows":
            raise ValueError(f"join={join!r} says how min_fiber_len joins short fibers: give min_fiber_len too "
                             f"(e.g. min_fiber_len=2048), or drop join")
        return None
    if isinstance(min_fiber_len, bool) or not isinstance(min_fiber_len, numbers.Integral) or min_fiber_len < 1:
        raise ValueError(f"min_fiber_len must be None or an int >= 1, got {min_fiber_len!r}")
    fits = ("auto", 1) if join == "rows" else ("auto", 0)
    if axis not in fits:
        raise ValueError(f"min_fiber_len with join={join!r} joins whole {join} into fibers (axis "
                         f"{fits[1]}); it cannot be combined with axis={axis!r}: use axis='auto' or {fits[1]}, "
                         f"or drop min_fiber_len")
    return int(min_fiber_len)


@functools.lru_cache(maxsize=4096)  # asked at every step, per tensor
def rows_per_fiber(rows: int, cols: int, min_fiber_len: int) -> int:
    """The smallest divisor ``g`` of ``rows`` with ``g * cols >= min_fiber_len`` (``rows`` when none is)."""
    if cols >= min_fiber_len:
        return 1
    for g in range(1, rows + 1):
        if rows % g == 0 and g * cols >= min_fiber_len:
            return g
    return max(rows, 1)


def fiber_layout(shape: Tuple[int, ...], ratio: float, axis: Axis = "auto",
                 min_fiber_len: Optional[int] = None, join: str = "rows") -> FiberLayout:
    """The :class:`FiberLayout` of a tensor of ``shape`` at density ``ratio``.

    ``min_fiber_len`` (short fibers joined), with ``join``:

    - ``"rows"``: where the rows of the matrix view are shorter than ``min_fiber_len``, fibers are runs of
      ``g`` whole adjacent rows (the view becomes ``[rows / g, g * cols]``, still contiguous), ``g`` the
      smallest divisor of ``rows`` that makes them at least that long (all rows where none does);
    - ``"columns"``: where the columns are shorter than ``min_fiber_len``, fibers are ``g`` whole columns
      each: the view becomes ``[rows * g, cols / g]`` (the same memory) and its columns are the fibers, so
      fiber ``j`` holds every row's entries in columns ``j, j + cols / g, j + 2 cols / g, ...``; ``g`` the
      smallest divisor of ``cols`` with ``rows * g >= min_fiber_len`` (all columns where none does).

    Where the fibers are long enough already, ``axis`` decides as without it (so ``1`` changes nothing). On a
    transformer's ``[3D, D]`` / ``[D, D]`` matrices at a small width the rows are short (``D = 128``:
    ``k = 1`` of 128 at ratio 0.01), and a budget per row keeps far less of the tensor's energy than a top-k
    over a few thousand entries does (BENCHMARKS.md 3k); joined columns span every row, so a fused ``qkv``'s
    q, k and v share one budget instead of a third each. Every rank still sends ``k`` per fiber, the same
    payload."""
    rows, cols = matrix_view_shape(tuple(shape))
    ratio = check_ratio(ratio)
    if check_min_fiber_len(min_fiber_len, axis, join) is not None:
        if join == "rows" and cols < min_fiber_len:
            g = rows_per_fiber(rows, cols, min_fiber_len)
            rows, cols = rows // g, cols * g
            return FiberLayout(tuple(int(s) for s in shape), rows, cols, 1, keep_count(ratio, cols))
        if join == "columns" and rows < min_fiber_len:
            g = rows_per_fiber(cols, rows, min_fiber_len)  # the same rule with the roles of rows and columns
            rows, cols = rows * g, cols // g
            return FiberLayout(tuple(int(s) for s in shape), rows, cols, 0, keep_count(ratio, rows))
    ax = resolve_axis(rows, cols, axis, ratio)
    fiber_len = cols if ax == 1 else rows
    return FiberLayout(tuple(int(s) for s in shape), rows, cols, ax, keep_count(ratio, fiber_len))



def fiber_bases(layout: FiberLayout, device: torch.device) -> torch.Tensor:
    """Flat offset of the first element of every fiber, repeated ``k`` times: ``[num_fibers * k]`` int64.

    ``flat = bases + local * layout.stride`` maps fiber-local indices (fiber-major order) to flat ones.
    """
    fibers = torch.arange(layout.num_fibers, device=device, dtype=torch.int64)
    first = fibers * layout.cols if layout.axis == 1 else fibers
    return first.repeat_interleave(layout.k)


def local_to_flat(local: torch.Tensor, layout: FiberLayout, bases: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Flat indices (int64) of fiber-local indices laid out fiber-major as :func:`all_dimension_topk` gives,
    for one rank's block or several concatenated ones (length a multiple of ``layout.count``)."""
    if layout.count == 0:  # an empty tensor: nothing to place
        return local.reshape(-1).to(torch.int64)
    if bases is None:
        bases = fiber_bases(layout, local.device)
    blocks = local.reshape(-1, layout.count).to(torch.int64)
    return (bases + blocks * layout.stride).reshape(-1)


def random_positions(numel: int, k: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``k`` distinct random flat positions out of ``numel``, drawn from ``generator`` (sorted, int64).

    Uniform over k-subsets. For ``k`` much smaller than ``numel`` it draws with replacement and removes
    duplicates (O(k)) instead of permuting all ``numel`` positions.
    """
    if k * 4 >= numel:
        return torch.randperm(numel, generator=generator, device=generator.device)[:k].sort().values.to(device)
    picked = torch.empty(0, dtype=torch.int64)
    while picked.numel() < k:
        draw = torch.randint(0, numel, (k + k // 8 + 16,), generator=generator, device=generator.device)
        picked = torch.unique(torch.cat([picked, draw]))
    keep = torch.randperm(picked.numel(), generator=generator, device=generator.device)[:k]
    return picked[keep].sort().values.to(device)


# --- threshold estimators -------------------------------------------------------------------------------
# Each returns a Python float t >= 0 such that about k = ratio * numel entries have |a| >= t. They never
# need to agree across ranks: threshold payloads travel as variable-size allgathers.


def _count_at_least(mag: torch.Tensor, t: float) -> int:
    return int((mag >= t).sum())


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when all of it is finite (the common case: one reduction), else its finite entries."""
    if x.numel() == 0 or math.isfinite(float(x.sum(dtype=torch.float64))):
        return x
    return x[torch.isfinite(x)]


def refine_threshold(mag: torch.Tensor, t: float, k: int, max_iters: int = 5, tolerance: float = 1.25) -> float:
    """Move ``t`` toward a count of ``k`` entries of ``mag >= t``.

    Doubles or halves ``t`` until the target count is bracketed, then interpolates (regula falsi) on
    ``log(count)`` against ``t``, which is close to linear in the tail of gradient magnitudes. Stops as soon
    as the count is within ``[k / tolerance, k * tolerance]`` or after ``max_iters`` full passes. Used to
    correct a fitted threshold (Gaussian-k, SIDCo, DGC's sampled estimate).
    """
    finite = _finite(mag)
    top = float(finite.max()) if finite.numel() else 0.0
    if top <= 0.0:
        return float(t)
    t = min(max(float(t), top * 1e-12), top)
    lo = hi = None  # (threshold, count) with count too big / too small
    goal = math.log(k)
    for _ in range(max_iters):
        c = _count_at_least(mag, t)
        if k / tolerance <= c <= k * tolerance:
            break
        if c > k * tolerance:
            lo = (t, c)
        else:
            hi = (t, c)
        if hi is None:
            t = min(t * 2.0, top)
        elif lo is None:
            t = t * 0.5
        else:
            (t_lo, c_lo), (t_hi, c_hi) = lo, hi
            l_lo, l_hi = math.log(c_lo), math.log(max(c_hi, 0.5))
            frac = (l_lo - goal) / (l_lo - l_hi)
            t = t_lo + min(max(frac, 0.05), 0.95) * (t_hi - t_lo)
    return float(t)


def dgc_threshold(mag: torch.Tensor, ratio: float, generator: torch.Generator, sample_fraction: float = 0.01,
                  min_sample: int = 1000) -> float:
    """DGC (Lin et al., ICLR 2018): top-``ratio`` threshold of a random sample of ``|a|`` (about 1%)."""
    n = mag.numel()
    s = min(n, max(min_sample, int(n * sample_fraction)))
    pos = torch.randint(0, n, (s,), generator=generator, device=generator.device).to(mag.device)
    sample = mag[pos]
    ks = keep_count(ratio, s)
    return float(torch.topk(sample, ks, sorted=False).values.min())


_SQRT2 = math.sqrt(2.0)


def normal_quantile(p: float) -> float:
    """Inverse of the standard normal CDF, by bisection on ``math.erf`` (accurate to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 0.5 * (1.0 + math.erf(mid / _SQRT2)) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def gaussian_threshold(a: torch.Tensor, ratio: float) -> float:
    """Gaussian-k (Shi et al., 2019): fit N(mu, sigma) to ``a``; keep the two tails of mass ``ratio``.

    ``t = |mu| + sigma * Phi^-1(1 - ratio / 2)``.
    """
    finite = _finite(a.reshape(-1))
    if finite.numel() < 2:
        return 0.0
    sigma_t, mu_t = torch.std_mean(finite.float() if finite.dtype in (torch.float16, torch.bfloat16) else finite)
    mu, sigma = float(mu_t), float(sigma_t)
    if ratio >= 1.0:
        return 0.0
    return abs(mu) + sigma * normal_quantile(1.0 - ratio / 2.0)


def redsync_threshold(mag: torch.Tensor, k: int, max_iters: int = 20, tolerance: float = 1.25) -> float:
    """RedSync (Fang et al., 2019): binary search ``r`` in [0, 1] for ``t = mean + r * (max - mean)``."""
    finite = _finite(mag)
    if finite.numel() == 0:
        return 0.0
    mean, top = float(finite.float().mean()), float(finite.max())
    lo, hi = 0.0, 1.0
    t = mean
    for _ in range(max_iters):
        r = 0.5 * (lo + hi)
        t = mean + r * (top - mean)
        c = _count_at_least(mag, t)
        if k / tolerance <= c <= k * tolerance:
            break
        if c > k * tolerance:
            lo = r
        else:
            hi = r
    if _count_at_least(mag, t) == 0 and top > 0:
        t = top
    return float(t)


#: the tail models SIDCo can fit
SIDCO_DISTRIBUTIONS = ("exponential", "gamma", "gpareto")


def sidco_threshold(mag: torch.Tensor, ratio: float, stages: int = 2, distribution: str = "exponential") -> float:
    """SIDCo (Abdelmoniem et al., MLSys 2021): multi-stage fit of the tail of ``|a|``.

    Stage ``s`` fits the chosen distribution to the exceedances over the previous threshold and keeps
    a tail of mass ``ratio ** (1 / stages)``, so that the stages compound to ``ratio``.

    - exponential: scale = mean exceedance; ``t += scale * ln(1 / q)``.
    - gamma: method-of-moments shape/scale, tail by a Wilson-Hilferty normal approximation.
    - gpareto: method-of-moments generalized Pareto; ``t += sigma / xi * (q ** -xi - 1)``.
    """
    if distribution not in SIDCO_DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {', '.join(SIDCO_DISTRIBUTIONS)}, got {distribution!r}")
    x = _finite(mag)
    q = ratio ** (1.0 / stages)
    t = 0.0
    for stage in range(stages):
        exceed = (x if stage == 0 else x[x > t] - t).double()
        if exceed.numel() < 2:
            break
        mean = float(exceed.mean())
        if mean <= 0:
            break
        if distribution == "exponential":
            t += mean * math.log(1.0 / q)
        elif distribution == "gamma":
            var = float(exceed.var())
            shape = mean * mean / var if var > 0 else 1.0
            scale = var / mean if var > 0 else mean
            z = normal_quantile(1.0 - q)
            wh = shape * (1 - 1 / (9 * shape) + z * math.sqrt(1 / (9 * shape))) ** 3  # Wilson-Hilferty
            t += max(wh, 0.0) * scale
        else:
            var = float(exceed.var())
            xi = 0.5 * (1.0 - mean * mean / var) if var > 0 else 0.0
            sigma = 0.5 * mean * (mean * mean / var + 1.0) if var > 0 else mean
            t += sigma * math.log(1.0 / q) if abs(xi) < 1e-6 else sigma / xi * (q ** -xi - 1.0)
    return float(t)
