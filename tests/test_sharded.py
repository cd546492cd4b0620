"""The owner-sharded exchange's plan and cost (horovod_adtopk.sharded), checked against the block format and
the per-rank bytes written out here by hand; its values are checked against the numpy model in
tests/test_local_steps.py (SHARDED_CASES, at 2, 3 and 8 ranks on both engines)."""
import pytest
import torch

import horovod_adtopk as hat
from horovod_adtopk import sharded
from horovod_adtopk.compressors import TensorInfo

pytestmark = pytest.mark.quick


def recipe_plan(world):
    """The README's AdamW recipe on a [3072, 1024] matrix: ADTopk 0.25, 2-bit values, value_group 64."""
    c = hat.Compression.adtopk(ratio=0.25)
    info = TensorInfo("w", (3072, 1024), 3072 * 1024, torch.float32)
    layout = c.codec(info).layout
    return sharded.plan_sparse("w", layout, 2, 64, world, torch.float32, torch.int16)


@pytest.mark.parametrize("world", [2, 3, 8, 64, 1024])
def test_recipe_bytes_per_rank_do_not_grow_with_world(world):
    # 3072 row fibers of 1024 keep 256 each: one set of 2 bfloat16 levels (4 B), 256 2-bit codes (64 B) and 256
    # 10-bit indices (320 B) per fiber = 388 B; 3072 fibers shared among W owners as evenly as whole fibers go
    per_fiber = 4 + 64 + 320
    shares = [3072 * (j + 1) // world - 3072 * j // world for j in range(world)]
    blocks = [-(-n * per_fiber // 8) * 8 for n in shares]
    plan = recipe_plan(world)
    assert plan.block_sizes() == blocks
    busiest = max((world - 1) * blocks[r] + (world - 1) * max(blocks) for r in range(world))
    assert sharded.worst(blocks, world).received == busiest
    payload = 3072 * per_fiber
    assert busiest <= 2 * payload * (world - 1) / world + 2 * (world - 1) * per_fiber  # within a fiber of 2 (W-1)/W P
    dense = 2 * (world - 1) / world * 4 * 3072 * 1024
    choice, reason = sharded.pick(plan, payload, 4 * 3072 * 1024, world, hat.netcost.Link())
    if world == 2:  # both move one payload; the allgather has half the messages
        assert choice == "allgather", reason
    else:
        assert choice == "sharded" and busiest < (world - 1) * payload and busiest < dense, reason
    if world >= 64:  # where the allgather moves more than a dense allreduce, the shards still win by ~10x
        assert (world - 1) * payload > dense and dense / busiest > 10


def test_latency_moves_the_break_even():
    """With a latency per message the two stages' 2 (W-1) messages cost more: a small tensor stays gathered."""
    c = hat.Compression.adtopk(ratio=0.25)
    info = TensorInfo("w", (64, 64), 64 * 64, torch.float32)
    plan = sharded.plan_sparse("w", c.codec(info).layout, 2, 64, 8, torch.float32, torch.int16)
    payload = sum(plan.block_sizes())
    assert sharded.pick(plan, payload, 4 * 64 * 64, 8, hat.netcost.Link())[0] == "sharded"
    slow = hat.netcost.Link.parse("10Gbit/s,50us")
    assert sharded.pick(plan, payload, 4 * 64 * 64, 8, slow)[0] == "allgather"


def test_too_few_groups_cannot_be_sharded():
    c = hat.Compression.adtopk(ratio=0.25, axis=1)
    info = TensorInfo("w", (1, 64), 64, torch.float32)
    assert sharded.plan_sparse("w", c.codec(info).layout, 2, None, 4, torch.float32, torch.int16) is None
    assert sharded.plan_dense("b", (64,), 2, None, 4) is None  # a 1-D tensor is one row: one group
    plan = sharded.plan_dense("w", (6, 10), 2, 20, 4)  # runs of 2 rows -> 3 groups among 4 owners: one owns none
    assert [hi - lo for lo, hi in plan.bounds] == [0, 2, 2, 2] and plan.block_sizes()[0] == 0


def test_settings():
    with pytest.raises(ValueError, match="exchange must be one of"):
        hat.Outer.sgd(1.0, exchange="ring")
    from horovod_adtopk.local_steps import check_settings
    with pytest.raises(ValueError, match="shards the fibers of an ADTopk payload"):
        check_settings(4, hat.Outer.sgd(1.0, exchange="sharded"), hat.Compression.topk(ratio=0.01))
    with pytest.raises(ValueError, match="shards the fibers of an ADTopk payload"):
        check_settings(4, hat.Outer.sgd(1.0, exchange="sharded"), None)  # dense fp32: an allreduce already
    check_settings(4, hat.Outer.sgd(1.0, value_bits=2, exchange="sharded"), None)
    check_settings(4, hat.Outer.sgd(1.0, exchange="sharded"), hat.Compression.adtopk(ratio=0.25))
