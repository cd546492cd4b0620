"""Issue 18: the hierarchical exchange (dense inside a host, sparse between hosts) on real Horovod ranks.

Two host names for this machine (``horovodrun -H localhost:2,127.0.0.1:2 --gloo``) give Horovod a real
2 hosts x 2 ranks layout (local_size 2, cross_size 2, real process sets); every process runs here. The
aggregated gradients are compared with a numpy model of exactly the hierarchical rule (written here from
the issue text, on tests/reference.py's selection masks), not with the package.
"""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests import reference as ref
from tests.harness import launch, RanksFailed
from tests.test_optimizer_reference import joined_view

TWO_BY_TWO = ["-H", "localhost:2,127.0.0.1:2"]
# 4 ranks on a 2-core machine: one rank can be off-CPU for longer than Gloo's default 30 s collective timeout
# (seen once in a full run); run_job's own timeout still kills a real hang
DYNAMIC = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
HOSTS, LOCAL = 2, 2
SHAPES = {
    "linear.weight": [33, 48],   # 33 rows: blocks of 17 and 16 fibers (axis 1)
    "linear.bias": [33],         # 1-D: dense
    "conv.weight": [8, 4, 3, 3],
    "embed.weight": [200, 16],   # auto: fibers are the 16 columns, blocks of 8 columns
    "tiny.weight": [1, 64],      # axis 1 / auto: one fiber < 2 local ranks: flat fallback
    "odd.weight": [200, 19],     # auto at 0.1: columns (k=1 of 1.9 per row is off), but block 0's 10 columns
                                 # alone would pass as rows: the block must keep the tensor's axis
}
NP_DTYPES = {"float32": np.float32, "float64": np.float64}
BASE = {"min_numel": 0, "hybrid": False}


def make_cases():
    cases = []
    for dtype in ("float32", "float64"):
        for axis in (0, 1, "auto"):
            cases.append({"shapes": SHAPES, "dtype": dtype, "steps": 3, "kwargs": {"ratio": 0.1, "axis": axis, **BASE}})
    cases.append({"shapes": SHAPES, "dtype": "float64", "steps": 3, "op": "sum",
                  "kwargs": {"ratio": 0.1, "axis": "auto", **BASE}})
    cases.append({"shapes": SHAPES, "dtype": "float32", "steps": 3, "op": "sum",
                  "kwargs": {"ratio": 0.05, "axis": 0, **BASE}})
    # short rows / columns joined (min_fiber_len): the blocks are runs of the joined view's fibers
    for join in ("rows", "columns"):
        cases.append({"shapes": SHAPES, "dtype": "float64", "steps": 3,
                      "kwargs": {"ratio": 0.1, "axis": "auto", "min_fiber_len": 100, "join": join, **BASE}})
    cases.append({"shapes": SHAPES, "dtype": "float64", "steps": 3, "compressor": "topk",
                  "kwargs": {"ratio": 0.05, **BASE}})
    cases.append({"shapes": SHAPES, "dtype": "float64", "steps": 3, "compressor": "threshold",
                  "kwargs": {"threshold": 2.5, **BASE}})
    return cases


def run_job(worker, np_, hosts, args, env=None, timeout=300):
    rc, log, outdir, seconds = launch(worker, np=np_, args=args, timeout=timeout, extra_horovodrun=hosts, env=env)
    if rc != 0:
        raise RanksFailed(f"{worker} exited {rc}\n{log[-20000:]}")
    return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(np_)], outdir


def cases_4():
    """The cases the 8-rank run (cases_8) does not cover, and the float32 axis-0 one that
    test_inter_host_payload_is_one_block counts with the axis-1 one (cases 0 and 1 here, as in make_cases)."""
    eight = cases_8()
    return [c for c in make_cases()
            if c not in eight or (c["dtype"] == "float32" and c["kwargs"].get("axis") == 0 and c.get("op") != "sum")]


@pytest.fixture(scope="module")
def cases_run():
    # 6 of make_cases()'s 12 on 2 x 2: the other 6 run on 2 x 4 (cases_run_8), the same paths on a larger layout
    cases = cases_4()
    results, outdir = run_job("hier_workers:hier_cases", 4, TWO_BY_TWO, {"cases": cases}, DYNAMIC)
    return cases, results, outdir


# --- the numpy model of the hierarchical rule ------------------------------------------------------------------

def split(n, parts):
    base, extra = divmod(n, parts)
    out, start = [], 0
    for j in range(parts):
        stop = start + base + (1 if j < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def view_of(case, shape):
    """The matrix view the fibers are cut from: ``[d0, rest]``, or the joined view with ``min_fiber_len``."""
    kw = case["kwargs"]
    if case.get("compressor", "adtopk") == "adtopk" and kw.get("min_fiber_len"):
        return joined_view(shape, kw["min_fiber_len"], kw["ratio"], kw.get("join", "rows"))[0]
    return shape[0], int(np.prod(shape[1:]))


def plan(case, shape, local=LOCAL):
    """(path, axis): "dense", "flat" (flat sparse: fewer fibers than ``local`` ranks) or "hier"."""
    kw, kind = case["kwargs"], case.get("compressor", "adtopk")
    dtype = NP_DTYPES[case["dtype"]]
    elem = np.dtype(dtype).itemsize
    if kind == "adtopk":
        if len(shape) < 2:
            return "dense", None
        if kw.get("min_fiber_len"):
            (rows, cols), axis = joined_view(shape, kw["min_fiber_len"], kw["ratio"], kw.get("join", "rows"))
        else:
            rows, cols = view_of(case, shape)
            axis = ref.resolve_axis(rows, cols, kw["axis"], kw["ratio"])
        if not ref.adtopk_is_sparse((rows, cols), kw["ratio"], axis, elem, elem, 0):
            return "dense", None
    else:
        ratio = kw.get("ratio", 0.01)
        if not ref.flat_is_sparse(tuple(shape), ratio, elem, elem):
            return "dense", None
        rows, cols, axis = shape[0], int(np.prod(shape[1:])), 1
    fibers = rows if axis == 1 else cols
    return ("flat" if fibers < local else "hier"), axis


def select(case, a, axis, whole=False):
    """The mask of a block (a matrix of the view's fibers), or with ``whole`` of a whole tensor of the flat
    path (cut into the fibers of its view)."""
    kw, kind = case["kwargs"], case.get("compressor", "adtopk")
    if kind == "adtopk":
        if whole:
            return ref.adtopk_mask(a.reshape(view_of(case, a.shape)), kw["ratio"], axis).reshape(a.shape)
        return ref.adtopk_mask(a, kw["ratio"], axis)
    if kind == "topk":
        return ref.topk_mask(a, kw["ratio"])  # the block's share of k
    return ref.threshold_mask(a, kw["threshold"])


def block_of(m, axis, bounds):
    lo, hi = bounds
    return m[lo:hi] if axis == 1 else m[:, lo:hi]


def model_hierarchical(case, grads, name, layout=(HOSTS, LOCAL)):
    """grads[rank][step][name], rank = host * local + local_rank on ``layout`` = (hosts, local ranks a host).
    Returns (outputs per step, residuals per (host, local rank) block)."""
    hosts, local = layout
    shape, dtype = case["shapes"][name], NP_DTYPES[case["dtype"]]
    rows, cols = view_of(case, shape)
    _, axis = plan(case, shape, local)
    bounds = split(rows if axis == 1 else cols, local)
    average = case.get("op") != "sum"
    scale = dtype(1.0 / (hosts * local)) if average else dtype(1.0)
    residual = {}
    outs = []
    for t in range(case["steps"]):
        host_sum = [sum(grads[h * local + j][t][name].reshape(rows, cols) for j in range(local)) for h in range(hosts)]
        full = np.zeros((rows, cols), dtype=dtype)
        for j in range(local):
            total = np.zeros_like(block_of(full, axis, bounds[j]))
            for h in range(hosts):
                a = block_of(host_sum[h], axis, bounds[j]).astype(dtype)
                if (h, j) in residual:
                    a = (a + residual[(h, j)]).astype(dtype)
                sent = np.where(select(case, a, axis), a, np.zeros_like(a))
                residual[(h, j)] = (a - sent).astype(dtype)
                total = (total + (sent * scale).astype(dtype)).astype(dtype)
            if axis == 1:
                full[bounds[j][0]:bounds[j][1]] = total
            else:
                full[:, bounds[j][0]:bounds[j][1]] = total
        outs.append(full.reshape(shape))
    return outs, residual


def load(outdir, ci, case, world=HOSTS * LOCAL):
    grads, outs, res, blocks = [], [], [], []
    for r in range(world):
        z = np.load(Path(outdir, f"case{ci}_rank{r}.npz"))
        grads.append([{n: z[f"g/{t}/{n}"] for n in case["shapes"]} for t in range(case["steps"])])
        outs.append([{n: z[f"out/{t}/{n}"] for n in case["shapes"]} for t in range(case["steps"])])
        res.append({n: z[f"res/{n}"] for n in case["shapes"] if f"res/{n}" in z.files})
        blocks.append({n: z[f"block/{n}"].tolist() for n in case["shapes"] if f"block/{n}" in z.files})
    return grads, outs, res, blocks


def tolerance(case):
    return dict(rtol=1e-5, atol=1e-6) if case["dtype"] == "float32" else dict(rtol=1e-12, atol=1e-12)


def test_layout_is_two_hosts_of_two(cases_run):
    _, results, _ = cases_run
    for r, res in enumerate(results):
        assert res["layout"] == {"rank": r, "local_rank": r % LOCAL, "local_size": LOCAL, "cross_rank": r // LOCAL,
                                 "cross_size": HOSTS}


def test_paths_and_reasons(cases_run):
    cases, results, _ = cases_run
    for ci, case in enumerate(cases):
        for res in results:
            info = res["cases"][ci]
            assert info["hierarchical"]["layout"] == [HOSTS, LOCAL]
            for n, shape in case["shapes"].items():
                path, _ = plan(case, shape)
                assert info["paths"][n] == {"dense": "dense", "flat": "sparse", "hier": "hierarchical"}[path], (ci, n)
                if path == "flat":
                    assert "1 fibers < 2 local ranks" in info["hierarchical"]["tensors"][f"case{ci}.{n}"]


def check_model(cases, outdir, layout):
    """Every rank's output equals rank 0's, bitwise, and rank 0's equals the numpy model's, for every
    hierarchical tensor of every case, on ``layout`` = (hosts, local ranks a host)."""
    hosts, local = layout
    checked = 0
    for ci, case in enumerate(cases):
        grads, outs, _, _ = load(outdir, ci, case, hosts * local)
        for n, shape in case["shapes"].items():
            if plan(case, shape, local)[0] != "hier":
                continue
            expected, _ = model_hierarchical(case, grads, n, layout)
            for t in range(case["steps"]):
                for r in range(1, hosts * local):
                    np.testing.assert_array_equal(outs[r][t][n], outs[0][t][n], err_msg=f"case {ci} {n} step {t} rank {r}")
                np.testing.assert_allclose(outs[0][t][n], expected[t], **tolerance(case),
                                           err_msg=f"case {ci} ({case.get('compressor', 'adtopk')} {case['kwargs']}, "
                                                   f"{case['dtype']}) step {t} tensor {n} on {hosts} x {local}")
            checked += 1
    return checked


def test_matches_numpy_model_and_ranks_agree(cases_run):
    cases, _, outdir = cases_run
    assert check_model(cases, outdir, (HOSTS, LOCAL)) >= 24


def test_flat_and_dense_tensors_beside_hierarchical_ones(cases_run):
    """The 1-D bias is averaged densely, the one-fiber tensor goes the flat sparse way (per-rank memory)."""
    cases, _, outdir = cases_run
    for ci, case in enumerate(cases):
        grads, outs, _, _ = load(outdir, ci, case)
        for n, shape in case["shapes"].items():
            path, axis = plan(case, shape)
            if path == "hier":
                continue
            sel = (lambda a, _n, axis=axis: select(case, a, axis, whole=True)) if path == "flat" else None
            expected = ref.simulate(grads, sel, {m: m == n and path == "flat" for m in case["shapes"]},
                                    average=case.get("op") != "sum")
            for t in range(case["steps"]):
                np.testing.assert_allclose(outs[0][t][n], expected[t][n], **tolerance(case), err_msg=f"case {ci} {n}")


def check_error_feedback(cases, outdir, layout):
    """Per block: what the hosts sent over all steps + every host's block memory == the sum of every rank's
    gradients over all steps (float64 Average cases); and the memory equals the model's, block by block.
    Returns how many tensors were checked."""
    hosts, local = layout
    world = hosts * local
    checked = 0
    for ci, case in enumerate(cases):
        if case["dtype"] != "float64":
            continue
        grads, outs, res, blocks = load(outdir, ci, case, world)
        for n, shape in case["shapes"].items():
            if plan(case, shape, local)[0] != "hier":
                continue
            rows, cols = view_of(case, shape)
            _, model_res = model_hierarchical(case, grads, n, layout)
            factor = world if case.get("op") != "sum" else 1
            sent = factor * sum(outs[0][t][n] for t in range(case["steps"])).reshape(rows, cols)
            memory = np.zeros((rows, cols))
            for r in range(world):
                axis, lo, hi = blocks[r][n]
                np.testing.assert_allclose(res[r][n], model_res[(r // local, r % local)], rtol=1e-12, atol=1e-12)
                if axis == 1:
                    memory[lo:hi] += res[r][n]
                else:
                    memory[:, lo:hi] += res[r][n]
            total = sum(grads[r][t][n] for r in range(world) for t in range(case["steps"])).reshape(rows, cols)
            np.testing.assert_allclose(sent + memory, total, rtol=1e-11, atol=1e-11, err_msg=f"case {ci} {n}")
            checked += 1
    return checked


def test_error_feedback_invariant_per_block(cases_run):
    cases, _, outdir = cases_run
    assert check_error_feedback(cases, outdir, (HOSTS, LOCAL)) >= 12


def pad8(nbytes):
    return -(-nbytes // 8) * 8


def test_inter_host_payload_is_one_block(cases_run):
    """Each rank's cross-host payload is its own block's: (its fibers) x k entries per ADTopk tensor and step,
    about 1/local_size of the flat payload (float32 cases with axis 0 and 1, counted exactly)."""
    cases, results, _ = cases_run
    for ci in (0, 1):
        case = cases[ci]
        ratio, axis_arg = case["kwargs"]["ratio"], case["kwargs"]["axis"]
        for r, res in enumerate(results):
            want = 0
            for n, shape in case["shapes"].items():
                path, axis = plan(case, shape)
                if path != "hier":
                    continue
                rows, cols = shape[0], int(np.prod(shape[1:]))
                fibers, fiber_len = (rows, cols) if axis == 1 else (cols, rows)
                lo, hi = split(fibers, LOCAL)[r % LOCAL]
                entries = (hi - lo) * max(1, math.floor(ratio * fiber_len))
                block = (pad8(entries * 4) + pad8(entries * ref.index_bytes(fiber_len - 1))) * case["steps"]
                want += block
                # what crosses the host's link: the block's allgather among the HOSTS ranks of this local rank
                assert res["cases"][ci]["wire"][n] == [(HOSTS - 1) * block] * 2, (ci, r, n)
            assert res["cases"][ci]["hierarchical"]["inter_host_payload_bytes"] == want, (ci, r, axis_arg)


# --- 8 ranks: 2 hosts x 4 (issue 51: the numpy references hold at W = 8) ------------------------------------------

TWO_BY_FOUR = ["-H", "localhost:4,127.0.0.1:4"]


def cases_8():
    """A cross-section of make_cases() (every axis, both dtypes, Sum, joined columns, Top-k), 3 steps each."""
    every = make_cases()
    pick = [c for c in every if c["dtype"] == "float64" and c.get("op") != "sum"
            and c["kwargs"].get("axis") in (1, "auto") and not c["kwargs"].get("min_fiber_len")
            and c.get("compressor", "adtopk") == "adtopk"]
    pick += [c for c in every if c["dtype"] == "float32" and c["kwargs"].get("axis") == 0]
    pick += [c for c in every if c.get("op") == "sum" and c["dtype"] == "float64"]
    pick += [c for c in every if c["kwargs"].get("join") == "columns" or c.get("compressor") == "topk"]
    return pick


@pytest.fixture(scope="module")
def cases_run_8():
    cases = cases_8()
    results, outdir = run_job("hier_workers:hier_cases", 8, TWO_BY_FOUR, {"cases": cases}, DYNAMIC, timeout=600)
    return cases, results, outdir


def test_8_ranks_layout_paths_model_and_error_feedback(cases_run_8):
    """2 hosts x 4 ranks: the layout Horovod reports, each tensor's path, every rank's output against the numpy
    model of the hierarchical rule, and the per-block error-feedback invariant."""
    cases, results, outdir = cases_run_8
    hosts, local = 2, 4
    for r, res in enumerate(results):
        assert res["layout"] == {"rank": r, "local_rank": r % local, "local_size": local, "cross_rank": r // local,
                                 "cross_size": hosts}
        for ci, case in enumerate(cases):
            info = res["cases"][ci]
            assert info["hierarchical"]["layout"] == [hosts, local]
            for n, shape in case["shapes"].items():
                path, _ = plan(case, shape, local)
                assert info["paths"][n] == {"dense": "dense", "flat": "sparse", "hier": "hierarchical"}[path], (ci, n)
    assert check_model(cases, outdir, (hosts, local)) >= 25
    assert check_error_feedback(cases, outdir, (hosts, local)) >= 15


@pytest.fixture(scope="module")
def consistency_run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("hier") / "ckpt.pt"
    args = {"steps": 40, "resume_at": 30, "compressor": "adtopk", "ratio": 0.05, "checkpoint": str(ckpt)}
    # Without tensor fusion: a 4-rank ring allreduce of the (dense) biases sums in an order set by where a
    # tensor sits in the fusion buffer, which depends on timing, so only unfused runs repeat bitwise.
    # 40 steps (300 took 168 s of CI's time, 120 took 126 s, 60 took 94 s: 4 ranks on 2 cores) with a resume 10
    # from the end
    results, _ = run_job("hier_workers:hier_consistency", 4, TWO_BY_TWO, args,
                         {**DYNAMIC, "HOROVOD_FUSION_THRESHOLD": "0"}, timeout=900)
    return results, ckpt


def test_40_steps_bitwise_identical_and_resume(consistency_run):
    results, _ = consistency_run
    assert len({r["digest"] for r in results}) == 1, [r["digest"] for r in results]
    assert results[0]["hierarchical"]["active"]
    assert results[0]["paths"]["fc1.weight"] == "hierarchical"
    for r in results:  # gather_state_dict on the same layout restores every rank's block memory exactly
        assert r["resumed_digest"] == r["digest"]
        assert not [w for w in r["warnings"] if "hierarchical" in w or "memory" in w], r["warnings"]


def test_fallbacks_say_why_and_other_layout_resets_with_warning(consistency_run):
    _, ckpt = consistency_run
    one_host, _ = run_job("hier_workers:hier_fallback", 4, ["-H", "localhost:4"], {"checkpoint": str(ckpt)}, DYNAMIC)
    for r in one_host:
        assert r["hierarchical"]["reason"] == "one host" and not r["hierarchical"]["active"]
        assert "sparse" in r["paths"].values() and "hierarchical" not in r["paths"].values()
        assert any("hierarchical error-feedback memory belongs to layout [2, 2]" in w for w in r["warnings"]), r
    assert len({r["digest"] for r in one_host}) == 1
    per_host, _ = run_job("hier_workers:hier_fallback", 2, ["-H", "localhost:1,127.0.0.1:1"], {}, DYNAMIC)
    assert all(r["hierarchical"]["reason"] == "one rank per host" for r in per_host)
    uneven, _ = run_job("hier_workers:hier_fallback", 3, ["-H", "localhost:2,127.0.0.1:1"], {"setting": "auto"},
                        DYNAMIC)
    assert all("uneven layout" in r["hierarchical"]["reason"] for r in uneven)
    assert len({r["digest"] for r in uneven}) == 1


def test_without_process_sets_a_clear_error():
    results, _ = run_job("hier_workers:hier_no_process_sets", 4, TWO_BY_TWO, {}, None)
    for r in results:
        assert r["error"] is not None and "HOROVOD_DYNAMIC_PROCESS_SETS=1" in r["error"], r


# --- single-process checks (no ranks) ------------------------------------------------------------------------------

def test_bad_setting_is_refused():
    import torch
    import horovod_adtopk as hat
    p = torch.nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="hierarchical must be False, True or \"auto\""):
        hat.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("p", p)],
                                 compression=hat.Compression.adtopk(ratio=0.1), hierarchical="yes")


def test_split_matches_horovods_rule_and_the_model_prefers_the_right_kind():
    from horovod_adtopk import hierarchical as hier
    assert hier.split_fibers(33, 2) == [(0, 17), (17, 33)] == [tuple(b) for b in split(33, 2)]
    assert hier.split_fibers(7, 4) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    dense, payload = 4 * 4096 * 4096, 4096 * 40 * 6  # a 4096 x 4096 fp32 layer at ADTopk 0.01
    # 8 hosts x 8 GPUs, 100 Gbit/s between hosts and NVLink-class inside: hierarchical beats the flat allgather
    fast = hier.LinkModel(5e-6, 150e9, 10e-6, 12.5e9)
    assert hier.hierarchical_wins(dense, payload, True, 8, 8, fast)[0]
    # 2 x 2 where the host's own links are barely faster than the network: the dense intra-host part loses
    slow = hier.LinkModel(1e-4, 0.3e9, 5e-5, 0.125e9)
    assert not hier.hierarchical_wins(dense, payload, True, 2, 2, slow)[0]
    # against a dense allreduce (the flat hybrid rule gave up on sparse) it wins even then
    assert hier.hierarchical_wins(dense, payload, False, 2, 2, slow)[0]
