"""hat.DistributedOptimizer as a drop-in for hvd.DistributedOptimizer in real training code.

Horovod's own optimizer scenarios (broadcast of parameters and optimizer state, gradient clipping with
synchronize() + skip_synchronize(), dynamic requires_grad, duplicate/missing names, process sets, sparse
embeddings, join) run on our optimizer with Compression.none and with a sparse ADTopk, plus the drop-in
issue's items (frozen layers, unused branches, channels_last, Random-k non-finite and bf16, bf16 dense,
settings that differ between ranks, every stock argument, sparse embeddings, argument validation, the
float16 wire, checkpoint shapes, an unconfigured class in stock Horovod).

Most multi-rank scenarios run in ONE 2-rank Gloo job (``tests/dropin_workers.py:run_cases``) whose results
every test reads; the aggregated gradients are checked against the numpy reference (``tests/reference.py``)
with a rank that has no gradient contributing nothing and keeping its memory.
"""
from __future__ import annotations

import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import reference as ref
from tests.harness import REPO, run_ranks

AD = ["adtopk", {"ratio": 0.1, "min_numel": 1}]
AD01 = ["adtopk", {"ratio": 0.01, "min_numel": 1}]
COMPS = {"none": "none", "ad": AD}

CASES = [["where", "where", {}]]
for _tag, _c in COMPS.items():
    CASES += [[f"broadcast_{_tag}", "broadcast_state", {"comp": _c}], [f"clip_{_tag}", "clipping", {"comp": _c}],
              [f"dyn_{_tag}", "dynamic_requires_grad", {"comp": _c}], [f"names_{_tag}", "names", {"comp": _c}],
              [f"embed_{_tag}", "sparse_embedding", {"comp": _c}],
              [f"branch_{_tag}", "unused_branch", {"comp": _c, "skip": {"1": [1], "3": [0, 1]}}]]
CASES += [["frozen_ad", "frozen", {"comp": AD01}], ["frozen_none", "frozen", {"comp": "none"}],
          ["cl_ad", "channels_last", {"comp": AD01}], ["cl_none", "channels_last", {"comp": "none"}],
          ["rk_nan", "randomk_nan", {}], ["rk_bf16", "randomk_bf16", {}],
          ["bf16_none", "bf16_dense", {"comp": "none"}], ["bf16_ad", "bf16_dense", {"comp": AD01}],
          ["fp16", "fp16_clamp", {}], ["load", "load_mismatch", {}], ["stock_class", "stock_with_class", {}],
          ["signature", "signature", {}]]
# issue 21: Horovod's test_sparse_embeddings without sparse_as_dense, the monkeypatch, channels_last broadcast
CASES += [[f"sgs_{tag}_{int(sad)}", "sparse_grad_like_stock", {"comp": c, "sparse_as_dense": sad}]
          for tag, c in COMPS.items() for sad in (False, True)]
CASES += [["monkeypatch_ad", "monkeypatch_broadcast_state", {"comp": AD}],
          ["monkeypatch_none", "monkeypatch_broadcast_state", {"comp": "none"}],
          ["cl_bcast", "channels_last_broadcast", {"comp": AD}]]


@pytest.fixture(scope="module")
def batch():
    results = run_ranks("dropin_workers:run_cases", np=2, controller="gloo", args={"cases": CASES}, timeout=240)
    return results


def case(batch, label):
    """Every rank's result of one case (failing on an unexpected exception), and the case's arrays."""
    res = [r[label] for r in batch]
    for r in res:
        assert "unexpected" not in r, r.get("trace", r)
    outdir = Path(batch[0]["outdir"])
    data = [dict(np.load(outdir / f"{label}_rank{r}.npz")) if (outdir / f"{label}_rank{r}.npz").exists() else {}
            for r in range(len(batch))]
    return res, data


def simulate(data, steps, names, sparse, ratio, world=None):
    """Expected aggregated gradient per step: sparse tensors through error feedback and ADTopk on every rank,
    dense ones summed; a rank without a gradient (``g/<step>/<name>`` absent) contributes nothing and keeps
    its memory. ``steps`` are the array-key prefixes ``"<prefix>" + str(t)``. Returns (outputs, residuals)."""
    world = world or len(data)
    residual = [dict() for _ in range(world)]
    out = []
    for key in steps:
        prefix, t = key
        agg = {}
        for n in names:
            total = None
            for r in range(world):
                g = data[r].get(f"{prefix}g/{t}/{n}")
                if g is None:
                    continue
                if sparse[n]:
                    a = g + residual[r][n] if n in residual[r] else g.copy()
                    sent = np.where(ref.adtopk_mask(a, ratio, "auto"), a, 0.0)
                    residual[r][n] = a - sent
                else:
                    sent = g
                total = sent if total is None else total + sent
            shape = data[0][f"{prefix}out/{t}/{n}"].shape
            agg[n] = np.zeros(shape) if total is None else total / world
        out.append(agg)
    return out, residual


def check_reference(data, steps, shapes, comp, world=None, ranks=None):
    """Every (member) rank's aggregated gradients equal the reference, bitwise equal across ranks."""
    ranks = ranks or list(range(len(data)))
    ratio = comp[1]["ratio"] if comp != "none" else 1.0
    sparse = {n: comp != "none" and ref.adtopk_is_sparse(tuple(s), ratio, "auto", 8, 8, 1) for n, s in shapes.items()}
    if comp != "none":
        assert any(sparse.values()), "the sparse path was not taken"
    expected, residual = simulate([data[r] for r in ranks], steps, list(shapes), sparse, ratio, world)
    for i, (prefix, t) in enumerate(steps):
        for n in shapes:
            for r in ranks:
                got = data[r][f"{prefix}out/{t}/{n}"]
                np.testing.assert_array_equal(got, data[ranks[0]][f"{prefix}out/{t}/{n}"])
                np.testing.assert_allclose(got, expected[i][n], rtol=1e-12, atol=1e-12, err_msg=f"{prefix}{t} {n}")
    return sparse, residual


# --- the ranks import this checkout ----------------------------------------------------------------------------

def test_ranks_import_this_checkout(batch):
    res, _ = case(batch, "where")
    for r in res:
        assert Path(r["file"]).resolve() == (REPO / "horovod_adtopk" / "__init__.py").resolve()


# --- item 1: frozen layer, unused branch -------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["ad", "none"])
def test_frozen_layer_does_not_move_and_keeps_its_residual(batch, tag):
    res, data = case(batch, f"frozen_{tag}")
    comp = AD01 if tag == "ad" else "none"
    shapes = res[0]["shapes"]
    for r in res:
        assert r["change"]["0.weight"] == 0.0 and r["change"]["0.bias"] == 0.0, r["change"]
        assert r["change"]["2.weight"] > 0 and r["identical"]
        if tag == "ad":
            assert "0.weight" in r["residual_names"] and r["residual_kept"] == {"0.weight": True}
    steps = [("", t) for t in range(3)] + [("late/", t) for t in range(5)]
    check_reference(data, steps, shapes, comp)
    for d in data:  # the frozen layer's aggregate is zeros (no rank has a gradient)
        for t in range(5):
            assert not d[f"late/out/{t}/0.weight"].any() and not d[f"late/out/{t}/0.bias"].any()


@pytest.mark.parametrize("tag", ["ad", "none"])
def test_unused_branch_on_one_rank_matches_reference(batch, tag):
    res, data = case(batch, f"branch_{tag}")
    assert all(r["identical"] for r in res)
    assert "g/1/b.weight" in data[0] and "g/1/b.weight" not in data[1]  # rank 1 skipped branch b at step 1
    sparse, residual = check_reference(data, [("", t) for t in range(5)], res[0]["shapes"], COMPS[tag])
    if tag == "ad":
        assert sparse["b.weight"]
        for r in range(2):  # the memory kept through the steps without a gradient
            np.testing.assert_allclose(data[r]["res/b.weight"], residual[r]["b.weight"], rtol=0, atol=1e-12)


# --- item 2: channels_last ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["ad", "none"])
def test_channels_last_matches_reference_and_contiguous_model(batch, tag):
    res, data = case(batch, f"cl_{tag}")
    comp = AD01 if tag == "ad" else "none"
    for r in res:
        assert r["channels_last"]["weight_channels_last"] and r["channels_last"]["finite"]
        assert r["channels_last"]["moved"] > 0
    for fmt in ("channels_last", "contiguous"):
        prefixed = [{k[len(fmt) + 1:]: v for k, v in d.items() if k.startswith(fmt + "/")} for d in data]
        sparse, _ = check_reference(prefixed, [("", t) for t in range(3)], res[0][fmt]["shapes"], comp)
        assert sparse["weight"] == (tag == "ad")
    for d in data:  # the convolution's own backward rounds differently in channels_last
        for key in d:
            if key.startswith("channels_last/out/"):
                np.testing.assert_allclose(d[key], d["contiguous/" + key[len("channels_last/"):]], rtol=1e-9, atol=1e-12)


# --- item 3: Random-k non-finite and bf16, bf16 on the dense path ---------------------------------------------

def test_randomk_nan_at_undrawn_position_surfaces_that_step_only(batch):
    res, _ = case(batch, "rk_nan")
    for r in res:
        assert r["nan_drawn"] is False
        assert r["finite"] == [True, False, True, True, True]
        assert r["residual_finite"]


def test_randomk_bfloat16_values_summed_in_float32(batch):
    _, data = case(batch, "rk_bf16")
    k = max(1, math.floor(0.05 * 1024))
    residual = [torch.zeros(16, 64), torch.zeros(16, 64)]
    for t in range(3):
        out = torch.from_numpy(data[0][f"out/{t}/w"])
        np.testing.assert_array_equal(data[0][f"out/{t}/w"], data[1][f"out/{t}/w"])
        pos = out.reshape(-1).nonzero().reshape(-1)
        assert pos.numel() == k
        a = [torch.from_numpy(data[r][f"g/{t}/w"]) + residual[r] for r in range(2)]
        wire = [x.reshape(-1)[pos].bfloat16().float() for x in a]
        torch.testing.assert_close(out.reshape(-1)[pos], (wire[0] + wire[1]) * 0.5, rtol=0, atol=0)
        for r in range(2):
            residual[r] = a[r].clone()
            residual[r].view(-1)[pos] = a[r].reshape(-1)[pos] - wire[r]
    for r in range(2):
        torch.testing.assert_close(torch.from_numpy(data[r]["res/w"]), residual[r], rtol=0, atol=0)


@pytest.mark.parametrize("tag", ["none", "ad"])
def test_bfloat16_dense_path(batch, tag):
    res, data = case(batch, f"bf16_{tag}")
    assert all(d == "torch.bfloat16" for d in res[0]["dtypes"])
    assert res[0]["paths"] == {"bias": "dense", "weight": "sparse" if tag == "ad" else "dense"}
    g = [{n: torch.from_numpy(d[f"g/0/{n}"]).float() for n in ("weight", "bias")} for d in data]
    for n in ("weight", "bias"):
        got = data[0][f"out/0/{n}"]
        np.testing.assert_array_equal(got, data[1][f"out/0/{n}"])
        if n == "bias" or tag == "none":  # allreduced as float32, cast back
            want = ((g[0][n] + g[1][n]) / 2).bfloat16()
        else:
            sent = [torch.where(torch.from_numpy(ref.adtopk_mask(x[n].numpy(), 0.01, "auto")), x[n], 0).bfloat16()
                    for x in g]
            want = (sent[0] + sent[1]) * 0.5
        np.testing.assert_array_equal(got, want.double().numpy())


# --- item 4: settings that differ between ranks ------------------------------------------------------------------

def test_differing_settings_raise_on_every_rank():
    results = run_ranks("dropin_workers:mismatches", np=2, controller="gloo", args={}, timeout=60)
    needles = {"groups": "groups: rank 0 has None", "partial_sparsification": "partial_sparsification",
               "profile_rounds": "profile_rounds: rank 0 has 3, rank 1 has 4",
               "all_frozen": "parameters only on rank 0"}
    for r in results:
        for label, needle in needles.items():
            assert r[label] is not None and needle in r[label], (label, r[label])


# --- item 5: hvd.join() --------------------------------------------------------------------------------------

@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_join_while_another_rank_still_steps(controller):
    comps = ["none", AD, ["randomk", {"ratio": 0.1, "min_numel": 1}]]
    results = run_ranks("dropin_workers:join_case", np=2, controller=controller, timeout=90,
                        args={"compressors": comps, "steps": 4, "early": 2})
    outdir = Path(results[0]["outdir"])
    for comp in comps:
        label = comp if isinstance(comp, str) else comp[0]
        r0, r1 = results[0][label], results[1][label]
        assert "error" not in r0 and "error" not in r1, (r0, r1)
        assert (r0["steps"], r1["steps"]) == (4, 2) and r0["last_joined"] == r1["last_joined"] == 0
        d = [np.load(outdir / f"join_{label}_rank{r}.npz") for r in range(2)]
        for t in (0, 1):
            for n in ("weight", "bias"):
                np.testing.assert_array_equal(d[0][f"out/{t}/{n}"], d[1][f"out/{t}/{n}"])
        for t in (2, 3):  # rank 1 has joined: it adds zeros and the average is over both ranks, as in Horovod
            for n in ("weight", "bias"):
                g = d[0][f"g/{t}/{n}"]
                if f"res/{t}/{n}" in d[0]:  # the sparse memory goes along with the first dense round
                    g = g + d[0][f"res/{t}/{n}"]
                np.testing.assert_allclose(d[0][f"out/{t}/{n}"], g / 2, rtol=1e-12, atol=1e-12)
        if label != "none":
            assert any("hvd.join()" in w for w in r0["warnings"])
            assert "res/3/weight" not in d[0]


# --- item 6: Horovod's signature --------------------------------------------------------------------------------

def test_signature_starts_with_horovods():
    import horovod.torch as hvd
    import horovod_adtopk as hat
    stock = list(inspect.signature(hvd.DistributedOptimizer).parameters.values())
    ours = list(inspect.signature(hat.DistributedOptimizer).parameters.values())
    assert [p.name for p in ours[:len(stock)]] == [p.name for p in stock] == [
        "optimizer", "named_parameters", "compression", "backward_passes_per_step", "op",
        "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense", "process_set"]
    for a, b in zip(ours, stock):
        assert a.kind == b.kind and a.default is b.default or a.default == b.default, (a, b)
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY for p in ours[len(stock):])


def test_every_stock_argument_positionally_and_by_keyword_trains_as_stock(batch):
    res, _ = case(batch, "signature")
    for r in res:
        finals = r["finals"]
        for cfg in ("sparse_as_dense", "groups", "num_groups"):
            assert finals[f"{cfg}/positional"] == finals[f"{cfg}/keyword"] == finals[f"{cfg}/stock"], cfg
        assert finals["groups/positional/groups"] >= 1 and finals["num_groups/keyword/groups"] >= 1
        assert finals["sparse_as_dense/positional/groups"] == 0
    assert res[0]["finals"] == res[1]["finals"]


# --- item 7 / Horovod's sparse embeddings ------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["none", "ad"])
def test_sparse_embedding(batch, tag):
    res, data = case(batch, f"embed_{tag}")
    for r, d in zip(res, data):
        for n in res[0]["shapes"]:  # sparse=True with sparse_as_dense trains as the dense embedding (SGD's
            # sparse update rounds differently from its dense one, as with stock Horovod)
            np.testing.assert_allclose(d[f"final1/{n}"], d[f"final0/{n}"], rtol=1e-12, atol=1e-12)
        assert r["error"] is None  # without sparse_as_dense: Horovod's sparse allreduce (test_sparse_grad_*)
    assert res[0]["final1"] == res[1]["final1"]
    for d in data:  # as Horovod: the aggregate of a sparse gradient comes back sparse (SparseAdam needs it)
        assert all(f"sparse1/sparse_grad/{t}/embed.weight" in d for t in range(3))
        assert not any(k.startswith("sparse0/sparse_grad/") for k in d)
    pre = [{k[len("sparse1/"):]: v for k, v in d.items() if k.startswith("sparse1/")} for d in data]
    sparse, _ = check_reference(pre, [("", t) for t in range(3)], res[0]["shapes"], COMPS[tag])
    assert sparse["embed.weight"] == (tag == "ad")


# --- item 8: argument validation (one process) -------------------------------------------------------------------

@pytest.mark.parametrize("build", [
    lambda hat: hat.Compression.adtopk(ratio=True),
    lambda hat: hat.Compression.adtopk(0.01, hybrid="no"),
    lambda hat: hat.Compression.adtopk(0.01, momentum="0.5"),
    lambda hat: hat.Compression.sidco(0.01, stages=1.5),
    lambda hat: hat.Compression.adtopk_t(0.01, warmup=-5),
    lambda hat: hat.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1),
                                         gradient_predivide_factor=float("inf")),
], ids=["ratio_bool", "hybrid_str", "momentum_str", "stages_float", "warmup_negative", "predivide_inf"])
def test_invalid_arguments_raise(build):
    import horovod_adtopk as hat
    with pytest.raises((ValueError, TypeError)):
        build(hat)


# --- item 10: float16 wire beyond 65504 ---------------------------------------------------------------------------

def test_fp16_wire_clamps_and_keeps_the_excess(batch):
    res, data = case(batch, "fp16")
    assert any("65504" in w for w in res[0]["warnings"])
    residual = [np.zeros((8, 64)), np.zeros((8, 64))]
    total_sent = np.zeros((8, 64))
    for t in range(4):
        sent = []
        for r in range(2):
            a = data[r][f"g/{t}/w"] + residual[r]
            carried = np.clip(a, -65504, 65504).astype(np.float16).astype(np.float64)
            mask = ref.adtopk_mask(a, 0.05, "auto")
            sent.append(np.where(mask, carried, 0.0))
            residual[r] = np.where(mask, a - carried, a)
        out = data[0][f"out/{t}/w"]
        assert np.isfinite(out).all()
        np.testing.assert_array_equal(out, data[1][f"out/{t}/w"])
        np.testing.assert_allclose(out, (sent[0] + sent[1]) / 2, rtol=1e-12, atol=1e-12)
        total_sent += out * 2
    assert data[0]["out/0/w"][2, 5] > 30000  # the clamped value travelled
    for r in range(2):
        assert np.isfinite(data[r]["res/w"]).all()
        np.testing.assert_allclose(data[r]["res/w"], residual[r], rtol=1e-12, atol=1e-9)
    grads = sum(data[r][f"g/{t}/w"] for r in range(2) for t in range(4))
    np.testing.assert_allclose(total_sent + data[0]["res/w"] + data[1]["res/w"], grads, rtol=1e-12, atol=1e-9)


# --- items 11, 12 ------------------------------------------------------------------------------------------------

def test_load_with_other_shapes_fails_at_load(batch):
    res, _ = case(batch, "load")
    for r in res:
        assert r["residuals"] == ["weight"]
        assert r["error"].startswith("ValueError") and "'weight'" in r["error"] and "(32, 64)" in r["error"]


def test_unconfigured_class_in_stock_horovod_points_to_ours(batch):
    res, _ = case(batch, "stock_class")
    for r in res:
        assert "horovod_adtopk.DistributedOptimizer" in r["error"] and "missing" not in r["error"], r["error"]


# --- Horovod's optimizer scenarios ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["none", "ad"])
def test_broadcast_parameters_and_optimizer_state(batch, tag):
    res, _ = case(batch, f"broadcast_{tag}")
    for r in res:
        assert r["root_matches"] and r["lr"] == 0.01 and r["trained_identical"]
        assert r["fresh_lr"] == 0.001 and r["fresh_identical"]


@pytest.mark.parametrize("tag", ["none", "ad"])
def test_gradient_clipping_with_synchronize_and_skip_synchronize(batch, tag):
    res, data = case(batch, f"clip_{tag}")
    for r in res:
        assert r["exact_update"] == [True] * 3 and r["identical"]
        assert all(n <= 0.05 + 1e-12 for n in r["norms"])
        assert r["quiet"] == [] and any("skip_synchronize" in w for w in r["loud"])
    check_reference(data, [("", t) for t in range(3)], res[0]["shapes"], COMPS[tag])


@pytest.mark.parametrize("tag", ["none", "ad"])
def test_dynamic_requires_grad(batch, tag):
    res, data = case(batch, f"dyn_{tag}")
    for r in res:
        assert r["identical"]
        for step, layer in r["frozen_at"].items():
            moved = r["moved"][step]
            assert moved[f"{layer}.weight"] == 0.0 and moved[f"{layer}.bias"] == 0.0, (step, moved)
            other = 2 - int(layer)
            assert moved[f"{other}.weight"] > 0
    _, residual = check_reference(data, [("", t) for t in range(5)], res[0]["shapes"], COMPS[tag])
    if tag == "ad":
        for r in range(2):
            for n, v in residual[r].items():
                np.testing.assert_allclose(data[r][f"res/{n}"], v, rtol=0, atol=1e-12)


@pytest.mark.parametrize("tag", ["none", "ad"])
def test_duplicate_and_missing_names(batch, tag):
    res, _ = case(batch, f"names_{tag}")
    for r in res:
        assert r["duplicate"].startswith("ValueError") and "unique" in r["duplicate"]
        assert r["missing"].startswith("ValueError") and "not named" in r["missing"]


def test_process_set_of_two_out_of_three():
    comps = {"none": "none", "ad": AD}
    results = run_ranks("dropin_workers:process_set_cases", np=3, controller="gloo", args={"compressors": comps},
                        timeout=120, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    outdir = Path(results[0]["outdir"])
    for label, comp in comps.items():
        data = [dict(np.load(outdir / f"ps_{label}_rank{r}.npz")) for r in range(3)]
        shapes = results[0][label]["shapes"]
        check_reference(data, [("", t) for t in range(3)], shapes, comp, world=2, ranks=[0, 1])
        for t in range(3):  # rank 2 is no member: its gradients are its own
            for n in shapes:
                np.testing.assert_array_equal(data[2][f"out/{t}/{n}"], data[2][f"g/{t}/{n}"])


# --- issue 21 ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["none", "ad"])
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_like_stock_horovod(batch, tag, sparse_as_dense):
    """Horovod's test_sparse_embeddings (uneven indices per rank, SparseAdam), 3 steps: the aggregate is the
    numpy average of the ranks' gradients, comes back sparse, and (stock's path: no sparse_as_dense, or a dense
    compressor) every parameter is bitwise what stock hvd.DistributedOptimizer gives."""
    res, data = case(batch, f"sgs_{tag}_{int(sparse_as_dense)}")
    for r in res:
        assert r["stock"]["sparse_after"] == [True] * 3 and r["ours"]["sparse_after"] == [True] * 3
    assert len({r["ours"]["final"] for r in res}) == 1  # ranks agree
    for t in range(3):
        for how in ("stock", "ours") if tag == "none" or not sparse_as_dense else ("stock",):
            expected = np.mean([d[f"{how}/g/{t}"] for d in data], axis=0)
            for d in data:
                np.testing.assert_allclose(d[f"{how}/out/{t}"], expected, rtol=1e-12, atol=1e-15)
    if tag == "none" or not sparse_as_dense:
        for d in data:
            np.testing.assert_array_equal(d["ours/final"], d["stock/final"])
            np.testing.assert_array_equal(d["ours/out/0"], d["stock/out/0"])
        assert res[0]["ours"]["final"] == res[0]["stock"]["final"]
    else:  # ADTopk on the densified gradient (a compressed update, so not stock's bits)
        assert res[0]["stats"]["weight"] == "sparse"


@pytest.mark.parametrize("tag", ["none", "ad"])
def test_monkeypatched_broadcast_optimizer_state_after_rank0_checkpoint(batch, tag):
    res, _ = case(batch, f"monkeypatch_{tag}")
    for r in res:
        assert r["is_ours"] and r["class_module"] == "horovod.torch.optimizer"
        assert r["broadcast_seconds"] < 60
    assert len({r["state"] for r in res}) == 1  # every rank has rank 0's checkpointed state
    assert len({r["final"] for r in res}) == 1


def test_channels_last_model_broadcast_and_train(batch):
    res, _ = case(batch, "cl_bcast")
    for r in res:
        assert r["stock_error"] is not None and "contiguous" in r["stock_error"]
        assert r["after"] == res[0]["root"], "every rank starts from rank 0's weights"
        assert r["layout_kept"] and r["conv_params"] > 0
        assert r["sparse"], "ADTopk compressed nothing"
    assert res[0]["mine"] != res[1]["mine"]  # the ranks really started from different weights
    assert len({r["final"] for r in res}) == 1
