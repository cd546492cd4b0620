"""Unit tests of the training job's modules (examples/job/), in this process, without Horovod running.

The job as a whole (2 ranks under horovodrun, resume, checkpoints that fail, the progress output) is
tests/test_train.py; here each module's own logic, against independent expectations: the flags and their
resolved defaults, the settings line, the learning-rate schedule, checkpoint files on a real file system,
the log formatting and when a live bar is drawn, the compressor and SGD groups the engine builds.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import horovod_adtopk as hat
from examples.job import build, channels, checkpoints, data, engine, logs, options, resume
from tests.harness import REPO, run_command

TRAIN = str(REPO / "examples" / "train.py")


# --------------------------------------------------------------------------------------------------------
# options: defaults, the recommended warm-up, errors, the settings line
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compressor", ["adtopk", "topk", "dgc", "randomk", "adtopk_i", "sidco"])
def test_sparse_compressors_default_to_the_recommended_warmup(compressor):
    args = options.parse_args(["--compressor", compressor])
    assert (args.dense_rounds, args.density_warmup, args.density_start) == (50, 150, 0.25)
    assert args.momentum_correction is True and args.ratio == 0.01


@pytest.mark.parametrize("argv, expected", [
    (["--compressor", "none"], (0, 0, None)),
    (["--compressor", "fp16"], (0, 0, None)),
    (["--compressor", "powersgd"], (0, 0, None)),
    (["--compressor", "threshold", "--threshold", "0.1"], (50, 0, 0.25)),  # a fixed threshold: no density
    (["--no-warmup"], (0, 0, 0.25)),
    (["--dense-rounds", "0", "--density-warmup", "0"], (0, 0, 0.25)),
    (["--dense-rounds", "7"], (7, 150, 0.25)),
    (["--density-warmup", "9", "--density-start", "0.5"], (50, 9, 0.5)),
    (["--compressor", "none", "--dense-rounds", "3", "--density-warmup", "5"], (3, 0, None)),
    (["--compressor", "powersgd", "--dense-rounds", "20"], (20, 0, None)),
    (["--no-warmup", "--dense-rounds", "0"], (0, 0, 0.25)),
])
def test_warmup_flags_resolve(argv, expected):
    args = options.parse_args(argv)
    assert (args.dense_rounds, args.density_warmup, args.density_start) == expected


@pytest.mark.parametrize("argv, message", [
    (["--no-warmup", "--dense-rounds", "5"], "--no-warmup contradicts"),
    (["--no-warmup", "--density-warmup", "5"], "--no-warmup contradicts"),
    (["--dense-rounds", "-1"], "must be >= 0"),
    (["--density-warmup", "-3"], "must be >= 0"),
    (["--dataset", "fashion-mnist", "--model", "lstm"], "does not fit"),
    (["--compressor", "threshold"], "--threshold"),
    (["--compressor", "none", "--value-dtype", "float16"], "sparse compressors"),
    (["--ratio", "1.5"], "--ratio must lie in (0, 1]"),
    (["--resume"], "need --checkpoint-dir"),
    (["--compressor", "powersgd", "--momentum-correction"], "PowerSGD uses SGD momentum"),
    (["--compressor", "none", "--momentum-correction"], "needs a sparse compressor"),
    (["--epochs", "0"], "--epochs must be >= 1"),
    (["--engine", "ddp", "--overlap", "on"], "--overlap applies to --engine horovod"),
    (["--compressor", "topk", "--min-fiber-len", "512"], "--min-fiber-len applies to the fiber rules"),
    (["--min-fiber-len", "0"], "--min-fiber-len must be >= 1"),
    (["--compressor", "topk", "--fiber-join", "columns"], "--fiber-join applies to the fiber rules"),
    (["--compressor", "none", "--fiber-join", "columns"], "--fiber-join applies to the fiber rules"),
    (["--fiber-join", "columns"], "give --min-fiber-len L > 1 too"),  # the CNN: no default L
    (["--dataset", "shakespeare", "--model", "gpt", "--min-fiber-len", "1", "--fiber-join", "columns"],
     "give --min-fiber-len L > 1 too"),
])
def test_bad_flags_exit_2_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        options.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_dataset_defaults_fill_only_unset_flags():
    args = options.parse_args(["--dataset", "shakespeare"])
    assert (args.model, args.batch_size, args.lr, args.clip_grad) == ("lstm", 32, 0.5, 1.0)
    args = options.parse_args(["--batch-size", "16"])
    assert (args.model, args.batch_size, args.lr, args.clip_grad) == ("cnn", 16, 0.1, 0.0)


def test_settings_line_says_what_runs():
    text = options.describe_compression(options.parse_args([]))
    assert text == ("adtopk: ratio 0.01, momentum correction 0.9 (the sparse tensors' SGD without momentum); "
                    "compression warm-up: 50 dense rounds, density 0.25 -> 0.01 over 150 rounds (--no-warmup: off)")
    text = options.describe_compression(options.parse_args(["--no-warmup", "--no-momentum-correction"]))
    assert text == "adtopk: ratio 0.01, SGD momentum 0.9; no compression warm-up"
    assert options.describe_compression(options.parse_args(["--compressor", "none"])) == \
        "none: dense, SGD momentum 0.9; no compression warm-up"
    text = options.describe_compression(options.parse_args(["--compressor", "powersgd", "--powersgd-rank", "4"]))
    assert text == "powersgd: rank 4, SGD momentum 0.9; no compression warm-up"


# --------------------------------------------------------------------------------------------------------
# engine: the compressor from the flags, SGD groups for momentum correction
# --------------------------------------------------------------------------------------------------------

def test_compressor_built_from_the_flags_carries_the_warmup():
    comp = engine.make_compression(options.parse_args(["--ratio", "0.05"]))
    cfg = comp.config()
    assert cfg["compressor"] == "adtopk" and cfg["ratio"] == 0.05 and cfg["momentum"] == 0.9
    assert cfg["density_warmup"] == 150 and cfg["density_start"] == 0.25
    cfg = engine.make_compression(options.parse_args(["--no-warmup", "--no-momentum-correction"])).config()
    assert cfg["density_warmup"] == 0 and cfg["momentum"] is None
    assert engine.make_compression(options.parse_args(["--compressor", "none"])) is hat.Compression.none


def test_min_fiber_len_reaches_the_compressor_and_the_settings_line():
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt", "--min-fiber-len", "2048",
                               "--fiber-join", "rows"])
    comp = engine.make_compression(args)
    assert comp.config()["min_fiber_len"] == 2048
    lay = comp.layout(hat.compressors.TensorInfo("qkv", (384, 128), 384 * 128, torch.float32))
    assert (lay.num_fibers, lay.fiber_len, lay.k) == (24, 2048, 20)  # 16 rows a fiber
    assert "short rows joined into fibers of >= 2048 entries" in options.describe_compression(args)
    assert "min_fiber_len" not in engine.make_compression(options.parse_args([])).config()


@pytest.mark.parametrize("extra", [[], ["--fiber-join", "columns"], ["--min-fiber-len", "2048"]])
def test_fiber_join_columns_reaches_the_compressor_and_the_settings_line(extra):
    # columns: the GPT's default every step, said or not, with its default L or an explicit one
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt", *extra])
    assert args.fiber_join == "columns"
    comp = engine.make_compression(args)
    assert comp.config()["min_fiber_len"] == 2048 and comp.config()["join"] == "columns"  # the GPT's default L
    lay = comp.layout(hat.compressors.TensorInfo("qkv", (384, 128), 384 * 128, torch.float32))
    assert (lay.num_fibers, lay.fiber_len, lay.k, lay.axis) == (16, 3072, 30, 0)  # 8 columns a fiber
    assert "short columns joined into fibers of >= 2048 entries" in options.describe_compression(args)


def test_fiber_join_rows_is_the_librarys_default_in_the_configuration():
    # rows, said for the GPT or the default elsewhere: nothing in the configuration, as before the flag
    for argv in (["--dataset", "shakespeare", "--model", "gpt", "--fiber-join", "rows"],
                 ["--compressor", "adtopk", "--min-fiber-len", "2048"]):
        args = options.parse_args(argv)
        assert args.fiber_join is None and "join" not in engine.make_compression(args).config()
        assert "short rows joined into fibers of >= 2048 entries" in options.describe_compression(args)
    for argv in (["--dataset", "shakespeare", "--model", "gpt", "--compressor", "topk"],
                 ["--dataset", "shakespeare", "--model", "gpt", "--sync-every", "10"],
                 ["--dataset", "shakespeare", "--model", "gpt", "--min-fiber-len", "1"]):
        assert options.parse_args(argv).fiber_join is None  # no joined fibers, nothing to join


def test_a_resume_refused_for_the_new_gpt_default_says_which_flag_continues_it():
    # a GPT checkpoint from before columns became the default says rows (None); the run now says columns
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt"])
    config = dict({k: getattr(args, k, None) for k in resume.RESUME_KEYS}, world_size=2)
    old = dict(config, fiber_join=None)
    assert config["fiber_join"] == "columns"
    assert "--fiber-join rows continues" in resume.resume_hint(old, config, elastic=False)
    assert resume.resume_hint(config, old, elastic=False) == ""  # the other way round a flag is not the answer
    assert "--elastic" in resume.resume_hint(dict(config, world_size=4), config, elastic=False)
    assert resume.resume_hint(dict(config, world_size=4), config, elastic=True) == ""


@pytest.mark.parametrize("argv, expected", [
    (["--compressor", "adtopk"], 2048),                      # the GPT every step: short columns joined
    (["--compressor", "adtopk_i"], 2048),
    (["--compressor", "adtopk", "--min-fiber-len", "1"], 1),  # turned off
    (["--compressor", "topk"], None),                        # not a fiber rule
    (["--compressor", "adtopk", "--sync-every", "10"], None),  # a sparse outer exchange keeps the paper's fibers
])
def test_gpt_joins_short_columns_by_default_every_step(argv, expected):
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt", *argv])
    assert args.min_fiber_len == expected
    assert ("short columns joined" in options.describe_compression(args)) == (expected == 2048)
    assert options.parse_args(["--compressor", "adtopk"]).min_fiber_len is None  # the CNN: unchanged


def test_sgd_groups_split_sparse_from_dense_parameters():
    model = data.make_model(options.parse_args([]), None)
    comp = engine.make_compression(options.parse_args([]))
    sparse = engine.sparse_parameter_names(model, comp, world=2)
    names = {n for n, _ in model.named_parameters()}
    # every weight of 2+ dimensions with enough entries is sparse; biases (1-D) never are
    expected = {n for n, p in model.named_parameters() if p.dim() >= 2 and comp.choose_path(
        hat.compressors.TensorInfo(n, tuple(p.shape), p.numel(), p.dtype), 2)[0]}
    assert sparse == expected and sparse and not any(n.endswith("bias") for n in sparse)
    groups = engine.sgd_groups(model, sparse, 0.9)
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert [g["momentum"] for g in groups] == [0.0, 0.9]
    assert {by_id[id(p)] for p in groups[0]["params"]} == sparse
    assert {by_id[id(p)] for p in groups[1]["params"]} == names - sparse
    assert len(engine.sgd_groups(model, set(), 0.9)) == 1  # no empty group
    assert engine.sparse_parameter_names(model, hat.Compression.none, 2) == set()


# --------------------------------------------------------------------------------------------------------
# data, build: loss, scores, learning-rate schedule
# --------------------------------------------------------------------------------------------------------

def test_loss_of_classifier_and_language_model_logits():
    torch.manual_seed(0)
    logits, target = torch.randn(4, 7, 11), torch.randint(0, 11, (4, 7))
    expected = F.cross_entropy(logits.permute(0, 2, 1), target, reduction="sum")
    assert torch.allclose(data.compute_loss(logits, target, reduction="sum"), expected)
    logits2, target2 = torch.randn(5, 3), torch.randint(0, 3, (5,))
    assert torch.equal(data.compute_loss(logits2, target2), F.cross_entropy(logits2, target2))


def test_scores_of_both_datasets():
    fm = data.DATASETS["fashion-mnist"].score(50.0, 80.0, 100.0)
    assert fm == {"test_loss": 0.5, "test_examples": 100, "test_accuracy": 0.8}
    assert data.DATASETS["fashion-mnist"].describe(fm) == "test accuracy 80.00%"
    sh = data.DATASETS["shakespeare"].score(200.0, 30.0, 100.0)
    assert sh["test_perplexity"] == pytest.approx(math.exp(2.0)) and sh["test_char_accuracy"] == 0.3
    assert data.DATASETS["shakespeare"].describe(sh) == f"test perplexity {math.exp(2.0):.3f}"
    empty = data.DATASETS["fashion-mnist"].score(0.0, 0.0, 0.0)
    assert math.isnan(empty["test_loss"]) and math.isnan(empty["test_accuracy"])


def test_lr_factor_warmup_then_cosine():
    world, warmup, horizon = 4, 10, 100
    # linear from lr (1/world of the peak) to the peak over the warm-up
    assert build.lr_factor(0, world, warmup, "constant", horizon) == pytest.approx(1 / world)
    assert build.lr_factor(5, world, warmup, "constant", horizon) == pytest.approx((1 + 3 * 0.5) / 4)
    assert build.lr_factor(10, world, warmup, "constant", horizon) == 1.0
    assert build.lr_factor(99, world, warmup, "constant", horizon) == 1.0
    assert build.lr_factor(0, world, 0, "constant", horizon) == 1.0  # no warm-up
    for step in (20, 50, 73):
        cos = 0.5 * (1 + math.cos(math.pi * step / horizon))
        assert build.lr_factor(step, world, warmup, "cosine", horizon) == pytest.approx(cos)
    assert build.lr_factor(100, world, warmup, "cosine", horizon) == pytest.approx(0.0, abs=1e-15)
    assert build.lr_factor(150, world, warmup, "cosine", horizon) == pytest.approx(0.0, abs=1e-15)  # clamped


# --------------------------------------------------------------------------------------------------------
# checkpoints: files on a real file system
# --------------------------------------------------------------------------------------------------------

def _ckpt(step: int) -> dict:
    return {"format": checkpoints.CKPT_FORMAT, "step": step, "config": {"seed": 1},
            "model": {"w": torch.full((3,), float(step))}}


def test_write_rotates_and_points_latest(tmp_path):
    for step in (2, 4, 6, 8):
        path = checkpoints.write_checkpoint(tmp_path, _ckpt(step), keep=2)
        assert path == tmp_path / f"ckpt-step{step}.pt"
        assert (tmp_path / "latest").read_text() == f"ckpt-step{step}.pt\n"
    assert sorted(p.name for p in tmp_path.glob("ckpt-step*.pt")) == ["ckpt-step6.pt", "ckpt-step8.pt"]
    assert [s for s, _ in checkpoints.checkpoint_files(tmp_path)] == [8, 6]
    ckpt, why = checkpoints.read_checkpoint(tmp_path / "ckpt-step8.pt")
    assert why is None and ckpt["step"] == 8 and torch.equal(ckpt["model"]["w"], torch.full((3,), 8.0))
    # an older step written after a newer one (a resume from an earlier checkpoint): later files stay
    checkpoints.write_checkpoint(tmp_path, _ckpt(3), keep=1)
    assert sorted(p.name for p in tmp_path.glob("ckpt-step*.pt")) == ["ckpt-step3.pt", "ckpt-step6.pt",
                                                                       "ckpt-step8.pt"]
    assert checkpoints.resume_candidates(tmp_path) == [tmp_path / "ckpt-step3.pt", tmp_path / "ckpt-step8.pt",
                                                        tmp_path / "ckpt-step6.pt"]
    checkpoints.write_checkpoint(tmp_path, _ckpt(9), keep=0)  # 0: keep all
    assert len(list(tmp_path.glob("ckpt-step*.pt"))) == 4
    assert not list(tmp_path.glob(".*tmp*"))


def test_unusable_checkpoints_say_why(tmp_path):
    (tmp_path / "trunc.pt").write_bytes(b"PK\x03\x04 truncated")
    assert checkpoints.read_checkpoint(tmp_path / "trunc.pt")[1].startswith("damaged (")
    torch.save({"step": 1}, tmp_path / "other.pt")
    assert checkpoints.read_checkpoint(tmp_path / "other.pt") == (None, "damaged (not a checkpoint of this script)")
    torch.save({**_ckpt(1), "format": 1}, tmp_path / "old.pt")
    assert checkpoints.read_checkpoint(tmp_path / "old.pt")[1] == \
        f"written in checkpoint format 1, this script reads format {checkpoints.CKPT_FORMAT}"
    (tmp_path / "latest").write_bytes(b"\xff\xfe")  # a pointer that is not text: the files are still found
    torch.save(_ckpt(5), tmp_path / "ckpt-step5.pt")
    assert checkpoints.resume_candidates(tmp_path) == [tmp_path / "ckpt-step5.pt"]


def test_stale_temporaries_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process id that no longer runs
    stale = tmp_path / f".ckpt-step3.pt.tmp{dead.pid}"
    mine = tmp_path / f".ckpt-step4.pt.tmp{os.getpid()}"
    pointer = tmp_path / f".latest.tmp{dead.pid}"
    for f in (stale, mine, pointer):
        f.write_bytes(b"partial")
    removed = checkpoints.remove_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([stale, pointer]) and mine.exists() and not stale.exists()


def test_failed_write_leaves_no_file_and_names_the_os_error(tmp_path):
    target = tmp_path / "ckpt-step1.pt"

    def write_then_fail(f):
        f.write(b"half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        checkpoints.atomic_write(target, write_then_fail)
    assert list(tmp_path.iterdir()) == []
    wrapped = RuntimeError("[enforce fail at inline_container.cc] . unexpected pos")
    wrapped.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    assert checkpoints.write_error(target, wrapped) == \
        f"could not write checkpoint {target}: No space left on device (errno ENOSPC); disk full?"
    assert checkpoints.write_error(target, OSError(errno.EACCES, "denied")) == \
        f"could not write checkpoint {target}: Permission denied (errno EACCES)"
    with pytest.raises(OSError, match="could not write checkpoint .*File exists"):
        (tmp_path / "file").write_text("x")
        checkpoints.write_checkpoint(tmp_path / "file", _ckpt(1), keep=2)


# --------------------------------------------------------------------------------------------------------
# logs: formatting, when a live bar is drawn
# --------------------------------------------------------------------------------------------------------

def test_durations_and_sizes():
    assert [logs.duration(s) for s in (0, 7.4, 59.6, 125, 3600, 3723)] == ["0s", "7s", "1m00s", "2m05s",
                                                                           "1h00m00s", "1h02m03s"]
    assert logs.mb(14_270_000) == "14.27 MB"


def test_rank_formatter_marks_warnings_and_other_ranks():
    def fmt(rank, world, level, msg):
        return logs._RankFormatter(rank, world).format(logging.LogRecord("x", level, "", 0, msg, None, None))
    assert fmt(0, 2, logging.INFO, "step 1") == "step 1"
    assert fmt(0, 2, logging.WARNING, "careful") == "warning: careful"
    assert fmt(1, 2, logging.ERROR, "broken") == "rank 1: error: broken"
    assert fmt(0, 1, logging.ERROR, "broken") == "error: broken"


def test_no_live_bar_under_launchers_or_without_a_terminal(monkeypatch):
    for var in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_CONTROLLER",
                "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    args = options.parse_args([])
    assert logs.use_live_bar(options.parse_args(["--progress"]), world=4) is True  # forced
    assert logs.use_live_bar(options.parse_args(["--no-progress"]), world=1) is False
    assert logs.use_live_bar(args, world=2) is False  # several ranks: a launcher tags the output
    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert logs.use_live_bar(args, world=1) is False  # horovodrun tags even one process
    monkeypatch.delenv("HOROVOD_RANK")
    if not sys.stderr.isatty():  # pytest captures stderr: not a terminal
        assert logs.use_live_bar(args, world=1) is False


# --------------------------------------------------------------------------------------------------------
# the entry point from anywhere
# --------------------------------------------------------------------------------------------------------

def test_train_py_runs_from_another_folder_without_pythonpath(tmp_path):
    rc, out, _ = run_command([sys.executable, TRAIN, "--help"], timeout=120, env={"PYTHONPATH": ""},
                             cwd=str(tmp_path))
    assert rc == 0, out[-3000:]
    assert "--no-warmup" in out and "--dense-rounds" in out and "Data-parallel training" in out


# --------------------------------------------------------------------------------------------------------
# channels: per-layer update density and the share of output channels updated (--channel-stats)
# --------------------------------------------------------------------------------------------------------

def test_channel_stats_against_numpy(tmp_path):
    import json
    import numpy as np
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 6, 3), torch.nn.Flatten(), torch.nn.Linear(8, 5))
    stats = channels.ChannelStats(model, str(tmp_path / "ch.json"), steady_after=1)
    assert [n for n, _ in stats.params] == ["0.weight", "2.weight"]  # biases (1-D) are not layers here
    rng = np.random.default_rng(0)
    grads = []
    for step in (1, 2, 3):
        step_grads = {}
        for n, p in model.named_parameters():
            g = rng.standard_normal(tuple(p.shape)) * (rng.random(tuple(p.shape)) < 0.05 * step)
            p.grad = torch.tensor(g, dtype=p.dtype)
            step_grads[n] = g
        grads.append(step_grads)
        stats.observe(step)
    stats.write({"tensors": {"0.weight": {"path": "sparse"}}})
    out = json.loads((tmp_path / "ch.json").read_text())
    assert out["steady_after_step"] == 1
    for n in ("0.weight", "2.weight"):
        rows = [g[n].reshape(g[n].shape[0], -1) != 0 for g in grads]
        dens = [r.mean() for r in rows]
        share = [r.any(axis=1).mean() for r in rows]
        got = out["layers"][n]
        assert got["steps"] == 3 and got["steady_steps"] == 2
        assert got["density"] == pytest.approx(np.mean(dens)) and got["channel_share"] == pytest.approx(np.mean(share))
        assert got["steady_density"] == pytest.approx(np.mean(dens[1:]))
        assert got["steady_channel_share"] == pytest.approx(np.mean(share[1:]))
        assert got["steady_min_channel_share"] == pytest.approx(min(share[1:]))
    assert out["layers"]["0.weight"]["path"] == "sparse" and out["layers"]["2.weight"]["path"] is None


# --------------------------------------------------------------------------------------------------------
# the transformer job: AdamW defaults, parameter groups, the unscaled schedule
# --------------------------------------------------------------------------------------------------------

def test_gpt_defaults_to_adamw_without_momentum_correction():
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt"])
    assert (args.optimizer, args.lr, args.weight_decay, args.clip_grad, args.seq_len) == ("adamw", 2e-3, 0.1, 1.0, 128)
    assert args.momentum_correction is False and args.betas == (0.9, 0.95)
    assert (args.dense_rounds, args.density_warmup) == (50, 150)  # the sparse warm-up still applies
    lstm = options.parse_args(["--dataset", "shakespeare"])
    assert (lstm.optimizer, lstm.lr, lstm.weight_decay, lstm.seq_len, lstm.momentum_correction) == \
        ("sgd", 0.5, 0.0, 64, True)
    sgd_gpt = options.parse_args(["--dataset", "shakespeare", "--model", "gpt", "--optimizer", "sgd", "--lr", "0.3"])
    assert sgd_gpt.momentum_correction is True and sgd_gpt.lr == 0.3
    assert "AdamW betas 0.9/0.95" in options.describe_compression(args)
    # AdamW with a fixed-size sparse compressor: error feedback on the update (local steps at every step)
    assert (args.error_feedback_on, args.sync_every, args.outer_lr, args.outer_momentum) == ("update", 1, 1.0, 0.0)
    assert "error feedback on the optimizer's update" in options.describe_compression(args)
    for argv in (["--compressor", "dgc"], ["--compressor", "none"], ["--error-feedback-on", "gradient"],
                 ["--sync-every", "10"]):
        other = options.parse_args(["--dataset", "shakespeare", "--model", "gpt", *argv])
        assert other.error_feedback_on == "gradient" and other.sync_every == (10 if "10" in argv else 0), argv
    assert lstm.error_feedback_on == "gradient" and lstm.sync_every == 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt", "--momentum-correction"], "AdamW keeps its moments"),
    (["--model", "gpt", "--gpt-dim", "30"], "must divide --gpt-dim"),
    (["--model", "gpt", "--betas", "0.9", "1.0"], "--betas must lie in"),
    (["--model", "lstm", "--optimizer", "adam"], "invalid choice"),
    (["--model", "gpt", "--error-feedback-on", "update", "--sync-every", "5"], "already means local steps"),
    (["--model", "gpt", "--error-feedback-on", "update", "--compressor", "dgc"], "fixed-size payloads"),
])
def test_bad_transformer_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        options.parse_args(["--dataset", "shakespeare", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_adamw_groups_decay_matrices_only():
    model = data.make_model(options.parse_args(["--dataset", "shakespeare", "--model", "gpt", "--gpt-layers", "1",
                                                "--gpt-dim", "16"]), vocab_size=7)
    groups = engine.adamw_groups(model, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (p.dim() >= 2), name
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    args = options.parse_args(["--dataset", "shakespeare", "--model", "gpt"])
    opt = engine.base_optimizer(model, args, 1e-3, set())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)


def test_lr_factor_unscaled_warmup_for_adamw():
    f = [build.lr_factor(s, world=4, warmup=10, kind="constant", horizon=100, scaled=False) for s in range(12)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0) and f[11] == 1.0
    assert all(b > a for a, b in zip(f[:10], f[1:10]))
    cos = build.lr_factor(50, world=4, warmup=10, kind="cosine", horizon=100, scaled=False)
    assert cos == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
