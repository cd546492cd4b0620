"""The training job examples/train.py (and examples/plot.py), launched for real on 2 ranks.

Every launch goes through tests.harness.run_command, which kills the whole process tree on timeout.
Runs are kept to a few optimizer steps (OMP_NUM_THREADS=1 per rank) so the file takes about 4 minutes
on 2 CPU cores.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import HOROVODRUN, REPO, run_command

TRAIN = str(REPO / "examples" / "train.py")
PLOT = str(REPO / "examples" / "plot.py")
TIMEOUT = 150
ENV = {"HOROVOD_CYCLE_TIME": "1"}
METRIC_KEYS = {"epoch", "step", "train_loss", "test_loss", "wall_time", "bytes_sent", "bytes_dense", "density",
               "compressor", "ratio", "world_size"}
QUICK = ["--no-progress", "--log-every", "0"]


def horovodrun(args, np_=2, timeout=TIMEOUT):
    cmd = [HOROVODRUN, "-np", str(np_), "--gloo", sys.executable, TRAIN, *QUICK, *map(str, args)]
    return run_command(cmd, timeout=timeout, env=ENV)


def check_ok(rc, out, what="run"):
    assert rc is not None, f"{what} timed out after {TIMEOUT}s and was killed\n{out[-6000:]}"
    assert rc == 0, f"{what} exited {rc}\n{out[-6000:]}"


def final_of(out: str) -> dict:
    """The summary in the log (runs with --print-final-json)."""
    lines = [line for line in out.splitlines() if "FINAL {" in line]
    assert len(lines) == 1, f"expected exactly one FINAL line (rank 0 only), got {len(lines)}\n{out[-4000:]}"
    return json.loads(lines[0].split("FINAL ", 1)[1])


def final_row(metrics: Path) -> dict:
    """The summary in the metrics file: its last line, marked final."""
    row = read_jsonl(metrics)[-1]
    assert row["final"] is True and "total_seconds" in row, row
    return row


def read_jsonl(path: Path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert rows, f"{path} is empty"
    return rows


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def latest(ckpt_dir: Path) -> Path:
    pointer = ckpt_dir / "latest"
    assert pointer.is_file(), f"no latest pointer in {ckpt_dir}: {sorted(os.listdir(ckpt_dir))}"
    path = ckpt_dir / pointer.read_text().strip()
    assert path.is_file()
    return path


def rank_states(ckpt: dict) -> dict:
    return ckpt["optimizer"]["horovod_adtopk"]["ranks"]


def assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: different keys {sorted(a)} vs {sorted(b)}"
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max |diff| {(a[k] - b[k]).abs().max().item()})"


# --------------------------------------------------------------------------------------------------------
# Fashion-MNIST: metrics, checkpoint, plot
# --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fashion_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("fashion")
    # --no-warmup: the 8 steps compress from the first (the default warm-up would send them all dense)
    rc, out, _ = horovodrun(["--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01", "--no-warmup",
                             "--max-steps", 8, "--test-batches", 2, "--checkpoint-dir", d / "ckpt",
                             "--metrics-out", d / "metrics.jsonl"])
    check_ok(rc, out, "fashion-mnist run")
    return d, out


def test_fashion_mnist_metrics_and_checkpoint(fashion_run):
    d, out = fashion_run
    final = final_row(d / "metrics.jsonl")
    assert "FINAL" not in out  # the summary stays out of the human log unless --print-final-json
    assert sum(line.startswith("Final test accuracy") or "<stdout>:Final test accuracy" in line
               for line in out.splitlines()) == 1, out[-4000:]
    assert final["step"] == 8 and final["world_size"] == 2 and final["compressor"] == "adtopk"
    assert 0.0 <= final["test_accuracy"] <= 1.0
    assert "bytes sent" in out and "vs dense" in out

    rows = read_jsonl(d / "metrics.jsonl")
    assert len(rows) == 1  # stopped inside the first epoch: one line at the end
    row = rows[0]
    assert METRIC_KEYS | {"test_accuracy"} <= set(row), sorted(METRIC_KEYS - set(row))
    assert row["step"] == 8 and row["ratio"] == 0.01 and row["world_size"] == 2
    assert 0 < row["bytes_sent"] < row["bytes_dense"] / 10
    assert 0 < row["density"] < 0.1

    ckpt = load_ckpt(latest(d / "ckpt"))
    assert ckpt["step"] == 8 and ckpt["epoch"] == 0 and ckpt["batch_in_epoch"] == 8
    states = rank_states(ckpt)
    assert sorted(states) == [0, 1]
    res0, res1 = states[0]["memory"]["residuals"], states[1]["memory"]["residuals"]
    assert res0 and set(res0) == set(res1)
    assert {"fc1.weight", "conv2.weight"} <= set(res0)
    # each rank's own memory (different data shards), not one rank's copied twice
    assert any(not torch.equal(res0[k], res1[k]) for k in res0)
    assert len(ckpt["rng"]["torch"]) == 2


def test_plot_writes_pngs(fashion_run, tmp_path):
    d, _ = fashion_run
    other = tmp_path / "dense.jsonl"  # a second run to compare against: same line, other label
    row = read_jsonl(d / "metrics.jsonl")[0]
    row.update(compressor="none", ratio=None, bytes_sent=row["bytes_dense"], test_accuracy=0.5)
    other.write_text(json.dumps(row) + "\n")
    rc, out, _ = run_command([sys.executable, PLOT, str(d / "metrics.jsonl"), str(other), "--out",
                              str(tmp_path / "plots")], timeout=TIMEOUT)
    check_ok(rc, out, "plot.py")
    written = [Path(line.strip()) for line in out.splitlines() if line.strip().endswith(".png")]
    assert len(written) == 3
    for path in written:
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------------
# Shakespeare
# --------------------------------------------------------------------------------------------------------

def test_shakespeare_metrics_and_checkpoint(tmp_path):
    # --no-warmup: the 4 steps compress (and leave residuals) from the first
    rc, out, _ = horovodrun(["--dataset", "shakespeare", "--no-warmup", "--max-steps", 4, "--batch-size", 8,
                             "--lstm-hidden", 64,
                             "--test-batches", 1, "--test-batch-size", 16, "--checkpoint-dir", tmp_path / "ckpt",
                             "--metrics-out", tmp_path / "metrics.jsonl"])
    check_ok(rc, out, "shakespeare run")
    final = final_row(tmp_path / "metrics.jsonl")
    assert "Final test perplexity" in out
    assert final["step"] == 4 and final["test_perplexity"] > 1.0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert METRIC_KEYS | {"test_perplexity"} <= set(rows[-1])
    assert rows[-1]["dataset"] == "shakespeare"
    ckpt = load_ckpt(latest(tmp_path / "ckpt"))
    states = rank_states(ckpt)
    assert sorted(states) == [0, 1]
    assert any(k.startswith("lstm.") for k in states[0]["memory"]["residuals"])
    assert set(states[0]["memory"]["residuals"]) == set(states[1]["memory"]["residuals"])


# --------------------------------------------------------------------------------------------------------
# Resume exactness
# --------------------------------------------------------------------------------------------------------

def _compare_final_checkpoints(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["epoch"] == b["epoch"] and a["batch_in_epoch"] == b["batch_in_epoch"]
    assert_same_tensors(a["model"], b["model"], "model")
    sa, sb = rank_states(a), rank_states(b)
    assert sorted(sa) == sorted(sb) == [0, 1]
    for r in sa:
        assert sa[r]["memory"]["residuals"], "no residuals saved"
        for store in ("residuals", "velocities"):
            assert_same_tensors(sa[r]["memory"][store], sb[r]["memory"][store], f"rank {r} {store}")
    assert a["optimizer"]["horovod_adtopk"]["round"] == b["optimizer"]["horovod_adtopk"]["round"] == a["step"]
    oa, ob = a["optimizer"]["state"], b["optimizer"]["state"]
    assert set(oa) == set(ob)
    for i in oa:
        assert_same_tensors(oa[i], ob[i], f"SGD state {i}")
    assert a["counters"] == b["counters"]


def _run_resume_case(tmp_path, common, total, first):
    a_dir, b_dir = tmp_path / "A", tmp_path / "B"
    rc, out_a, _ = horovodrun([*common, "--max-steps", total, "--checkpoint-dir", a_dir / "ckpt",
                               "--metrics-out", a_dir / "m.jsonl"])
    check_ok(rc, out_a, "run A")
    rc, out_b1, _ = horovodrun([*common, "--max-steps", first, "--checkpoint-dir", b_dir / "ckpt",
                                "--metrics-out", b_dir / "m.jsonl"])
    check_ok(rc, out_b1, "run B, first part")
    assert latest(b_dir / "ckpt").name == f"ckpt-step{first}.pt"
    rc, out_b2, _ = horovodrun([*common, "--max-steps", total, "--checkpoint-dir", b_dir / "ckpt", "--resume",
                                "--metrics-out", b_dir / "m.jsonl"])
    check_ok(rc, out_b2, "run B, resumed")
    assert f"resumed from" in out_b2 and f"at step {first}" in out_b2

    a = load_ckpt(latest(a_dir / "ckpt"))
    b = load_ckpt(latest(b_dir / "ckpt"))
    assert a["step"] == b["step"] == total
    _compare_final_checkpoints(a, b)

    fa, fb = final_row(a_dir / "m.jsonl"), final_row(b_dir / "m.jsonl")
    for key in ("train_loss", "test_loss", "bytes_sent", "bytes_dense", "density"):
        assert fa[key] == fb[key], (key, fa[key], fb[key])
    return a_dir, b_dir


def test_resume_is_bitwise_exact_fashion_mnist(tmp_path):
    common = ["--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01", "--test-batches", 1,
              "--checkpoint-every", 4, "--no-warmup"]
    _run_resume_case(tmp_path, common, total=12, first=6)
    # periodic checkpoints too, of which the newest two are kept (--keep-checkpoints 2)
    assert sorted(p.name for p in (tmp_path / "A" / "ckpt").glob("ckpt-step*.pt")) == ["ckpt-step12.pt",
                                                                                       "ckpt-step8.pt"]


def tiny_corpus(folder: Path) -> Path:
    """A 4.7k-character text folder (277 training windows of 16): 5 steps per epoch at batch 32 on 2 ranks."""
    folder.mkdir()
    line = "Now is the winter of our discontent made glorious summer by this sun of York.\n"
    (folder / "play.txt").write_text(line * 60)
    return folder


# A GPT small enough for a test (2 blocks of width 16: fc [64, 16] and proj [16, 64] reach --min-numel 256),
# trained as the transformer job is: AdamW, clipping, the tied head, bfloat16 autocast.
TINY_GPT = ["--dataset", "shakespeare", "--model", "gpt", "--gpt-dim", 16, "--gpt-layers", 2, "--gpt-heads", 2,
            "--seq-len", 16, "--batch-size", 32, "--bf16", "--min-numel", 256, "--test-batches", 1, "--no-warmup"]


def test_gpt_adamw_resume_is_bitwise_exact(tmp_path):
    """The transformer job on the Horovod engine: AdamW's moments, every rank's residuals and the tied
    embedding/head continue bit for bit after a resume; the MLP weights travel sparse."""
    common = [*TINY_GPT, "--data-dir", tiny_corpus(tmp_path / "text"), "--epochs", 2, "--compressor", "adtopk",
              "--ratio", "0.05", "--error-feedback-on", "gradient"]
    a_dir, _ = _run_resume_case(tmp_path, common, total=7, first=4)
    a = load_ckpt(latest(a_dir / "ckpt"))
    assert {"exp_avg", "exp_avg_sq"} <= set(next(iter(a["optimizer"]["state"].values())))
    residuals = rank_states(a)[0]["memory"]["residuals"]
    assert {"blocks.0.fc.weight", "blocks.1.proj.weight"} <= set(residuals)
    assert "head.weight" not in a["model"] or torch.equal(a["model"]["head.weight"], a["model"]["tok_emb.weight"])
    final = final_row(a_dir / "m.jsonl")
    assert final["model"] == "gpt" and final["density"] < 0.5 and final["test_perplexity"] > 1.0


def test_gpt_adamw_error_feedback_on_the_update(tmp_path):
    """AdamW's default with a sparse compressor: error feedback on the update (local steps at every step, outer
    SGD lr 1); compressed, and a resumed run ends bitwise where the straight run does; a resume with another
    --outer-feedback-decay is refused."""
    common = [*TINY_GPT, "--data-dir", tiny_corpus(tmp_path / "text"), "--epochs", 2, "--compressor", "adtopk",
              "--ratio", "0.05"]
    runs = {}
    for name, steps, extra in (("a", 6, []), ("b", 3, []), ("b", 6, ["--resume"])):
        if extra:  # a resume with another error-feedback decay is refused before anything changes
            rc, out, _ = horovodrun([*common, "--max-steps", steps, "--checkpoint-dir", tmp_path / name / "ckpt",
                                     "--resume", "--outer-feedback-decay", "0.9"])
            assert rc != 0 and "outer_feedback_decay: checkpoint 1.0, now 0.9" in out, out[-4000:]
        rc, out, _ = horovodrun([*common, "--max-steps", steps, "--checkpoint-dir", tmp_path / name / "ckpt",
                                 "--metrics-out", tmp_path / name / "m.jsonl", *extra])
        check_ok(rc, out, f"run {name} to step {steps}")
        runs[name] = out
    assert "error feedback on the optimizer's update" in runs["a"] and "at step 3" in runs["b"]
    a, b = load_ckpt(latest(tmp_path / "a" / "ckpt")), load_ckpt(latest(tmp_path / "b" / "ckpt"))
    assert a["step"] == b["step"] == 6
    assert_same_tensors(a["model"], b["model"], "model")
    fa, fb = final_row(tmp_path / "a" / "m.jsonl"), final_row(tmp_path / "b" / "m.jsonl")
    for key in ("train_loss", "test_loss", "bytes_sent", "bytes_dense", "density"):
        assert fa[key] == fb[key], (key, fa[key], fb[key])
    assert fa["density"] < 0.5


def test_resume_is_bitwise_exact_across_epochs(tmp_path):
    # A tiny text corpus: 5 steps per epoch, so the runs cross two epoch boundaries (sampler epochs, skipped
    # batches after the resume in the middle of epoch 2).
    text_dir = tiny_corpus(tmp_path / "text")
    common = ["--dataset", "shakespeare", "--data-dir", text_dir, "--seq-len", 16, "--batch-size", 32,
              "--lstm-hidden", 32, "--lstm-layers", 1, "--epochs", 3, "--compressor", "adtopk", "--ratio", "0.05",
              "--test-batches", 1, "--no-warmup"]
    a_dir, b_dir = _run_resume_case(tmp_path, common, total=12, first=7)
    a = load_ckpt(latest(a_dir / "ckpt"))
    assert a["epoch"] == 2 and a["batch_in_epoch"] == 2  # 5 steps per epoch: 12 = 2 epochs + 2 batches
    rows_a = read_jsonl(a_dir / "m.jsonl")
    rows_b = read_jsonl(b_dir / "m.jsonl")
    assert [r["step"] for r in rows_a] == [5, 10, 12]
    assert [r["step"] for r in rows_b] == [5, 7, 10, 12]  # the first part's end line, then the resumed run's
    for ra, rb in zip(rows_a, [rows_b[0], rows_b[2], rows_b[3]]):
        assert ra["train_loss"] == rb["train_loss"] and ra["test_loss"] == rb["test_loss"]


def assert_one_synced_model(ckpt: dict, syncs: int) -> None:
    """A local-steps checkpoint written right after the last sync: no open interval, no per-rank parameters,
    ``syncs`` syncs, and the model equal to the outer parameters."""
    block = ckpt["optimizer"]["horovod_adtopk"]
    assert block["local_steps"]["step"] == 0 and block["local_steps"]["syncs"] == syncs
    assert not any("local_params" in e for e in block["ranks"].values())
    params = {k: v for k, v in ckpt["model"].items() if k in block["local_steps"]["outer_params"]}
    assert len(params) == len(block["local_steps"]["outer_params"]) > 0
    assert_same_tensors(params, block["local_steps"]["outer_params"], "outer parameters")


def test_local_steps_resume_and_last_sync(tmp_path):
    """--sync-every 3 on the tiny corpus (5 steps per epoch, 2 epochs: the schedule ends at step 10, one step
    into an interval). The job syncs that last step (opt.sync_now(average=True)), so the final checkpoint
    holds one model: no open interval, no per-rank parameters, the outer parameters equal to the model. A run
    stopped at step 7 (--max-steps, one step into an interval) writes its checkpoint *before* its own last
    sync, and a resume from it to the end is bitwise the same as the straight run."""
    text_dir = tiny_corpus(tmp_path / "text")
    common = ["--dataset", "shakespeare", "--data-dir", text_dir, "--seq-len", 16, "--batch-size", 32,
              "--lstm-hidden", 32, "--lstm-layers", 1, "--epochs", 2, "--compressor", "adtopk", "--ratio", "0.05",
              "--sync-every", 3, "--test-batches", 1, "--no-warmup", "--keep-checkpoints", 5]
    a_dir, b_dir = tmp_path / "A", tmp_path / "B"
    rc, out_a, _ = horovodrun([*common, "--checkpoint-dir", a_dir / "ckpt", "--metrics-out", a_dir / "m.jsonl"])
    check_ok(rc, out_a, "straight run")
    assert "last sync: the average of the 1 local step(s)" in out_a
    rc, out_b1, _ = horovodrun([*common, "--max-steps", 7, "--checkpoint-dir", b_dir / "ckpt",
                                "--metrics-out", b_dir / "m.jsonl"])
    check_ok(rc, out_b1, "run stopped at step 7")
    assert "last sync: the average of the 1 local step(s)" in out_b1
    stopped_ckpt = load_ckpt(b_dir / "ckpt" / "ckpt-step7.pt")
    stopped = stopped_ckpt["optimizer"]["horovod_adtopk"]
    assert stopped["local_steps"]["step"] == 1 and stopped["local_steps"]["syncs"] == 2
    assert all("local_params" in e for e in stopped["ranks"].values())
    # benchmarks/score_final_models.py's candidates: each rank's model and their mean (numpy)
    from benchmarks.score_final_models import candidates, main as score_main
    models = candidates(stopped_ckpt)
    own = [stopped["ranks"][r]["local_params"] for r in (0, 1)]
    assert sorted(own[0]) == sorted(stopped["local_steps"]["outer_params"])
    assert any(not torch.equal(own[0][n], own[1][n]) for n in own[0])
    for n in own[0]:
        want = (own[0][n].double().numpy() + own[1][n].double().numpy()) / 2
        np.testing.assert_allclose(models["mean of the ranks"][n].double().numpy(), want, rtol=1e-6, atol=1e-7)
        assert torch.equal(models["rank 1's own"][n], own[1][n])
    assert score_main([str(b_dir / "ckpt" / "ckpt-step7.pt"), "--json", str(tmp_path / "scores.json"), "--",
                       *map(str, common[:12])]) == 0
    scores = json.loads((tmp_path / "scores.json").read_text())[str(b_dir / "ckpt" / "ckpt-step7.pt")]
    assert scores["step_in_interval"] == 1 and len(scores["test_loss"]) == 4
    assert all(0 < v < 10 for v in scores["test_loss"].values())
    rc, out_b2, _ = horovodrun([*common, "--checkpoint-dir", b_dir / "ckpt", "--metrics-out", b_dir / "m.jsonl",
                                "--resume"])
    check_ok(rc, out_b2, "resumed run")
    assert "at step 7" in out_b2
    a, b = load_ckpt(latest(a_dir / "ckpt")), load_ckpt(latest(b_dir / "ckpt"))
    assert a["step"] == b["step"] == 10
    assert_same_tensors(a["model"], b["model"], "model")
    assert_one_synced_model(a, syncs=4)  # 3 full intervals + the last
    fa, fb = final_row(a_dir / "m.jsonl"), final_row(b_dir / "m.jsonl")
    for key in ("train_loss", "test_loss", "bytes_sent", "bytes_dense"):
        assert fa[key] == fb[key], (key, fa[key], fb[key])


def test_elastic_local_steps_end_with_one_model(tmp_path):
    """The --elastic loop (hvd.elastic.run, one host, 2 ranks, no fault) with --sync-every 3 on the tiny corpus:
    the schedule ends at step 10, one step into an interval, and the loop syncs it as the plain loop does
    (opt.sync_now(average=True)). Every rank's final model is the same (the elastic log's end digests), the
    final checkpoint has no open interval, and its model is the outer parameters of that last sync."""
    text_dir = tiny_corpus(tmp_path / "text")
    discover = tmp_path / "discover.sh"
    discover.write_text("#!/bin/sh\necho localhost:2\n")
    discover.chmod(0o755)
    log, ckpt_dir = tmp_path / "elastic.jsonl", tmp_path / "ckpt"
    cmd = [HOROVODRUN, "-np", "2", "--min-np", "2", "--max-np", "2", "--network-interface", "lo",
           "--host-discovery-script", str(discover), "--gloo", sys.executable, TRAIN, *QUICK,
           *map(str, ["--dataset", "shakespeare", "--data-dir", text_dir, "--seq-len", 16, "--batch-size", 32,
                      "--lstm-hidden", 32, "--lstm-layers", 1, "--epochs", 2, "--compressor", "adtopk",
                      "--ratio", "0.05", "--sync-every", 3, "--test-batches", 1, "--no-warmup", "--elastic",
                      "--commit-every", 5, "--elastic-log", log, "--checkpoint-dir", ckpt_dir])]
    rc, out, _ = run_command(cmd, timeout=TIMEOUT, env=ENV)
    check_ok(rc, out, "elastic run with local steps")
    assert "last sync: the average of the 1 local step(s)" in out
    ends = [r for r in read_jsonl(log) if r["event"] == "end"]
    assert sorted(r["rank"] for r in ends) == [0, 1] and {r["step"] for r in ends} == {10}, ends
    assert len({r["digest"] for r in ends}) == 1, f"the ranks ended with different models: {ends}"
    ckpt = load_ckpt(latest(ckpt_dir))
    assert ckpt["step"] == 10
    assert_one_synced_model(ckpt, syncs=4)


# --------------------------------------------------------------------------------------------------------
# Launchers and errors
# --------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun on PATH")
def test_plain_mpirun_launch():
    cmd = ["mpirun", "-np", "2"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += ["--oversubscribe", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH", "-x", "PYTHONUNBUFFERED",
            "-x", "HOROVOD_CYCLE_TIME", "-x", "PATH",
            sys.executable, TRAIN, *QUICK, "--max-steps", "3", "--test-batches", "1", "--print-final-json"]
    rc, out, _ = run_command(cmd, timeout=TIMEOUT, env=ENV)
    check_ok(rc, out, "mpirun launch")
    assert "mpi4py init" in out  # detected the MPI launcher without horovodrun's variables
    final = final_of(out)
    assert final["step"] == 3 and final["world_size"] == 2


def test_missing_dataset_fails_with_the_loader_message(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = horovodrun(["--dataset", "fashion-mnist", "--data-dir", empty, "--max-steps", 2])
    assert rc is not None, out[-4000:]
    assert rc != 0
    assert "Fashion-MNIST files missing" in out and "To fix" in out, out[-4000:]
    assert f'File "{TRAIN}"' not in out  # a clear message, not a traceback from the script
    assert "FINAL" not in out


def test_missing_text_single_process(tmp_path):
    rc, out, _ = run_command([sys.executable, TRAIN, *QUICK, "--dataset", "shakespeare", "--data-dir",
                              str(tmp_path), "--max-steps", "1"], timeout=TIMEOUT, env=ENV)
    assert rc == 2, f"exit {rc}\n{out[-4000:]}"
    assert "No *.txt files" in out and "To fix" in out
    assert "Traceback" not in out


def test_bad_arguments_are_rejected():
    rc, out, _ = run_command([sys.executable, TRAIN, "--dataset", "fashion-mnist", "--model", "lstm"],
                             timeout=TIMEOUT)
    assert rc == 2 and "does not fit" in out
    rc, out, _ = run_command([sys.executable, TRAIN, "--compressor", "threshold"], timeout=TIMEOUT)
    assert rc == 2 and "--threshold" in out
    rc, out, _ = run_command([sys.executable, TRAIN, "--compressor", "none", "--value-dtype", "float16"],
                             timeout=TIMEOUT)
    assert rc == 2 and "sparse compressors" in out


def test_exchange_when_alone_at_one_rank(tmp_path):
    """--exchange-when-alone: one process runs the whole exchange (hat.DistributedOptimizer
    exchange_when_alone=True), so it counts ADTopk's fixed-size payload, per rank the same bytes as each of
    two ranks sends for the same steps; without the flag one process sends nothing."""
    common = [*QUICK, "--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01", "--no-warmup",
              "--max-steps", "3", "--test-batches", "1", "--print-final-json"]
    alone = {}
    for flag in (True, False):
        rc, out, _ = run_command([sys.executable, TRAIN, *common, *(["--exchange-when-alone"] if flag else [])],
                                 timeout=TIMEOUT, env=ENV)
        check_ok(rc, out, f"one process, exchange_when_alone={flag}")
        alone[flag] = final_of(out)
    rc, out, _ = horovodrun(common[len(QUICK):])
    check_ok(rc, out, "two ranks")
    two = final_of(out)
    assert alone[False]["bytes_sent"] == alone[False]["elements_sent"] == 0
    assert alone[True]["world_size"] == 1 and two["world_size"] == 2
    assert 0 < alone[True]["density"] < 0.02
    # the summary sums the ranks' counters: each of the two ranks sent what the one process sent
    assert alone[True]["bytes_sent"] == two["bytes_sent"] / 2 > 0
    assert alone[True]["density"] == two["density"]
    assert alone[True]["wire_bytes_sent"] == 0  # an allgather over a world of one delivers no other payload
    rc, out, _ = run_command([sys.executable, TRAIN, "--engine", "ddp", "--exchange-when-alone"], timeout=TIMEOUT)
    assert rc == 2 and "--exchange-when-alone applies to --engine horovod" in out


# --------------------------------------------------------------------------------------------------------
# Log lines, summary outputs, TensorBoard
# --------------------------------------------------------------------------------------------------------

def test_log_lines_and_summary_outputs(tmp_path):
    """Under horovodrun: no bar, one complete flushed line per progress report (nothing glued to the
    launcher's tags), the summary in --summary-json and, with --print-final-json, once in the log."""
    summary = tmp_path / "summary.json"
    cmd = [HOROVODRUN, "-np", "2", "--gloo", sys.executable, TRAIN, "--log-every", "0.001", "--max-steps", "4",
           "--test-batches", "1", "--summary-json", str(summary), "--print-final-json"]
    rc, out, _ = run_command(cmd, timeout=TIMEOUT, env=ENV)
    check_ok(rc, out, "run with progress lines")
    assert "\r" not in out and "it/s" not in out  # no tqdm bar under a launcher
    lines = [line for line in out.splitlines() if line.strip()]
    for line in lines:
        assert line.count("<stdout>:") + line.count("<stderr>:") <= 1, f"two outputs on one line: {line!r}"
    progress = [line for line in lines if "<stdout>:step " in line]
    assert len(progress) >= 2, out[-4000:]
    for line in progress:
        for part in ("epoch 1/1", "loss ", "samples/s", "ETA ", "vs dense", "density"):
            assert part in line, (part, line)
    assert any("step 4/4" in line for line in progress)
    final = final_of(out)
    assert json.loads(summary.read_text()) == final
    assert final["step"] == 4 and final["final"] is True
    assert final["replicas_identical"] is True  # every rank's parameters hashed, compared across the ranks
    # the defaults: the recommended warm-up, said at start; its first 50 rounds are dense
    assert any("compressor adtopk: ratio 0.01, momentum correction 0.9" in line and
               "compression warm-up: 50 dense rounds, density 0.25 -> 0.01 over 150 rounds" in line
               for line in lines), out[-4000:]
    assert final["density"] == 1.0 and final["bytes_sent"] == final["bytes_dense"] > 0
    headline = [line for line in lines if "Final test accuracy" in line]
    assert len(headline) == 1 and headline[0].split("<stdout>:", 1)[-1].startswith("Final test accuracy")
    assert not any(line.startswith("[1]") for line in lines), "rank 1 logged at info level"


def test_model_digest_parameters_and_buffers():
    """The digest behind the summary's replicas_identical: one ulp in one parameter changes it, a buffer
    (batch-norm statistics, each rank's own under Horovod) changes it only with buffers=True; numpy's
    SHA-256 of the same bytes is the reference."""
    import hashlib

    from examples.job.common import model_digest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    params, full = model_digest(model, buffers=False), model_digest(model)
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
        h.update(np.ascontiguousarray(p.detach().numpy()).tobytes())
    assert params == h.hexdigest() and full != params
    model[1].running_mean.add_(1.0)
    assert model_digest(model, buffers=False) == params and model_digest(model) != full
    with torch.no_grad():
        w = model[0].weight
        w[1, 2] = float(np.nextafter(np.float32(w[1, 2].item()), np.float32(np.inf)))
    assert model_digest(model, buffers=False) != params


def test_tensorboard_event_file(tmp_path):
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard is not installed (pip install tensorboard) - --tensorboard is an optional extra")
    tb = tmp_path / "tb"
    rc, out, _ = horovodrun(["--max-steps", 3, "--test-batches", 1, "--tensorboard", tb, "--no-warmup"])
    check_ok(rc, out, "run with --tensorboard")
    acc = event_accumulator.EventAccumulator(str(tb), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    for tag in ("train/loss", "train/learning_rate", "compression/bytes_sent", "compression/density",
                "compression/compress_seconds", "test/accuracy", "test/loss"):
        assert tag in tags["scalars"], (tag, tags["scalars"])
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]
    assert 0 < acc.Scalars("compression/density")[-1].value < 0.1
    assert "compression/layer_density" in tags["histograms"]
    hist = acc.Histograms("compression/layer_density")[-1].histogram_value
    assert hist.num > 0 and 0 < hist.min <= hist.max <= 1
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1  # rank 0 only


# --------------------------------------------------------------------------------------------------------
# Checkpoints that fail well
# --------------------------------------------------------------------------------------------------------

def test_damaged_checkpoint_falls_back_then_fails_clearly(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--test-batches", 1, "--checkpoint-dir", ckpt, "--checkpoint-every", 2]
    rc, out, _ = horovodrun([*common, "--max-steps", 4])
    check_ok(rc, out, "first run")
    assert sorted(p.name for p in ckpt.glob("ckpt-step*.pt")) == ["ckpt-step2.pt", "ckpt-step4.pt"]

    # The newest is truncated; a save killed mid-write left its temporary file (a process id not running).
    newest = ckpt / "ckpt-step4.pt"
    newest.write_bytes(newest.read_bytes()[:5000])
    stale = ckpt / ".ckpt-step3.pt.tmp99999999"
    stale.write_bytes(b"partial")
    rc, out, _ = horovodrun([*common, "--max-steps", 6, "--resume"])
    check_ok(rc, out, "resume past a damaged checkpoint")
    assert f"checkpoint {newest} is damaged" in out, out[-4000:]
    assert f"resumed from {ckpt / 'ckpt-step2.pt'} at step 2" in out
    assert "weights_only" not in out and "Traceback" not in out
    assert not stale.exists() and "removed .ckpt-step3.pt.tmp99999999" in out
    assert (ckpt / "ckpt-step4.pt.damaged").is_file()
    assert sorted(p.name for p in ckpt.glob("ckpt-step*.pt")) == ["ckpt-step4.pt", "ckpt-step6.pt"]
    assert load_ckpt(latest(ckpt))["step"] == 6

    # Nothing usable left: a clear message from rank 0, status 2, no traceback.
    (ckpt / "ckpt-step6.pt").write_bytes(b"\x00garbage" * 100)
    (ckpt / "ckpt-step4.pt").write_bytes(b"")
    rc, out, _ = horovodrun([*common, "--max-steps", 8, "--resume"])
    assert rc is not None and rc != 0, out[-4000:]  # the ranks exit 2; horovodrun reports that as 1
    assert "Exit code: 2" in out, out[-4000:]
    assert "no usable checkpoint in" in out and str(ckpt / "ckpt-step6.pt") in out, out[-4000:]
    assert sum("no usable checkpoint" in line for line in out.splitlines()) == 1
    assert f'File "{TRAIN}"' not in out and "weights_only" not in out  # (horovodrun prints its own traceback)
    assert "Final test" not in out


def _mount_tiny_tmpfs(path: Path) -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    path.mkdir()
    import subprocess
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def test_disk_full_save_stops_every_rank(tmp_path):
    """A real full file system: a 256 KiB tmpfs (needs root; the checkpoint is about 1.8 MB)."""
    full = tmp_path / "full"
    if not _mount_tiny_tmpfs(full):
        pytest.skip("needs root to mount a tiny tmpfs for a real disk-full")
    try:
        rc, out, _ = horovodrun(["--max-steps", 2, "--test-batches", 1, "--checkpoint-dir", full])
        assert rc is not None, f"a rank hung after the failed save\n{out[-4000:]}"
        assert rc != 0, out[-4000:]
        assert f"could not write checkpoint {full / 'ckpt-step2.pt'}: No space left on device" in out, out[-4000:]
        assert "disk full?" in out
        assert f'File "{TRAIN}"' not in out and "basic_ios" not in out
        assert sorted(os.listdir(full)) == []  # no partial checkpoint, no temporary file
    finally:
        import subprocess
        subprocess.run(["umount", str(full)], capture_output=True)


def test_live_bar_for_a_single_process_in_a_terminal(tmp_path):
    """One plain process whose stderr is a terminal gets the redrawn bar; log lines are written above it."""
    import fcntl
    import pty
    import struct
    import subprocess
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = dict(os.environ, OMP_NUM_THREADS="1", TERM="xterm",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, TRAIN, "--max-steps", "6", "--test-batches", "1", "--checkpoint-dir",
                             str(tmp_path / "ckpt"), "--checkpoint-every", "3"],
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # the terminal closed: every writer exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    try:
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = None
    out = b"".join(chunks).decode(errors="replace")
    assert rc == 0, f"exit {rc}\n{out[-4000:]}"
    assert "\r" in out and "step/s" in out and "6/6" in out, out[-4000:]  # tqdm redrew the bar
    text = out.replace("\r", "\n")
    assert "checkpoint " in text and "Final test accuracy" in text
    assert not any(line.startswith("step ") for line in text.splitlines())  # no timed lines with a bar
