"""The cost model (horovod_adtopk.netcost) against a step-by-step simulation of the ring algorithms, the path
choice at W = 2..16 against the model's bytes, and Stats' wire counters.

The reference simulates Gloo's rings message by message with numpy (chunk sizes as ``np.array_split`` cuts a
buffer), counting what each rank sends and receives; the model's closed forms must agree with it to within
the chunks' rounding. Pure Python and single-process: these are in the quick tier.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from horovod_adtopk import netcost
from horovod_adtopk.compressors import Compression, TensorInfo
from horovod_adtopk.quantize import QuantizedWire
from horovod_adtopk.stats import Stats

pytestmark = pytest.mark.quick


def simulate_ring_allreduce(nbytes: int, world: int):
    """Bytes each rank sends and receives in a ring reduce-scatter + allgather of an ``nbytes`` buffer."""
    chunks = [len(c) for c in np.array_split(np.zeros(nbytes, dtype=np.uint8), world)]
    sent, received = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
    for phase in range(2):  # 0: reduce-scatter, 1: allgather
        for step in range(world - 1):
            for r in range(world):
                chunk = (r - step + phase) % world
                sent[r] += chunks[chunk]
                received[(r + 1) % world] += chunks[chunk]
    return sent, received


def simulate_ring_allgather(sizes):
    """Bytes each rank sends and receives in a ring allgather of payloads of ``sizes`` bytes."""
    world = len(sizes)
    sent, received = np.zeros(world, dtype=np.int64), np.zeros(world, dtype=np.int64)
    for step in range(world - 1):
        for r in range(world):
            block = (r - step) % world  # rank r forwards the block it received in the previous step
            sent[r] += sizes[block]
            received[(r + 1) % world] += sizes[block]
    return sent, received


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("nbytes", [8, 1000, 4 * 3072 * 1024 + 4])
def test_ring_allreduce_bytes_match_a_simulation(world, nbytes):
    sent, received = simulate_ring_allreduce(nbytes, world)
    w = netcost.allreduce(nbytes, world)
    for r in range(world):
        assert abs(w.sent - sent[r]) <= 2 * (world - 1), (r, w, sent[r])  # chunks differ by at most a byte
        assert abs(w.received - received[r]) <= 2 * (world - 1)
    assert sum(sent) == sum(received)
    assert netcost.allreduce(nbytes, world, netcost.Link(reduction="in_network")) == netcost.Wire(nbytes, nbytes)


@pytest.mark.parametrize("world", [2, 3, 8, 16])
def test_ring_allgather_bytes_match_a_simulation(world):
    sent, received = simulate_ring_allgather([4712] * world)
    w = netcost.allgather(4712, world)
    assert all(w.sent == s and w.received == r for s, r in zip(sent, received))
    # variable sizes: this rank's (W-1) x own is exact summed over the ranks
    sizes = [8 * (3 + 5 * r) for r in range(world)]
    sent, received = simulate_ring_allgather(sizes)
    assert sum(netcost.allgather(s, world).sent for s in sizes) == sent.sum() == received.sum()
    for r in range(world):
        assert received[r] == sum(sizes) - sizes[r]


def test_one_rank_and_empty_buffers_move_nothing():
    for collective in netcost.COLLECTIVES:
        assert netcost.wire(collective, 1000, 1) == netcost.NONE
        assert netcost.wire(collective, 0, 8) == netcost.NONE
    with pytest.raises(ValueError, match="unknown collective"):
        netcost.wire("allscatter", 8, 2)


def test_link_parsing_and_errors():
    link = netcost.Link.parse("25Gbit/s, 10us")
    assert link.bandwidth == pytest.approx(25e9 / 8) and link.latency == pytest.approx(10e-6)
    assert netcost.Link.parse("100gbit,in_network").reduction == "in_network"
    assert netcost.Link.parse("500MB/s,1ms").bandwidth == pytest.approx(5e8)
    with pytest.raises(ValueError, match="give e.g."):
        netcost.Link.parse("fast")
    with pytest.raises(ValueError, match="bandwidth"):
        netcost.Link(bandwidth=0)
    with pytest.raises(ValueError, match="reduction"):
        netcost.Link(reduction="tree")


def test_link_from_environment(monkeypatch):
    monkeypatch.setenv(netcost.LINK_ENV, "1Gbit/s,50us")
    link = netcost.Link.from_env()
    assert link.bandwidth == pytest.approx(1.25e8) and link.latency == pytest.approx(50e-6)
    monkeypatch.delenv(netcost.LINK_ENV)
    assert netcost.Link.from_env() == netcost.Link()


@pytest.mark.parametrize("world", range(2, 17))
def test_gather_chosen_only_where_it_moves_fewer_bytes(world):
    """Without latency (the default: fused collectives) an allgather is chosen iff it moves fewer bytes
    per rank than the ring allreduce, i.e. W P < 2 D; never a payload of at least D."""
    dense = 4 * 3072 * 1024
    for payload in sorted({1, dense // 64, dense // 16, dense // 8, 2 * dense // world - 8, 2 * dense // world,
                           2 * dense // world + 8, dense // 2, dense - 1, dense}):
        if payload <= 0:
            continue
        gather, why = netcost.choose_gather(payload, dense, world, netcost.Link())
        expected = payload < dense and (world - 1) * payload < 2 * (world - 1) * dense / world
        assert gather == expected, (world, payload, why)
        if gather:
            assert netcost.allgather(payload, world).received <= netcost.allreduce(dense, world).received
        else:
            assert "allgather" in why or ">= dense" in why


def test_latency_pays_for_a_few_more_gathered_bytes_but_no_more():
    """With latency, the allgather's W-1 messages against the allreduce's 2(W-1) buy it exactly
    ``(W-1) latency bandwidth`` bytes of slack, per the alpha-beta model."""
    world, dense = 8, 80_000
    link = netcost.Link(bandwidth=1e9, latency=10e-6)
    slack = (world - 1) * link.latency * link.bandwidth / (world - 1)  # per payload byte of the (W-1) P term
    edge = 2 * dense / world  # bandwidth-only break-even payload
    assert netcost.choose_gather(int(edge + slack) - 8, dense, world, link)[0]
    assert not netcost.choose_gather(int(edge + slack) + 8, dense, world, link)[0]
    assert not netcost.choose_gather(int(edge) + 8, dense, world, netcost.Link(bandwidth=1e9))[0]


@pytest.mark.parametrize("world", range(2, 17))
def test_adtopk_path_follows_the_model(world):
    """The compressor's hybrid rule is the model's: fp32 values + int16 fiber-local indices (6 B per entry,
    each region padded to 8), compared with a ring allreduce of the fp32 tensor at W ranks."""
    for ratio in (0.01, 0.1, 0.25, 0.4):
        c = Compression.adtopk(ratio=ratio)
        info = TensorInfo("w", (3072, 1024), 3072 * 1024, torch.float32)
        k = max(1, math.floor(ratio * 1024))
        payload = 3072 * k * 6
        sparse, why = c.choose_path(info, world)
        assert sparse == (world * payload < 2 * 4 * 3072 * 1024), (world, ratio, why)


def quantized_block_bytes(bits: int, count: int, group: int, max_index: int) -> int:
    """The low-bit block's size from its documented layout: bfloat16 levels, packed codes, packed indices,
    padded to 8 bytes (quantize module docstring), computed here independently."""
    levels = (count // group) * 2 ** (bits - 1) * 2
    index_bits = max(1, math.ceil(math.log2(max_index + 1)))
    used = levels + math.ceil(count * bits / 8) + math.ceil(count * index_bits / 8)
    return -(-used // 8) * 8


def test_low_bit_payload_is_judged_on_its_codes():
    """The issue's example: the README's AdamW recipe (ADTopk 0.25, 2-bit values, groups of 64) on a
    [3072, 1024] matrix was judged on its fp32 payload and sent dense from W = 6. On its codes it is
    sparse up to the W where (W-1) x block >= 2 (W-1)/W x dense."""
    info = TensorInfo("w", (3072, 1024), 3072 * 1024, torch.float32)
    c = Compression.adtopk(ratio=0.25)
    lay = c.layout(info)
    block = QuantizedWire(2, lay.count, lay.k, lay.fiber_len - 1).block_bytes
    group_of = lay.k  # value_group 64 <= k = 256: one fiber per group
    assert block == quantized_block_bytes(2, lay.count, group_of, lay.fiber_len - 1)
    last_sparse = max(w for w in range(2, 1025) if w * block < 2 * 4 * info.numel)
    assert last_sparse >= 8  # sparse at W = 8 on its codes (was dense from W = 6 on fp32)
    for world in (2, 6, 8, last_sparse, last_sparse + 1, 64):
        assert c.choose_path(info, world, payload=block)[0] == (world <= last_sparse), world


def test_stats_wire_counters():
    s = Stats()
    world = 4
    s.record("w", 1000, 10, 80, wire=netcost.allgather(80, world), world=world)
    s.record("b", 10, 10, 40, wire=netcost.allreduce(40, world), world=world)
    d = s.as_dict()
    assert d["wire_bytes_sent"] == d["wire_bytes_received"] == 3 * 80 + 60
    assert d["wire_bytes_dense"] == 6000 + 60  # 2 (W-1)/W x 4 x numel each
    assert d["wire_compression"] == pytest.approx(6060 / 300)
    assert d["bytes_sent"] == 120 and d["bytes_dense"] == 4040  # the payload figures, unchanged
    assert d["tensors"]["w"]["wire_bytes_sent"] == 240 and d["tensors"]["w"]["wire_bytes_dense"] == 6000
    s.baseline("w", 1000, world)  # a step without communication (local steps): the baseline only
    assert s.as_dict()["wire_bytes_dense"] == 12060 and s.as_dict()["wire_bytes_sent"] == 300
    assert Stats().as_dict()["wire_compression"] == 0.0
