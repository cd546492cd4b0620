"""Checkpoints as collectives: every rank takes part in a save (rank 0 writes every rank's state), rank 0
picks the newest readable checkpoint for ``--resume`` and every rank restores from it, or a fresh run
broadcasts rank 0's initial state. A failure stops every rank with rank 0's message.

``--engine ddp --elastic`` (torchrun ``--nnodes MIN:MAX --max-restarts R``): every start resumes from the
newest checkpoint in ``--checkpoint-dir`` (``--resume`` is implied; the first start finds none), also one
written at another world size (:mod:`job.elastic_resume` says what carries over and how)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch

from .checkpoints import CKPT_FORMAT, read_checkpoint, resume_candidates, write_checkpoint
from .common import LOG, JobFailed, agree
from .elastic_resume import (WORLD_KEYS, apply_plan, elastic_ddp, log_world_change, pending_update,
                             restore_position, warn_shared_store, world_change_diffs)
from .state import COUNTER_KEYS, Job, Progress, counter_totals

# Settings a checkpoint must share with the resuming run, or the continuation would not be the same run.
RESUME_KEYS = ("dataset", "model", "compressor", "ratio", "value_dtype", "threshold", "min_numel", "momentum_correction",
               "batch_size", "lr", "momentum", "weight_decay", "lr_schedule", "schedule_horizon", "warmup_steps",
               "clip_grad", "seed", "seq_len", "lstm_hidden", "lstm_layers", "world_size", "dense_rounds",
               "density_warmup", "density_start", "powersgd_rank", "optimizer", "betas", "bf16", "gpt_dim",
               "gpt_layers", "gpt_heads", "tie_weights", "sync_every", "outer_lr", "outer_momentum",
               "outer_feedback_decay", "outer_value_bits", "outer_value_group", "error_feedback_on", "min_fiber_len",
               "fiber_join", "outer_exchange", "exchange")
# What a checkpoint written before a setting existed ran with.
RESUME_DEFAULTS = {"outer_feedback_decay": 1.0, "outer_value_bits": None, "outer_value_group": None,
                   "min_fiber_len": None, "fiber_join": None, "outer_exchange": "auto", "exchange": "allgather"}


def save_checkpoint(job: Job, progress: Progress, extra: Optional[dict] = None) -> None:
    """Collective (every rank calls it); rank 0 writes. If the write fails every rank stops (status 1).
    ``extra``: more top-level entries (``--elastic`` adds the sampler's position)."""
    engine = job.engine
    optimizer_state = engine.checkpoint_state(job.opt)
    per_rank = engine.allgather_object({"torch_rng": torch.get_rng_state(),
                                        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
                                        "loss_sum": float(progress.loss_sum)},
                                       name="train.ckpt_rank_state")
    counters = counter_totals(job, progress)
    error, path = None, None
    if job.rank == 0:
        ckpt = {
            "format": CKPT_FORMAT,
            "step": progress.step,
            "epoch": progress.epoch,
            "batch_in_epoch": progress.batch,
            "model": job.model.state_dict(),
            "optimizer": optimizer_state,
            "lr_scheduler": job.scheduler.state_dict(),
            "rng": {"torch": [r["torch_rng"] for r in per_rank], "cuda": [r["cuda_rng"] for r in per_rank]},
            "train_loss_sum": [r["loss_sum"] for r in per_rank],
            "train_loss_count": int(progress.loss_count),
            "counters": {k: float(counters[k]) for k in COUNTER_KEYS},
            "wall_time": float(job.wall(progress)),
            "config": job.config,
            **(extra or {}),
        }
        try:
            path = write_checkpoint(job.ckpt_dir, ckpt, job.args.keep_checkpoints)
        except OSError as exc:
            error = str(exc)
    error = engine.broadcast_object(error, name="train.ckpt_written")  # the others must not wait on
    if error is not None:
        if job.rank == 0:
            LOG.error(error)
        raise JobFailed(1)
    job.last_ckpt_step = progress.step
    LOG.info(f"checkpoint {path}")


def _set_aside(skipped) -> None:
    """Rename the damaged files skipped, so they neither count as kept checkpoints nor get tried again."""
    for bad, why in skipped:
        if not why.startswith("damaged"):
            continue
        try:
            bad.rename(bad.with_name(bad.name + ".damaged"))
            LOG.warning(f"renamed the damaged {bad.name} to {bad.name}.damaged")
        except OSError:
            pass


def _choose_on_rank0(directory: Path) -> Tuple[Optional[str], Optional[dict], Optional[str]]:
    """``(path, checkpoint, error)``: the newest readable checkpoint, warning about every damaged one."""
    candidates = resume_candidates(directory) if directory.is_dir() else []
    skipped = []
    for path in candidates:
        ckpt, why = read_checkpoint(path)
        if ckpt is not None:
            if skipped:
                LOG.warning(f"using the previous checkpoint {path} instead of the newest")
            _set_aside(skipped)
            return str(path), ckpt, None
        skipped.append((path, why))
        LOG.warning(f"checkpoint {path} is {why}; "
                    + ("trying the previous one" if path != candidates[-1] else "no other checkpoint is left"))
    if candidates:
        return None, None, (f"--resume: no usable checkpoint in {directory} (none of its {len(candidates)} "
                            f"checkpoint files can be read, see above); restore a good copy, or remove them to "
                            f"start from scratch")
    LOG.info(f"--resume: no checkpoint in {directory}; starting from scratch")
    return None, None, None


def find_checkpoint(job: Job) -> Tuple[Optional[str], Optional[dict]]:
    """Collective: rank 0 picks the newest readable checkpoint (warning about every damaged one it skips);
    returns its path (None: start from scratch) and, on rank 0, the loaded checkpoint."""
    chosen, ckpt, error = _choose_on_rank0(job.ckpt_dir) if job.rank == 0 else (None, None, None)
    chosen, error = job.engine.broadcast_object((chosen, error), name="train.resume_path")
    if error is not None:
        if job.rank == 0:
            LOG.error(error)
        raise JobFailed(2)
    return chosen, ckpt


def resume(job: Job) -> Progress:
    """Restore a run from ``--checkpoint-dir`` (``--resume``) or broadcast rank 0's fresh state."""
    progress = Progress(counters={k: 0.0 for k in COUNTER_KEYS})
    elastic = elastic_ddp(job)
    if elastic and job.ckpt_dir is None:
        if job.rank == 0:
            LOG.error("--engine ddp --elastic needs --checkpoint-dir: a torchrun restart continues from the newest "
                      "checkpoint there (--checkpoint-every N sets how much a lost host costs)")
        raise JobFailed(2)
    if elastic:
        warn_shared_store(job)
    path, ckpt = find_checkpoint(job) if job.args.resume or elastic else (None, None)
    if path is None:
        job.engine.broadcast_initial_state(job.model, job.opt)
        if elastic:
            apply_plan(job, None)
        return progress
    error = None
    if ckpt is None:  # ranks other than 0 read the file rank 0 chose
        ckpt, why = read_checkpoint(Path(path))
        error = None if ckpt is not None else f"checkpoint {path} is {why}"
    agree(job.engine, error, "resume_read")
    old_world = int(ckpt["config"].get("world_size", job.world))
    world_changed = elastic and old_world != job.world
    keys = [k for k in RESUME_KEYS if not (elastic and k in WORLD_KEYS)]
    saved = {k: ckpt["config"].get(k, RESUME_DEFAULTS.get(k)) for k in keys}
    diffs = [f"{k}: checkpoint {saved[k]!r}, now {job.config[k]!r}" for k in keys if saved[k] != job.config[k]]
    diffs += world_change_diffs(job, ckpt) if elastic else []
    if diffs:
        if job.rank == 0:
            LOG.error(f"cannot resume from {path}, the run settings differ: " + "; ".join(diffs)
                      + resume_hint(saved, job.config, elastic))
        raise JobFailed(2)
    _restore(job, ckpt, progress, world_changed)
    if elastic:
        apply_plan(job, ckpt)
    if world_changed:
        old_batch, replayed = restore_position(job, ckpt, progress)
        log_world_change(job, ckpt, path, progress, old_batch, replayed, pending_update(job, ckpt))
        return progress
    LOG.info(f"resumed from {path} at step {progress.step} "
             f"(epoch {progress.epoch + 1}, batch {progress.batch}/{job.steps_per_epoch})")
    return progress


def resume_hint(saved: dict, now: dict, elastic: bool) -> str:
    """What to do about settings that differ from a checkpoint's, where a flag fixes it ("" otherwise)."""
    hint = ""
    if not elastic and saved.get("world_size") != now.get("world_size"):
        hint += " (--engine ddp --elastic resumes at another world size)"
    if "fiber_join" in saved and saved["fiber_join"] is None and now.get("fiber_join") == "columns":
        hint += (" (--fiber-join rows continues a run that joined rows, such as a GPT run from before columns "
                 "became its default)")
    return hint


def _restore(job: Job, ckpt: dict, progress: Progress, world_changed: bool = False) -> None:
    """Load model, optimizer (every rank its own residuals), scheduler, this rank's RNG and the counters
    (``world_changed``: the rank-indexed parts are left to ``elastic_resume.restore_position``)."""
    job.model.load_state_dict(ckpt["model"])
    job.opt.load_state_dict(ckpt["optimizer"])  # every rank picks its own residuals
    job.scheduler.load_state_dict(ckpt["lr_scheduler"])
    for group, lr in zip(job.opt.param_groups, job.scheduler.get_last_lr()):
        group["lr"] = lr
    progress.counters = {k: float(ckpt["counters"].get(k, 0.0)) for k in COUNTER_KEYS}
    progress.wall_offset = float(ckpt["wall_time"])
    job.last_ckpt_step = int(ckpt["step"])
    if world_changed:
        return
    torch.set_rng_state(ckpt["rng"]["torch"][job.rank])
    cuda_states = ckpt["rng"].get("cuda") or []
    if job.device.type == "cuda" and job.rank < len(cuda_states) and cuda_states[job.rank] is not None:
        torch.cuda.set_rng_state(cuda_states[job.rank])
    progress.step, progress.epoch, progress.batch = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["batch_in_epoch"])
    progress.loss_sum, progress.loss_count = float(ckpt["train_loss_sum"][job.rank]), int(ckpt["train_loss_count"])

