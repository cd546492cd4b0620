"""Issue 29: local steps with an outer exchange (DiLoCo / SparseLoCo style) on both engines.

Real Horovod ranks (``tests.harness.run_ranks``) and real torch.distributed Gloo ranks (``tests._ddp_launch``
under ``tests.harness.run_command``'s timeout, which kills the whole process tree). Checked against a numpy
model of DiLoCo and of the error-feedback sparse outer exchange written here from the issue's equations
(nothing of the package is imported for it), at 2, 3 and 8 ranks over several syncs:

- the final parameters and every rank's pseudo-gradient residuals equal the numpy model's;
- ranks are bitwise identical after every sync; no collective runs between syncs (counted on the engine's
  real communicator);
- the error-feedback invariant per rank: ``sum_t delta_t = sent + residual``, with what was sent observed
  through the parameters (``Outer.sgd(1)``: ``W (theta_0 - theta_T) = sum_r sent_r``);
- a run that ends mid-interval: ``opt.sync_now()`` syncs the shorter last interval (in the numpy model too)
  with the outer step, or with ``average=True`` the average as it is; once: a second call runs no collective;
- ``sync_every=1`` + ``Outer.sgd(1)`` + dense equals ordinary data parallelism (both engines);
- a resume in the middle of an interval is bitwise the same as not stopping (both engines);
- bad settings raise clear errors; ranks that disagree all raise; ``hvd.join()`` / uneven data.
"""
import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests import reference as ref
from tests.harness import RanksFailed, run_command, run_ranks

IN, OUT, BATCH = 24, 16, 8
SPARSE_KW = {"min_numel": 0, "hybrid": False}
CASES = [
    {"name": "diloco_dense", "sync_every": 3, "steps": 12, "inner_lr": 0.1,
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}},
    {"name": "adtopk_nesterov_warmup", "sync_every": 3, "steps": 12, "inner_lr": 0.1, "warmup": 1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.1, "axis": 1, **SPARSE_KW},
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}},
    {"name": "adtopk_sparseloco_decay", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.1, "axis": 0, **SPARSE_KW},
     "outer": {"lr": 1.0, "momentum": 0.0, "feedback_decay": 0.8}},
    {"name": "topk_ef_sgd", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "topk", "kwargs": {"ratio": 0.05, **SPARSE_KW}, "outer": {"lr": 1.0, "momentum": 0.0}},
    # SparseLoCo-style low-bit values: per-fiber levels (ADTopk) and one group per payload (Top-k)
    {"name": "adtopk_2bit_ef_sgd", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "axis": 1, **SPARSE_KW},
     "outer": {"lr": 1.0, "momentum": 0.0, "value_bits": 2}},
    {"name": "adtopk_3bit_cols_decay_nesterov", "sync_every": 3, "steps": 12, "inner_lr": 0.1, "warmup": 1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.5, "axis": 0, **SPARSE_KW},
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True, "feedback_decay": 0.9, "value_bits": 3}},
    {"name": "topk_1bit_ef_sgd", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "topk", "kwargs": {"ratio": 0.1, **SPARSE_KW}, "outer": {"lr": 1.0, "momentum": 0.0, "value_bits": 1}},
    # levels shared by runs of whole fibers: 24 column fibers keep 4 each, value_group 10 -> runs of 3 fibers
    {"name": "adtopk_2bit_grouped_cols", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "axis": 0, **SPARSE_KW},
     "outer": {"lr": 1.0, "momentum": 0.0, "value_bits": 2, "value_group": 10}},
    # whole columns joined (the GPT job's fiber layout): W [16, 24] -> view [48, 8], 8 fibers of 48 keeping 12,
    # 2-bit levels shared by runs of 2 fibers
    {"name": "adtopk_joined_columns_2bit_grouped", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "min_fiber_len": 48, "join": "columns", **SPARSE_KW},
     "outer": {"lr": 1.0, "momentum": 0.0, "value_bits": 2, "value_group": 20}},
    # dense low-bit: every entry as a code (Compression.none + value_bits), levels per row / per run of rows
    {"name": "dense_2bit_ef_sgd", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "outer": {"lr": 1.0, "momentum": 0.0, "value_bits": 2}},
    # a run that ends mid-interval: opt.sync_now() syncs the last, shorter interval with the outer step, or
    # (average=True) applies its average as it is
    {"name": "diloco_dense_final_outer_step", "sync_every": 3, "steps": 11, "inner_lr": 0.1, "final_sync": "outer",
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}},
    {"name": "diloco_dense_final_average", "sync_every": 4, "steps": 10, "inner_lr": 0.1, "final_sync": "average",
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True}},
    {"name": "adtopk_ef_sgd_final_sync", "sync_every": 4, "steps": 10, "inner_lr": 0.1, "final_sync": "outer",
     "compressor": "adtopk", "kwargs": {"ratio": 0.1, "axis": 1, **SPARSE_KW}, "outer": {"lr": 1.0, "momentum": 0.0}},
    # torchft's model: any torch.optim optimizer as the outer step (Outer.custom), here Adam on the EF pseudo-gradient
    {"name": "adtopk_custom_adam_outer", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "axis": 1, **SPARSE_KW},
     "outer": {"optimizer": "adam", "lr": 0.05, "betas": [0.9, 0.99], "eps": 1e-8, "momentum": 0.0}},
    {"name": "dense_1bit_grouped_nesterov_decay", "sync_every": 3, "steps": 12, "inner_lr": 0.1, "warmup": 1,
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True, "feedback_decay": 0.9, "value_bits": 1,
               "value_group": 48}},
]
# the cases above pin the allgather; these run the owner-sharded exchange (horovod_adtopk.sharded): the owner
# averages its fibers' shard, adds its own residual, re-selects (ADTopk) and re-encodes, e_own <- c - carried
for _case in CASES:
    _case["outer"].setdefault("exchange", "allgather")
SHARDED_CASES = [
    {"name": "sharded_adtopk_2bit_grouped_decay", "sync_every": 2, "steps": 10, "inner_lr": 0.1, "warmup": 1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "axis": 0, **SPARSE_KW},
     "outer": {"lr": 1.0, "momentum": 0.0, "feedback_decay": 0.9, "value_bits": 2, "value_group": 8,
               "exchange": "sharded"}},
    {"name": "sharded_adtopk_rows_fp_ef_sgd", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "axis": 1, **SPARSE_KW},
     "outer": {"lr": 1.0, "momentum": 0.0, "exchange": "sharded"}},
    {"name": "sharded_joined_columns_2bit_nesterov", "sync_every": 3, "steps": 12, "inner_lr": 0.1,
     "compressor": "adtopk", "kwargs": {"ratio": 0.25, "min_fiber_len": 48, "join": "columns", **SPARSE_KW},
     "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True, "value_bits": 2, "exchange": "sharded"}},
    {"name": "sharded_dense_2bit_ef_sgd", "sync_every": 2, "steps": 10, "inner_lr": 0.1,
     "outer": {"lr": 1.0, "momentum": 0.0, "value_bits": 2, "exchange": "sharded"}},
]
CASES += SHARDED_CASES


# --- the numpy model ---------------------------------------------------------------------------------------------

def batch(rank: int, step: int):
    rs = np.random.RandomState(1000 * rank + step + 1)
    return rs.standard_normal((BATCH, IN)), rs.standard_normal((BATCH, OUT))


def grads(w, b, x, y):
    """Gradients of ``0.5 * mean_i ||W x_i + b - y_i||^2``."""
    r = (x @ w.T + b - y) / x.shape[0]
    return {"weight": r.T @ x, "bias": r.sum(0)}


def joined(case):
    """The min_fiber_len of a case whose short columns are joined (``join="columns"``), else False."""
    kw = case.get("kwargs", {})
    return kw.get("join") == "columns" and kw["min_fiber_len"]


def select_mask(case, a):
    kind = case.get("compressor", "none")
    if kind == "adtopk" and joined(case):
        return ref.joined_columns_mask(a, case["kwargs"]["ratio"], case["kwargs"]["min_fiber_len"])
    if kind == "adtopk":
        return ref.adtopk_mask(a, case["kwargs"]["ratio"], case["kwargs"]["axis"])
    if kind == "topk":
        return ref.topk_mask(a, case["kwargs"]["ratio"])
    raise AssertionError(kind)


def bf16_gathers(numel: int, world: int) -> bool:
    """An allgather of bfloat16 ((W-1) x 2 bytes an entry) against a ring allreduce of float32 (2 (W-1)/W x 4)."""
    return (world - 1) * 2 * numel < 2 * (world - 1) / world * 4 * numel


def numpy_local_steps(case, initial, world):
    """DiLoCo / the EF sparse outer exchange, W ranks (module docstring of horovod_adtopk.local_steps):
    H inner SGD steps per rank; delta = theta - w_r; a = delta + beta e; sent = a * mask (dense: a);
    e = a - sent; avg = mean sent; b = mu b + avg; theta -= lr (avg + mu b) (Nesterov) or lr avg."""
    theta = {n: np.array(v, dtype=np.float64) for n, v in initial.items()}
    w = [{n: v.copy() for n, v in theta.items()} for _ in range(world)]
    resid = [{} for _ in range(world)]
    mom = {n: np.zeros_like(v) for n, v in theta.items()}
    sq = {n: np.zeros_like(v) for n, v in theta.items()}  # Adam's second moment (Outer.custom cases)
    owner = {}  # the owners' residuals, all shards together (sharding leaves the math unchanged)
    o, H, sparse_kind = case["outer"], case["sync_every"], case.get("compressor", "none") != "none"
    syncs = 0
    for step in range(case["steps"]):
        for r in range(world):
            g = grads(w[r]["weight"], w[r]["bias"], *batch(r, step))
            for n in theta:
                w[r][n] = w[r][n] - case["inner_lr"] * g[n]
        if (step + 1) % H and not (case.get("final_sync") and step == case["steps"] - 1):
            continue
        sent = []
        for r in range(world):
            mine = {}
            for n in theta:
                delta = theta[n] - w[r][n]
                if not sparse_kind and o.get("value_bits"):  # every entry as a code: levels per row (run of rows)
                    a = delta + o.get("feedback_decay", 1.0) * resid[r].get(n, 0.0)
                    if syncs < case.get("warmup", 0):
                        mine[n] = a
                    elif delta.ndim == 2:
                        mine[n] = ref.quantize_sparse(a, np.ones(a.shape, bool), o["value_bits"], 1,
                                                      o.get("value_group"))
                    else:
                        mine[n] = ref.quantize_group(a, o["value_bits"])
                    resid[r][n] = a - mine[n]
                elif sparse_kind and delta.ndim == 2:  # 1-D tensors travel dense (no residual)
                    a = delta + o.get("feedback_decay", 1.0) * resid[r].get(n, 0.0)
                    if syncs < case.get("warmup", 0):
                        mine[n], resid[r][n] = a, np.zeros_like(a)
                    else:
                        mask = select_mask(case, a)
                        mine[n] = np.where(mask, a, 0.0)
                        if o.get("value_bits") and joined(case):  # levels per fiber: the joined view's columns
                            view = ref.joined_columns_shape(a.shape, joined(case))
                            mine[n] = ref.quantize_sparse(a.reshape(view), mask.reshape(view), o["value_bits"], 0,
                                                          o.get("value_group")).reshape(a.shape)
                        elif o.get("value_bits"):  # carried values, the rest stays in e (module docstring)
                            axis = case["kwargs"].get("axis") if case["compressor"] == "adtopk" else None
                            mine[n] = ref.quantize_sparse(a, mask, o["value_bits"], axis, o.get("value_group"))
                        resid[r][n] = a - mine[n]
                elif o.get("value_bits") and bf16_gathers(delta.size, world):
                    # always-dense tensors then travel as bfloat16, the rounding in e, while gathering bfloat16
                    # moves fewer bytes than an fp32 allreduce; from 4 ranks on they are allreduced exactly
                    a = delta + o.get("feedback_decay", 1.0) * resid[r].get(n, 0.0)
                    mine[n] = ref.round_bf16(a)
                    resid[r][n] = a - mine[n]
                else:
                    mine[n] = delta
            sent.append(mine)
        final_average = case.get("final_sync") == "average" and step == case["steps"] - 1 and (step + 1) % H
        averages = {n: sum(s[n] for s in sent) / world for n in theta}
        if o.get("exchange") == "sharded" and world > 1 and syncs >= case.get("warmup", 0):
            owner_stage(case, averages, owner)
        for n in theta:
            avg = averages[n]
            if final_average:  # sync_now(average=True): the average as it is, the momentum kept
                theta[n] = theta[n] - avg
            elif o.get("optimizer") == "adam":  # torch.optim.Adam's update (Kingma & Ba, bias-corrected)
                (b1, b2), t = o["betas"], syncs + 1
                mom[n] = b1 * mom[n] + (1 - b1) * avg
                sq[n] = b2 * sq[n] + (1 - b2) * avg * avg
                denom = np.sqrt(sq[n]) / np.sqrt(1 - b2 ** t) + o["eps"]
                theta[n] = theta[n] - o["lr"] / (1 - b1 ** t) * mom[n] / denom
            elif o["momentum"] > 0:
                mom[n] = o["momentum"] * mom[n] + avg
                theta[n] = theta[n] - o["lr"] * (avg + o["momentum"] * mom[n] if o.get("nesterov") else mom[n])
            else:
                theta[n] = theta[n] - o["lr"] * avg
        for r in range(world):
            w[r] = {n: v.copy() for n, v in theta.items()}
        syncs += 1
    return theta, resid, owner


def owner_stage(case, averages, owner):
    """The owners' step of the sharded exchange on the 2-D weight: c = avg + e_own; ADTopk's rule again on c
    (the same k per fiber, ties to the lower position), its values carried as the allgather path carries a
    rank's (low-bit codes per run of fibers, or exactly); e_own = c - carried; the update is what was carried.
    Shards are runs of whole value groups, so cutting the fibers among owners changes no value."""
    o = case["outer"]
    n = "weight"
    c = averages[n] + owner.get(n, 0.0)
    if case.get("compressor", "none") == "none":  # dense low-bit: every entry a code, levels per row (run)
        carried = ref.quantize_sparse(c, np.ones(c.shape, bool), o["value_bits"], 1, o.get("value_group"))
    else:
        mask = select_mask(case, c)
        carried = np.where(mask, c, 0.0)
        if o.get("value_bits") and joined(case):
            view = ref.joined_columns_shape(c.shape, joined(case))
            carried = ref.quantize_sparse(c.reshape(view), mask.reshape(view), o["value_bits"], 0,
                                          o.get("value_group")).reshape(c.shape)
        elif o.get("value_bits"):
            carried = ref.quantize_sparse(c, mask, o["value_bits"], case["kwargs"]["axis"], o.get("value_group"))
    owner[n] = c - carried
    averages[n] = carried


# --- the checks --------------------------------------------------------------------------------------------------

def check_reference(results, world):
    """``results[rank][case]`` from local_steps_workers.train_case."""
    for ci, case in enumerate(CASES):
        per_rank = [results[r][ci] for r in range(world)]
        theta, resid, owner = numpy_local_steps(case, per_rank[0]["initial"], world)
        if owner:  # every rank's shard of the owners' residuals, joined in fiber order
            check_owner_residuals(case, per_rank, owner, world)
        H = case["sync_every"]
        for r, res in enumerate(per_rank):
            assert res["initial"] == per_rank[0]["initial"], f"{case['name']}: rank {r} did not start from rank 0"
            for n, v in theta.items():
                np.testing.assert_allclose(np.array(res["final"][n]), v, rtol=1e-9, atol=1e-12,
                                           err_msg=f"{case['name']} rank {r} {n}")
            got = {n: np.array(v) for n, v in res["residuals"].items()}
            want = {n: v for n, v in resid[r].items()}
            assert sorted(got) == sorted(want), (case["name"], sorted(got), sorted(want))
            for n in want:
                np.testing.assert_allclose(got[n], want[n], rtol=1e-9, atol=1e-12, err_msg=f"{case['name']} e_{r} {n}")
            # no collective between syncs (the first step also runs the configuration check)
            for step, count in enumerate(res["collectives"]):
                if (step + 1) % H == 0:
                    assert count > 0, f"{case['name']}: step {step} should have synced"
                elif step > 0:
                    assert count == 0, f"{case['name']}: {count} collectives at local step {step}"
            assert res["digests"] == per_rank[0]["digests"], f"{case['name']}: rank {r} differs after a sync"
        assert len(per_rank[0]["digests"]) == n_syncs(case)
        if case.get("final_sync"):  # synced once, then nothing left to exchange
            for res in per_rank:
                assert res["final_sync"][:3] == [True, res["final_sync"][1], False] and res["final_sync"][1] > 0
                assert res["final_sync"][3] == 0, f"{case['name']}: a second sync_now() ran collectives"
        lossless = case["outer"].get("feedback_decay", 1.0) == 1.0
        if case["outer"]["lr"] == 1.0 and case["outer"]["momentum"] == 0.0 and lossless:  # the EF invariant
            for n in theta:
                initial = np.array(per_rank[0]["initial"][n])
                moved = world * (initial - np.array(per_rank[0]["final"][n]))  # = sum_r sent_r - W sum_j e_own_j
                sent = sum(np.array(res["delta_sum"][n]) - np.array(res["residuals"].get(n, 0.0)) for res in per_rank)
                if n in owner:  # the owners' memory holds what the second selection did not carry yet
                    sent = sent - world * owner[n]
                np.testing.assert_allclose(sent, moved, rtol=1e-9, atol=1e-12, err_msg=f"EF invariant {n}")
            assert any(np.abs(np.array(v)).sum() > 0 for res in per_rank for v in res["residuals"].values())
        stats = per_rank[0]["stats"]
        dense = 4 * (IN * OUT + OUT) * case["steps"]
        assert stats["bytes_dense"] == dense and stats["steps"] == case["steps"] and stats["round"] == n_syncs(case)
        assert 0 < stats["bytes_sent"] < dense
        sharded_case = case["outer"]["exchange"] == "sharded"
        if case["outer"].get("value_bits") and case.get("compressor") == "adtopk" and not sharded_case:
            assert stats["bytes_sent"] == low_bit_bytes(case, world), case["name"]
        if case["outer"].get("value_bits") and "compressor" not in case and not sharded_case:
            assert stats["bytes_sent"] == low_bit_dense_bytes(case), case["name"]
        # wire bytes: every exchange here is an allgather or an allreduce, and at W ranks an allgather moves
        # (W-1) payloads, a ring allreduce 2 (W-1)/W of its buffer; at 2 ranks both are the payload itself
        assert stats["wire_bytes_dense"] == round(2 * (world - 1) / world * 4 * (IN * OUT + OUT)) * case["steps"]
        if case["outer"]["exchange"] == "sharded":
            check_sharded_bytes(case, per_rank, world)
        else:
            assert stats["wire_bytes_sent"] == stats["wire_bytes_received"], case["name"]
            if world == 2:
                assert stats["wire_bytes_sent"] == stats["bytes_sent"], case["name"]
        mem = per_rank[0]["memory_bytes"]
        numel = IN * OUT + OUT
        assert mem["outer_params"] == 8 * numel
        if case["outer"].get("optimizer") == "adam":  # two moments per entry and a float32 step count per tensor
            assert mem["outer_momentum"] == 2 * 8 * numel + 4 * 2, case["name"]
        else:
            assert mem["outer_momentum"] == (8 * numel if case["outer"]["momentum"] > 0 else 0)
        low_bit_dense = "compressor" not in case and case["outer"].get("value_bits")
        # the bias keeps a residual where it travels rounded: as codes (gathered below 16 ranks here) or bfloat16
        bf16_bias = OUT if case["outer"].get("value_bits") and (low_bit_dense or bf16_gathers(OUT, world)) else 0
        assert mem["residuals"] == (8 * (IN * OUT + bf16_bias) if "compressor" in case or low_bit_dense else 0)


def fiber_matrix(case, w):
    """The weight as the sharded exchange's fiber matrix [fibers, fiber_len] (rows of the fiber view)."""
    if case.get("compressor", "none") == "none":
        return w
    if joined(case):
        return w.reshape(ref.joined_columns_shape(w.shape, joined(case))).T
    return w if case["kwargs"]["axis"] == 1 else w.T


def weight_shards(case, world):
    """(fibers, fiber_len, k, run, owner fiber ranges) of the weight, from the rules written out here: runs of
    whole fibers sharing levels (value_group), owner j taking groups [G j // W, G (j+1) // W)."""
    fibers, fiber_len = fiber_matrix(case, np.zeros((OUT, IN))).shape
    o = case["outer"]
    k = fiber_len if case.get("compressor", "none") == "none" else int(np.floor(case["kwargs"]["ratio"] * fiber_len))
    run = ref.fiber_run(fibers, k, o.get("value_group")) if o.get("value_bits") else 1
    groups = fibers // run
    return fibers, fiber_len, k, run, [(groups * j // world * run, groups * (j + 1) // world * run) for j in range(world)]


def check_owner_residuals(case, per_rank, owner, world):
    """Every rank holds the owner residual of its own fibers; joined in rank order they equal the model's."""
    fibers, fiber_len, _, _, bounds = weight_shards(case, world)
    parts = [np.array(res["owner"]["weight"]).reshape(-1, fiber_len) for res in per_rank]
    assert [p.shape[0] for p in parts] == [hi - lo for lo, hi in bounds], case["name"]
    np.testing.assert_allclose(np.concatenate(parts), fiber_matrix(case, owner["weight"]), rtol=1e-9, atol=1e-12,
                               err_msg=f"{case['name']}: owners' residuals")
    assert sum(res["memory_bytes"]["owner_residuals"] for res in per_rank) == 8 * IN * OUT


def check_sharded_bytes(case, per_rank, world):
    """Wire bytes of the sharded weight per sync, from the block format written out here (levels, codes and
    packed indices padded to 8 bytes; without value_bits float64 values and int16 indices): stage 1 sends the
    other owners' blocks and receives (W-1) of its own shard's, stage 2 (W-1) of the widest block each way.
    The bias travels as in the allgather cases (float64 allreduce; bfloat16 gathered below 4 ranks)."""
    fibers, fiber_len, k, run, bounds = weight_shards(case, world)
    o = case["outer"]
    pad = lambda n: -(-n // 8) * 8  # noqa: E731
    width = int(np.ceil(np.log2(fiber_len)))
    indexed = case.get("compressor", "none") != "none"
    def block(lo, hi):
        n = (hi - lo) * k
        if not o.get("value_bits"):
            return pad(8 * n) + pad(2 * n)  # float64 values, int16 indices (the narrowest the wire uses)
        return pad((hi - lo) // run * 2 ** (o["value_bits"] - 1) * 2 + -(-n * o["value_bits"] // 8)
                   + (-(-n * width // 8) if indexed else 0))
    blocks = [block(lo, hi) for lo, hi in bounds]
    syncs, warm = n_syncs(case), case.get("warmup", 0)
    codes = pad(2 ** (o.get("value_bits") or 1) + -(-OUT * (o.get("value_bits") or 1) // 8))  # dense: the bias's codes
    if not indexed:
        gathers = (world - 1) * codes < 2 * (world - 1) / world * 4 * OUT
        bias = (world - 1) * codes if gathers else round(2 * (world - 1) / world * 8 * OUT)
    elif o.get("value_bits"):
        bias = (world - 1) * 2 * OUT if bf16_gathers(OUT, world) else round(2 * (world - 1) / world * 8 * OUT)
    else:
        bias = round(2 * (world - 1) / world * 8 * OUT)
    dense_weight = round(2 * (world - 1) / world * 8 * IN * OUT)
    for r, res in enumerate(per_rank):
        sent = sum(b for j, b in enumerate(blocks) if j != r) + (world - 1) * max(blocks)
        received = (world - 1) * blocks[r] + (world - 1) * max(blocks)
        # warm-up syncs: the weight as a float64 allreduce; a sparse rule's bias travels as always (bfloat16 with
        # value_bits), a dense low-bit bias as float64
        dense_bias = round(2 * (world - 1) / world * 8 * OUT) if not indexed else bias
        base = warm * (dense_weight + dense_bias) + (syncs - warm) * bias
        assert res["stats"]["wire_bytes_sent"] == base + (syncs - warm) * sent, (case["name"], r)
        assert res["stats"]["wire_bytes_received"] == base + (syncs - warm) * received, (case["name"], r)


def n_syncs(case) -> int:
    """Syncs in a case: every ``sync_every`` steps, plus ``sync_now()`` after a last, shorter interval."""
    full, rest = divmod(case["steps"], case["sync_every"])
    return full + (1 if rest and case.get("final_sync") else 0)


def low_bit_bytes(case, world: int) -> int:
    """What a rank hands to the collectives over the run with ADTopk and ``value_bits`` (module docstring of
    horovod_adtopk.quantize): per sync the weight's block (levels per run of fibers, packed codes, packed
    indices, padded to 8 bytes), the model's float64 during the warm-up syncs, and the bias as bfloat16 (as
    float64 from 4 ranks on, where allreducing it moves fewer bytes than gathering bfloat16)."""
    o, kw = case["outer"], case["kwargs"]
    bits = o["value_bits"]
    if joined(case):  # the joined view's columns: [OUT * g, IN / g]
        fiber_len, fibers = ref.joined_columns_shape((OUT, IN), joined(case))
    else:
        fibers, fiber_len = (OUT, IN) if kw["axis"] == 1 else (IN, OUT)
    k = int(np.floor(kw["ratio"] * fiber_len))
    run = ref.fiber_run(fibers, k, o.get("value_group"))
    count, width = fibers * k, int(np.ceil(np.log2(fiber_len)))
    used = (fibers // run) * 2 ** (bits - 1) * 2 + -(-count * bits // 8) + -(-count * width // 8)
    syncs, warm = n_syncs(case), case.get("warmup", 0)
    return (syncs - warm) * (-(-used // 8) * 8) + warm * 8 * IN * OUT + syncs * (2 if bf16_gathers(OUT, world) else 8) * OUT


def low_bit_dense_bytes(case) -> int:
    """The same for a dense low-bit exchange: per sync the weight's block (levels per run of rows, packed codes)
    and the bias's (one set of levels), each padded to 8 bytes; the model's float64 during the warm-up syncs."""
    o = case["outer"]
    bits = o["value_bits"]
    pad = lambda n: -(-n // 8) * 8  # noqa: E731
    run = ref.fiber_run(OUT, IN, o.get("value_group"))
    weight = pad((OUT // run) * 2 ** (bits - 1) * 2 + -(-IN * OUT * bits // 8))
    bias = pad(2 ** (bits - 1) * 2 + -(-OUT * bits // 8))
    syncs, warm = n_syncs(case), case.get("warmup", 0)
    return (syncs - warm) * (weight + bias) + warm * 8 * (IN * OUT + OUT)


def run_ddp(worker: str, np_: int, args: dict, timeout: float = 180.0) -> list:
    outdir = tempfile.mkdtemp(prefix="hat-local-ddp-")
    atexit.register(shutil.rmtree, outdir, True)
    Path(outdir, "args.json").write_text(json.dumps(args))
    rc, log, _ = run_command([sys.executable, "-m", "tests._ddp_launch", str(np_), f"local_steps_workers:{worker}",
                              str(Path(outdir, "args.json")), outdir], timeout=timeout)
    if rc != 0:
        raise RanksFailed(f"{worker} on {np_} DDP ranks: exit {rc} (None: timed out and killed)\n{log[-20000:]}")
    return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(np_)]


_JOBS: dict = {}
_CKPT_DIR = tempfile.mkdtemp(prefix="hat-local-ckpt-")
atexit.register(shutil.rmtree, _CKPT_DIR, True)


def job(engine: str, world: int) -> list:
    """One job per engine and world size, shared by the tests below (2 ranks: every check; 3: the reference).
    Horovod: real ranks under horovodrun; DDP (2 ranks): a DDP-wrapped model and the plain module."""
    key = (engine, world)
    if key not in _JOBS:
        args = {"cases": CASES, "all": world == 2}
        if engine == "horovod":  # a checkpoint written mid-interval at 2 ranks is loaded at 3
            ckpt = str(Path(_CKPT_DIR, "two_ranks.pt"))
            if world == 3:
                job("horovod", 2)
            if world <= 3:
                args["other_world"] = {"write": ckpt} if world == 2 else {"read": ckpt}
            args["sharded_resume"] = world == 3
            _JOBS[key] = run_ranks("local_steps_workers:hvd_job", np=world, args=args, timeout=240 if world <= 3 else 480)
        else:
            _JOBS[key] = run_ddp("ddp_job", world, args, timeout=240)
    return _JOBS[key]


@pytest.mark.parametrize("engine,world,key", [("horovod", 2, "reference"), ("horovod", 3, "reference"),
                                              ("horovod", 8, "reference"),
                                              ("ddp", 2, "reference"), ("ddp", 2, "reference_plain")],
                         ids=["horovod-2", "horovod-3", "horovod-8", "ddp-2-wrapped", "ddp-2-plain-module"])
def test_matches_numpy_model(engine, world, key):
    check_reference([r[key] for r in job(engine, world)], world)


@pytest.mark.parametrize("engine", ["horovod", "ddp"])
def test_sync_every_1_is_data_parallel(engine):
    for r in job(engine, 2):
        eq = r["equivalence"]
        assert eq["max_abs_diff"] <= 1e-6 * max(1.0, eq["scale"]), eq


@pytest.mark.parametrize("engine", ["horovod", "ddp"])
def test_resume_mid_interval_is_bitwise(engine):
    res = [r["resume"] for r in job(engine, 2)]
    for r in res:
        assert r["resumed"] == r["straight"], "resume in the middle of an interval changed the result"
        if engine == "horovod":
            assert r["step_in_interval"] == 2, r
    assert res[0]["straight"] == res[1]["straight"]


def test_custom_outer_optimizer_resumes_bitwise():
    """Outer.custom(Adam): its moments, step count and a learning rate changed after construction come back
    from one gather_state_dict file; the resumed run ends bitwise where the straight one does."""
    res = [r["resume_custom"] for r in job("horovod", 2)]
    for r in res:
        assert r["resumed"] == r["straight"], "resume changed the result of the custom outer optimizer"
        assert r["step_in_interval"] == 2, r
    assert res[0]["straight"] == res[1]["straight"]


def test_bad_settings_raise_clear_errors():
    expected = {"sync_every_0": "sync_every must be an int >= 1", "sync_every_float": "sync_every must be an int",
                "outer_lr_0": "outer lr must be a finite number > 0",
                "custom_not_callable": "takes a callable that builds a torch.optim.Optimizer",
                "custom_not_optimizer": "returned list, not a torch.optim.Optimizer", "outer_lr_neg": "outer lr must be",
                "momentum_1": "outer momentum must be a number in [0, 1)", "momentum_neg": "outer momentum",
                "outer_not_outer": "outer must be a horovod_adtopk.Outer", "outer_without_sync": "needs sync_every",
                "backward_passes": "backward_passes_per_step", "hierarchical": "hierarchical=True",
                "overlap": "overlap=True", "op_sum": "op=hvd.Sum", "variable_count": "variable number of entries",
                "powersgd": "cannot compress the pseudo-gradient",
                "resume_other_settings": "resume with the same sync_every", "mismatch": "sync_every: rank 0 has 2"}
    for r in job("horovod", 2):
        for key, text in expected.items():
            assert r["errors"][key] is not None and text in r["errors"][key], (key, r["errors"][key])


def test_reset_for_elastic_starts_a_fresh_interval():
    res = [r["reset"] for r in job("horovod", 2)]
    for r in res:
        assert r["held_before"]["residuals"] > 0 and r["held_before"]["outer_momentum"] > 0
        assert r["after"]["step_in_interval"] == 0
        assert r["after"]["memory_bytes"] == {"outer_params": 0, "outer_momentum": 0, "residuals": 0,
                                              "owner_residuals": 0, "total": 0}
        assert r["theta_is_start"]
    assert res[0]["digest"] == res[1]["digest"]


def test_sharded_resume_mid_interval_is_bitwise():
    """Three ranks, the owner-sharded exchange on every matrix: a gathered checkpoint (owners' residuals
    included) restores every rank exactly in the middle of an interval."""
    res = [r["resume_sharded"] for r in job("horovod", 3)]
    for r in res:
        assert r["resumed"] == r["straight"], "resume with the sharded exchange changed the result"
        assert r["step_in_interval"] == 2 and r["owner_tensors"] > 0 and "sharded" in r["paths"], r
    assert len({r["straight"] for r in res}) == 1


def test_checkpoint_from_another_world_size():
    """Written at 2 ranks, read at 3: the outer state carries over; the residuals fold (new rank j takes old
    rank j's, scaled 3/2; rank 2 none: horovod_adtopk.state.fold); the interval restarts from the outer
    parameters, with a warning."""
    for rank, r in enumerate(job("horovod", 3)):
        got = r["other_world"]
        assert got["step"] == 0 and got["syncs"] == 1 and got["params_are_outer"] and got["momentum_kept"], got
        assert (got["residuals"] > 0) == (rank < 2), (rank, got)
        assert not any("holds compression state for ranks" in w for w in got["warnings"]), got["warnings"]
        assert any("interval restarts from the outer parameters" in w for w in got["warnings"]), got["warnings"]
    # the owners' residuals (units of the average, one range of fibers per owner) are re-cut, none lost or doubled
    ranks = job("horovod", 3)
    written = np.concatenate([np.array(m) for m in ranks[0]["other_world"]["owner_written"]])
    now = np.concatenate([np.array(r["other_world"]["owner_now"]) for r in ranks])
    assert np.abs(written).sum() > 0 and len(ranks[0]["other_world"]["owner_written"][1]) > 0
    np.testing.assert_array_equal(now, written)


def test_horovod_join_uneven_data():
    res = [r["join"] for r in job("horovod", 2)]
    assert res[0]["errors_after_join"] and max(res[0]["errors_after_join"]) < 1e-12, res
    assert res[0]["last_joined"] == res[1]["last_joined"] == 0


def test_job_flags():
    """examples/train.py --sync-every / --outer-lr / --outer-momentum: checks, defaults, the keywords built."""
    from examples.job import options
    from examples.job.engine import make_local_steps

    args = options.parse_args(["--compressor", "adtopk", "--ratio", "0.05", "--sync-every", "10"])
    assert (args.sync_every, args.dense_rounds, args.density_warmup, args.momentum_correction) == (10, 0, 0, False)
    kw = make_local_steps(args)
    assert kw["sync_every"] == 10 and kw["outer"].config() == {"lr": 0.7, "momentum": 0.9, "nesterov": True,
                                                               "feedback_decay": 1.0, "value_bits": None, "value_group": None, "exchange": "auto"}
    args = options.parse_args(["--compressor", "none", "--sync-every", "5", "--outer-lr", "1", "--outer-momentum", "0"])
    assert make_local_steps(args)["outer"].config() == {"lr": 1.0, "momentum": 0.0, "nesterov": False,
                                                        "feedback_decay": 1.0, "value_bits": None, "value_group": None, "exchange": "auto"}
    assert "sync every 5 steps, outer SGD lr 1.0" in options.describe_compression(args)
    args = options.parse_args(["--compressor", "adtopk", "--sync-every", "10", "--outer-lr", "1", "--outer-momentum",
                               "0", "--outer-feedback-decay", "0.95"])
    assert make_local_steps(args)["outer"].config() == {"lr": 1.0, "momentum": 0.0, "nesterov": False,
                                                        "feedback_decay": 0.95, "value_bits": None, "value_group": None, "exchange": "auto"}
    assert "error feedback decayed by 0.95 per sync" in options.describe_compression(args)
    # AdamW's per-step default (error feedback on the update) is local steps with H = 1: the decay applies there too
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt", "--compressor", "topk",
                               "--outer-feedback-decay", "0.9"])
    assert make_local_steps(args)["outer"].config()["feedback_decay"] == 0.9
    assert make_local_steps(options.parse_args(["--compressor", "none"])) == {}
    for argv in (["--sync-every", "-1"], ["--sync-every", "2", "--outer-lr", "0"],
                 ["--sync-every", "2", "--outer-momentum", "1"], ["--sync-every", "2", "--momentum-correction"],
                 ["--sync-every", "2", "--overlap", "on"], ["--sync-every", "2", "--compressor", "powersgd"],
                 ["--sync-every", "2", "--compressor", "none", "--outer-feedback-decay", "0.9"],
                 ["--sync-every", "2", "--compressor", "adtopk", "--outer-feedback-decay", "0"],
                 ["--compressor", "adtopk", "--outer-feedback-decay", "0.9"]):
        with pytest.raises(SystemExit) as exc:
            options.parse_args(argv)
        assert exc.value.code == 2, argv


def test_feedback_decay_settings():
    """``feedback_decay`` (SparseLoCo's beta): a number in (0, 1], only where a sparse compressor keeps an
    error-feedback memory; old checkpoints (no ``feedback_decay`` in their outer block) read as 1."""
    import horovod_adtopk as hat
    from horovod_adtopk import local_steps

    assert hat.Outer.sgd(1.0, feedback_decay=0.95).config()["feedback_decay"] == 0.95
    assert hat.Outer.nesterov().config()["feedback_decay"] == 1.0
    for bad in (0, 0.0, -0.5, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="feedback_decay must be a number in"):
            hat.Outer.sgd(1.0, feedback_decay=bad)
    for dense in (None, hat.Compression.none, hat.Compression.fp16,
                  hat.Compression.adtopk(ratio=0.1, error_feedback=False)):
        with pytest.raises(ValueError, match="keeps none"):
            local_steps.check_settings(2, hat.Outer.sgd(1.0, feedback_decay=0.9), dense)
    local_steps.check_settings(2, hat.Outer.sgd(1.0, feedback_decay=0.9), hat.Compression.adtopk(ratio=0.1))


# --- low-bit values of the outer exchange (horovod_adtopk.quantize), one process ---------------------------------

@pytest.mark.parametrize("width", [1, 2, 3, 5, 7, 8, 10, 13, 16, 31])
def test_bitpack_matches_numpy_packbits(width):
    from horovod_adtopk.quantize import bitpack, bitunpack
    import torch

    rs = np.random.RandomState(width)
    for n in (0, 1, 7, 8, 9, 1000):
        x = rs.randint(0, 2 ** width, size=n).astype(np.int64)
        packed = bitpack(torch.from_numpy(x), width)
        assert packed.dtype == torch.uint8 and packed.numel() == -(-n * width // 8)
        np.testing.assert_array_equal(packed.numpy(), ref.bitpack(x, width) if n else np.zeros(0, np.uint8))
        np.testing.assert_array_equal(bitunpack(packed, n, width).numpy(), x)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_quantized_wire_matches_reference(bits, dtype):
    """encode -> decode at 1 and 3 ranks against the numpy rule (reference.quantize_group): per group, the
    levels, the signs, the bins; indices round-trip exactly; what the sender says it carried is what every
    receiver decodes; the block has the documented size."""
    import torch
    from horovod_adtopk.quantize import QuantizedWire

    rs = np.random.RandomState(bits)
    groups, group, max_index = 9, 12, 767
    wire = QuantizedWire(bits, groups * group, group, max_index)
    L = 2 ** (bits - 1)
    assert wire.index_bits == 10 and wire.levels == L
    used = groups * L * 2 + -(-groups * group * bits // 8) + -(-groups * group * 10 // 8)
    assert wire.block_bytes == -(-used // 8) * 8
    blocks, want = [], []
    for r in range(3):
        v = rs.standard_normal(groups * group) * rs.choice([1e-6, 1.0, 1e3], size=groups).repeat(group)
        v[:3] = 0.0  # zeros and a tie inside the first group
        v[5] = -v[4]
        t = torch.from_numpy(v).to(getattr(torch, dtype))
        idx = torch.from_numpy(rs.randint(0, max_index + 1, size=groups * group))
        block, carried = wire.encode(t, idx)
        assert block.dtype == torch.uint8 and block.numel() == wire.block_bytes
        vv = t.to(torch.float64).numpy()
        expect = np.concatenate([ref.quantize_group(vv[g * group:(g + 1) * group], bits) for g in range(groups)])
        np.testing.assert_array_equal(carried.numpy(), expect)
        blocks.append(block)
        want.append((expect, idx.numpy()))
    for world in (1, 3):
        got = wire.decode(torch.cat(blocks[:world]), world)
        assert len(got) == world
        for (values, index), (expect, idx) in zip(got, want):
            np.testing.assert_array_equal(values.numpy(), expect)
            np.testing.assert_array_equal(index.numpy(), idx)
    with pytest.raises(ValueError, match="ranks disagree on the outer wire format"):
        wire.decode(torch.cat(blocks[:2])[:-8], 2)


@pytest.mark.parametrize("shape,group,levels", [((16, 24), None, 16), ((16, 24), 48, 8), ((16, 24), 1000, 1),
                                                  ((40,), 8, 1), ((3, 2, 5), None, 3), ((0, 4), None, 0)])
def test_dense_wire_matches_reference(shape, group, levels):
    """QuantizedWire.dense (value_bits with Compression.none): every entry in order, no indices, levels per row of
    the tensor's ``[d0, -1]`` view or per run of rows (1-D: one set), against reference.quantize_sparse with every
    entry kept; the block holds levels and codes only."""
    import torch
    from horovod_adtopk.quantize import QuantizedWire

    rs = np.random.RandomState(len(shape))
    for bits in (1, 2):
        wire = QuantizedWire.dense(bits, shape, group)
        numel = int(np.prod(shape))
        assert wire.index_bits == 0 and wire.groups == levels
        assert wire.block_bytes == -(-(levels * 2 ** (bits - 1) * 2 + -(-numel * bits // 8)) // 8) * 8
        blocks, want = [], []
        for _ in range(2):
            a = rs.standard_normal(shape)
            block, carried = wire.encode(torch.from_numpy(a).reshape(-1))
            if numel == 0:
                expect = a
            elif len(shape) >= 2:
                expect = ref.quantize_sparse(a, np.ones(shape, bool), bits, 1, group)
            else:
                expect = ref.quantize_group(a, bits)
            np.testing.assert_array_equal(carried.numpy(), expect.reshape(-1))
            blocks.append(block)
            want.append(expect.reshape(-1))
        for (values, index), expect in zip(wire.decode(torch.cat(blocks), 2), want):
            assert index is None
            np.testing.assert_array_equal(values.numpy(), expect)
    with pytest.raises(ValueError, match="takes none"):
        QuantizedWire.dense(2, (4, 4)).encode(torch.zeros(16), torch.arange(16))


def test_value_bits_settings():
    import horovod_adtopk as hat
    from horovod_adtopk import local_steps

    assert hat.Outer.sgd(1.0, value_bits=2).config()["value_bits"] == 2
    assert hat.Outer.nesterov().config()["value_bits"] is None
    for bad in (0, 9, 2.0, True, "2"):
        with pytest.raises(ValueError, match="value_bits must be None"):
            hat.Outer.sgd(1.0, value_bits=bad)
    with pytest.raises(ValueError, match="already sets its own"):
        local_steps.check_settings(2, hat.Outer.sgd(1.0, value_bits=2), hat.Compression.fp16)
    with pytest.raises(ValueError, match="keeps none"):
        local_steps.check_settings(2, hat.Outer.sgd(1.0, feedback_decay=0.9), None)
    for ok in (None, hat.Compression.none, hat.Compression.topk(ratio=0.1)):  # a dense low-bit exchange, or sparse
        local_steps.check_settings(2, hat.Outer.sgd(1.0, value_bits=2, feedback_decay=0.9), ok)
    assert hat.Outer.sgd(1.0, value_bits=2, value_group=64).config()["value_group"] == 64
    for bad in (0, -1, 2.5, True, "64"):
        with pytest.raises(ValueError, match="value_group must be None"):
            hat.Outer.sgd(1.0, value_bits=2, value_group=bad)
    with pytest.raises(ValueError, match="set value_bits too"):
        hat.Outer.nesterov(value_group=64)


def test_value_group_runs_of_whole_fibers():
    """``value_group``: the fewest whole fibers, a divisor of their number, that keep at least n entries share
    one set of levels; a flat rule (Top-k) keeps one group for its payload."""
    import torch
    import horovod_adtopk as hat
    from horovod_adtopk.compressors import TensorInfo
    from horovod_adtopk.quantize import QuantizedWire, fibers_per_group

    assert [fibers_per_group(24, 4, g) for g in (None, 1, 4, 5, 10, 12, 13, 50, 97)] == [1, 1, 1, 2, 3, 3, 4, 24, 24]
    assert fibers_per_group(7, 3, 10) == 7  # a prime number of fibers: the whole tensor
    c = hat.Compression.adtopk(ratio=0.05, axis=1)
    info = TensorInfo("w", (384, 128), 384 * 128, torch.float32)
    codec = c.codec(info, 10 ** 6)  # 384 row fibers of 128, k = 6
    for group, run in ((None, 1), (64, 12), (6, 1), (7, 2)):
        wire = QuantizedWire.for_codec(2, codec, info.numel, group)
        assert wire.group == 6 * run and wire.groups == 384 // run, group
    from horovod_adtopk.compressors.base import FlatCodec
    assert QuantizedWire.for_codec(2, FlatCodec(info.numel, 2457), info.numel, 64).groups == 1


def test_value_bits_job_flag():
    from examples.job import options
    from examples.job.engine import make_local_steps

    args = options.parse_args(["--compressor", "adtopk", "--ratio", "0.05", "--sync-every", "10", "--outer-lr", "1",
                               "--outer-momentum", "0", "--outer-feedback-decay", "0.95", "--outer-value-bits", "2"])
    assert make_local_steps(args)["outer"].config() == {"lr": 1.0, "momentum": 0.0, "nesterov": False,
                                                        "feedback_decay": 0.95, "value_bits": 2, "value_group": None, "exchange": "auto"}
    assert "2-bit values and bit-packed indices" in options.describe_compression(args)
    args = options.parse_args(["--compressor", "adtopk", "--sync-every", "10", "--outer-lr", "1", "--outer-momentum",
                               "0", "--outer-value-bits", "2", "--outer-value-group", "64"])
    assert make_local_steps(args)["outer"].config()["value_group"] == 64
    assert "levels shared by at least 64 entries" in options.describe_compression(args)
    args = options.parse_args(["--compressor", "none", "--sync-every", "16", "--outer-value-bits", "1",
                               "--outer-value-group", "1024", "--outer-feedback-decay", "0.9"])  # dense low-bit
    assert make_local_steps(args)["outer"].config() == {"lr": 0.7, "momentum": 0.9, "nesterov": True,
                                                        "feedback_decay": 0.9, "value_bits": 1, "value_group": 1024, "exchange": "auto"}
    assert "every entry as a 1-bit code" in options.describe_compression(args)
    for argv in (["--compressor", "adtopk", "--outer-value-bits", "2"],
                 ["--compressor", "fp16", "--sync-every", "4", "--outer-value-bits", "2"],
                 ["--compressor", "none", "--sync-every", "4", "--outer-feedback-decay", "0.9"],
                 ["--compressor", "adtopk", "--sync-every", "4", "--outer-value-bits", "0"],
                 ["--compressor", "adtopk", "--sync-every", "4", "--outer-value-bits", "9"],
                 ["--compressor", "threshold", "--threshold", "0.1", "--sync-every", "4", "--outer-value-bits", "2"],
                 ["--compressor", "adtopk", "--sync-every", "4", "--outer-value-group", "64"],
                 ["--compressor", "adtopk", "--sync-every", "4", "--outer-value-bits", "2", "--outer-value-group", "0"]):
        with pytest.raises(SystemExit) as exc:
            options.parse_args(argv)
        assert exc.value.code == 2, argv
