"""Selection rules and wire format against numpy, in one process (no Horovod collectives)."""
import math

import zlib

import numpy as np

import pytest
import torch

from horovod_adtopk import kernels
from horovod_adtopk import selection as sel
from horovod_adtopk import wire
from horovod_adtopk.compressors import Compression, TensorInfo
from tests import reference as ref


def info_of(t, name="w"):
    return TensorInfo(name, tuple(t.shape), t.numel(), t.dtype)


def mask_of(flat, shape):
    m = np.zeros(int(np.prod(shape)), dtype=bool)
    m[flat.numpy()] = True
    return m.reshape(shape)


@pytest.mark.parametrize("shape", [(7, 300), (300, 7), (16, 8, 3, 3), (5, 4, 3, 2, 2), (1, 50), (50, 1), (3, 3)])
@pytest.mark.parametrize("axis", [0, 1, "auto"])
@pytest.mark.parametrize("ratio", [0.001, 0.1, 0.5, 1.0])
def test_adtopk_matches_reference(shape, axis, ratio):
    a = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(repr((shape, str(axis))).encode()) % 1000), dtype=torch.float64)
    s = Compression.adtopk(ratio=ratio, axis=axis).select(a, info_of(a), 0)
    want = ref.adtopk_mask(a.numpy(), ratio, axis)
    got = mask_of(s.flat, shape)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(s.values.numpy(), a.reshape(-1).numpy()[s.flat.numpy()])  # signed values
    rows, cols = shape[0], int(np.prod(shape[1:]))
    ax = ref.resolve_axis(rows, cols, axis, ratio)
    fib, nfib = (cols, rows) if ax == 1 else (rows, cols)
    assert s.values.numel() == nfib * max(1, math.floor(ratio * fib))
    # wire indices are fiber-local and decode back to the same flat positions
    assert int(s.wire_index.max()) < fib
    assert torch.equal(s.codec.to_flat(s.wire_index.to(s.codec.index_dtype)), s.flat)


@pytest.mark.parametrize("shape,ratio,axis", [
    ((4096, 2048), 0.01, 1),    # the MLP's first layer: rows (k=20 of 2048, -2.3%), no longer strided columns
    ((4096, 2048), 0.001, 1),   # k=2 of 2048: -2.3%
    ((30522, 768), 0.01, 0),    # BERT embeddings: rows would keep 7 of 768 (-8.9%): the longer axis
    ((3072, 768), 0.01, 0),     # -8.9% as rows: columns
    ((300, 100), 0.1, 1),       # k=10 of 100 exactly: rows although columns are longer
    ((300, 50), 0.01, 0),       # k>=1 inflates rows to 2%: columns (k=3 of 300)
    ((50, 300), 0.001, 1),      # neither axis near 0.1%: the longer axis, as before
])
def test_auto_axis_prefers_contiguous_rows_within_tolerance(shape, ratio, axis):
    layout = sel.fiber_layout(shape, ratio, "auto")
    assert layout.axis == axis == ref.resolve_axis(shape[0], shape[1], "auto", ratio)
    row_density = max(1, math.floor(ratio * shape[1])) / shape[1]
    assert (abs(row_density / ratio - 1) <= 0.05) == (axis == 1) or shape[1] >= shape[0]
    for explicit in (0, 1):  # explicit choices are left alone
        assert sel.fiber_layout(shape, ratio, explicit).axis == explicit


def test_every_fiber_keeps_an_entry_where_global_topk_starves_rows():
    a = torch.randn(64, 256)
    a[:8] *= 1000  # eight loud rows
    s = Compression.adtopk(ratio=0.01, axis=1).select(a, info_of(a), 0)
    rows_hit = set((s.flat // 256).tolist())
    assert rows_hit == set(range(64))
    g = Compression.topk(ratio=0.01).select(a, info_of(a), 0)
    assert set((g.flat // 256).tolist()) <= set(range(8))


@pytest.mark.parametrize("numel,ratio", [(1000, 0.01), (4096, 0.001), (10, 0.5), (7, 1.0)])
def test_topk_hits_k_exactly(numel, ratio):
    a = torch.randn(numel // 1 if numel > 10 else numel, 1).reshape(-1, 1).repeat(1, 2)
    s = Compression.topk(ratio=ratio).select(a, info_of(a), 0)
    assert s.values.numel() == max(1, math.floor(ratio * a.numel()))
    np.testing.assert_array_equal(mask_of(s.flat, a.shape), ref.topk_mask(a.numpy(), ratio))


def test_index_width():
    assert wire.index_dtype_for(32767) == torch.int16
    assert wire.index_dtype_for(32768) == torch.int32
    assert wire.index_dtype_for(2**31 - 1) == torch.int32
    assert wire.index_dtype_for(2**31) == torch.int64
    small = Compression.adtopk(ratio=0.01)
    assert small.codec(TensorInfo("a", (4096, 4096), 4096 * 4096, torch.float32)).index_dtype == torch.int16
    assert small.codec(TensorInfo("b", (10, 40000), 400000, torch.float32)).index_dtype == torch.int32


@pytest.mark.parametrize("vdtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("idtype", [torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("counts", [[37, 37], [1, 3], [0, 5, 2], [0, 0]])
def test_pack_roundtrip(vdtype, idtype, counts):
    gen = torch.Generator().manual_seed(sum(counts))
    values = [torch.randn(n, dtype=torch.float64, generator=gen) for n in counts]
    index = [torch.randint(0, 30000, (n,), generator=gen) for n in counts]
    blocks = [wire.pack(v, i, vdtype, idtype) for v, i in zip(values, index)]
    for n, b in zip(counts, blocks):
        assert b.dtype == torch.uint8 and b.dim() == 1
        assert b.numel() == wire.block_bytes(n, vdtype, idtype) < n * wire.entry_bytes(vdtype, idtype) + 16
    gathered = torch.cat(blocks)  # what an allgather of these ranks looks like
    v, i = wire.unpack(gathered, counts, vdtype, idtype)
    assert torch.equal(v, torch.cat(values).to(vdtype))
    assert torch.equal(i, torch.cat(index))
    with pytest.raises(ValueError, match="ranks disagree"):
        wire.unpack(gathered, [c + 8 for c in counts], vdtype, idtype)


def test_nonfinite_entries_are_always_selected():
    a = torch.randn(4, 100)
    a[1, 5] = float("nan")
    a[2, 7] = float("-inf")
    s = Compression.adtopk(ratio=0.01, axis=1).select(a, info_of(a), 0)
    assert {105, 207} <= set(s.flat.tolist())
    v, f = kernels.threshold_select(a, 10.0)
    assert set(f.tolist()) == {105, 207}


@pytest.mark.parametrize("shape,min_len,fibers,axis", [
    ((384, 128), 1024, 48, 1),     # a D = 128 transformer's qkv: 8 rows per fiber (k = 10 of 1024 at 0.01)
    ((65, 128), 1024, 5, 1),       # 65 = 5 x 13 rows: 13 rows (1664 entries) per fiber
    ((7, 300), 1000, 1, 1),        # 7 is prime: the whole tensor is one fiber
    ((16, 8, 3, 3), 100, 8, 1),    # rows of 72: two per fiber
    ((300, 7), 5, 7, 0),           # rows already long enough: axis "auto" decides (the longer axis here)
    ((300, 7), 1, 7, 0),           # min_fiber_len=1 never joins: the default layout
])
@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_min_fiber_len_joins_whole_rows(shape, min_len, fibers, axis, ratio):
    a = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape) * 7 + min_len), dtype=torch.float32)
    comp = Compression.adtopk(ratio=ratio, min_fiber_len=min_len)
    lay = comp.layout(info_of(a))
    assert (lay.num_fibers, lay.axis) == (fibers, axis) and lay.fiber_len * fibers == a.numel()
    if min_len <= shape[1]:
        assert lay == Compression.adtopk(ratio=ratio).layout(info_of(a))
    s = comp.select(a, info_of(a), 0)
    np.testing.assert_array_equal(mask_of(s.flat, shape), ref.joined_rows_mask(a.numpy(), ratio, min_len))
    np.testing.assert_array_equal(s.values.numpy(), a.reshape(-1).numpy()[s.flat.numpy()])
    assert s.values.numel() == fibers * max(1, math.floor(ratio * a.numel() / fibers))
    assert int(s.wire_index.max()) < lay.fiber_len  # fiber-local indices decode back
    assert torch.equal(s.codec.to_flat(s.wire_index.to(s.codec.index_dtype)), s.flat)
    assert comp.config()["min_fiber_len"] == min_len
    assert "min_fiber_len" not in Compression.adtopk(ratio=ratio).config()  # earlier configurations unchanged


@pytest.mark.parametrize("shape,min_len,fibers,fiber_len", [
    ((384, 128), 2048, 16, 3072),   # the GPT's fused qkv: 8 columns per fiber, q, k and v in every one
    ((128, 512), 2048, 32, 2048),   # a wide matrix: 16 columns per fiber
    ((84, 128), 2048, 4, 2688),     # the GPT's token embedding: 32 columns (84 x 24 < 2048)
    ((7, 13), 1000, 1, 91),         # 13 is prime and the tensor is short: the whole tensor is one fiber
    ((16, 8, 3, 3), 100, 9, 128),   # a conv: columns of 16 entries, 8 per fiber (7 does not divide 72)
    ((300, 7), 100, 7, 300),        # columns already long enough: axis "auto" decides (columns here)
])
@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_min_fiber_len_joins_whole_columns(shape, min_len, fibers, fiber_len, ratio):
    gen = torch.Generator().manual_seed(len(shape) * 11 + min_len)
    a = torch.randn(shape, generator=gen, dtype=torch.float32)
    a.reshape(-1)[::17] = 0.5  # ties: the lower index wins, as everywhere
    comp = Compression.adtopk(ratio=ratio, min_fiber_len=min_len, join="columns")
    lay = comp.layout(info_of(a))
    assert (lay.num_fibers, lay.fiber_len) == (fibers, fiber_len) and lay.axis == 0
    if min_len <= shape[0]:
        assert lay == Compression.adtopk(ratio=ratio).layout(info_of(a))
    s = comp.select(a, info_of(a), 0)
    np.testing.assert_array_equal(mask_of(s.flat, shape), ref.joined_columns_mask(a.numpy(), ratio, min_len))
    np.testing.assert_array_equal(s.values.numpy(), a.reshape(-1).numpy()[s.flat.numpy()])
    assert s.values.numel() == fibers * max(1, math.floor(ratio * fiber_len))
    assert int(s.wire_index.max()) < lay.fiber_len  # fiber-local indices decode back
    assert torch.equal(s.codec.to_flat(s.wire_index.to(s.codec.index_dtype)), s.flat)
    assert comp.config()["join"] == "columns"
    assert "join" not in Compression.adtopk(ratio=ratio, min_fiber_len=min_len).config()  # rows: unchanged


@pytest.mark.parametrize("bad,axis,match", [(0, "auto", "min_fiber_len"), (1.5, "auto", "min_fiber_len"),
                                            (True, "auto", "min_fiber_len"), (512, 0, "axis=0")])
def test_bad_min_fiber_len_is_rejected_clearly(bad, axis, match):
    with pytest.raises(ValueError, match=match):
        Compression.adtopk(ratio=0.1, axis=axis, min_fiber_len=bad)


@pytest.mark.parametrize("kwargs,match", [({"min_fiber_len": 512, "join": "diagonal"}, "join must be"),
                                          ({"join": "columns"}, "give min_fiber_len too"),
                                          ({"min_fiber_len": 512, "join": "columns", "axis": 1}, "axis=1")])
def test_bad_join_is_rejected_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Compression.adtopk(ratio=0.1, **kwargs)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan"), "x", None])
def test_bad_ratio_is_rejected_clearly(bad):
    with pytest.raises(ValueError, match="ratio"):
        Compression.adtopk(ratio=bad)


@pytest.mark.parametrize("bad", [2, -1, "rows", True, 1.0])
def test_bad_axis_is_rejected_clearly(bad):
    with pytest.raises(ValueError, match="axis"):
        Compression.adtopk(ratio=0.1, axis=bad)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="value_dtype"):
        Compression.adtopk(ratio=0.1, value_dtype=torch.int32)
    with pytest.raises(ValueError, match="min_numel"):
        Compression.adtopk(ratio=0.1, min_numel=-1)
    with pytest.raises(ValueError, match="threshold"):
        Compression.threshold(threshold=-1.0)
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        Compression.get("nope", ratio=0.1)
    with pytest.raises(ValueError, match="dense"):
        Compression.get("none", ratio=0.1)
    with pytest.raises(TypeError, match="horovod_adtopk.DistributedOptimizer"):
        Compression.adtopk(ratio=0.1).compress(torch.ones(3, 3))


def test_integer_gradients_are_rejected():
    a = torch.ones(8, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match="floating"):
        Compression.adtopk(ratio=0.1).select(a, info_of(a), 0)


def test_registry_lists_every_compressor():
    names = Compression.names()
    for n in ["none", "fp16", "adtopk", "adtopk_i", "adtopk_t", "topk", "randomk", "dgc", "gaussiank", "redsync",
              "sidco", "threshold"]:
        assert n in names
    assert Compression.get("ADTopk", ratio=0.1).ratio == 0.1
