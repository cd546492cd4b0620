"""horovod_adtopk.kernels against the independent numpy reference (tests/reference.py).

Every selection test runs on both CPU implementations: the native extension (skipped, with a message, when
it was not built) and the pure-PyTorch fallback. Selected sets are compared as masks; where magnitudes tie,
validity is checked instead (k per fiber, every selected magnitude >= every unselected one). The native
kernel breaks ties towards the lower index, as the reference's stable argsort does, so it must match the
reference mask exactly.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from horovod_adtopk import kernels as K

from tests import reference as ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NATIVE_SKIP = "native extension horovod_adtopk._C not built (python setup.py build_ext --inplace); fallback only"


@pytest.fixture(params=["native", "torch"])
def impl(request, monkeypatch):
    if request.param == "native":
        if not K.native_available():
            pytest.skip(NATIVE_SKIP)
        monkeypatch.setenv("HOROVOD_ADTOPK_NATIVE", "1")
        assert K.backend(torch.zeros(1)) == "native-cpu"
    else:
        monkeypatch.setenv("HOROVOD_ADTOPK_NATIVE", "0")
        assert K.backend(torch.zeros(1)) == "torch"
    return request.param


# --- helpers --------------------------------------------------------------------------------------------------


def as_np(x: torch.Tensor) -> np.ndarray:
    """float64 numpy copy (exact for every floating dtype)."""
    return x.detach().to(torch.float64).numpy()


def keys(x: np.ndarray) -> np.ndarray:
    mag = np.abs(x)
    return np.where(np.isnan(mag), np.inf, mag)


def ratio_for(k: int, n: int) -> float:
    """A ratio for which the reference keeps exactly k of n: max(1, floor(ratio * n)) == k."""
    return 1.0 if k == n else (k + 0.5) / n


def make(shape, dtype, kind="normal", seed=0, special=0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    elif kind == "ints":  # many ties
        x = torch.randint(-4, 5, shape, generator=g).to(torch.float64)
    elif kind == "equal":
        x = torch.full(shape, -1.5, dtype=torch.float64)
    else:
        raise ValueError(kind)
    x = x.to(dtype)
    if special > 0:
        flat = x.view(-1)
        pick = torch.rand(flat.numel(), generator=g) < special
        choice = torch.randint(0, 3, (flat.numel(),), generator=g)
        specials = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
        flat[pick] = specials[choice[pick]]
    return x


def check_fibers(a_sel: np.ndarray, axis: int, k: int, values: torch.Tensor, local: torch.Tensor) -> np.ndarray:
    """Validate one adtopk_select result against the matrix it selected from; return the mask [rows, cols]."""
    mt = a_sel if axis == 1 else a_sel.T
    nf, n = mt.shape
    assert values.shape == (nf, k) and local.shape == (nf, k)
    assert local.dtype == torch.int64
    loc = local.numpy()
    assert (loc >= 0).all() and (loc < n).all()
    if k > 1:
        assert (np.diff(loc, axis=1) > 0).all(), "positions must be strictly ascending within a fiber"
    mask_t = np.zeros(mt.shape, dtype=bool)
    np.put_along_axis(mask_t, loc, True, axis=1)
    key = keys(mt)
    sel_min = np.where(mask_t, key, np.inf).min(axis=1)
    unsel_max = np.where(mask_t, -np.inf, key).max(axis=1)
    assert (sel_min >= unsel_max).all(), "a selected magnitude is below an unselected one"
    np.testing.assert_array_equal(as_np(values), np.take_along_axis(mt, loc, axis=1))
    return mask_t if axis == 1 else mask_t.T


def run_adtopk(a0: torch.Tensor, rows, cols, axis, k, impl, with_grad=False, zero_sent=False, seed=1):
    a = a0.clone()
    grad = make(a0.shape, a0.dtype, seed=seed) if with_grad else None
    expect = (a0 + grad) if with_grad else a0.clone()  # same-dtype add: same rounding as the fused one
    values, local = K.adtopk_select(a, rows, cols, axis, k, grad=grad, zero_sent=zero_sent)
    e = as_np(expect).reshape(rows, cols)
    mask = check_fibers(e, axis, k, values, local)
    after = np.where(mask, 0.0, e) if zero_sent else e
    np.testing.assert_array_equal(as_np(a).reshape(rows, cols), after)
    ref_mask = ref.adtopk_mask(e, ratio_for(k, rows if axis == 0 else cols), axis)
    if impl == "native":
        np.testing.assert_array_equal(mask, ref_mask)  # same (lower-index) tie rule as the reference
    return mask, ref_mask, values, local


# --- all-dimension top-k ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("shape,k", [((37, 3000), 7), ((3000, 37), 5), ((64, 64), 64), ((9, 5), 1), ((5, 9), 5),
                                     ((300, 2048), 20), ((1, 1), 1)])
def test_adtopk_matches_reference(impl, dtype, axis, shape, k):
    rows, cols = shape
    n = cols if axis == 1 else rows
    k = min(k, n)
    a0 = make(shape, dtype, seed=rows * 7 + cols)
    mask, ref_mask, _, _ = run_adtopk(a0, rows, cols, axis, k, impl, with_grad=True, zero_sent=True)
    e = as_np(a0.clone().add_(make(shape, dtype, seed=1))).reshape(rows, cols)
    if len(np.unique(keys(e))) == e.size:  # no ties: the set is unique
        np.testing.assert_array_equal(mask, ref_mask)


@pytest.mark.parametrize("kind", ["ints", "equal"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adtopk_ties(impl, kind, axis, dtype):
    for rows, cols, k in [(40, 4000, 13), (4000, 40, 13), (8, 100, 50), (33, 33, 33)]:
        a0 = make((rows, cols), dtype, kind=kind, seed=rows)
        run_adtopk(a0, rows, cols, axis, min(k, cols if axis == 1 else rows), impl, zero_sent=True)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_adtopk_non_finite_always_selected(impl, axis, dtype):
    rows, cols = (50, 2000) if axis == 1 else (2000, 50)
    a0 = make((rows, cols), dtype, seed=3, special=0.002)
    k = 20
    mask, _, _, _ = run_adtopk(a0, rows, cols, axis, k, impl)
    e = as_np(a0).reshape(rows, cols)
    nonfinite = ~np.isfinite(e)
    mt, nt = (mask, nonfinite) if axis == 1 else (mask.T, nonfinite.T)
    for f in range(mt.shape[0]):
        if nt[f].sum() <= k:
            assert mt[f][nt[f]].all(), "a NaN/Inf entry was not selected"
        else:
            assert not mt[f][~nt[f]].any(), "a finite entry was selected before a non-finite one"


def test_adtopk_nan_before_finite(impl):
    a = torch.tensor([[1.0, float("nan"), 3.0, -float("inf"), 2.0, 0.5]])
    values, local = K.adtopk_select(a, 1, 6, 1, 2)
    assert local.tolist() == [[1, 3]]
    values, local = K.adtopk_select(a.clone(), 1, 6, 1, 3)
    assert local.tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("axis", [0, 1])
def test_adtopk_k_equals_fiber_len_and_k1(impl, axis):
    a0 = make((70, 90), torch.float32, seed=5)
    n = 90 if axis == 1 else 70
    for k in (1, n):
        _, local = K.adtopk_select(a0.clone(), 70, 90, axis, k)
        if k == n:
            assert torch.equal(local, torch.arange(n).expand(local.shape[0], n))
        run_adtopk(a0, 70, 90, axis, k, impl, with_grad=True, zero_sent=True)


@pytest.mark.parametrize("axis", [0, 1])
def test_adtopk_deterministic(impl, axis):
    a0 = make((257, 1031), torch.float32, kind="ints", seed=9)
    out1 = K.adtopk_select(a0.clone(), 257, 1031, axis, 11)
    out2 = K.adtopk_select(a0.clone(), 257, 1031, axis, 11)
    assert torch.equal(out1[0], out2[0]) and torch.equal(out1[1], out2[1])


def test_adtopk_fused_grad_without_zeroing(impl):
    a0 = make((30, 500), torch.float16, seed=2)
    run_adtopk(a0, 30, 500, 1, 5, impl, with_grad=True, zero_sent=False)
    run_adtopk(a0, 30, 500, 0, 3, impl, with_grad=True, zero_sent=False)


# --- global top-k -----------------------------------------------------------------------------------------------


def check_flat(e: np.ndarray, k: int, values: torch.Tensor, flat: torch.Tensor) -> np.ndarray:
    assert values.shape == (k,) and flat.shape == (k,) and flat.dtype == torch.int64
    idx = flat.numpy()
    assert (np.diff(idx) > 0).all(), "flat indices must be strictly ascending"
    mask = np.zeros(e.size, dtype=bool)
    mask[idx] = True
    key = keys(e.reshape(-1))
    assert key[mask].min() >= (key[~mask].max() if (~mask).any() else -np.inf)
    np.testing.assert_array_equal(as_np(values), e.reshape(-1)[idx])
    return mask.reshape(e.shape)


def run_topk(a0, k, impl, with_grad=False, zero_sent=False):
    a = a0.clone()
    grad = make(a0.shape, a0.dtype, seed=11) if with_grad else None
    expect = (a0 + grad) if with_grad else a0.clone()
    values, flat = K.topk_select(a, k, grad=grad, zero_sent=zero_sent)
    e = as_np(expect)
    mask = check_flat(e, k, values, flat)
    np.testing.assert_array_equal(as_np(a), np.where(mask, 0.0, e) if zero_sent else e)
    if impl == "native":
        np.testing.assert_array_equal(mask, ref.topk_mask(keys(e), ratio_for(k, e.size)))
    return mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,k", [((1000, 300), 300), ((1000, 300), 1), ((7, 9), 63), ((50, 50), 2000),
                                     ((100001,), 17)])
def test_topk_matches_reference(impl, dtype, shape, k):
    a0 = make(shape, dtype, seed=k)
    mask = run_topk(a0, k, impl, with_grad=True, zero_sent=True)
    e = as_np(a0 + make(shape, dtype, seed=11))
    if len(np.unique(keys(e))) == e.size:
        np.testing.assert_array_equal(mask, ref.topk_mask(e, ratio_for(k, e.size)))


@pytest.mark.parametrize("kind", ["ints", "equal"])
def test_topk_ties(impl, kind):
    run_topk(make((300, 1000), torch.float32, kind=kind, seed=4), 1000, impl, zero_sent=True)


def test_topk_adversarial_layouts(impl):
    """Large entries packed where a strided sample cannot see them, or sorted data: still exact."""
    n = 1 << 18
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[1000:1500] = torch.linspace(5, 6, 500)  # 500 large ones in one place
    run_topk(x, 600, impl)
    run_topk(torch.linspace(-1, 1, n, dtype=torch.float64), 3000, impl)
    run_topk(make((n,), torch.float32, seed=2, special=0.001), 100, impl)


# --- thresholds ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_select_and_count(impl, dtype):
    a = make((333, 517), dtype, seed=8, special=0.001)
    e = as_np(a)
    for t in (0.0, 0.1, 1.7, 2.5, 1e6, -1.0, float("inf"), float("nan")):
        expect = ref.threshold_mask(e, t)  # float64 data: exact comparison
        values, flat = K.threshold_select(a, t)
        assert flat.dtype == torch.int64 and (np.diff(flat.numpy()) > 0).all()
        np.testing.assert_array_equal(flat.numpy(), np.flatnonzero(expect))
        np.testing.assert_array_equal(as_np(values), e.reshape(-1)[flat.numpy()])
        assert K.count_at_least(a, t) == int(expect.sum())


def test_threshold_exact_between_representable_values(impl):
    """t between two fp16 values: |x| >= t is decided exactly, not after rounding t to fp16."""
    a = torch.tensor([0.0999755859375, 0.10003662109375, -0.1], dtype=torch.float16)
    _, flat = K.threshold_select(a, 0.1)
    assert flat.tolist() == [1]
    assert K.count_at_least(a, 0.1) == 1
    assert K.count_at_least(a, float(a[0])) == 3


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fiber_threshold_select(impl, axis, dtype):
    rows, cols = 123, 77
    a = make((rows, cols), dtype, seed=12, special=0.002)
    e = as_np(a)
    nf = rows if axis == 1 else cols
    thr = torch.linspace(0.0, 3.0, nf, dtype=torch.float64)
    thr[0] = float("nan")
    t = thr.numpy().reshape(-1, 1) if axis == 1 else thr.numpy().reshape(1, -1)
    expect = (np.abs(e) >= t) | ~np.isfinite(e)
    values, flat = K.fiber_threshold_select(a, rows, cols, axis, thr)
    np.testing.assert_array_equal(flat.numpy(), np.flatnonzero(expect))
    np.testing.assert_array_equal(as_np(values), e.reshape(-1)[flat.numpy()])


# --- native vs fallback -------------------------------------------------------------------------------------------


def test_native_and_fallback_select_the_same(monkeypatch):
    if not K.native_available():
        pytest.skip(NATIVE_SKIP)
    a0 = make((700, 1500), torch.float64, seed=21)  # continuous data: no ties, unique answers
    thr = torch.rand(700, dtype=torch.float64) * 2
    out = {}
    for env in ("1", "0"):
        monkeypatch.setenv("HOROVOD_ADTOPK_NATIVE", env)
        out[env] = [K.adtopk_select(a0.clone(), 700, 1500, 1, 15), K.adtopk_select(a0.clone(), 700, 1500, 0, 7),
                    K.topk_select(a0.clone(), 1000), K.threshold_select(a0, 2.0),
                    K.fiber_threshold_select(a0, 700, 1500, 1, thr), K.count_at_least(a0, 1.5)]
    for nat, fb in zip(out["1"], out["0"]):
        if isinstance(nat, int):
            assert nat == fb
        else:
            assert torch.equal(nat[0], fb[0]) and torch.equal(nat[1], fb[1])


# --- argument checks -----------------------------------------------------------------------------------------------


def test_non_contiguous_rejected():
    a = torch.randn(40, 30).t()
    with pytest.raises(ValueError, match="contiguous"):
        K.adtopk_select(a, 30, 40, 1, 3)
    with pytest.raises(ValueError, match="contiguous"):
        K.topk_select(a, 3)
    with pytest.raises(ValueError, match="contiguous"):
        K.threshold_select(a, 0.5)
    with pytest.raises(ValueError, match="contiguous"):
        K.count_at_least(a, 0.5)
    with pytest.raises(ValueError, match="contiguous"):
        K.fiber_threshold_select(a, 30, 40, 1, torch.zeros(30, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad must be contiguous"):
        K.adtopk_select(torch.randn(30, 40), 30, 40, 1, 3, grad=a)


def test_bad_arguments_rejected():
    a = torch.randn(4, 5)
    with pytest.raises(ValueError, match="rows \\* cols"):
        K.adtopk_select(a, 5, 5, 1, 1)
    with pytest.raises(ValueError, match="axis"):
        K.adtopk_select(a, 4, 5, 2, 1)
    with pytest.raises(ValueError, match="k must be"):
        K.adtopk_select(a, 4, 5, 1, 6)
    with pytest.raises(ValueError, match="k must be"):
        K.topk_select(a, 0)
    with pytest.raises(ValueError, match="float16"):
        K.topk_select(torch.ones(4, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="grad must match"):
        K.adtopk_select(a, 4, 5, 1, 1, grad=torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="one entry per fiber"):
        K.fiber_threshold_select(a, 4, 5, 0, torch.zeros(4, dtype=torch.float64))


# --- fuzz -------------------------------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    axis = draw(st.sampled_from([0, 1]))
    long = draw(st.integers(1, 6000))
    short = draw(st.integers(1, 40))
    rows, cols = (short, long) if draw(st.booleans()) else (long, short)
    n = cols if axis == 1 else rows
    k = draw(st.one_of(st.integers(1, max(1, n // 100)), st.integers(1, n)))
    kind = draw(st.sampled_from(["normal", "normal", "ints", "equal"]))
    special = draw(st.sampled_from([0.0, 0.0, 0.001, 0.05]))
    seed = draw(st.integers(0, 2**16))
    return dtype, axis, rows, cols, k, kind, special, seed, draw(st.booleans()), draw(st.booleans())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_fuzz_adtopk_and_topk(impl, case):
    dtype, axis, rows, cols, k, kind, special, seed, with_grad, zero_sent = case
    a0 = make((rows, cols), dtype, kind=kind, seed=seed, special=special)
    run_adtopk(a0, rows, cols, axis, k, impl, with_grad=with_grad, zero_sent=zero_sent, seed=seed + 1)
    kg = max(1, min(rows * cols, int(math.ceil(k * (rows * cols) / (cols if axis == 1 else rows)))))
    run_topk(a0, kg, impl, with_grad=with_grad, zero_sent=zero_sent)


# --- SIMD paths and threads -----------------------------------------------------------------------------------------


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _bits(x: torch.Tensor) -> np.ndarray:
    """The raw bits (so NaN payloads and signed zeros count)."""
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.contiguous().view(view).numpy().copy()


def _select_all(dtype):
    """Fused add + ADTopk (rows, columns; full and partial tiles) and global top-k on data with NaN, Inf and
    ties; returns the raw bits of every output and of the updated tensors, and the masks."""
    out, masks = [], []
    for rows, cols, axis, k in [(300, 2048, 1, 20), (37, 3000, 1, 7), (2051, 40, 0, 5), (1000, 64, 0, 3),
                                (17, 130, 1, 1)]:
        a = make((rows, cols), dtype, seed=rows + cols)
        g = make((rows, cols), dtype, seed=3)
        a.view(-1)[::97] = float("nan")
        g.view(-1)[::89] = float("inf")
        a.view(-1)[5::50] = 1.0  # ties
        expect = a + g
        values, local = K.adtopk_select(a, rows, cols, axis, k, grad=g, zero_sent=True)
        out += [_bits(a), _bits(values), local.numpy().copy()]
        masks.append((as_np(expect), axis, k, local))
    a = make((5000, 33), dtype, seed=9)
    g = make((5000, 33), dtype, seed=10)
    values, flat = K.topk_select(a, 1500, grad=g, zero_sent=True)
    return out + [_bits(a), _bits(values), flat.numpy().copy()], masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_simd_scalar_and_threads_give_identical_bits(monkeypatch, dtype):
    """AVX2 vs HOROVOD_ADTOPK_SIMD=0, 1 vs 2 threads: bit-identical, and the reference's selection."""
    if not K.native_available():
        pytest.skip(NATIVE_SKIP)
    from horovod_adtopk import _C
    monkeypatch.setenv("HOROVOD_ADTOPK_NATIVE", "1")
    has_avx2 = {"avx2", "f16c"} <= _cpu_flags()
    threads = torch.get_num_threads()
    runs = {}
    try:
        for simd in ("1", "0"):
            monkeypatch.setenv("HOROVOD_ADTOPK_SIMD", simd)
            assert _C.simd_path() == ("avx2" if simd == "1" and has_avx2 else "scalar")
            for nt in (1, 2):
                torch.set_num_threads(nt)
                runs[(simd, nt)] = _select_all(dtype)
    finally:
        torch.set_num_threads(threads)
    base, masks = runs[("0", 1)]
    for key, (out, _) in runs.items():
        for x, y in zip(out, base):
            np.testing.assert_array_equal(x, y, err_msg=f"SIMD={key[0]} threads={key[1]} differs from scalar, 1 thread")
    for e, axis, k, local in masks:
        want = ref.adtopk_mask(e, ratio_for(k, e.shape[1] if axis == 1 else e.shape[0]), axis)
        got = np.zeros(e.shape, dtype=bool)
        rows_idx = np.repeat(np.arange(local.shape[0]), k)
        if axis == 1:
            got[rows_idx, local.numpy().reshape(-1)] = True
        else:
            got[local.numpy().reshape(-1), rows_idx] = True
        np.testing.assert_array_equal(got, want)


# (rows, cols, axis, k) that take each path of the native selection: column slabs with block-maxima
# thresholds (a width that is not a multiple of 8 too); column slabs and rows with thresholds from a sample of
# the keys (k too large a share of the fiber for block maxima); the tiled column walk (sampling would keep
# half the fiber).
PATH_CASES = [(3072, 40, 0, 30), (2051, 70, 0, 5), (1000, 33, 0, 50), (4096, 20, 0, 300), (20, 3072, 1, 153),
              (33, 1000, 1, 60), (300, 50, 0, 100)]


def _defeat_sample(shape, axis, dtype, seed):
    """Tiny keys except at the positions the native kernel samples (q * n // S, S = min(256, n // 4)): the
    sample's threshold is then reached by fewer than k entries, which must send the fiber to an exact
    selection among all of its entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(shape, generator=g, dtype=torch.float64) * 0.01
    n = shape[0] if axis == 0 else shape[1]
    s = min(256, n // 4)
    for q in range(s):
        if axis == 0:
            x[(q * n) // s, :] = 100.0 + q
        else:
            x[:, (q * n) // s] = 100.0 + q
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_selection_paths_identical_to_legacy_and_reference(monkeypatch, dtype):
    """Slab passes and sampled thresholds vs HOROVOD_ADTOPK_LEGACY_SELECT=1 (the tiled walk, every entry a
    candidate), AVX2 or not, 1 or 2 threads: bit-identical outputs and residuals, and the reference's mask."""
    if not K.native_available():
        pytest.skip(NATIVE_SKIP)
    monkeypatch.setenv("HOROVOD_ADTOPK_NATIVE", "1")
    threads = torch.get_num_threads()
    try:
        for i, (rows, cols, axis, k) in enumerate(PATH_CASES):
            n = rows if axis == 0 else cols
            for kind in ("normal", "special", "defeat"):
                a0 = (_defeat_sample((rows, cols), axis, dtype, i) if kind == "defeat"
                      else make((rows, cols), dtype, seed=i, special=0.01 if kind == "special" else 0.0))
                g = None if kind == "defeat" else make((rows, cols), dtype, seed=100 + i)
                expect = as_np(a0 if g is None else a0 + g)
                want = ref.adtopk_mask(expect, ratio_for(k, n), axis)
                runs = {}
                for legacy, simd, nt in [("1", "0", 1), ("0", "0", 1), ("0", "1", 1), ("0", "1", 2), ("1", "1", 2)]:
                    monkeypatch.setenv("HOROVOD_ADTOPK_LEGACY_SELECT", legacy)
                    monkeypatch.setenv("HOROVOD_ADTOPK_SIMD", simd)
                    torch.set_num_threads(nt)
                    a = a0.clone()
                    values, local = K.adtopk_select(a, rows, cols, axis, k, grad=g, zero_sent=True)
                    runs[(legacy, simd, nt)] = [_bits(a), _bits(values), local.numpy().copy()]
                    got = np.zeros((rows, cols), dtype=bool)
                    fib = np.repeat(np.arange(local.shape[0]), k)
                    if axis == 1:
                        got[fib, local.numpy().reshape(-1)] = True
                    else:
                        got[local.numpy().reshape(-1), fib] = True
                    np.testing.assert_array_equal(got, want, err_msg=f"{(rows, cols, axis, k, kind)} legacy={legacy} "
                                                                     f"simd={simd} threads={nt}: not the reference's")
                base = runs[("1", "0", 1)]
                for key, out in runs.items():
                    for x, y in zip(out, base):
                        np.testing.assert_array_equal(x, y, err_msg=f"{(rows, cols, axis, k, kind)} {key} differs "
                                                                    "from the legacy scalar path")
    finally:
        torch.set_num_threads(threads)


# --- hints: thresholds carried from step to step ------------------------------------------------------------------

# (rows, cols, axis, k): rows with block-maxima thresholds (k a small share), with sampled thresholds (k a
# large share), k == 1, rows short enough that every entry is a candidate (768-long rows as in BERT and GPT-2);
# column slabs with block maxima and with sampled thresholds, and the tiled walk of short columns (which
# leaves the hint as it is).
HINT_CASES = [(64, 768, 1, 7), (40, 768, 1, 38), (50, 1000, 1, 1), (30, 40, 1, 9), (17, 300, 1, 300),
              (768, 20, 0, 7), (300, 24, 0, 60), (40, 30, 0, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_hint_gives_the_same_selection_step_after_step(impl, monkeypatch, dtype):
    """Error feedback over many steps with a hint carried along (the optimizer's use), against the same steps
    without one and against the numpy reference each step: identical values, positions and residuals, bit for
    bit. The gradient scale falls and rises so that, on the native kernel, some fibers reach their hint with k
    or more entries (the hinted pass decides) and some with fewer (the usual selection takes over); the test
    checks that both happened, on rows and on column slabs. Ties, NaN and +-Inf ride along. The torch fallback
    and the tiled walk of short columns leave the hint as it is."""
    threads = torch.get_num_threads()
    both = {(axis, what): 0 for axis in (0, 1) for what in ("hinted", "fallback")}
    try:
        for i, (rows, cols, axis, k) in enumerate(HINT_CASES):
            nf, n = (rows, cols) if axis == 1 else (cols, rows)
            for nt in (1, 2):
                torch.set_num_threads(nt)
                r_plain = torch.zeros(rows * cols, dtype=dtype)
                r_hint = r_plain.clone()
                hint = K.new_hint(nf)
                for step in range(14):
                    scale = [1.0, 1.0, 1.0, 0.05, 0.05, 1.0, 8.0, 1.0, 1.0, 0.3, 1.0, 1.0, 0.01, 1.0][step]
                    kind = "ints" if step == 8 else "normal"
                    g = (make((rows * cols,), torch.float64, kind=kind, seed=1000 * i + step,
                              special=0.002 if step == 10 else 0.0) * scale).to(dtype)
                    acc = as_np(r_plain + g).reshape(rows, cols)
                    if impl == "native" and step > 0:
                        fib = keys(acc if axis == 1 else acc.T)
                        reach = (fib >= hint.numpy()[:, None]).sum(axis=1)
                        live = hint.numpy() > 0
                        both[(axis, "hinted")] += int(((reach >= k) & live).sum())
                        both[(axis, "fallback")] += int(((reach < k) & live).sum())
                    v1, l1 = K.adtopk_select(r_plain, rows, cols, axis, k, grad=g, zero_sent=True)
                    v2, l2 = K.adtopk_select(r_hint, rows, cols, axis, k, grad=g, zero_sent=True, hint=hint)
                    where = f"{(rows, cols, axis, k)} {dtype} step {step} threads {nt}"
                    assert torch.equal(l1, l2), where
                    np.testing.assert_array_equal(_bits(v1), _bits(v2), err_msg=where)
                    np.testing.assert_array_equal(_bits(r_plain), _bits(r_hint), err_msg=where)
                    mask = check_fibers(acc, axis, k, v2, l2)
                    if impl == "native":
                        np.testing.assert_array_equal(mask, ref.adtopk_mask(acc, ratio_for(k, n), axis), err_msg=where)
                    np.testing.assert_array_equal(as_np(r_hint).reshape(rows, cols), np.where(mask, 0.0, acc),
                                                  err_msg=where)
                if impl == "torch" or (rows, cols) == (40, 30):
                    assert not hint.any(), "the fallback and the tiled walk must leave the hint alone"
                else:
                    assert hint.any(), where
    finally:
        torch.set_num_threads(threads)
    if impl == "native":
        assert all(v > 0 for v in both.values()), both


# Candidate counts around the boundaries of the final ranking (with AVX2: ranks by counting up to 23
# candidates, a bitwise search for the k-th key from 24 to 4,096, nth_element above; the scalar code counts up
# to 64), with k at, just below and far below the count.
CANDIDATE_CASES = [(c, k) for c in (23, 24, 25, 64, 65, 300, 4096, 4097) for k in (1, 7, c // 2, c - 1, c)]


def _candidates_row(n, c, seed, dtype):
    """A fiber of n keys of which exactly c reach 1.0 (the hint): they are 1, 2 or 3, some +-Inf or NaN, with
    signs mixed, so the k-th key is tied many times over; the others lie in (0, 0.5)."""
    gen = np.random.default_rng(seed)
    x = gen.uniform(0.0, 0.5, n) * gen.choice([-1.0, 1.0], n)
    pos = gen.choice(n, c, replace=False)
    x[pos] = gen.integers(1, 4, c) * gen.choice([-1.0, 1.0], c)
    special = pos[gen.random(c) < 0.05]
    x[special] = gen.choice([np.inf, -np.inf, np.nan], len(special))
    return torch.from_numpy(x).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [1, 0])
def test_final_ranking_at_every_candidate_count(monkeypatch, dtype, axis):
    """The hinted pass hands the final ranking exactly c candidates (the entries reaching the hint) with the
    k-th key tied many times: the selection is the reference's (ties to the lower index) and AVX2 gives the
    same bits as the scalar code, for c on both sides of every switch between ranking methods."""
    if not K.native_available():
        pytest.skip(NATIVE_SKIP)
    monkeypatch.setenv("HOROVOD_ADTOPK_NATIVE", "1")
    n, nf = 5000, 3
    for i, (c, k) in enumerate(CANDIDATE_CASES):
        fibers = torch.stack([_candidates_row(n, c, 100 * i + f, dtype) for f in range(nf)])
        m = fibers if axis == 1 else fibers.T.contiguous()
        rows, cols = m.shape
        want = ref.adtopk_mask(as_np(m), ratio_for(k, n), axis)
        runs = []
        for simd in ("1", "0"):
            monkeypatch.setenv("HOROVOD_ADTOPK_SIMD", simd)
            a, hint = m.clone(), torch.ones(nf, dtype=torch.float64)
            values, local = K.adtopk_select(a, rows, cols, axis, k, zero_sent=True, hint=hint)
            where = f"c={c} k={k} axis={axis} {dtype} simd={simd}"
            mask = check_fibers(as_np(m), axis, k, values, local)
            np.testing.assert_array_equal(mask, want, err_msg=where)
            np.testing.assert_array_equal(as_np(a), np.where(mask, 0.0, as_np(m)), err_msg=where)
            runs.append([_bits(values), local.numpy().copy(), hint.numpy().copy()])
        for x, y in zip(*runs):
            np.testing.assert_array_equal(x, y, err_msg=f"c={c} k={k} axis={axis} {dtype}: AVX2 differs from scalar")


def test_bad_hint_rejected():
    a = torch.randn(4, 5)
    for bad, why in [(torch.zeros(4), "float32"), (torch.zeros(5, dtype=torch.float64), "5 entries"),
                     (torch.zeros(8, dtype=torch.float64)[::2], "not contiguous"), ([0.0] * 4, "a list")]:
        with pytest.raises(ValueError, match="kernels.new_hint\\(4\\)"):
            K.adtopk_select(a, 4, 5, 1, 2, hint=bad)
    with pytest.raises(ValueError, match="one entry per fiber \\(5\\)"):
        K.adtopk_select(a, 4, 5, 0, 2, hint=K.new_hint(4))


def test_cuda_select_setting_is_checked(monkeypatch):
    """HOROVOD_ADTOPK_CUDA_SELECT: a value that is not auto / triton / torch is an error that lists them."""
    monkeypatch.setenv("HOROVOD_ADTOPK_CUDA_SELECT", "fast")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        K._cuda_choice()
    for choice in ("auto", " Torch ", ""):
        monkeypatch.setenv("HOROVOD_ADTOPK_CUDA_SELECT", choice)
        assert K._cuda_choice() == (choice.strip().lower() or "auto")
