"""Triton selection kernels (horovod_adtopk.triton_kernels) against the numpy reference.

On a CUDA machine the kernels run compiled on CUDA tensors; elsewhere they run on CPU tensors under the
Triton interpreter (TRITON_INTERPRET=1, set here before Triton is imported). The interpreter is slow, so
shapes are small; the streaming (multi-pass) paths are reached on small fibers by lowering the module's
``ONE_PASS_MAX`` and ``FLAT_BLOCK`` knobs.
"""
import importlib
import math
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

pytest.importorskip("triton", reason="Triton is not installed; the Triton kernels are tested only where it is")

from horovod_adtopk import triton_kernels as tk  # noqa: E402

from .reference import adtopk_mask, threshold_mask, topk_mask  # noqa: E402

if not CUDA and not tk.interpreted():
    # Imported earlier in this process without the interpreter (e.g. by another test module): rebuild.
    tk = importlib.reload(tk)

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _np(x: torch.Tensor) -> np.ndarray:
    """Exact float64 copy of a tensor (bf16 has no numpy dtype)."""
    return x.detach().to("cpu", torch.float64).numpy()


def _mag(x: np.ndarray) -> np.ndarray:
    m = np.abs(x)
    return np.where(np.isnan(m), np.inf, m)


def _randn(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (and -0 vs +0 ignored)."""
    xs, ys = _np(x), _np(y)
    return bool(np.all((xs == ys) | (np.isnan(xs) & np.isnan(ys))))


def _ratio(k: int, n: int) -> float:
    return (k + 0.5) / n  # floor(ratio * n) == k for the reference


def _check_fibers(a_cpu: torch.Tensor, rows, cols, axis, k, values, local):
    """Exact k per fiber, ascending positions, values at the positions, a valid top-k set, and the same
    set as the reference (ties go to the lower position in both)."""
    n_fibers, L = (rows, cols) if axis == 1 else (cols, rows)
    assert values.shape == (n_fibers, k) and local.shape == (n_fibers, k)
    assert local.dtype == torch.int64 and values.dtype == a_cpu.dtype
    local = local.cpu()
    m = a_cpu.reshape(rows, cols)
    fibers = m if axis == 1 else m.t()
    assert bool((local >= 0).all() and (local < L).all())
    if k > 1:
        assert bool((local[:, 1:] > local[:, :-1]).all()), "positions must be strictly ascending"
    assert _same_bits(values.cpu(), torch.gather(fibers, 1, local))
    mask = np.zeros((n_fibers, L), dtype=bool)
    np.put_along_axis(mask, local.numpy(), True, axis=1)
    mag = _mag(_np(fibers))
    for f in range(n_fibers):
        if k < L:
            assert mag[f][mask[f]].min() >= mag[f][~mask[f]].max()
    ref = adtopk_mask(_np(m), _ratio(k, L), axis)
    got = mask if axis == 1 else mask.T
    assert np.array_equal(got, ref)


# (rows, cols, axis, k): short fibers (shorter than a block), k == 1, k == fiber_len, one fiber, columns.
CASES = [(4, 37, 1, 5), (37, 4, 0, 5), (3, 5, 1, 1), (3, 5, 1, 5), (6, 3, 0, 3), (1, 50, 1, 7), (50, 1, 0, 50),
         (9, 20, 0, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_adtopk_matches_reference(dtype, case):
    rows, cols, axis, k = case
    a = _randn((rows, cols), dtype, seed=rows * 1000 + cols).to(DEVICE)
    before = a.clone()
    values, local = tk.adtopk_select(a, rows, cols, axis, k)
    assert torch.equal(a, before), "a must not change without grad / zero_sent"
    _check_fibers(before.cpu(), rows, cols, axis, k, values, local)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("axis", [0, 1, "0-transposed"])
def test_adtopk_streamed_fibers(monkeypatch, dtype, axis):
    """Fibers longer than one tile: several passes over memory, in chunks (and a partial last chunk).
    Long columns go through the strided column kernel, or a transposed copy when there are few of them."""
    monkeypatch.setattr(tk, "ONE_PASS_MAX", 16)
    monkeypatch.setattr(tk, "COLUMN_MIN_PROGRAMS", 1000 if axis == "0-transposed" else 0)
    axis = 0 if axis == "0-transposed" else axis
    rows, cols = (3, 70) if axis == 1 else (70, 3)
    for k in (1, 9, 70):
        a = _randn((rows, cols), dtype, seed=k).to(DEVICE)
        values, local = tk.adtopk_select(a, rows, cols, axis, k)
        _check_fibers(a.cpu(), rows, cols, axis, k, values, local)


def test_adtopk_long_row_default_config():
    """A row longer than ONE_PASS_MAX with the production block sizes."""
    rows, cols, k = 2, tk.ONE_PASS_MAX + 300, 41
    a = _randn((rows, cols), torch.float32, seed=7).to(DEVICE)
    values, local = tk.adtopk_select(a, rows, cols, 1, k)
    _check_fibers(a.cpu(), rows, cols, 1, k, values, local)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_adtopk_ties_and_nonfinite(monkeypatch, stream, axis):
    if stream:
        monkeypatch.setattr(tk, "ONE_PASS_MAX", 8)
        monkeypatch.setattr(tk, "COLUMN_MIN_PROGRAMS", 0)
    g = torch.Generator().manual_seed(3)
    rows, cols = (5, 24) if axis == 1 else (24, 5)
    a = torch.randint(-2, 3, (rows, cols), generator=g).to(torch.float32)  # many ties, zeros
    a[1, 3] = float("nan")
    a[2, 0] = float("inf")
    a[2, 2] = float("-inf")
    a[0, 1] = float("nan")
    a[0, 4] = float("-inf")
    a = a.to(DEVICE)
    for k in (1, 2, 3, 7):
        values, local = tk.adtopk_select(a, rows, cols, axis, k)
        _check_fibers(a.cpu(), rows, cols, axis, k, values, local)
    # Deterministic: the same input gives the same output.
    v1, l1 = tk.adtopk_select(a, rows, cols, axis, 7)
    v2, l2 = tk.adtopk_select(a, rows, cols, axis, 7)
    assert torch.equal(l1, l2) and _same_bits(v1, v2)



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_adtopk_early_exit_same_as_all_rounds(monkeypatch, dtype, stream, axis):
    """Stopping a program's radix rounds once every fiber has exactly k keys at its prefix selects what all
    rounds select, bit for bit, also when only some fibers of a program get there (ties keep the rest going)
    and with the fused grad add and zeroing."""
    if stream:
        monkeypatch.setattr(tk, "ONE_PASS_MAX", 8)
        monkeypatch.setattr(tk, "COLUMN_MIN_PROGRAMS", 0)
    n_fibers, L = 6, 40
    g = torch.Generator().manual_seed(11)
    fib = torch.randn(n_fibers, L, generator=g)
    fib[1] = torch.randint(-2, 3, (L,), generator=g).float()  # ties: this fiber runs every round
    fib[4, :5] = 7.0  # five equal largest keys
    rows, cols = (n_fibers, L) if axis == 1 else (L, n_fibers)
    base = (fib if axis == 1 else fib.t().contiguous()).to(dtype)
    grad = (torch.randn(rows, cols, generator=g) * 0.1).to(dtype)
    for k in (1, 3, 5, 12):
        out = {}
        for early in (False, True):
            monkeypatch.setattr(tk, "EARLY_EXIT", early)
            a = base.clone().to(DEVICE)
            values, local = tk.adtopk_select(a, rows, cols, axis, k, grad=grad.to(DEVICE), zero_sent=True)
            out[early] = (values.cpu(), local.cpu(), a.cpu())
        assert torch.equal(out[True][1], out[False][1])
        assert _same_bits(out[True][0], out[False][0]) and _same_bits(out[True][2], out[False][2])
        summed = base + grad  # torch rounds the sum once, as the fused add does
        _check_fibers(summed, rows, cols, axis, k, out[True][0], out[True][1])

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_adtopk_fused_grad_and_zero_sent(monkeypatch, dtype, stream, axis):
    if stream:
        monkeypatch.setattr(tk, "ONE_PASS_MAX", 8)
        monkeypatch.setattr(tk, "COLUMN_MIN_PROGRAMS", 0 if dtype != torch.float16 else 1000)
    rows, cols, k = 6, 21, 4
    res = _randn((rows, cols), dtype, seed=11).to(DEVICE)
    grad = _randn((rows, cols), dtype, seed=12).to(DEVICE)
    expected = res + grad  # torch's own add, in the tensor's dtype
    for zero_sent in (False, True):
        a = res.clone()
        values, local = tk.adtopk_select(a, rows, cols, axis, k, grad=grad, zero_sent=zero_sent)
        _check_fibers(expected.cpu(), rows, cols, axis, k, values, local)
        sent = torch.zeros(rows, cols, dtype=torch.bool)
        view = sent if axis == 1 else sent.t()
        view.scatter_(1, local.cpu(), True)
        if zero_sent:
            assert bool((a.cpu()[sent] == 0).all())
            assert torch.equal(a.cpu()[~sent], expected.cpu()[~sent])
        else:
            assert torch.equal(a, expected)


def _flat_check(a_cpu, k, values, flat):
    n = a_cpu.numel()
    assert values.shape == (k,) and flat.shape == (k,) and flat.dtype == torch.int64
    flat = flat.cpu()
    if k > 1:
        assert bool((flat[1:] > flat[:-1]).all())
    assert _same_bits(values.cpu(), a_cpu.reshape(-1)[flat])
    mask = np.zeros(n, dtype=bool)
    mask[flat.numpy()] = True
    mag = _mag(_np(a_cpu).reshape(-1))
    if k < n:
        assert mag[mask].min() >= mag[~mask].max()
    m = _np(a_cpu)
    if np.isnan(m).any():  # reference.topk_mask ranks NaN last; the rule is NaN ties with +-Inf, lower index first
        want = np.zeros(n, dtype=bool)
        want[np.argsort(-_mag(m).reshape(-1), kind="stable")[:k]] = True
    else:
        want = topk_mask(m, _ratio(k, n)).reshape(-1)
    assert np.array_equal(mask, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_select(monkeypatch, dtype):
    monkeypatch.setattr(tk, "FLAT_BLOCK", 64)  # several blocks: offsets cross block boundaries
    a = _randn((5, 31), dtype, seed=5).to(DEVICE)
    for k in (1, 70, a.numel()):
        values, flat = tk.topk_select(a, k)
        _flat_check(a.cpu(), k, values, flat)


def test_topk_select_ties_across_blocks(monkeypatch):
    """The tied entries at the threshold span several blocks; the lowest-indexed ones are taken."""
    monkeypatch.setattr(tk, "FLAT_BLOCK", 32)
    g = torch.Generator().manual_seed(9)
    a = torch.randint(-3, 4, (8, 17), generator=g).to(torch.float16)
    a[4, 4] = float("nan")
    a[6, 1] = float("-inf")
    a = a.to(DEVICE)
    for k in (2, 30, 61):
        values, flat = tk.topk_select(a, k)
        _flat_check(a.cpu(), k, values, flat)
    v2, f2 = tk.topk_select(a, 61)
    assert torch.equal(flat, f2) and _same_bits(values, v2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_topk_select_grad_zero_sent(monkeypatch, dtype):
    monkeypatch.setattr(tk, "FLAT_BLOCK", 32)
    res = _randn((5, 40), dtype, seed=21).to(DEVICE)
    grad = _randn((5, 40), dtype, seed=22).to(DEVICE)
    expected = res + grad
    a = res.clone()
    values, flat = tk.topk_select(a, 13, grad=grad, zero_sent=True)
    _flat_check(expected.cpu(), 13, values, flat)
    sent = torch.zeros(a.numel(), dtype=torch.bool)
    sent[flat.cpu()] = True
    assert bool((a.cpu().reshape(-1)[sent] == 0).all())
    assert torch.equal(a.cpu().reshape(-1)[~sent], expected.cpu().reshape(-1)[~sent])
    a = res.clone()
    tk.topk_select(a, 13, grad=grad)
    assert torch.equal(a, expected)


def _with_nonfinite(dtype, seed, shape=(6, 25)):
    a = _randn(shape, dtype, seed)
    a.view(-1)[[3, 40, 77]] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    return a.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_threshold_select(monkeypatch, dtype):
    monkeypatch.setattr(tk, "FLAT_BLOCK", 32)
    a = _with_nonfinite(dtype, seed=31)
    for t in (0.0, 0.5, 1.25, 1e30 if dtype != torch.float16 else 60000.0):  # thresholds exact in every dtype
        values, flat = tk.threshold_select(a, t)
        want = np.flatnonzero(threshold_mask(_np(a), t))
        assert np.array_equal(flat.cpu().numpy(), want)
        assert _same_bits(values.cpu(), a.cpu().reshape(-1)[flat.cpu()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("axis", [0, 1])
def test_fiber_threshold_select(monkeypatch, dtype, axis):
    monkeypatch.setattr(tk, "FLAT_BLOCK", 32)
    rows, cols = 6, 25
    a = _with_nonfinite(dtype, seed=41, shape=(rows, cols))
    n_fibers = rows if axis == 1 else cols
    thr = torch.tensor([(0.25, 0.5, 1.0, 1.5, 3.0)[i % 5] for i in range(n_fibers)], dtype=torch.float64)
    values, flat = tk.fiber_threshold_select(a, rows, cols, axis, thr.to(DEVICE))
    t_full = thr.numpy()[:, None] if axis == 1 else thr.numpy()[None, :]
    m = _np(a)
    want = np.flatnonzero(((np.abs(m) >= t_full) | ~np.isfinite(m)).reshape(-1))
    assert np.array_equal(flat.cpu().numpy(), want)
    assert _same_bits(values.cpu(), a.cpu().reshape(-1)[flat.cpu()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_count_at_least(monkeypatch, dtype):
    monkeypatch.setattr(tk, "FLAT_BLOCK", 32)
    a = _with_nonfinite(dtype, seed=51)
    m = _np(a)
    for t in (0.0, 0.5, 2.0, math.inf):
        with np.errstate(invalid="ignore"):
            want = int((np.abs(m) >= t).sum())  # NaN never counts, +-Inf counts
        assert tk.count_at_least(a, t) == want


def test_empty_and_errors():
    assert tk.available()
    a = _randn((4, 6), torch.float32, seed=1).to(DEVICE)
    with pytest.raises(ValueError):
        tk.adtopk_select(a, 4, 6, 1, 7)  # k > fiber_len
    with pytest.raises(ValueError):
        tk.adtopk_select(a, 4, 6, 1, 0)
    with pytest.raises(ValueError):
        tk.adtopk_select(a.t(), 6, 4, 1, 2)  # not contiguous
    with pytest.raises(TypeError):
        tk.topk_select(a.to(torch.int32), 1)
    with pytest.raises(ValueError):
        tk.fiber_threshold_select(a, 4, 6, 1, torch.ones(5, dtype=torch.float64))
    values, flat = tk.threshold_select(torch.zeros(0, device=DEVICE), 1.0)
    assert values.numel() == 0 and flat.numel() == 0
    assert tk.count_at_least(torch.zeros(0, device=DEVICE), 1.0) == 0


def test_clear_error_without_triton(monkeypatch):
    monkeypatch.setattr(tk, "triton", None)
    assert not tk.available()
    with pytest.raises(RuntimeError, match="Triton"):
        tk.adtopk_select(torch.ones(2, 2), 2, 2, 1, 1)


@pytest.mark.skipif(not CUDA, reason="the dispatch rule is for CUDA tensors (the CPU has its native kernel)")
@pytest.mark.parametrize("choice", ["auto", "triton", "torch"])
def test_cuda_dispatch_rule(monkeypatch, choice):
    """kernels.* on CUDA: Triton for fibers up to CUDA_TRITON_MAX_FIBER, torch.topk beyond and for global
    top-k (auto), or what HOROVOD_ADTOPK_CUDA_SELECT names; the result the reference's either way."""
    from horovod_adtopk import kernels as K

    monkeypatch.setenv("HOROVOD_ADTOPK_CUDA_SELECT", choice)
    n_long = K.CUDA_TRITON_MAX_FIBER + 1
    short = _randn((4, 600), torch.float32, seed=31).to(DEVICE)
    long = _randn((2, n_long), torch.float32, seed=32).to(DEVICE)
    fast = {"auto": "triton", "triton": "triton", "torch": "torch"}[choice]
    slow = {"auto": "torch", "triton": "triton", "torch": "torch"}[choice]
    assert K._select_impl(short, 600) == fast
    assert K._select_impl(long, n_long) == slow and K._select_impl(short, None) == slow
    for a, k in ((short, 6), (long, 163)):
        rows, cols = a.shape
        values, local = K.adtopk_select(a, rows, cols, 1, k)
        _check_fibers(a.cpu(), rows, cols, 1, k, values, local)
    values, flat = K.topk_select(long, 327)
    _flat_check(long.cpu(), 327, values, flat)
