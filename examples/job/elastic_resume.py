"""Resuming at another world size: ``--engine ddp --elastic`` under torchrun's elastic agent.

torchrun (``--nnodes MIN:MAX --max-restarts R``) restarts every worker when a host is lost and when one joins;
each start resumes from the newest checkpoint in ``--checkpoint-dir``, which ``W`` ranks may have written while
``W'`` run now. What carries over, and how:

* model, optimizer, scheduler state, the step count, the epoch and the cumulative counters: as saved.
* error-feedback memory: the checkpoint holds every rank's entry (``gather_state_dict``) and the library folds
  it onto the new ranks, new rank ``j`` receiving ``(W'/W) * sum_{i mod W' = j} r_i`` (residuals and DGC
  velocities), so the update still owed, ``sum_i r_i / W``, is unchanged. This module checks that on every
  restart (one allreduce of the memory) and logs what it found: folded, or lost.
* the plan: the world size ``W0`` the job started with, and in steps the warm-up, the cosine horizon and the
  run's length (kept in the checkpoint's config: ``plan_world_size``, ``plan_steps_per_epoch``,
  ``warmup_steps``, ``schedule_horizon``), so the learning rate stays a function of the step.
* the batch: ``--batch-size B`` is per rank at ``W0``, and the global batch ``B W0`` is kept whenever ``W'``
  divides it: each rank then takes ``B W0 / W'`` samples per step, a step averages the same number of samples
  as in the fault-free run and the rates are the plan's (3 -> 2 ranks at B 64: 96 per rank). Otherwise each
  rank keeps ``B`` and SGD's peak rate follows the world size, ``lr x W'`` (linear scaling), logged as such.
* the data position: ``DistributedSampler`` shuffles all ``N`` indices with ``seed + epoch`` whatever the world
  size and gives rank ``r`` the positions ``r, r + W, r + 2W, ...``; after ``b`` batches of ``B`` the ``W`` ranks
  have consumed exactly the first ``S = b B W`` positions of the epoch's permutation. At ``W'`` (batch ``B'``)
  the epoch goes on at batch ``floor(S / (B' W'))`` of the new layout: the same permutation, none skipped, fewer
  than ``B' W'`` samples seen a second time (none when the global batch is kept).
* RNG: every rank's generator is reseeded from ``(seed, step, rank, W')`` (an old rank's stream cannot be split
  or merged): distinct per rank, and the same on every rerun of the same restart.
* the epoch's running training loss: every new rank starts from the old ranks' mean, so the epoch's average
  (sum over ranks / (ranks x batches)) is unchanged.
"""
from __future__ import annotations

import math
import os
from typing import List, Optional, Tuple

import torch

from .common import LOG
from .state import Job, Progress

# Config keys that follow the world size; under --elastic they come from the checkpoint, never compared.
WORLD_KEYS = ("world_size", "warmup_steps", "schedule_horizon")
PLAN_KEY = "plan_steps_per_epoch"
PLAN_WORLD_KEY = "plan_world_size"
RANK_BATCH_KEY = "rank_batch_size"  # the per-rank batch a start trained with (--batch-size scaled, see apply_plan)
# torchrun (c10d rendezvous) by default lets the workers share the agents' TCPStore across rendezvous rounds:
# the keys a lost round's workers left there (their Gloo addresses) are read by the next round's, which then
# connect to dead ports ("Connection refused") until the restarts run out, and a node joining later waits for a
# MASTER_ADDR that the leader, having cached it, never writes again (seen with torch 2.13 on 3 emulated hosts).
SHARED_STORE_WARNING = (
    "--elastic: torchrun shares its rendezvous store with the workers (TORCHELASTIC_USE_AGENT_STORE=True); after a "
    "membership change the new workers can read the lost workers' addresses from it and fail to connect, and a "
    "node joining later can wait forever for the master address. Launch torchrun with "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (every rendezvous round then gets a fresh store)")


def warn_shared_store(job: Job) -> None:
    """Rank 0: the warning above, when torchrun shares its store with the workers."""
    if job.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        LOG.warning(SHARED_STORE_WARNING)


def elastic_ddp(job: Job) -> bool:
    """``--engine ddp --elastic``: restarts resume from the newest checkpoint, at any world size."""
    return bool(getattr(job.args, "elastic", False)) and getattr(job.engine, "name", "") == "ddp"


def steps_per_epoch_at(job: Job, world: int, rank_batch: int) -> int:
    """``ceil(ceil(N / W) / B)``: what ``DistributedSampler`` gives each of ``world`` ranks, in batches of ``B``."""
    return math.ceil(math.ceil(len(job.train_set) / world) / rank_batch)


def plan_of(job: Job, ckpt: Optional[dict]) -> Tuple[int, int]:
    """``(steps per epoch, world size)`` of the start that made the plan: the checkpoint's, or this run's."""
    if ckpt is None:
        return job.steps_per_epoch, job.world
    cfg = ckpt["config"]
    world = int(cfg.get(PLAN_WORLD_KEY) or cfg["world_size"])
    return int(cfg.get(PLAN_KEY) or steps_per_epoch_at(job, world, job.args.batch_size)), world


def world_change_diffs(job: Job, ckpt: dict) -> List[str]:
    """Settings that differ although the world-size keys are not compared: an explicit ``--warmup-steps``."""
    saved = ckpt["config"].get("warmup_steps")
    if job.args.warmup_steps is not None and saved != job.args.warmup_steps:
        return [f"warmup_steps: checkpoint {saved!r}, now {job.args.warmup_steps!r}"]
    return []


def apply_plan(job: Job, ckpt: Optional[dict]) -> None:
    """The batch, the schedule and the run's length from the plan (see the module docstring), on every start.

    With ``B`` = ``--batch-size`` and ``W0`` the plan's world size, the global batch ``B W0`` is kept when ``W'``
    divides it (each rank takes ``B W0 / W'``; the rates are the plan's); otherwise each rank keeps ``B`` and
    SGD's peak rate becomes ``lr x W'``."""
    from .build import lr_factor  # build imports resume, which imports this module

    args = job.args
    spe, plan_world = plan_of(job, ckpt)
    batch = job.config["batch_size"]  # --batch-size: per rank at the plan's world size
    keep_global = (batch * plan_world) % job.world == 0
    args.batch_size = batch * plan_world // job.world if keep_global else batch
    job.steps_per_epoch = math.ceil(len(job.sampler) / args.batch_size)
    warmup = spe if args.warmup_steps is None else args.warmup_steps
    horizon = args.epochs * spe
    job.warmup = warmup
    job.total_steps = horizon if args.max_steps is None else min(horizon, args.max_steps)
    job.config.update({PLAN_KEY: spe, PLAN_WORLD_KEY: plan_world, RANK_BATCH_KEY: args.batch_size,
                       "warmup_steps": warmup, "world_size": job.world,
                       "schedule_horizon": horizon if args.lr_schedule == "cosine" else None})
    scaled = args.optimizer == "sgd" and not getattr(args, "sync_every", 0)
    lr_world = plan_world if keep_global else job.world
    schedule = dict(world=lr_world, warmup=warmup, kind=args.lr_schedule, horizon=horizon, scaled=scaled)
    sched = job.scheduler
    sched.lr_lambdas = [lambda step: lr_factor(step, **schedule) for _ in job.opt.param_groups]
    # the checkpoint's param groups and scheduler carry the rate they were saved with: set it from the plan
    base = args.lr * lr_world if scaled else args.lr
    sched.base_lrs = [base for _ in job.opt.param_groups]
    step = max(sched.last_epoch, 0)
    for group, fn in zip(job.opt.param_groups, sched.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * fn(step)
    sched._last_lr = [g["lr"] for g in job.opt.param_groups]


def restore_position(job: Job, ckpt: dict, progress: Progress) -> Tuple[int, int]:
    """World-size change: this rank's RNG, the position inside the epoch and the running loss (module
    docstring). Returns ``(batch in the old layout, samples of the epoch seen a second time)``."""
    cfg = ckpt["config"]
    old_world, old_batch_size = int(cfg["world_size"]), int(cfg.get(RANK_BATCH_KEY) or cfg["batch_size"])
    progress.step, progress.epoch = int(ckpt["step"]), int(ckpt["epoch"])
    old_batch = int(ckpt["batch_in_epoch"])
    consumed = old_batch * old_batch_size * old_world
    per_step = job.args.batch_size * job.world
    progress.batch = consumed // per_step
    sums = [float(x) for x in ckpt["train_loss_sum"]]
    progress.loss_sum, progress.loss_count = sum(sums) / len(sums), int(ckpt["train_loss_count"])
    seed = (int(job.args.seed) * 1_000_003 + progress.step * 7919 + job.rank * 131 + job.world) % (2 ** 63)
    torch.manual_seed(seed)
    return old_batch, consumed - progress.batch * per_step


def _memory(job: Job):
    """The DDP hook's error-feedback memory (None: plain DDP, PowerSGD, local steps)."""
    state = getattr(job.opt, "hook_state", None)
    return getattr(state, "memory", None)


def pending_update(job: Job, ckpt: dict) -> Optional[Tuple[float, float, float]]:
    """Collective: ``(|sum_i r_i / W| before, the same after loading, max |difference|)`` over every memory
    tensor (residuals and velocities), or None when the hook keeps no memory."""
    memory = _memory(job)
    hook = ckpt["optimizer"].get("horovod_adtopk_ddp")
    if memory is None or hook is None:
        return None
    entries = [e["memory"] for e in hook["ranks"].values()]
    old_world = int(hook["world_size"])
    keys = sorted({(store, name) for e in entries for store in ("residuals", "velocities")
                   for name in e.get(store, {})})
    shapes = {}
    before = []
    for store, name in keys:
        ts = [e[store][name].double() for e in entries if name in e.get(store, {})]
        shapes[(store, name)] = ts[0].shape
        before.append(torch.stack(ts).sum(0).reshape(-1) / old_world)
    mine = []
    for store, name in keys:
        t = getattr(memory, store).get(name)
        mine.append(torch.zeros(shapes[(store, name)], dtype=torch.float64).reshape(-1) if t is None
                    else t.detach().double().cpu().reshape(-1))
    if not keys:
        return 0.0, 0.0, 0.0
    before_flat = torch.cat(before)
    after_flat = job.engine.sum(torch.cat(mine), name="train.elastic_pending") / job.world
    return (float(before_flat.norm()), float(after_flat.norm()), float((after_flat - before_flat).abs().max()))


def log_world_change(job: Job, ckpt: dict, path: str, progress: Progress, old_batch: int, replayed: int,
                     pending: Optional[Tuple[float, float, float]]) -> None:
    """Rank 0: one line that says what the world-size change did."""
    if job.rank != 0:
        return
    old_world = int(ckpt["config"]["world_size"])
    if pending is None:
        memory = "no error-feedback memory to carry"
    else:
        before, after, diff = pending
        kept = diff <= 1e-6 * max(before, 1e-30) + 1e-12
        memory = (f"error-feedback residuals of {old_world} ranks folded onto {job.world} (pending update "
                  f"sum_i r_i / W: norm {before:.6g} before, {after:.6g} after, max difference {diff:.3g})" if kept else
                  f"error-feedback residuals NOT carried over (pending update norm {before:.6g} before, {after:.6g} "
                  f"after the load, max difference {diff:.3g})")
    peak = job.scheduler.base_lrs[0]
    LOG.info(f"elastic: world size {old_world} -> {job.world} at step {progress.step} ({path}): {memory}; epoch "
             f"{progress.epoch + 1} goes on at batch {progress.batch}/{job.steps_per_epoch} (was {old_batch} at "
             f"{old_world} ranks; {replayed} samples of the epoch seen again); batch {job.args.batch_size}/rank "
             f"(global {job.args.batch_size * job.world}), peak lr {peak:.6g}, plan {job.total_steps} steps, "
             f"warm-up {job.warmup}")
