"""Warm-ups (dense rounds, density warm-up) and PowerSGD in the same engine.

PowerSGD in the same engine: the aggregated update equals a numpy model of the documented algorithm.

Independent of the package: the numpy model re-derives the initial Q from the documented seeding (crc32 of
"powersgd", seed, name, 0 joined by 0x1f; float64 normal draws from torch's generator, cast to the gradient
dtype), then runs power iteration, Gram-Schmidt, Vogels' local error feedback and the averaged Q with a
warm start, rank by rank.
"""
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import RanksFailed, launch

SHAPES = {"w": [24, 40], "conv": [8, 3, 3, 3], "b": [24], "small": [3, 3]}


def run_case(case):
    rc, log, outdir, _ = launch("reference_cases", np=2, controller="gloo", args={"cases": [case]}, timeout=120)
    if rc != 0:
        raise RanksFailed(f"reference_cases exited {rc}\n{log[-20000:]}")
    import json
    summary = json.loads(Path(outdir, "rank0.json").read_text())[0]
    return Path(outdir), summary


def initial_q(name: str, m: int, r: int, dtype) -> np.ndarray:
    seed = zlib.crc32("\x1f".join(["powersgd", "0", name, "0"]).encode()) & 0x7FFFFFFF
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=gen, dtype=torch.float64).numpy().astype(dtype)


def gram_schmidt(p: np.ndarray) -> np.ndarray:
    p = p.copy()
    for i in range(p.shape[1]):
        p[:, i] /= np.linalg.norm(p[:, i]) + 1e-8
        for j in range(i + 1, p.shape[1]):
            p[:, j] -= p[:, i] * (p[:, i] @ p[:, j])
    return p


def simulate(grads, names, rank, min_numel):
    world, steps = len(grads), len(grads[0])
    error = [dict() for _ in range(world)]
    q_state, out = {}, []
    for t in range(steps):
        agg = {}
        for name in names:
            g0 = grads[0][t][name]
            n = g0.shape[0]
            m = g0.size // n
            r = min(rank, n, m)
            low_rank = g0.ndim >= 2 and g0.size >= min_numel and g0.size / ((n + m) * r) >= 2.0
            if not low_rank:
                agg[name] = sum(grads[i][t][name] for i in range(world)) / world
                continue
            mats = [(grads[i][t][name] + error[i].get(name, 0)).reshape(n, m) for i in range(world)]
            q = q_state.get(name, initial_q(f"case0.{name}", m, r, g0.dtype))
            p = gram_schmidt(sum(mat @ q for mat in mats))
            q_locals = [mat.T @ p for mat in mats]
            for i in range(world):
                error[i][name] = (mats[i] - p @ q_locals[i].T).reshape(g0.shape)
            q_mean = sum(q_locals) / world
            q_state[name] = q_mean
            agg[name] = (p @ q_mean.T).reshape(g0.shape)
        out.append(agg)
    return out, error


@pytest.mark.parametrize("rank", [1, 3])
def test_powersgd_matches_numpy_model(rank):
    case = {"shapes": SHAPES, "dtype": "float64", "steps": 4, "compressor": "powersgd",
            "kwargs": {"rank": rank, "min_numel": 16}}
    outdir, summary = run_case(case)
    data = [np.load(outdir / f"case0_rank{r}.npz") for r in range(2)]
    names = list(SHAPES)
    grads = [[{n: d[f"g/{t}/{n}"] for n in names} for t in range(4)] for d in data]
    expected, error = simulate(grads, names, rank, 16)
    paths = summary["paths"]
    assert paths == {"w": "sparse", "conv": "sparse", "b": "dense", "small": "dense"}, paths
    for t in range(4):
        for n in names:
            for d in data:
                np.testing.assert_allclose(d[f"out/{t}/{n}"], expected[t][n], rtol=1e-9, atol=1e-10,
                                           err_msg=f"step {t} {n}")
            np.testing.assert_array_equal(data[0][f"out/{t}/{n}"], data[1][f"out/{t}/{n}"])
    for r, d in enumerate(data):  # the memory is each rank's own e_i = M_i - P Q_i^T
        for n in ("w", "conv"):
            np.testing.assert_allclose(d[f"res/{n}"], error[r][n], rtol=1e-9, atol=1e-10)
    # bytes: P and Q of every low-rank tensor, every step (float64)
    w_bytes = 4 * (24 + 40) * rank * 8
    assert summary["tensors"]["w"]["bytes_sent"] == w_bytes


def test_powersgd_error_feedback_loses_nothing():
    """sum over steps of what each rank contributed (P Q_i^T) + its final memory == sum of its gradients."""
    case = {"shapes": {"w": [16, 32]}, "dtype": "float64", "steps": 5, "compressor": "powersgd",
            "kwargs": {"rank": 1, "min_numel": 16}}
    outdir, summary = run_case(case)
    data = [np.load(outdir / f"case0_rank{r}.npz") for r in range(2)]
    total_grad = sum(d[f"g/{t}/w"] for d in data for t in range(5))
    total_sent = 2 * sum(data[0][f"out/{t}/w"] for t in range(5))  # averaged update x ranks = sum sent
    total_memory = sum(d["res/w"] for d in data)
    np.testing.assert_allclose(total_sent + total_memory, total_grad, rtol=1e-9, atol=1e-9)


def test_powersgd_rejects_bad_settings():
    import horovod_adtopk as hat
    for kwargs in ({"rank": 0}, {"rank": 1.5}, {"warm_start": "yes"}, {"min_compression_rate": 0},
                   {"density_warmup": 10}):
        with pytest.raises((ValueError, TypeError)):
            hat.Compression.powersgd(**kwargs)


def test_dense_warmup_then_density_warmup_match_reference():
    """warmup_steps=2: rounds 0-1 are plain averages (no memory); then ADTopk at the DGC-style density
    ratio_t = max(ratio, start * (ratio / start) ** (t / density_warmup)) of round t.

    "tall" [64, 16] changes axis under "auto" with the same k: at round 2's density (0.194) its rows keep 3 of
    16, at the target (0.05) its columns keep 3 of 64 (a codec cached by k alone reused the row layout)."""
    from tests import reference as ref
    shapes = {"w": [32, 64], "tall": [64, 16], "b": [32]}
    ratio, start, warm = 0.05, 0.75, 4
    r2 = start * (ratio / start) ** (2 / warm)
    ones = np.ones((64, 16))
    assert ref.resolve_axis(64, 16, "auto", r2) == 1 and ref.adtopk_mask(ones, r2, "auto").sum() == 64 * 3
    assert ref.resolve_axis(64, 16, "auto", ratio) == 0 and ref.adtopk_mask(ones, ratio, "auto").sum() == 16 * 3
    case = {"shapes": shapes, "dtype": "float64", "steps": 6, "compressor": "adtopk", "warmup_steps": 2,
            "kwargs": {"ratio": ratio, "min_numel": 0, "hybrid": False, "density_warmup": warm,
                       "density_start": start}}
    outdir, summary = run_case(case)
    data = [np.load(outdir / f"case0_rank{r}.npz") for r in range(2)]
    residual = [{}, {}]
    for t in range(6):
        for name in ("w", "tall"):
            g = [d[f"g/{t}/{name}"] for d in data]
            if t < 2:
                expected = (g[0] + g[1]) / 2
            else:
                r_t = max(ratio, start * (ratio / start) ** (t / warm)) if t < warm else ratio
                total = np.zeros_like(g[0])
                for i in range(2):
                    a = g[i] + residual[i].get(name, 0)
                    sent = np.where(ref.adtopk_mask(a, r_t, "auto"), a, 0.0)
                    residual[i][name] = a - sent
                    total = total + sent
                expected = total / 2
            for d in data:
                np.testing.assert_allclose(d[f"out/{t}/{name}"], expected, rtol=1e-12, atol=1e-12,
                                           err_msg=f"{name}, round {t}")
        for d in data:
            np.testing.assert_allclose(d[f"out/{t}/b"], (data[0][f"g/{t}/b"] + data[1][f"g/{t}/b"]) / 2, rtol=1e-12)
    # densities really decreased: round 2 sent more than round 5
    assert summary["tensors"]["w"]["density"] > ratio
