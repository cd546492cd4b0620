"""Issue 30: the DDP engine inside the training frameworks, each through its own launcher, on 2 real processes.

For each framework the example under ``examples/frameworks/`` runs as a user would run it (``Trainer(devices=2)``,
``accelerate launch``, ``torchrun``) and writes every rank's digests with ``--report``. Checked against an
independent reference, the same training as a plain ``DistributedDataParallel`` loop with ``no_sync()`` by hand
(``tests/framework_workers.py``, the hook itself being checked against numpy in tests/test_ddp.py):

- compression happens: bytes sent well under dense;
- the ranks end with bitwise identical parameters;
- gradient accumulation: one round per optimizer step, parameters *and* every rank's residuals bitwise equal
  to the reference's (a hook fired on every micro-batch, or a residual fed one micro-batch, would differ);
- the framework's own checkpoint carries every rank's residuals: a run resumed from it ends bitwise where the
  run that did not stop ends.

Each framework's tests skip, with the reason, when its package is not installed (``scripts/setup.sh`` installs
the ``integrations`` extra). Every job runs under ``tests.harness.run_command``'s timeout (kills the whole
process tree).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import REPO, run_command, run_ranks
from tests.test_ddp import run_ddp

EXAMPLES = REPO / "examples" / "frameworks"
ENV = {"GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


# A local Ray cluster takes 20-30 s to start on this 2-core machine (each Ray test about a minute and a half in
# all); they run in every suite where ray is installed (HAT_SKIP_RAY=1 skips them in your own quick loop).
RAY_SKIPPED = os.environ.get("HAT_SKIP_RAY") == "1"


def needs(package: str, *modules: str):
    """Skip unless the top-level ``modules`` are installed (found without importing them)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{package} is not installed (no {', '.join(missing)}; "
                                                   "scripts/setup.sh installs it, or pip install .[integrations])")


def run_example(cmd: list, report: Path, timeout: float = 180.0, env: dict = None) -> list:
    """Run one example command under the harness timeout; return its ``--report`` (one entry per rank). Every
    rank must exit 0: a rank that aborts at exit after a complete run fails the job for its scheduler (issue 56;
    the examples end with ``hat.ddp.shutdown()``, benchmarks/bench_clean_exit.py counts such exits)."""
    rc, log, seconds = run_command(cmd + ["--report", str(report)], timeout=timeout, env={**ENV, **(env or {})})
    assert rc == 0, f"{' '.join(cmd)}: exit {rc} (None: timed out after {timeout:.0f} s and was killed)\n{log[-12000:]}"
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def reference() -> dict:
    """The plain-DDP reference for every sharding the frameworks use, per rank."""
    runs = [{"name": s, "sharding": s, "epochs": 2, "accumulate": 2, "ratio": 0.01} for s in ("shuffled", "sample", "batch")]
    rc, log, outdir, _ = run_ddp("framework_workers:plain_reference", 2, {"runs": runs}, timeout=120)
    assert rc == 0, f"reference: exit {rc}\n{log[-12000:]}"
    return [json.loads(Path(outdir, f"rank{r}.json").read_text()) for r in range(2)]


def check_against(ranks: list, reference: list, sharding: str, rounds: int) -> None:
    assert len(ranks) == 2
    assert ranks[0]["params"] == ranks[1]["params"], "the ranks' parameters differ"
    for r, entry in enumerate(ranks):
        ref = reference[r][sharding]
        assert entry["round"] == rounds == ref["round"], f"rank {r}: {entry['round']} rounds, {rounds} optimizer steps"
        assert entry["params"] == ref["params"], f"rank {r}: parameters differ from the plain-DDP reference"
        assert entry["residuals"] == ref["residuals"], f"rank {r}: residuals differ from the plain-DDP reference"
    assert ranks[0]["residuals"] != ranks[1]["residuals"]  # rank-private memory (so a rank-0-only save would lose some)


def check_compressed(ranks: list) -> None:
    for entry in ranks:
        assert 0 < entry["bytes_sent"] < 0.1 * entry["bytes_dense"], entry


# --- PyTorch Lightning ------------------------------------------------------------------------------------------

@needs("pytorch-lightning", "pytorch_lightning")
def test_lightning_accumulation_checkpoint_resume(reference, tmp_path):
    """``Trainer(devices=2, accumulate_grad_batches=2)`` + ``DDPCompression``: 2 epochs of 4 steps; resumed from
    the epoch-0 checkpoint ``ModelCheckpoint`` wrote, bitwise the same end."""
    script = [sys.executable, str(EXAMPLES / "lightning_ddp.py"), "--ckpt-dir", str(tmp_path / "ckpt")]
    straight = run_example(script, tmp_path / "straight.json")
    check_compressed(straight)
    check_against(straight, reference, "shuffled", rounds=8)
    ckpt = tmp_path / "ckpt" / "epoch=0.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["horovod_adtopk.DDPCompression"]
    assert sorted(saved["ranks"]) == [0, 1] and saved["round"] == 4  # every rank's residuals, in rank 0's file
    resumed = run_example([sys.executable, str(EXAMPLES / "lightning_ddp.py"), "--resume", str(ckpt)],
                          tmp_path / "resumed.json")
    for a, b in zip(straight, resumed):
        assert (a["params"], a["residuals"], a["round"]) == (b["params"], b["residuals"], b["round"])


@needs("pytorch-lightning", "pytorch_lightning")
def test_lightning_refuses_the_strategy_hook(tmp_path):
    """``DDPStrategy(ddp_comm_hook=...)`` next to the callback: a clear error (on CPU Lightning skips that hook)."""
    code = ("import torch, pytorch_lightning as pl\n"
            "from pytorch_lightning.strategies import DDPStrategy\n"
            "import horovod_adtopk as hat\n"
            "from horovod_adtopk.integrations.lightning import DDPCompression\n"
            "from lightning_ddp import Classifier, toy_data\n"
            "st = hat.ddp.CompressionState(compression=hat.Compression.adtopk(ratio=0.01))\n"
            "tr = pl.Trainer(accelerator='cpu', devices=1, strategy=DDPStrategy(ddp_comm_state=st, ddp_comm_hook=hat.ddp.hook),\n"
            "                callbacks=[DDPCompression(hat.Compression.adtopk(ratio=0.01))], max_steps=1, logger=False,\n"
            "                enable_checkpointing=False, enable_progress_bar=False)\n"
            "tr.fit(Classifier(), torch.utils.data.DataLoader(toy_data(), batch_size=4))\n")
    rc, log, _ = run_command([sys.executable, "-c", code], timeout=120, env=dict(ENV, PYTHONPATH=f"{EXAMPLES}{os.pathsep}{REPO}"))
    assert rc not in (0, None), log[-4000:]
    assert "remove ddp_comm_hook/ddp_comm_state from DDPStrategy" in log, log[-4000:]


# --- Hugging Face Accelerate -------------------------------------------------------------------------------------

@needs("accelerate", "accelerate")
def test_accelerate_accumulation_checkpoint_resume(reference, tmp_path):
    """``accelerate launch --multi_gpu --num_processes 2`` (CPU processes here), ``accelerator.accumulate`` over 2
    micro-batches, ``register`` after ``prepare``; ``save_state`` after each epoch, resumed from epoch 0's."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    ckpt = tmp_path / "ckpt"
    script = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
              "no", "--dynamo_backend", "no", str(EXAMPLES / "accelerate_ddp.py"), "--ckpt-dir", str(ckpt)]
    home = {"HF_HOME": str(tmp_path / "hf")}  # no user accelerate config
    straight = run_example(script, tmp_path / "straight.json", env=home)
    check_compressed(straight)
    check_against(straight, reference, "batch", rounds=8)
    saved = torch.load(ckpt / "epoch_0" / "custom_checkpoint_0.pkl", weights_only=False)
    assert sorted(saved["ranks"]) == [0, 1] and saved["round"] == 4  # every rank's residuals, in the main process's file
    shutil.rmtree(ckpt / "epoch_1")
    resumed = run_example(script + ["--resume"], tmp_path / "resumed.json", env=home)
    for a, b in zip(straight, resumed):
        assert (a["params"], a["residuals"], a["round"]) == (b["params"], b["residuals"], b["round"])


# --- Transformers Trainer ----------------------------------------------------------------------------------------

@needs("transformers", "transformers", "accelerate")
def test_trainer_accumulation_checkpoint_resume(reference, tmp_path):
    """``torchrun --nproc_per_node 2``, ``gradient_accumulation_steps=2``, ``attach``; the Trainer saves
    ``checkpoint-4`` and ``checkpoint-8`` (with every rank's residuals); resumed from ``checkpoint-4``."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    out = tmp_path / "run"
    script = [torchrun, "--nproc_per_node", "2", str(EXAMPLES / "transformers_trainer.py"), "--out", str(out)]
    home = {"HF_HOME": str(tmp_path / "hf")}
    straight = run_example(script, tmp_path / "straight.json", env=home)
    check_compressed(straight)
    check_against(straight, reference, "batch", rounds=8)
    saved = torch.load(out / "checkpoint-4" / "horovod_adtopk_ddp.pt", weights_only=True)
    assert sorted(saved["ranks"]) == [0, 1] and saved["round"] == 4
    resumed = run_example(script + ["--resume", str(out / "checkpoint-4")], tmp_path / "resumed.json", env=home)
    for a, b in zip(straight, resumed):
        assert (a["params"], a["residuals"], a["round"]) == (b["params"], b["residuals"], b["round"])


# --- Ray Train, and Horovod's own RayExecutor -----------------------------------------------------------------

ray_opt_in = pytest.mark.skipif(RAY_SKIPPED, reason="HAT_SKIP_RAY=1 (a local Ray cluster start is slow)")


@ray_opt_in
@needs("ray[train]", "ray", "pyarrow", "pandas")
def test_ray_train_accumulation_checkpoint_resume(reference, tmp_path):
    """``TorchTrainer`` (2 workers, local cluster) running the example's ``train_loop``: ``prepare_model``'s DDP
    with the hook, manual ``no_sync`` accumulation; resumed from the epoch-0 ``ray.train.Checkpoint``."""
    rc, log, _ = run_command([sys.executable, "-m", "tests.ray_driver", str(tmp_path)], timeout=420,
                             env={**ENV, "RAY_USAGE_STATS_ENABLED": "0"})
    assert rc == 0, f"ray driver: exit {rc} (None: timed out)\n{log[-12000:]}"
    assert (tmp_path / "saved.txt").read_text() == "0 4 [0, 1]"  # epoch 0, round 4, both ranks' residuals
    straight = json.loads((tmp_path / "straight.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    check_compressed(straight)
    check_against(straight, reference, "sample", rounds=8)
    for a, b in zip(straight, resumed):
        assert (a["params"], a["residuals"], a["round"]) == (b["params"], b["residuals"], b["round"])


@ray_opt_in
@needs("ray", "ray")
def test_horovod_ray_executor(tmp_path):
    """``horovod.ray.RayExecutor`` (Horovod 0.28.1 on Ray 2.60, local cluster) runs ``hat.DistributedOptimizer``
    with ``backward_passes_per_step=2``: ranks identical, one round per optimizer step, bitwise what the same
    function does under ``horovodrun``."""
    on_ray = run_example([sys.executable, str(EXAMPLES / "horovod_ray.py"), "--steps", "6"], tmp_path / "ray.json",
                         timeout=300, env={"RAY_USAGE_STATS_ENABLED": "0"})
    under_horovodrun = run_ranks("framework_workers:horovod_reference", np=2,
                                 args={"ratio": 0.01, "steps": 6, "accumulate": 2}, timeout=120)
    assert [r["rank"] for r in on_ray] == [0, 1]
    assert on_ray[0]["params"] == on_ray[1]["params"]
    for a, b in zip(on_ray, under_horovodrun):
        assert a["steps"] == 6 and 0 < a["bytes_sent"] < 0.1 * a["bytes_dense"], a
        assert {k: a[k] for k in a} == {k: b[k] for k in a}  # (the harness adds its outdir to b)


@needs("pytorch-lightning", "pytorch_lightning")
def test_lightning_strategy_hook_is_skipped_on_cpu(tmp_path):
    """The trap the callback exists for, as Lightning 2.6.6 behaves: ``DDPStrategy(ddp_comm_hook=hat.ddp.hook)``
    on 2 CPU processes trains and never calls the hook (0 rounds). If this starts failing, Lightning registers
    hooks off CUDA now: update the README's Lightning trap."""
    script = tmp_path / "strategy_hook.py"
    script.write_text(
        "import sys, torch, pytorch_lightning as pl\n"
        "from pytorch_lightning.strategies import DDPStrategy\n"
        "import horovod_adtopk as hat\n"
        "from lightning_ddp import Classifier, toy_data\n"
        "if __name__ == '__main__':\n"
        "    st = hat.ddp.CompressionState(compression=hat.Compression.adtopk(ratio=0.01))\n"
        "    tr = pl.Trainer(accelerator='cpu', devices=2, strategy=DDPStrategy(ddp_comm_state=st, ddp_comm_hook=hat.ddp.hook),\n"
        "                    max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False)\n"
        "    tr.fit(Classifier(), torch.utils.data.DataLoader(toy_data(), batch_size=4))\n"
        "    print(f'RANK {tr.global_rank} STEPS {tr.global_step} ROUNDS {st.round}', flush=True)\n"
        "    hat.ddp.shutdown()\n")
    rc, log, _ = run_command([sys.executable, str(script)], timeout=180, env=dict(ENV, PYTHONPATH=f"{EXAMPLES}{os.pathsep}{REPO}"))
    assert rc == 0, log[-6000:]
    assert "RANK 0 STEPS 4 ROUNDS 0" in log and "RANK 1 STEPS 4 ROUNDS 0" in log, log[-6000:]


def test_import_pulls_in_no_framework():
    """``import horovod_adtopk`` (and its integrations package) imports none of the frameworks."""
    code = ("import sys, horovod_adtopk, horovod_adtopk.ddp, horovod_adtopk.integrations\n"
            "bad = [m for m in ('pytorch_lightning', 'lightning', 'accelerate', 'transformers', 'ray') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(REPO), timeout=120)


@pytest.mark.parametrize("module,blocked,package", [
    ("lightning", ["pytorch_lightning", "lightning"], "pytorch-lightning"),
    ("accelerate", ["accelerate"], "accelerate"),
    ("transformers", ["transformers"], "transformers"),
])
def test_missing_framework_says_what_to_install(module, blocked, package):
    """An integration module whose framework is not installed raises an ImportError naming the package."""
    code = (f"import sys\nfor m in {blocked!r}: sys.modules[m] = None\n"
            f"try:\n    import horovod_adtopk.integrations.{module}\nexcept ImportError as exc:\n    print(exc)\n"
            f"else:\n    raise SystemExit('imported without its framework')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(REPO), timeout=120, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"pip install {package}" in out.stdout, out.stdout
