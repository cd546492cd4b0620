"""``scripts/gpu_check.sh``'s ``hvd_jobs`` stage where there is no GPU.

With ``GPU_CHECK_DRY=1`` the stage runs its three jobs (the CNN and the GPT with ADTopk per step, the README's
local-steps recipe) through ``examples/train.py`` under a real ``horovodrun -np 2 --gloo`` on CPU tensors, and
checks each summary, ``replicas_identical`` among them. Without it, on a machine whose Horovod has no NCCL
operations, the stage must refuse at once with the reason. Each launch runs in its own session under a timeout
that kills the whole process group (tests.harness.run_command). The two-rank dry run takes about 70 s on 2 CPU
cores, the one-rank one (the GPU run's shape, ``GPU_CHECK_HVD_JOBS_NP=1``, the recipe job only) about a third of that.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from tests.harness import REPO, run_command

SCRIPT = str(REPO / "scripts" / "gpu_check.sh")


def _gpu_check(out_dir, dry: bool, timeout: float, **extra):
    env = {"OUT": str(out_dir), "GPU_CHECK_STAGES": "hvd_jobs", "GPU_CHECK_DRY": "1" if dry else "0", **extra,
           # the interpreter running the tests, and its horovodrun beside it
           "PYTHON": sys.executable, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    return run_command(["bash", SCRIPT], timeout=timeout, env=env)


def _horovod_nccl_built() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    return bool(hvd.nccl_built())


def test_hvd_jobs_dry_two_ranks_identical(tmp_path):
    rc, out, _ = _gpu_check(tmp_path, dry=True, timeout=240)
    assert rc is not None, f"gpu_check.sh timed out and was killed\n{out[-6000:]}"
    assert rc == 0, f"gpu_check.sh exited {rc}\n{out[-8000:]}"
    assert "=== stage hvd_jobs ok" in out and "all stages passed" in out
    record = json.loads((tmp_path / "hvd_jobs.json").read_text())
    assert record["ok"] is True and record["device"] == "cpu" and record["ranks"] == 2
    assert set(record["jobs"]) == {"cnn", "gpt", "recipe"}
    for name, job in record["jobs"].items():
        assert job["ok"] is True and job["failed_checks"] == [], (name, job)
        assert job["replicas_identical"] is True, name
    # The record against each job's own summary, written by train.py (not by the stage's checks)
    for name, (steps, ratio) in {"cnn": (6, 0.01), "gpt": (3, 0.01), "recipe": (4, 0.25)}.items():
        summary = json.loads((tmp_path / f"hvd_jobs_{name}.json").read_text())
        assert summary["world_size"] == 2 and summary["step"] == steps, (name, summary)
        assert summary["compressor"] == "adtopk" and summary["ratio"] == ratio, (name, summary)
        assert summary["replicas_identical"] is True, name
        assert 0 < summary["bytes_sent"] < summary["bytes_dense"], (name, summary)
        assert summary["wire_bytes_sent"] > 0, name  # two ranks: the payloads crossed between processes
        log = (tmp_path / f"hvd_jobs_{name}.log").read_text()
        assert "2 rank(s) (horovod init, cpu)" in log, name
    # the recipe's 4 steps hold one sync (H = 4): 2-bit values with bit-packed indices, ADTopk 0.25 / 4 steps
    recipe = json.loads((tmp_path / "hvd_jobs_recipe.json").read_text())
    assert 0.25 / 4 <= recipe["density"] < 0.08
    assert recipe["bytes_sent"] / recipe["bytes_dense"] < recipe["density"] / 2


def test_hvd_jobs_dry_one_rank_exchanges_alone(tmp_path):
    """The GPU run's shape on the CPU: one rank, --exchange-when-alone; the replicas' check does not apply. The
    recipe job only (GPU_CHECK_HVD_JOBS), local steps with 2-bit values: the per-step exchange at one rank is
    tests/test_train.py::test_exchange_when_alone_at_one_rank's, and the three jobs on two ranks are above."""
    rc, out, _ = _gpu_check(tmp_path, dry=True, timeout=240, GPU_CHECK_HVD_JOBS_NP="1", GPU_CHECK_HVD_JOBS="recipe")
    assert rc is not None, f"gpu_check.sh timed out and was killed\n{out[-6000:]}"
    assert rc == 0, f"gpu_check.sh exited {rc}\n{out[-8000:]}"
    record = json.loads((tmp_path / "hvd_jobs.json").read_text())
    assert record["ok"] is True and record["ranks"] == 1 and record["exchange_when_alone"] is True
    assert set(record["jobs"]) == {"recipe"} and not (tmp_path / "hvd_jobs_cnn.json").exists()
    for name, job in record["jobs"].items():
        assert job["ok"] is True and job["replicas_identical"] == "not applicable at 1 rank", (name, job)
        summary = json.loads((tmp_path / f"hvd_jobs_{name}.json").read_text())
        assert summary["world_size"] == 1 and summary["bytes_sent"] > 0, (name, summary)
        assert summary["wire_bytes_sent"] == 0, name  # one rank: no other rank's payload to deliver
        assert "1 rank(s) (horovod init, cpu)" in (tmp_path / f"hvd_jobs_{name}.log").read_text(), name


@pytest.mark.skipif(_horovod_nccl_built(), reason="this Horovod has NCCL operations")
def test_hvd_jobs_refuses_without_nccl(tmp_path):
    rc, out, _ = _gpu_check(tmp_path, dry=False, timeout=120)
    assert rc == 1, f"exit {rc}\n{out[-4000:]}"
    assert "hvd_jobs stage: needs a CUDA device and Horovod built with NCCL operations" in out, out[-4000:]
    assert "!!! stage hvd_jobs failed" in out
    assert not list(tmp_path.glob("hvd_jobs_*.json"))  # nothing was run
