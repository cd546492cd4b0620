"""Issue 7: consistency, exact resume across processes, non-finite gradients, lost peers, safety."""
import ast
from pathlib import Path

import pytest
import torch

from tests.harness import HOROVODRUN, launch, run_ranks

ALL = ["adtopk", "adtopk_i", "adtopk_t", "topk", "randomk", "dgc", "gaussiank", "redsync", "sidco"]


def specs_for(names, ratio=0.01):
    return [{"compressor": n, "kwargs": {"ratio": ratio}} for n in names]


def test_every_compressor_keeps_ranks_bitwise_identical(request):
    steps = 150
    specs = specs_for(ALL) + [{"compressor": "threshold", "kwargs": {"threshold": 0.01}},
                              {"compressor": "dgc", "kwargs": {"ratio": 0.01, "momentum": 0.9}}]
    results = run_ranks("train_consistency", np=2, controller="gloo",
                        args={"compressors": specs, "steps": steps}, timeout=900)
    runs = {k: v for k, v in results[0].items() if k != "outdir"}
    assert len(runs) == len(specs) and all(r["steps"] == steps for r in runs.values())
    for name, res in runs.items():
        assert len(set(res["digests"])) == 1, f"{name}: ranks diverged after {steps} steps"


RESUME_SPECS = specs_for(["adtopk", "adtopk_i", "dgc", "adtopk_t"]) + [
    {"compressor": "adtopk", "kwargs": {"ratio": 0.05}, "partial": True}]


def test_resume_in_new_processes_is_bitwise_exact(tmp_path):
    n = 7  # odd, so ADTopk-I resumes mid-period
    full = run_ranks("resume_run", np=2, args={"phase": "full", "steps": n, "specs": RESUME_SPECS}, timeout=300)
    first = run_ranks("resume_run", np=2, args={"phase": "first", "steps": n, "specs": RESUME_SPECS}, timeout=300)
    second = run_ranks("resume_run", np=2, timeout=300,
                       args={"phase": "second", "steps": n, "specs": RESUME_SPECS, "first_dir": first[0]["outdir"]})
    for si, spec in enumerate(RESUME_SPECS):
        if spec.get("partial"):
            # The dense/sparse decision comes from timings measured in each run, so only the resumed run
            # must agree with the run it resumes from, and every rank with every other.
            assert first[0][str(si)]["paths"] == second[0][str(si)]["paths"] == second[1][str(si)]["paths"]
            b = torch.load(Path(second[0]["outdir"], f"final{si}.pt"), weights_only=True)
            assert b["optimizer"]["horovod_adtopk"]["partial_sparsification"] is not None
            continue
        a = torch.load(Path(full[0]["outdir"], f"final{si}.pt"), weights_only=True)
        b = torch.load(Path(second[0]["outdir"], f"final{si}.pt"), weights_only=True)
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), f"{spec}: parameter {k} differs after resume"
        sa, sb = a["optimizer"], b["optimizer"]
        for pid in sa["state"]:
            assert torch.equal(sa["state"][pid]["momentum_buffer"], sb["state"][pid]["momentum_buffer"])
        ha, hb = sa["horovod_adtopk"], sb["horovod_adtopk"]
        assert ha["round"] == hb["round"] == 2 * n
        assert sorted(ha["ranks"]) == [0, 1]
        for r in (0, 1):
            ma, mb = ha["ranks"][r]["memory"], hb["ranks"][r]["memory"]
            assert ma["residuals"].keys() == mb["residuals"].keys() and ma["residuals"], spec
            for name in ma["residuals"]:
                assert torch.equal(ma["residuals"][name], mb["residuals"][name]), f"{spec}: residual {name} rank {r}"
        assert full[0][str(si)]["paths"] == second[0][str(si)]["paths"]


def test_nonfinite_gradient_reaches_user_and_does_not_poison_memory():
    results = run_ranks("nonfinite_case", np=2, args={}, timeout=90)
    for res in results:
        assert res["finite"] == [True, True, False, True, True]
        assert res["residual_finite"]
    assert results[1]["nonfinite_steps"] == 1


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_lost_peer_ends_the_job_quickly(controller):
    rc, log, outdir, seconds = launch("die_midway", np=2, controller=controller, timeout=120)
    assert rc is not None, "job hung after a rank was killed"
    assert rc != 0
    assert seconds < 60
    lowered = log.lower()
    assert any(s in lowered for s in ("signal 9", "killed", "exit with status code -9", "peer rank was probably lost",
                                      "terminating remaining workers")), log[-3000:]


def test_package_opens_no_listener():
    """Safety: no sockets, servers or listeners anywhere in the package (Horovod does all networking)."""
    pkg = Path(__file__).resolve().parent.parent / "horovod_adtopk"
    banned = {"socket", "socketserver", "http", "xmlrpc", "asyncio", "multiprocessing"}
    for path in pkg.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [(node.module or "").split(".")[0]]
            else:
                continue
            assert not banned.intersection(mods), f"{path.name} imports {mods}"
