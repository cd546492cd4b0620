"""The owner-sharded exchange's plan and cost (horovod_adtopk.sharded), checked against the block format and
the per-rank bytes written out here by hand; its values are checked against the numpy model in
tests/test_local_steps.py (SHARDED_CASES, at 2, 3 and 8 ranks on both engines)."""
import numpy as np
import pytest
import torch

import horovod_adtopk as hat
from horovod_adtopk import sharded
from horovod_adtopk.compressors import TensorInfo



def recipe_plan(world):
    """The README's AdamW recipe on a [3072, 1024] matrix: ADTopk 0.25, 2-bit values, value_group 64."""
    c = hat.Compression.adtopk(ratio=0.25)
    info = TensorInfo("w", (3072, 1024), 3072 * 1024, torch.float32)
    layout = c.codec(info).layout
    return sharded.plan_sparse("w", layout, 2, 64, world, torch.float32, torch.int16)


@pytest.mark.quick
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


@pytest.mark.quick
def test_latency_moves_the_break_even():
    """With a latency per message the two stages' 2 (W-1) messages cost more: a small tensor stays gathered."""
    c = hat.Compression.adtopk(ratio=0.25)
    info = TensorInfo("w", (64, 64), 64 * 64, torch.float32)
    plan = sharded.plan_sparse("w", c.codec(info).layout, 2, 64, 8, torch.float32, torch.int16)
    payload = sum(plan.block_sizes())
    assert sharded.pick(plan, payload, 4 * 64 * 64, 8, hat.netcost.Link())[0] == "sharded"
    slow = hat.netcost.Link.parse("10Gbit/s,50us")
    assert sharded.pick(plan, payload, 4 * 64 * 64, 8, slow)[0] == "allgather"


@pytest.mark.quick
def test_too_few_groups_cannot_be_sharded():
    c = hat.Compression.adtopk(ratio=0.25, axis=1)
    info = TensorInfo("w", (1, 64), 64, torch.float32)
    assert sharded.plan_sparse("w", c.codec(info).layout, 2, None, 4, torch.float32, torch.int16) is None
    assert sharded.plan_dense("b", (64,), 2, None, 4) is None  # a 1-D tensor is one row: one group
    plan = sharded.plan_dense("w", (6, 10), 2, 20, 4)  # runs of 2 rows -> 3 groups among 4 owners: one owns none
    assert [hi - lo for lo, hi in plan.bounds] == [0, 2, 2, 2] and plan.block_sizes()[0] == 0


@pytest.mark.quick
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


# --- the per-step exchange on real Horovod ranks, against a numpy model ------------------------------------------

IN, OUT, BATCH, LR = 24, 16, 8, 0.1
STEP_CASES = [
    {"name": "rows", "ratio": 0.25, "axis": 1, "steps": 6},
    {"name": "columns_warmup", "ratio": 0.25, "axis": 0, "steps": 6, "warmup": 1},
    {"name": "auto_choice", "ratio": 0.25, "axis": 1, "steps": 2, "exchange": "auto"},
    # the plain allgather path through the same model and checks (no owners): every rank's payload summed
    {"name": "rows_allgather", "ratio": 0.25, "axis": 1, "steps": 4, "exchange": "allgather"},
]


def numpy_steps(case, world):
    """Per-step SGD with the owner-sharded exchange, from the issue's equations: each rank a = g + r, keeps
    ADTopk's k per fiber (sent), r = a - sent; avg = mean of sent; the owners: c = avg + e_own, ADTopk again on c
    (out), e_own = c - out; the weight steps by out, the bias (1-D, dense) by the mean gradient. Sharding among
    owners cuts whole fibers, so it changes no value: the model keeps e_own whole."""
    import torch  # only for the model's initial parameters (the workers' linear_model)
    from tests import reference as ref
    torch.manual_seed(0)
    lin = torch.nn.Linear(IN, OUT).double()
    w, b = lin.weight.detach().numpy().copy(), lin.bias.detach().numpy().copy()
    resid, owner = [np.zeros_like(w) for _ in range(world)], np.zeros_like(w)
    grad_sum = np.zeros_like(w)
    for step in range(case["steps"]):
        sent, bias = [], []
        for r in range(world):
            rs = np.random.RandomState(1000 * r + step + 1)
            x, y = rs.standard_normal((BATCH, IN)), rs.standard_normal((BATCH, OUT))
            res = (x @ w.T + b - y) / BATCH
            gw, gb = res.T @ x, res.sum(0)
            grad_sum += gw
            bias.append(gb)
            if step < case.get("warmup", 0):  # dense round: g + r sent whole, the residual released
                sent.append(gw + resid[r])
                resid[r] = np.zeros_like(w)
                continue
            a = gw + resid[r]
            kept = np.where(ref.adtopk_mask(a, case["ratio"], case["axis"]), a, 0.0)
            resid[r] = a - kept
            sent.append(kept)
        avg = sum(sent) / world
        if step >= case.get("warmup", 0) and case.get("exchange", "sharded") == "sharded":
            c = avg + owner
            avg = np.where(ref.adtopk_mask(c, case["ratio"], case["axis"]), c, 0.0)
            owner = c - avg
        w, b = w - LR * avg, b - LR * sum(bias) / world
    return w, b, resid, owner, grad_sum


_RUNS: dict = {}


def run_ddp(worker: str, np_: int, args: dict, timeout: float) -> list:
    """``np_`` torch.distributed (Gloo) ranks of ``tests.<worker>``; the whole tree killed past ``timeout``."""
    import json
    import sys
    import tempfile
    from pathlib import Path
    from tests.harness import RanksFailed, run_command
    with tempfile.TemporaryDirectory(prefix="hat-sharded-ddp-") as outdir:
        Path(outdir, "args.json").write_text(json.dumps(args))
        rc, log, _ = run_command([sys.executable, "-m", "tests._ddp_launch", str(np_), worker,
                                  str(Path(outdir, "args.json")), outdir], timeout=timeout)
        if rc != 0:
            raise RanksFailed(f"{worker} on {np_} DDP ranks: exit {rc} (None: timed out and killed)\n{log[-20000:]}")
        return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(np_)]


def step_ranks(engine: str, world: int) -> list:
    """Horovod ranks under horovodrun, or DDP (Gloo) ranks under tests._ddp_launch; one job per engine and W."""
    key = (engine, world)
    if key not in _RUNS:
        if engine == "horovod":
            from tests.harness import run_ranks
            _RUNS[key] = run_ranks("sharded_workers:steps", np=world, args={"cases": STEP_CASES}, timeout=300)
        else:
            _RUNS[key] = run_ddp("sharded_workers:ddp_steps", world, {"cases": STEP_CASES}, timeout=300)
    return _RUNS[key]


@pytest.mark.parametrize("engine,world", [("horovod", 3), ("horovod", 8), ("ddp", 3), ("ddp", 8)])
def test_per_step_sharded_matches_numpy(engine, world):
    ranks = step_ranks(engine, world)
    for ci, case in enumerate(STEP_CASES):
        res = [r["cases"][ci] for r in ranks]
        if case.get("exchange") == "auto":  # by the cost model: 6 row fibers' payloads move fewer bytes sharded
            assert all(r["paths"]["weight"] == "sharded" and r["paths"]["bias"] == "dense" for r in res), res[0]["paths"]
            continue
        w, b, resid, owner, grad_sum = numpy_steps(case, world)
        for r, got in enumerate(res):
            assert got["digest"] == res[0]["digest"], f"{case['name']}: rank {r} differs"
            np.testing.assert_allclose(np.array(got["final"]["weight"]), w, rtol=1e-9, atol=1e-12, err_msg=case["name"])
            np.testing.assert_allclose(np.array(got["final"]["bias"]), b, rtol=1e-9, atol=1e-12, err_msg=case["name"])
            np.testing.assert_allclose(np.array(got["residuals"]["weight"]), resid[r], rtol=1e-9, atol=1e-12)
            assert got["paths"]["weight"] == ("sparse" if case.get("exchange") == "allgather" else "sharded")
        fibers_n, L = (OUT, IN) if case["axis"] == 1 else (IN, OUT)
        k = int(np.floor(case["ratio"] * L))
        pad = lambda n: -(-n // 8) * 8  # noqa: E731
        if case.get("exchange") == "allgather":  # (W-1) payloads of float64 values and int16 indices each way
            payload = pad(8 * k * fibers_n) + pad(2 * k * fibers_n)
            assert all(got["owner"] == {} for got in res)
            assert all(got["wire"]["weight"] == [case["steps"] * (world - 1) * payload] * 2 for got in res)
            continue
        # the owners' residuals, joined in fiber order, are the model's; each rank holds its own fibers only
        fibers = owner if case["axis"] == 1 else owner.T
        joined = np.concatenate([np.array(got["owner"]["weight"]).reshape(-1, fibers.shape[1]) for got in res])
        np.testing.assert_allclose(joined, fibers, rtol=1e-9, atol=1e-12, err_msg=f"{case['name']}: owners")
        # the error-feedback invariant with the owners' memory, on the engine's own state: the ranks' gradients
        # add up to what was applied (W (w0 - w_T) / lr) plus every rank's residual plus W times the owners'
        w0 = numpy_steps(dict(case, steps=0), world)[0]
        applied = world * (w0 - np.array(res[0]["final"]["weight"])) / LR
        held = sum(np.array(got["residuals"]["weight"]) for got in res) + world * (joined if case["axis"] == 1 else joined.T)
        np.testing.assert_allclose(applied + held, grad_sum, rtol=1e-8, atol=1e-9, err_msg=f"{case['name']}: EF")
        # wire bytes of the weight per step, from the block format: float64 values and int16 indices of k per
        # fiber, owner j taking fibers [F j // W, F (j+1) // W); stage 1 the other shards out and (W-1) of its
        # own in, stage 2 (W-1) of the widest block each way
        blocks = [pad(8 * k * n) + pad(2 * k * n) for n in
                  (fibers_n * (j + 1) // world - fibers_n * j // world for j in range(world))]
        sparse_steps = case["steps"] - case.get("warmup", 0)
        dense = round(2 * (world - 1) / world * 8 * IN * OUT) * case.get("warmup", 0)
        for r, got in enumerate(res):
            sent = sum(x for j, x in enumerate(blocks) if j != r) + (world - 1) * max(blocks)
            received = (world - 1) * blocks[r] + (world - 1) * max(blocks)
            assert got["wire"]["weight"] == [dense + sparse_steps * sent, dense + sparse_steps * received], (case, r)
    assert all(r["resumed"] == r["straight"] for r in ranks), "a gathered checkpoint did not resume bitwise"


def test_join_and_disagreeing_ranks():
    """hvd.join(): the rounds after a member joined travel dense over the active members, per step and in local
    steps, both sharded, and nothing hangs (the harness kills a hung job). Ranks that disagree on the exchange
    all raise a clear error at the first step."""
    from tests.harness import run_ranks
    ranks = run_ranks("sharded_workers:join_and_mismatch", np=3, timeout=300)
    for r in ranks:
        assert r["per_step"]["paths"]["weight"] == "sharded" and r["local_steps"]["paths"]["weight"] == "sharded"
        assert r["mismatch"] is not None and "disagree" in r["mismatch"], r["mismatch"]
    assert ranks[0]["per_step"]["digest"] == ranks[1]["per_step"]["digest"]  # the members still training agree
    assert ranks[0]["local_steps"]["digest"] == ranks[1]["local_steps"]["digest"]
