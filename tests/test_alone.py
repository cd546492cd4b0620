"""``hat.DistributedOptimizer(exchange_when_alone=True)`` at one Horovod rank: the whole exchange runs over a world
of one (selection, error feedback, the collectives) and its result equals the numpy reference of the rule; with
the default False one rank passes its gradients through untouched, as Horovod does.

One real Horovod process (``hvd.init()`` at size 1, the harness's rank entry point without ``horovodrun``, whose
launcher would only add start-up time; under a timeout) runs every case; the reference is
:func:`tests.reference.simulate` at W = 1, where the average is the rank's own decompressed selection.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import horovod_adtopk as hat
from tests import reference as ref
from tests.harness import run_command
from tests.test_optimizer_reference import pad8

SHAPES = {"linear.weight": [32, 48], "linear.bias": [32], "conv.weight": [8, 4, 3, 3]}
CASES = [
    {"shapes": SHAPES, "dtype": "float64", "steps": 3, "alone": True,
     "kwargs": {"ratio": 0.1, "axis": 1, "min_numel": 0, "hybrid": False}},
    {"shapes": SHAPES, "dtype": "float64", "steps": 3, "alone": True, "compressor": "topk",
     "kwargs": {"ratio": 0.05, "min_numel": 0, "hybrid": False}},
    {"shapes": SHAPES, "dtype": "float64", "steps": 2, "alone": False,
     "kwargs": {"ratio": 0.1, "axis": 1, "min_numel": 0, "hybrid": False}},
]


@pytest.fixture(scope="module")
def alone_run(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("alone")
    (outdir / "args.json").write_text(json.dumps({"cases": CASES}))
    rc, log, _ = run_command([sys.executable, "-m", "tests._rank_main", "alone_cases", str(outdir / "args.json"),
                              str(outdir)], timeout=120)
    assert rc == 0, f"alone_cases exited {rc}\n{log[-20000:]}"
    return str(outdir), json.loads((outdir / "rank0.json").read_text())


def _case_arrays(outdir, ci, case):
    z = np.load(Path(outdir, f"case{ci}_rank0.npz"))
    grads = [{n: z[f"g/{t}/{n}"] for n in case["shapes"]} for t in range(case["steps"])]
    outs = [{n: z[f"out/{t}/{n}"] for n in case["shapes"]} for t in range(case["steps"])]
    res = {n: z[f"res/{n}"] for n in case["shapes"] if f"res/{n}" in z.files}
    return grads, outs, res


def _rule(case):
    """``(select, sparse)``: the numpy selection of the case's rule, and which tensors it sends sparsely."""
    kw = case["kwargs"]
    if case.get("compressor", "adtopk") == "adtopk":
        sparse = {n: ref.adtopk_is_sparse(tuple(s), kw["ratio"], kw["axis"], 8, 8, 0) for n, s in SHAPES.items()}
        return (lambda a, n: ref.adtopk_mask(a, kw["ratio"], kw["axis"])), sparse
    sparse = {n: ref.flat_is_sparse(tuple(s), kw["ratio"], 8, 8) for n, s in SHAPES.items()}
    return (lambda a, n: ref.topk_mask(a, kw["ratio"])), sparse


def _payload_block(case, shape) -> int:
    """One step's payload bytes of a sparse tensor as the optimizer counts them: values and indices, each
    padded to 8 bytes."""
    kw, numel = case["kwargs"], int(np.prod(shape))
    if case.get("compressor", "adtopk") == "adtopk":
        rows, cols = shape[0], numel // shape[0]
        fib, nfib = (cols, rows) if kw["axis"] == 1 else (rows, cols)
        entries, max_index = nfib * max(1, math.floor(kw["ratio"] * fib)), fib - 1
    else:
        entries, max_index = max(1, math.floor(kw["ratio"] * numel)), numel - 1
    return pad8(entries * 8) + pad8(entries * ref.index_bytes(max_index))


def test_one_rank_runs_the_exchange_and_matches_the_reference(alone_run):
    outdir, result = alone_run
    for ci, case in enumerate(CASES):
        if not case["alone"]:
            continue
        grads, outs, res = _case_arrays(outdir, ci, case)
        select, sparse = _rule(case)
        assert any(sparse.values()) and not all(sparse.values())  # both paths are exercised
        expected = ref.simulate([grads], select, sparse)
        for t in range(case["steps"]):
            for n in SHAPES:
                np.testing.assert_allclose(outs[t][n], expected[t][n], rtol=1e-12, atol=1e-12,
                                           err_msg=f"case {ci} step {t} {n}")
        stats = result["cases"][ci]
        assert stats["world_size"] == 1 and stats["steps"] == case["steps"]
        assert 0 < stats["density"] < 1
        want = sum(_payload_block(case, s) if sparse[n] else 8 * int(np.prod(s)) for n, s in SHAPES.items())
        assert stats["bytes_sent"] == want * case["steps"]
        assert stats["bytes_sent"] < stats["bytes_dense"]
        # an allgather or ring allreduce over one rank moves (W - 1) shares: nothing on a wire
        assert stats["wire_bytes_sent"] == stats["wire_bytes_received"] == 0
        for n, s in SHAPES.items():
            assert stats["tensors"][n]["path"] == ("sparse" if sparse[n] else "dense"), (ci, n)
            if not sparse[n]:
                continue
            # error feedback: what was applied plus what stays in the residual is every gradient fed
            total = sum(g[n] for g in grads)
            np.testing.assert_allclose(sum(o[n] for o in outs) + res[n], total, rtol=1e-12, atol=1e-12)
            assert np.count_nonzero(res[n]) > 0


def test_default_passes_gradients_through(alone_run):
    outdir, result = alone_run
    ci = next(i for i, c in enumerate(CASES) if not c["alone"])
    grads, outs, res = _case_arrays(outdir, ci, CASES[ci])
    for t in range(CASES[ci]["steps"]):
        for n in SHAPES:
            np.testing.assert_array_equal(outs[t][n], grads[t][n])
    assert not res and result["cases"][ci]["steps"] == 0 and result["cases"][ci]["bytes_sent"] == 0


def test_local_steps_exchange_when_alone(alone_run):
    _, result = alone_run
    off, on = result["local"]["False"], result["local"]["True"]
    assert off["bytes_sent"] == 0 and off["residual_tensors"] == 0 and off["round"] == 2
    assert on["round"] == 2 and 0 < on["density"] < 1 and on["bytes_sent"] > 0 and on["residual_tensors"] >= 1


@pytest.mark.quick
@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_exchange_when_alone_must_be_a_bool(bad):
    model = torch.nn.Linear(4, 2)
    for extra in ({}, {"sync_every": 2}):
        with pytest.raises(TypeError, match="exchange_when_alone must be True or False"):
            hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(),
                                     compression=hat.Compression.adtopk(ratio=0.1), exchange_when_alone=bad, **extra)


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hvd_gpu_check", Path(__file__).resolve().parent.parent
                                                  / "benchmarks" / "hvd_gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
def test_gpu_check_excuses_only_near_ties():
    """benchmarks/hvd_gpu_check.py's comparison: a position chosen by one run only passes when its magnitude is
    within 1e-6 of the other run's smallest selected magnitude in its fiber; any other difference fails."""
    check = _gpu_check_module()
    a = np.random.default_rng(0).standard_normal((4, 8))
    cpu = np.zeros_like(a)
    for r in range(4):
        top = np.argsort(-np.abs(a[r]))[:2]
        cpu[r, top] = a[r, top]
    second, third = np.argsort(-np.abs(a[0]))[1:3]
    dev = cpu.copy()
    dev[0, second], dev[0, third] = 0.0, np.copysign(abs(a[0, second]) * (1 + 2e-7), a[0, third])
    assert check.compare({"w": dev}, {"w": cpu}, {"w"}) == {"worst": 0.0, "differ": 2, "ties": 2}
    dev[0, third] = a[0, third]  # the real third-largest entry: no tie
    assert check.compare({"w": dev}, {"w": cpu}, {"w"})["ties"] == 0
    assert not check.check_run([{"w": dev}], [{"w": cpu}], {"w"})["ok"]
    near = cpu * (1 + 5e-6)  # values within the 1e-5 relative tolerance
    assert check.check_run([{"w": near}], [{"w": cpu}], {"w"})["ok"]
    assert not check.check_run([{"w": cpu * (1 + 5e-5)}], [{"w": cpu}], {"w"})["ok"]
