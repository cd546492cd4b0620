"""Smoke test of benchmarks/bench_selection_quality.py: a few steps, then check what it measured against
the layouts the package itself reports (about 10 s on one core)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.datasets import FASHION_MNIST_DIR

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "bench_selection_quality.py"


def test_selection_quality_quick(tmp_path):
    if not Path(FASHION_MNIST_DIR).is_dir():
        pytest.skip(f"Fashion-MNIST not installed in {FASHION_MNIST_DIR}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--steps", "8", "--every", "2",
                           "--methods", "dense,topk,adtopk,adtopk_eqbytes", "--test-limit", "500",
                           "--no-plots", "--out-dir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["label"]: r for r in summary["rows"]}
    assert set(rows) == {"dense", "topk@0.01", "adtopk@0.01", "adtopk_eqbytes@0.01"}
    assert rows["dense"]["layers"] == {}
    # The same sparse tensors as the package's own rule: conv1.weight (288 < 1024) and biases go dense.
    assert set(rows["topk@0.01"]["layers"]) == {"conv2.weight", "fc1.weight", "fc2.weight"}
    for label in ("topk@0.01", "adtopk@0.01", "adtopk_eqbytes@0.01"):
        layout = summary["layouts"][label]
        for name, L in rows[label]["layers"].items():
            # achieved density is exactly the compressor's nominal count (fixed-size rules)
            assert L["density"] == pytest.approx(layout[name]["nominal_density"])
            # never more than the oracle beyond float32 rounding of the two sums
            assert 0.0 < L["energy"] <= L["oracle"] * (1 + 1e-5) and L["oracle"] <= 1.0 + 1e-6
    ad = rows["adtopk@0.01"]["layers"]
    # conv2 [64, 32, 3, 3]: 64 fibers of 288, k = floor(2.88) = 2 -> 128 / 18432
    assert ad["conv2.weight"]["density"] == pytest.approx(128 / 18432)
    assert all(L["coverage"] == 1.0 for L in ad.values())  # one fiber per output unit
    for L in rows["topk@0.01"]["layers"].values():  # exact top-k captures the oracle's energy
        assert L["energy"] == pytest.approx(L["oracle"], rel=1e-6)
    # equal bytes: ADTopk's payload does not exceed Top-k's, and is within one fiber-row of it
    top_b, eq_b = rows["topk@0.01"]["sparse_bytes_per_step"], rows["adtopk_eqbytes@0.01"]["sparse_bytes_per_step"]
    assert eq_b <= top_b and eq_b > 0.9 * top_b
