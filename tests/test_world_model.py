"""benchmarks/bench_world_model.py against hand computations (pure Python: no torch, no Horovod; ~2 s).

The expected numbers below are worked out by hand from the layer shapes and the wire format (README's
"Wire format": fp32 values, int16 indices for indices up to 32767, int32 above, each part padded to 8 bytes),
not by calling the script's own helpers.
"""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("bench_world_model", REPO / "benchmarks" / "bench_world_model.py")
wm = sys.modules[SPEC.name] = importlib.util.module_from_spec(SPEC)  # dataclasses look it up
SPEC.loader.exec_module(wm)

pytestmark = pytest.mark.quick

GPT2 = 124_439_808
FUSED = wm.FUSED


def test_real_shapes_add_up():
    assert sum(math.prod(s) for _, s in wm.model_shapes("gpt2-small")) == GPT2
    assert len(wm.model_shapes("gpt2-small")) == 2 + 12 * 12 + 2  # wte, wpe, 12 per block, ln_f
    assert sum(math.prod(s) for _, s in wm.model_shapes("bert-base")) == 109_482_240
    assert sum(math.prod(s) for _, s in wm.model_shapes("resnet50")) == 25_557_032
    assert dict(wm.model_shapes("resnet50"))["layer4.0.conv2"] == (512, 512, 3, 3)


def test_dense_ring_bytes_gpt2_at_64():
    # 2 (W-1)/W * 4 * numel = 126/64 * 4 * 124,439,808 = 63 * 15,554,976
    c = wm.REGISTRY["dense"][0](wm.model_shapes("gpt2-small"), 64, 8, FUSED)
    assert c.wire.sent == c.wire.received == 979_963_488 == 2 * 63 * 4 * GPT2 // 64
    assert c.nic == 979_963_488  # 8 hosts: one ring edge leaves each host
    assert wm.REGISTRY["fp16"][0](wm.model_shapes("gpt2-small"), 64, 8, FUSED).wire.sent == 979_963_488 // 2
    one_host = wm.REGISTRY["dense"][0](wm.model_shapes("gpt2-small"), 8, 8, FUSED)
    assert one_host.nic == 0 and one_host.wire.sent == 2 * 7 * 4 * GPT2 // 8


def test_adtopk_allgather_bytes_gpt2_at_64():
    # per-rank payloads at ratio 0.01 (fiber, k, entries, values + indices padded):
    #   wte [50257, 768]: 768 columns of 50,257, k = 502: 385,536 entries, int32: 1,542,144 + 1,542,144
    #   wpe [1024, 768]: rows of 768 give k = 7 (0.0091, not within 5% of 0.01) -> 768 columns of 1024, k = 10:
    #       7,680 entries, int16: 30,720 + 15,360
    #   c_attn [768, 2304]: rows, k = 23: 17,664 entries: 70,656 + 35,328
    #   attn c_proj [768, 768]: rows (tie), k = 7: 5,376 entries: 21,504 + 10,752
    #   c_fc [768, 3072]: rows, k = 30 (0.00977, within 5%): 23,040 entries: 92,160 + 46,080
    #   mlp c_proj [3072, 768]: 768 columns of 3072, k = 30: 23,040 entries: 92,160 + 46,080
    payload = 3_084_288 + 46_080 + 12 * (105_984 + 32_256 + 138_240 + 138_240)
    assert payload == 8_107_008
    # every one is gathered at W = 64 (64 P < 2 D, e.g. wte 64 x 3.08 MB < 2 x 154.4 MB)
    # the 1-D tensors, 12 x 9,984 + 1,536 = 121,344 floats, are allreduced: 126/64 x 4 x 121,344 = 955,584
    c = wm.REGISTRY["adtopk"][0](wm.model_shapes("gpt2-small"), 64, 8, FUSED)
    assert c.wire.sent == 63 * payload + 955_584 == 511_697_088
    assert c.nic == c.wire.sent
    # at W = 256 the hybrid rule allreduces everything (256 P >= 2 D for every tensor): dense's bytes
    c256 = wm.REGISTRY["adtopk"][0](wm.model_shapes("gpt2-small"), 256, 8, FUSED)
    assert c256.wire.sent == wm.REGISTRY["dense"][0](wm.model_shapes("gpt2-small"), 256, 8, FUSED).wire.sent


def test_topk_flat_int32_indices():
    # [4096, 4096] at 0.01: k = 167,772 entries, 4 + 4 bytes each (flat indices > 32767)
    c = wm.REGISTRY["topk"][0]([("w", (4096, 4096))], 16, 8, FUSED)
    assert c.wire.sent == 15 * 167_772 * 8


def test_hierarchical_one_tensor():
    # [4096, 4096] at 64 ranks = 8 hosts x 8: rows of 4096, k = 40; each local rank owns 512 rows:
    # a block of 20,480 entries = 81,920 + 40,960 bytes, allgathered among the 8 hosts
    c = wm.REGISTRY["hierarchical"][0]([("w", (4096, 4096))], 64, 8, FUSED)
    assert c.wire.sent == 7 * 122_880
    assert c.nic == 7 * 8 * 122_880  # eight cross-host rings share the host's NIC
    assert c.intra == pytest.approx(2 * 7 / 8 * 4 * 4096 * 4096)  # reduce-scatter + allgather inside the host
    flat = wm.REGISTRY["adtopk"][0]([("w", (4096, 4096))], 64, 8, FUSED)
    assert flat.nic == 63 * 8 * 122_880  # (W-1) P: hierarchical moves (H-1)/(W-1) of it
    assert "flat: one host" in wm.REGISTRY["hierarchical"][0]([("w", (4096, 4096))], 8, 8, FUSED).notes


def test_powersgd_rank4():
    # [3072, 768]: P 3072 x 4, Q 768 x 4 floats, each allreduced: 126/64 x (49,152 + 12,288)
    c = wm.REGISTRY["powersgd"][0]([("w", (3072, 768)), ("b", (768,))], 64, 8, FUSED)
    assert c.wire.sent == 120_960 + 126 * 4 * 768 // 64


def test_adamw_recipe_low_bit_block_and_its_switch_to_allreduce():
    # [768, 3072] at ratio 0.25: rows, k = 768, 589,824 entries; 2-bit codes 147,456 B, indices of 12 bits
    # (fiber of 3072) 884,736 B, one group per fiber (k >= 64): 768 x 2 bf16 levels = 3,072 B -> 1,035,264 B
    shape = [("w", (768, 3072))]
    gathered = wm.REGISTRY["adamw_recipe_allgather"][0]  # exchange="allgather": the allgather or the allreduce
    c16 = gathered(shape, 16, 8, FUSED)
    assert c16.wire.sent == 15 * 1_035_264 // 4 and not c16.per_step  # gathered (16 P < 2 D), a sync every 4 steps
    c32 = gathered(shape, 32, 8, FUSED)
    assert c32.wire.sent == 2 * 31 * 4 * 768 * 3072 // 32 // 4  # 32 P >= 2 D: fp32 allreduce, as DiLoCo
    assert c32.wire.sent == wm.REGISTRY["diloco"][0](shape, 32, 8, FUSED).wire.sent
    # the default (auto): the owner-sharded exchange from 3 ranks on, 2 (W-1)/W P per rank at any W
    for w in (3, 16, 32, 1024):
        c = wm.REGISTRY["adamw_recipe"][0](shape, w, 8, FUSED)
        assert c.wire.sent == round(2 * (w - 1) / w * 1_035_264) // 4 and c.steps == 2 * (w - 1) // 4, w
    assert wm.REGISTRY["adamw_recipe"][0](shape, 2, 1, FUSED).wire.sent == 1_035_264 // 4  # W = 2: gathered


def test_sharded_exchanges_do_not_grow_with_w():
    shapes = wm.model_shapes("resnet50")
    for name in ("lowbit_twostage", "sparse_rs"):
        costs = [wm.REGISTRY[name][0](shapes, w, 8, FUSED) for w in (16, 64, 256, 1024)]
        # a host's NIC: its 8 ranks' all-to-all to the other hosts, 8 (W-8)/W P, and one allgather ring edge
        assert costs[-1].nic <= 2 * costs[0].nic, name
        # a rank's wire bytes: 2 (W-1)/W P, within 7% of each other from W = 16 to 1,024
        assert costs[-1].wire.received <= 1.07 * costs[0].wire.received, name
    # 2-bit codes of [1024, 1024]: 262,144 B of codes + 1024 rows x 2 bf16 levels = 266,240 B = P; 16 ranks on 2
    # hosts of 8, flat over all ranks: a NIC carries its 8 ranks' all-to-all shares for the other host,
    # 8 x 8/16 P = 4 P, and one edge of the allgather ring, 15/16 P; a rank 2 x 15/16 P; a sync every 4 steps
    c = wm.REGISTRY["lowbit_twostage"][0]([("w", (1024, 1024))], 16, 8, FUSED)
    assert c.nic == (4 + 15 / 16) * 266_240 / 4 and c.wire.received == round(2 * 15 / 16 * 266_240) // 4


def test_break_even_closed_form():
    # no overlap, no latency: PowerSGD beats dense below (dense NIC - PowerSGD NIC) / its GPU work
    shapes, hw = wm.model_shapes("gpt2-small"), wm.Hardware(25e9 / 8, 300e9, 0.0, 0.0, 0.19, 0.1)
    x, d = (wm.REGISTRY[n][0](shapes, 64, 8, FUSED) for n in ("powersgd", "dense"))
    work = wm.step_seconds(x, 64, 8, 0.3, hw)["work_s"]
    expected = (d.nic - x.nic) / work * 8 / 1e9
    assert wm.break_even_gbit("powersgd", shapes, 64, 8, 0.3, hw) == pytest.approx(expected, rel=2e-3)
    assert wm.break_even_gbit("fp16", shapes, 64, 8, 0.3, hw) == "always"


def test_validate_records(tmp_path):
    good = {"config": "adtopk:0.01", "world": 8, "ranks_per_host": 1, "shapes": [["w", [4096, 2048]], ["b", [4096]]],
            "wire_bytes_sent": 3 * (7 * 491_520 + 28_672) * 1.01, "steps": 3}  # 3 steps, measured 1% above
    # [4096, 2048]: rows of 2048, k = 20: 81,920 entries, 327,680 + 163,840 B gathered from 7 others;
    # the bias allreduced: 7/4 x 16,384 B
    off = {"config": "none", "world": 8, "layout": [8, 1], "numel": 1000, "wire_bytes_sent": 2000}  # model 7,000
    path = tmp_path / "records.json"
    path.write_text(json.dumps([good]))
    rows, ok = wm.validate(path, 8, 0.05)
    assert ok and rows[0]["wire_bytes_sent_model"] == 7 * 491_520 + 28_672
    path.write_text(json.dumps({"records": [good, off]}))
    assert wm.main(["--validate", str(path)]) == 1


def test_main_writes_json_and_markdown(tmp_path):
    assert wm.main(["--models", "resnet50", "--worlds", "8", "64", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "world_model.json").read_text())
    assert data["provenance"]["command"].startswith("python benchmarks/bench_world_model.py")
    row = data["models"]["resnet50"]["worlds"]["64"]
    assert row["dense"]["pct_of_dense"] == 100 and set(row) == set(wm.REGISTRY)
    assert "| W=64" in (tmp_path / "world_model.md").read_text()
