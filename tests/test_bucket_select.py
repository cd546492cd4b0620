"""Whole-bucket ADTopk selection (horovod_adtopk.bucket_select) against the numpy reference and, bit for bit,
against the per-tensor path (triton_kernels.adtopk_select and kernels.adtopk_select).

As in tests/test_triton_kernels.py: on a CUDA machine the fused launches run compiled on CUDA tensors;
elsewhere on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is imported),
with small shapes, and the streamed (multi-pass) fibers reached by lowering ``ONE_PASS_MAX``.
"""
import importlib
import os

import numpy as np
import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any import of triton

from horovod_adtopk import bucket_select as bs  # noqa: E402
from horovod_adtopk import kernels  # noqa: E402

from .reference import adtopk_mask  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DEVICE = "cuda" if CUDA else "cpu"
_INT = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}

# A mixed bucket: row and column fibers, k = 1, k = fiber length, a single fiber, lengths not a power of two.
MIXED = [bs.FiberSpec(8, 20, 1, 3), bs.FiberSpec(12, 6, 0, 2), bs.FiberSpec(4, 33, 1, 33), bs.FiberSpec(5, 7, 0, 1),
         bs.FiberSpec(1, 40, 1, 1), bs.FiberSpec(9, 3, 0, 9)]


def _tk():
    tk = pytest.importorskip("horovod_adtopk.triton_kernels")
    if not tk.available():
        pytest.skip("Triton is not installed")
    if not CUDA and not tk.interpreted():
        tk = importlib.reload(tk)  # imported earlier in this process without the interpreter
    return tk


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().contiguous().view(_INT.get(x.dtype, x.dtype))


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal values, any NaN equal to any NaN (torch's own addition may give another NaN payload)."""
    xs, ys = _np(x), _np(y)
    return bool(np.all((xs == ys) | (np.isnan(xs) & np.isnan(ys))))


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def _offsets(specs, gap=0):
    offs, o = [], gap
    for s in specs:
        offs.append(o)
        o += s.numel + gap
    return offs, o


def _data(n, dtype, seed, ties=False, nonfinite=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct magnitudes: many ties at every fiber's k-th key
        x = (torch.randint(-3, 4, (n,), generator=g).to(torch.float32) * 0.5)
    else:
        x = torch.randn(n, generator=g)
    x = x.to(dtype)
    if nonfinite:
        pos = torch.randperm(n, generator=g)[:max(3, n // 25)]
        specials = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
        x[pos] = specials[torch.arange(pos.numel()) % 3]
    return x


def _check(specs, dtype, seed, impl="triton", ties=False, nonfinite=False, grad=True, zero=True, gap=0):
    a_off, n_a = _offsets(specs)
    g_off, n_g = _offsets(specs, gap)
    a = _data(n_a, dtype, seed, ties, nonfinite).to(DEVICE)
    g = _data(n_g, dtype, seed + 1, ties, False).to(DEVICE) if grad else None
    before = a.clone()
    p = bs.plan(specs, a_off, g_off, dtype=dtype, device=DEVICE, impl=impl)
    values, local = bs.select(a, p, g, zero_sent=zero)
    assert values.shape == (p.total,) and local.dtype == torch.int64
    per_tensor = before.clone()  # the per-tensor path through kernels.adtopk_select (native / torch / Triton)
    ref_a = before.clone()
    triton_a = before.clone() if impl == "triton" else None
    for i, (s, (v, l)) in enumerate(zip(specs, bs.split(p, values, local))):
        sa = slice(a_off[i], a_off[i] + s.numel)
        gi = None if g is None else g[g_off[i]:g_off[i] + s.numel]
        v2, l2 = kernels.adtopk_select(per_tensor[sa], s.rows, s.cols, s.axis, s.k, gi, zero)
        assert torch.equal(_bits(v), _bits(v2)) and torch.equal(l.cpu(), l2.cpu()), f"tensor {i}: not the per-tensor path"
        if triton_a is not None:
            v3, l3 = _tk().adtopk_select(triton_a[sa], s.rows, s.cols, s.axis, s.k, grad=gi, zero_sent=zero)
            assert torch.equal(_bits(v), _bits(v3)) and torch.equal(l.cpu(), l3.cpu()), f"tensor {i}: not Triton's"
        # numpy reference on a + g (added in the tensor's dtype, as the kernels do)
        full = ref_a[sa] if gi is None else (ref_a[sa] + gi)
        m = _np(full).reshape(s.rows, s.cols)
        mask = np.zeros((s.num_fibers, s.fiber_len), dtype=bool)
        np.put_along_axis(mask, l.cpu().numpy(), True, axis=1)
        ref = adtopk_mask(m, (s.k + 0.5) / s.fiber_len, s.axis)
        assert np.array_equal(mask if s.axis == 1 else mask.T, ref), f"tensor {i}: not the reference's set"
        if s.k > 1:
            assert bool((l[:, 1:] > l[:, :-1]).all())
        fibers = full.view(s.rows, s.cols) if s.axis == 1 else full.view(s.rows, s.cols).t()
        assert _same(v, torch.gather(fibers.cpu(), 1, l.cpu()))
        # the residual: a + g with the sent entries zeroed
        want = full.clone().view(s.rows, s.cols)
        if zero:
            if s.axis == 1:
                want.scatter_(1, l, 0)
            else:
                want.scatter_(0, l.t(), 0)
        assert _same(a[sa], want.view(-1))
    assert torch.equal(_bits(a), _bits(per_tensor))
    if triton_a is not None:
        assert torch.equal(_bits(a), _bits(triton_a))
    return p


@pytest.mark.parametrize("dtype", DTYPES)
def test_bucket_fused_matches_per_tensor_and_reference(dtype):
    _tk()
    p = _check(MIXED, dtype, seed=1, nonfinite=True)
    assert p.fused == list(range(len(MIXED))) and p.single == []
    assert 1 <= p.launches < len(MIXED)  # fewer launches than tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bucket_fused_ties_no_grad_no_zero(dtype):
    _tk()
    _check(MIXED, dtype, seed=3, ties=True, grad=False, zero=False)


def test_bucket_fused_separate_grad_offsets():
    """Gradients at other offsets than the residuals (e.g. a DDP bucket buffer with dense tensors between)."""
    _tk()
    _check(MIXED, torch.float32, seed=5, ties=True, nonfinite=True, gap=7)


@pytest.mark.parametrize("route", ["streamed", "transposed"])
def test_bucket_streamed_and_transposed_fibers(monkeypatch, route):
    """Fibers longer than ONE_PASS_MAX (streamed in several passes); few long columns take the per-tensor
    transposed route inside the same call."""
    tk = _tk()
    monkeypatch.setattr(tk, "ONE_PASS_MAX", 8)
    monkeypatch.setattr(tk, "COLUMN_MIN_PROGRAMS", 0 if route == "streamed" else 1000)
    monkeypatch.setattr(bs, "_PLANS", {})  # plans depend on the knobs
    specs = [bs.FiberSpec(3, 37, 1, 5), bs.FiberSpec(21, 4, 0, 6), bs.FiberSpec(2, 5, 1, 2), bs.FiberSpec(19, 2, 0, 19)]
    p = _check(specs, torch.float16, seed=7, ties=True, nonfinite=True)
    if route == "transposed":
        assert 1 in p.single and 3 in p.single and 0 in p.fused
    else:
        assert p.single == []


@pytest.mark.quick
@pytest.mark.parametrize("dtype", DTYPES)
def test_bucket_loop_fallback_is_the_per_tensor_path(dtype):
    """Without fused launches (CPU tensors, impl "auto" or "loop"): a loop over kernels.adtopk_select."""
    for impl in ("auto", "loop"):
        if CUDA and impl == "auto":
            continue
        p = _check(MIXED, dtype, seed=11, impl=impl, ties=dtype == torch.float16, nonfinite=True)
        assert p.fused == [] and p.launches == 0 and p.table is None


def _same_block(got: torch.Tensor, want: torch.Tensor, n: int, value_dtype: torch.dtype) -> bool:
    """Two wire blocks of ``n`` entries: the same bytes, except that a NaN may have another bit pattern (torch's
    own conversions to bfloat16 give different NaN payloads on different CPUs and on the GPU)."""
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape:
        return False
    vb = n * torch.empty((), dtype=value_dtype).element_size()
    gv, wv = got[:vb].view(value_dtype), want[:vb].view(value_dtype)
    nan = torch.isnan(gv) & torch.isnan(wv)
    same_values = bool(((gv.view(_INT[value_dtype]) == wv.view(_INT[value_dtype])) | nan).all())
    return same_values and torch.equal(got[vb:], want[vb:])


def _check_wire(specs, dtype, wire_dtype, seed, impl="triton", ties=False, gap=0):
    """The plan with a wire: every tensor's block bit for bit wire.pack of the per-tensor path's selection, the
    flat positions, the finiteness flags, and the residual (zeroed where sent, or keeping the rounding of a
    narrower wire) bit for bit the per-tensor path's followed by the memory's update."""
    from horovod_adtopk import wire

    a_off, n_a = _offsets(specs)
    g_off, n_g = _offsets(specs, gap)
    a = _data(n_a, dtype, seed, ties, nonfinite=True).to(DEVICE)
    assert specs[0].axis == 1  # its first fiber: all NaN / Inf, more than k of them, so some stay unsent
    specials = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    a[a_off[0]:a_off[0] + specs[0].fiber_len] = specials[torch.arange(specs[0].fiber_len) % 3].to(DEVICE)
    g = _data(n_g, dtype, seed + 1, ties, False).to(DEVICE)
    want_a = a.clone()
    p = bs.plan(specs, a_off, g_off, dtype=dtype, device=DEVICE, impl=impl, wire_dtype=wire_dtype)
    r = bs.select(a, p, g, zero_sent=True)
    assert isinstance(r, bs.BucketWire) and r.wire.dtype == torch.uint8 and r.wire.numel() == p.wire_bytes
    exact = wire_dtype == dtype
    saw_nonfinite = False
    for i, (s, got) in enumerate(zip(specs, bs.split_wire(p, r))):
        v, flat, wv, wi, block, finite = got
        sa = slice(a_off[i], a_off[i] + s.numel)
        v2, l2 = kernels.adtopk_select(want_a[sa], s.rows, s.cols, s.axis, s.k, g[g_off[i]:g_off[i] + s.numel],
                                       exact)
        assert torch.equal(_bits(v), _bits(v2)), f"tensor {i}: values"
        idt = wire.index_dtype_for(s.fiber_len - 1)
        fib = torch.arange(s.num_fibers).view(-1, 1)
        l2 = l2.cpu()
        flat2 = (fib * s.cols + l2) if s.axis == 1 else (l2 * s.cols + fib)
        assert torch.equal(flat.cpu(), flat2.reshape(-1)), f"tensor {i}: flat positions"
        packed = wire.pack(v2.reshape(-1), l2.reshape(-1), wire_dtype, idt)
        assert block.dtype == torch.uint8 and _same_block(block, packed, s.count, wire_dtype), f"tensor {i}: block"
        assert wi.dtype == idt and torch.equal(wi.cpu().to(torch.int64), l2.reshape(-1))
        assert _same(wv, v2.reshape(-1).to(wire_dtype))
        assert bool(finite) == bool(torch.isfinite(v2).all())
        saw_nonfinite |= not bool(finite)
        if not exact:  # the memory's update after a rounding wire
            rem = torch.nan_to_num(v2.reshape(-1) - v2.reshape(-1).to(wire_dtype).to(dtype), nan=0.0, posinf=0.0,
                                   neginf=0.0)
            want_a[sa][flat2.reshape(-1).to(want_a.device)] = rem
    assert saw_nonfinite  # the data put NaN / Inf into some fiber's top k
    # the unsent NaN / Inf are zeroed too (the memory's scrub: only fibers that sent non-finite values have any)
    assert bool((~torch.isfinite(want_a)).any())
    torch.nan_to_num_(want_a, nan=0.0, posinf=0.0, neginf=0.0)
    assert torch.equal(_bits(a), _bits(want_a))
    # the blocks lie back to back: the engines send them without a copy
    assert wire.join([b for *_, b, _ in bs.split_wire(p, r)]).data_ptr() == r.wire.data_ptr()
    return p


WIRES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16),
         (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float32), (torch.float64, torch.bfloat16),
         (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float16)]


@pytest.mark.parametrize("dtype,wire_dtype", WIRES)
def test_bucket_fused_wire_is_pack_of_the_per_tensor_path(dtype, wire_dtype):
    _tk()
    p = _check_wire(MIXED, dtype, wire_dtype, seed=13, ties=dtype == torch.float16)
    assert p.fused == list(range(len(MIXED))) and p.single == []


@pytest.mark.parametrize("route", ["streamed", "transposed"])
def test_bucket_fused_wire_streamed_and_transposed(monkeypatch, route):
    tk = _tk()
    monkeypatch.setattr(tk, "ONE_PASS_MAX", 8)
    monkeypatch.setattr(tk, "COLUMN_MIN_PROGRAMS", 0 if route == "streamed" else 1000)
    monkeypatch.setattr(bs, "_PLANS", {})
    specs = [bs.FiberSpec(3, 37, 1, 5), bs.FiberSpec(21, 4, 0, 6), bs.FiberSpec(2, 5, 1, 2), bs.FiberSpec(19, 2, 0, 19)]
    p = _check_wire(specs, torch.float32, torch.bfloat16, seed=17, ties=True, gap=3)
    assert (p.single == []) == (route == "streamed")


@pytest.mark.quick
@pytest.mark.parametrize("dtype,wire_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.float64, torch.float16)])
def test_bucket_loop_wire_is_pack_of_the_per_tensor_path(dtype, wire_dtype):
    """The loop (CPU) fills the same wire buffer tensor by tensor."""
    p = _check_wire(MIXED, dtype, wire_dtype, seed=19, impl="loop", gap=2)
    assert p.fused == [] and p.wire_bytes == sum(
        bs.block_bytes(s.count, wire_dtype, bs.index_dtype_for(s.fiber_len - 1)) for s in MIXED)


def _check_decode(specs, dtype, wire_dtype, impl, scale, world=3, gap=4):
    """Three ranks' packed buckets, stacked as an allgather delivers them, decoded into a bucket buffer: every
    tensor's region bit for bit sparsify.sum_in_rank_order of its blocks, the gaps between them untouched."""
    from horovod_adtopk import wire
    from horovod_adtopk.compressors.base import FiberCodec
    from horovod_adtopk.selection import FiberLayout
    from horovod_adtopk.sparsify import sum_in_rank_order

    a_off, n_a = _offsets(specs)
    g_off, n_g = _offsets(specs, gap)
    p = bs.plan(specs, a_off, g_off, dtype=dtype, device=DEVICE, impl=impl, wire_dtype=wire_dtype)
    wires = []
    for r in range(world):
        a = _data(n_a, dtype, 50 + r, ties=r == 1, nonfinite=r == 2).to(DEVICE)
        wires.append(bs.select(a, p, _data(n_g, dtype, 60 + r).to(DEVICE), zero_sent=True).wire)
    rows = torch.stack(wires)
    out = torch.full((n_g,), 7.0, dtype=dtype, device=DEVICE)
    bs.decode(p, rows, out, scale)
    outside = torch.ones(n_g, dtype=torch.bool)
    for i, s in enumerate(specs):
        vo, io = p.wire_regions(i)
        idt = p.index_dtypes[i]
        values = torch.cat([w[vo:vo + s.count * wire.dtype_bytes(wire_dtype)].view(wire_dtype) for w in wires])
        index = torch.cat([w[io:io + s.count * wire.dtype_bytes(idt)].view(idt) for w in wires])
        layout = FiberLayout((s.rows, s.cols), s.rows, s.cols, s.axis, s.k)
        want = torch.empty(s.numel, dtype=dtype, device=DEVICE)
        sum_in_rank_order(want, values, index.to(torch.int64), [s.count] * world, FiberCodec(layout), scale)
        got = out[g_off[i]:g_off[i] + s.numel]
        assert torch.equal(_bits(got), _bits(want)) or _same(got, want), f"tensor {i}: decode"
        outside[g_off[i]:g_off[i] + s.numel] = False
    assert bool((out.cpu()[outside] == 7.0).all())  # the dense tensors between are left alone
    return p


@pytest.mark.parametrize("dtype,wire_dtype,scale", [(torch.float32, torch.float32, 1 / 3),
                                                    (torch.float32, torch.bfloat16, 1 / 3),
                                                    (torch.bfloat16, torch.bfloat16, 1 / 3),
                                                    (torch.float16, torch.float16, 1.0),
                                                    (torch.float64, torch.float32, 1 / 3)])
def test_bucket_decode_is_sum_in_rank_order(dtype, wire_dtype, scale):
    _tk()
    _check_decode(MIXED, dtype, wire_dtype, "triton", scale)


@pytest.mark.quick
def test_bucket_decode_loop_is_sum_in_rank_order():
    _check_decode(MIXED, torch.float32, torch.bfloat16, "loop", 0.25, world=4)
    p = bs.plan(MIXED, _offsets(MIXED)[0], dtype=torch.float32, impl="loop")
    with pytest.raises(ValueError, match="wire_dtype"):
        bs.decode(p, torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(1000))


@pytest.mark.quick
def test_wire_join_views_or_copies():
    from horovod_adtopk import wire

    buf = torch.arange(40, dtype=torch.uint8)
    j = wire.join([buf[0:8], buf[8:24], buf[24:32]])
    assert j.data_ptr() == buf.data_ptr() and torch.equal(j, buf[:32])
    other = torch.arange(8, dtype=torch.uint8)
    c = wire.join([buf[0:8], other, buf[16:24]])  # not back to back: a copy, same bytes
    assert c.data_ptr() != buf.data_ptr() and torch.equal(c, torch.cat([buf[0:8], other, buf[16:24]]))
    assert torch.equal(wire.join([buf[8:16], buf[0:8]]), torch.cat([buf[8:16], buf[0:8]]))
    with pytest.raises(ValueError):
        wire.join([])


@pytest.mark.quick
def test_plan_cached_and_checked():
    offs, n = _offsets(MIXED)
    p = bs.plan(MIXED, offs, dtype=torch.float32, impl="loop")
    assert bs.plan(list(MIXED), list(offs), dtype=torch.float32, impl="loop") is p
    old_max = bs.MAX_PLANS
    try:  # bounded: the least recently used plan goes first
        bs.MAX_PLANS = 2
        q = bs.plan(MIXED[:2], offs[:2], dtype=torch.float32, impl="loop")
        assert bs.plan(MIXED, offs, dtype=torch.float32, impl="loop") is p  # p used again
        bs.plan(MIXED[:3], offs[:3], dtype=torch.float32, impl="loop")  # drops q
        assert bs.plan(MIXED, offs, dtype=torch.float32, impl="loop") is p
        assert bs.plan(MIXED[:2], offs[:2], dtype=torch.float32, impl="loop") is not q
        assert len(bs._PLANS) <= 2
    finally:
        bs.MAX_PLANS = old_max
    assert p.total == sum(s.count for s in MIXED)
    with pytest.raises(ValueError):
        bs.plan([bs.FiberSpec(2, 3, 1, 4)], [0], dtype=torch.float32)
    with pytest.raises(ValueError):
        bs.plan(MIXED, offs, dtype=torch.float32, impl="fast")
    with pytest.raises(ValueError):
        bs.select(torch.zeros(n - 1, device=DEVICE), bs.plan(MIXED, offs, dtype=torch.float32, device=DEVICE))


# --- the engines' entry: Sparsifier.select_bucket against Sparsifier.select, tensor by tensor ----------------

SHAPES = [(16, 12), (24, 5, 2), (7, 40), (4, 16), (3, 3, 4, 4)]


def _sparsifier(value_dtype, prescale=1.0):
    from horovod_adtopk.compressors import ADTopkCompressor
    from horovod_adtopk.memory import ErrorFeedback
    from horovod_adtopk.sparsify import Sparsifier

    c = ADTopkCompressor(ratio=0.2, value_dtype=value_dtype)
    return Sparsifier(c, ErrorFeedback(None), prescale=prescale)


def _bucket(dtype, seed):
    from horovod_adtopk.compressors import TensorInfo

    n = sum(int(np.prod(s)) for s in SHAPES) + 5 * len(SHAPES)
    buf = _data(n, dtype, seed, ties=seed % 2 == 0, nonfinite=seed % 3 == 0).to(DEVICE)
    items, o = [], 3
    for i, shape in enumerate(SHAPES):
        m = int(np.prod(shape))
        items.append((buf[o:o + m].view(shape), TensorInfo(f"t{i}", shape, m, dtype)))
        o += m + 5  # gaps: dense tensors of the bucket between the sparse ones
    return buf, items


@pytest.mark.parametrize("impl", ["loop", "triton"])
@pytest.mark.parametrize("dtype,value_dtype,prescale", [(torch.float32, None, 1.0), (torch.bfloat16, None, 1.0),
                                                        (torch.float32, torch.float16, 0.5),
                                                        (torch.float32, torch.bfloat16, 1.0)])
def test_select_bucket_is_select_per_tensor(impl, dtype, value_dtype, prescale):
    """Three steps: every selection (values, positions, wire values, finiteness, the packed block) and every
    residual bit for bit as Sparsifier.select gives them one tensor at a time; exact wires zero what they send
    in the kernel, others keep the wire's rounding error in the memory (in the kernel too, where the selection
    packs the wire: no prescale, no float16 clamping)."""
    from horovod_adtopk import payload
    if impl == "triton":
        _tk()
    per, bucket = _sparsifier(value_dtype, prescale), _sparsifier(value_dtype, prescale)
    assert bucket.batches(None)
    for step in range(3):
        buf, items = _bucket(dtype, seed=20 + step)
        want = [per.select(g, info, step) for g, info in items]
        got = bucket.select_bucket(buf, items, step, impl=impl)
        for (g, info), s1, s2 in zip(items, want, got):
            assert torch.equal(_bits(s1.values), _bits(s2.values))
            assert torch.equal(s1.flat.cpu(), s2.flat.cpu())
            assert torch.equal(s1.wire_index.cpu().to(torch.int64), s2.wire_index.cpu().to(torch.int64))
            assert _same(s1.wire_values, s2.wire_values)  # NaN payloads aside (see _same_block)
            assert (s2.block is not None) == (prescale == 1.0)  # packed by the selection
            kind = payload.SparseGather(2, per.compression)
            item1, item2 = payload.Item(info.name, info, s1), payload.Item(info.name, info, s2)
            assert s1.block is None and _same_block(kind.encode(item2), kind.encode(item1), s1.values.numel(),
                                                    kind.value_dtype(info))
            assert bool(s1.finite) == bool(s2.finite)
            assert s1.codec.layout == s2.codec.layout
        assert [n for n, *_ in per.nonfinite] == [n for n, *_ in bucket.nonfinite]
        # the round's end: the packed path zeroed the unsent NaN / Inf already, the per-tensor one does it now
        scrubbed = per.scrub_nonfinite()
        assert bucket.scrub_nonfinite() == scrubbed and (scrubbed > 0) == (step == 1)  # step 1: NaN / Inf
        for _, info in items:
            assert torch.equal(_bits(per.memory.residuals[info.name]), _bits(bucket.memory.residuals[info.name]))
    # the residuals live in one buffer; one replaced elsewhere (a checkpoint) is copied back in, same result
    bucket.memory.residuals["t1"] = bucket.memory.residuals["t1"].clone()
    buf, items = _bucket(dtype, seed=40)
    want = [per.select(g, info, 3) for g, info in items]
    got = bucket.select_bucket(buf, items, 3, impl=impl)
    for s1, s2 in zip(want, got):
        assert torch.equal(_bits(s1.values), _bits(s2.values)) and torch.equal(s1.flat.cpu(), s2.flat.cpu())
    per.scrub_nonfinite()
    bucket.scrub_nonfinite()
    for name in per.memory.residuals:
        assert torch.equal(_bits(per.memory.residuals[name]), _bits(bucket.memory.residuals[name]))


@pytest.mark.quick
def test_batches_only_plain_adtopk_with_plain_error_feedback():
    from horovod_adtopk.compressors import ADTopkICompressor, TopkCompressor
    from horovod_adtopk.memory import ErrorFeedback
    from horovod_adtopk.sparsify import Sparsifier

    assert _sparsifier(None).batches(None)
    assert not Sparsifier(ADTopkICompressor(ratio=0.1), ErrorFeedback(None)).batches(None)
    assert not Sparsifier(TopkCompressor(ratio=0.1), ErrorFeedback(None)).batches(None)
    assert not Sparsifier(_sparsifier(None).compression, ErrorFeedback(0.9)).batches(None)
    assert not Sparsifier(_sparsifier(None).compression, None).batches(None)


def test_ddp_engine_bucket_path_is_bitwise_the_per_tensor_path(tmp_path):
    """The DDP engine at 2 Gloo ranks with every bucket's ADTopk tensors selected together
    (HOROVOD_ADTOPK_BUCKET_SELECT=loop: the bucket path on CPU tensors) against the per-tensor path (off):
    every step's averaged gradients bit for bit, on 7 adtopk cases (axes 0, 1, auto, float64, joined rows and
    columns, a float16 wire)."""
    import json
    import sys

    from tests.harness import run_command
    from tests.test_ddp import SPARSE_KW, compare_cases
    from tests.test_optimizer_reference import load_case

    cases = [c for c in compare_cases() if c.get("compressor", "adtopk") == "adtopk" and "momentum" not in c["kwargs"]
             and c["kwargs"].get("error_feedback", True)][:7]
    assert len(cases) == 7 and cases[6]["kwargs"].get("value_dtype") == "float16"
    assert all(c["kwargs"].get("min_numel") == SPARSE_KW["min_numel"] for c in cases)
    outs, decodes = {}, {}
    # "triton": the fused launches (selection, packing, and the whole-bucket decode) under the interpreter
    modes = {"off": cases, "loop": cases, "triton": cases[:3]}
    for mode, mode_cases in modes.items():
        out = tmp_path / mode
        out.mkdir()
        (out / "args.json").write_text(json.dumps({"cases": mode_cases}))
        env = {"HOROVOD_ADTOPK_BUCKET_SELECT": mode}
        if mode == "triton" and not torch.cuda.is_available():
            env["TRITON_INTERPRET"] = "1"
        rc, log, _ = run_command([sys.executable, "-m", "tests._ddp_launch", "2", "reference_cases",
                                  str(out / "args.json"), str(out)], timeout=240, env=env)
        assert rc == 0, log[-5000:]
        outs[mode] = [load_case(str(out), ci, 2, case)[1] for ci, case in enumerate(mode_cases)]
        decodes[mode] = [c["bucket_decodes"] for c in json.loads((out / "rank0.json").read_text())]
    compared = 0
    for mode in ("loop", "triton"):
        for ci, case in enumerate(modes[mode]):
            for r in range(2):
                for t in range(case["steps"]):
                    for n in case["shapes"]:
                        a, b = np.asarray(outs["off"][ci][r][t][n]), np.asarray(outs[mode][ci][r][t][n])
                        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"{mode} case {ci} rank {r} step {t} {n}"
                        compared += 1
    assert compared > 70
    # the whole-bucket decode ran (every case but the float16 wire of float32 gradients, packed per tensor)
    assert decodes["off"] == [0] * 7 and all(d > 0 for d in decodes["loop"][:6] + decodes["triton"]), decodes
    assert decodes["loop"][6] == 0, decodes


def test_gpu_check_bucket_and_step_stages_dry(tmp_path):
    """scripts/gpu_check.sh's stages bucket and step in dry mode (CPU tensors, the interpreter, tiny shapes):
    they run, and their JSON says the checks passed (timings of a dry run mean nothing and are not judged)."""
    import json
    import math

    from tests.harness import REPO, run_command

    rc, log, _ = run_command(["bash", "scripts/gpu_check.sh"], timeout=240,
                             env={"GPU_CHECK_DRY": "1", "GPU_CHECK_STAGES": "bucket step", "OUT": str(tmp_path),
                                  "PYTHON": sys_executable()}, cwd=str(REPO))
    assert rc == 0, log[-6000:]
    assert "stage bucket ok" in log and "stage step ok" in log
    res = json.loads((tmp_path / "bench_bucket_select.json").read_text())
    assert res["ok"] is True and res["dry"] is True
    models = res["bucket"]["models"]
    assert len(models) == 3
    for name, m in models.items():
        assert m["bitwise_equal"] is True, name
        assert m["tensors"] >= 4 and 1 <= m["fused_launches"] < m["tensors"] + m["buckets"], name
        assert m["payload_entries"] >= m["tensors"] and m["numel"] > m["payload_entries"], name
        assert all(m[k] > 0 for k in ("copy_ms", "bucket_ms", "per_layer_ms")), name
    step = res["step"]
    assert step["ok"] is True and step["adtopk_bucket_equals_per_tensor"] is True
    assert set(step["variants"]) == {"dense", "adtopk", "adtopk_per_tensor", "powersgd", "fp16"}
    for v in step["variants"].values():
        assert v["finite"] and all(math.isfinite(x) for x in v["losses"]) and v["step_ms"] > 0
    # the bucket path decoded its packed buckets whole (every step's buckets, on the DDP engine)
    assert step["variants"]["adtopk"]["bucket_decodes"] > 0
    assert step["variants"]["adtopk"]["syncs"] == "skipped (CPU tensors)"


def sys_executable():
    import sys

    return sys.executable


@pytest.mark.quick
def test_gpu_guide_example():
    """The code block of docs/guides/gpu.md's "Whole-bucket selection", as written there."""
    import re

    from tests.harness import REPO

    text = (REPO / "docs" / "guides" / "gpu.md").read_text()
    section = text[text.index("## Whole-bucket selection"):]
    block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "bs.select(" in block
    exec(compile(block, "docs/guides/gpu.md", "exec"), {})


# --- the Horovod engine: gradients selected in groups (exchange.SparseSender) against one by one ---------------

HVD_SPECS = [  # Net of tests/bucket_workers.py: conv [6, 2, 3, 3], fc1 [40, 96], fc2 [24, 40], fc3 [5, 24]
    {"steps": 4, "kwargs": {"ratio": 0.1, "axis": 1, "min_numel": 0, "hybrid": False}, "cap": 4000},
    {"steps": 4, "kwargs": {"ratio": 0.2, "axis": 0, "min_numel": 0, "hybrid": False}, "bpps": 2},
    {"steps": 4, "kwargs": {"ratio": 0.1, "min_numel": 0, "hybrid": False, "value_dtype": "float16"},
     "warmup_steps": 1, "cap": 20000},
    {"steps": 3, "kwargs": {"ratio": 0.1, "axis": 1, "min_numel": 0, "hybrid": False}, "exchange": "sharded"},
]


def _hvd_cases():
    from tests.test_optimizer_reference import make_cases

    cases = [c for c in make_cases() if c.get("compressor", "adtopk") == "adtopk"
             and c["kwargs"].get("error_feedback", True)]
    keep = [c for c in cases if (c["kwargs"].get("axis"), c["kwargs"]["ratio"], c["dtype"]) in
            (("auto", 0.05, "float32"), (0, 0.3, "float64"))]
    keep += [c for c in cases if "value_dtype" in c["kwargs"] or "predivide" in c
             or c["kwargs"].get("join") == "columns"]
    assert len(keep) == 5
    return keep


def _hvd_run(mode, cases, specs, extra_env=None):
    from tests.harness import launch

    rc, log, outdir, seconds = launch("bucket_workers:train", np=2, args={"specs": specs, "cases": cases},
                                      timeout=240, env={"HOROVOD_ADTOPK_BUCKET_SELECT": mode, **(extra_env or {})})
    assert rc == 0, log[-8000:]
    print(f"{mode}: {seconds:.1f} s")
    import json
    from pathlib import Path

    return outdir, [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(2)]


def _npz(outdir, name):
    from pathlib import Path

    with np.load(Path(outdir, name)) as z:
        return {k: z[k] for k in z.files}


def _untimed(x):
    """Counters without the measured seconds."""
    if isinstance(x, dict):
        return {k: _untimed(v) for k, v in x.items() if not k.endswith("_seconds")}
    return [_untimed(v) for v in x] if isinstance(x, list) else x


def _hvd_compare(runs, specs, cases, prefix=False):
    """Every mode's files bit for bit the first's (gradients, residuals, counters); ranks' gradients identical.
    ``prefix``: the other modes ran fewer steps (their steps against the first's, counters not compared)."""
    from tests.test_optimizer_reference import load_case

    (_, (base_dir, base_sum)), *others = runs.items()
    compared = 0
    for mode, (outdir, summ) in others:
        for r in range(2):
            assert prefix or summ[r]["train"] == base_sum[r]["train"], mode
            if cases:
                assert _untimed(summ[r]["cases"]) == _untimed(base_sum[r]["cases"]), mode
            for si in range(len(specs)):
                a, b = _npz(base_dir, f"spec{si}_rank{r}.npz"), _npz(outdir, f"spec{si}_rank{r}.npz")
                assert (set(b) <= set(a) if prefix else sorted(a) == sorted(b)) and any(k.startswith("res/") for k in b)
                for k in b:
                    assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), \
                        f"{mode} spec {si} rank {r} {k}"
                    compared += 1
            for ci, case in enumerate(cases):
                a, b = _npz(base_dir, f"case{ci}_rank{r}.npz"), _npz(outdir, f"case{ci}_rank{r}.npz")
                assert sorted(a) == sorted(b)
                for k in a:
                    assert a[k].tobytes() == b[k].tobytes(), f"{mode} case {ci} rank {r} {k}"
                    compared += 1
    for outdir, _ in runs.values():  # the ranks hand back the same average
        for si in range(len(specs)):
            a, b = _npz(outdir, f"spec{si}_rank0.npz"), _npz(outdir, f"spec{si}_rank1.npz")
            for k in a:
                if k.startswith("out/"):
                    assert a[k].tobytes() == b[k].tobytes(), f"spec {si} {k}: ranks differ"
        for ci, case in enumerate(cases):
            outs = load_case(outdir, ci, 2, case)[1]
            for t in range(case["steps"]):
                for n in case["shapes"]:
                    assert outs[0][t][n].tobytes() == outs[1][t][n].tobytes()
    return compared


def test_horovod_engine_groups_are_bitwise_the_per_tensor_path():
    """hat.DistributedOptimizer at 2 Gloo ranks with its plain-ADTopk gradients selected in groups
    (HOROVOD_ADTOPK_BUCKET_SELECT=loop: the group path on CPU tensors; =triton on the first spec's first rounds:
    its fused launches under the Triton interpreter, on any machine) against one by one (off): a model
    trained through the gradient hooks (row and column fibers, 1-D biases dense, groups closed by small caps and
    flushed at synchronize(), backward_passes_per_step=2, a dense warm-up round, a float16 wire, the
    owner-sharded exchange) and five reference cases fed through synchronize() (float32 and float64, joined
    columns, a float16 wire, a predivide factor): every step's averaged gradients, every rank's residuals and
    the byte counters bit for bit; the ranks agree; the group path's aggregates match the numpy reference."""
    from tests.test_optimizer_reference import expected_for, load_case

    _tk()
    cases = _hvd_cases()
    env = {"TRITON_INTERPRET": "1"}  # the ranks' tensors are CPU tensors, on a CUDA machine too
    runs = {mode: _hvd_run(mode, cases, HVD_SPECS, env) for mode in ("off", "loop")}
    assert _hvd_compare(runs, HVD_SPECS, cases) > 600
    # the interpreter is slow: the first spec's first two rounds
    runs["triton"] = _hvd_run("triton", [], [dict(HVD_SPECS[0], steps=2)], env)
    assert _hvd_compare({m: runs[m] for m in ("off", "triton")}, HVD_SPECS[:1], [], prefix=True) > 25
    off, loop, triton = (runs[m][1][0] for m in ("off", "loop", "triton"))
    assert off["groups"] == [0, 0, 0, 0] and off["fused_launches"] == 0
    assert loop["train"][3]["sharded"] and loop["groups"][3] == 3  # the owner-sharded exchange, grouped
    # spec 0: the small cap closes a group before synchronize() (2 or more per round); spec 1: one per round
    assert loop["groups"][0] >= 8 and loop["groups"][1] == 4 and triton["groups"][0] >= 4
    assert loop["fused_launches"] == 0 and triton["fused_launches"] > 0
    outdir = runs["loop"][0]
    for ci, case in enumerate(cases):
        grads, outs, _ = load_case(outdir, ci, 2, case)
        expected, sparse = expected_for(case, grads, 2)
        assert any(sparse.values())
        tol = dict(rtol=1e-5, atol=1e-6) if case["dtype"] == "float32" else dict(rtol=1e-12, atol=1e-12)
        for t in range(case["steps"]):
            for n in case["shapes"]:
                np.testing.assert_allclose(outs[0][t][n], expected[t][n], **tol, err_msg=f"case {ci} step {t} {n}")
    assert all(s["paths"][f"s{i}.fc1.bias"] == "dense" and s["paths"][f"s{i}.fc1.weight"] != "dense"
               for i, s in enumerate(loop["train"]))
