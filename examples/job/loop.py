"""The training loop: steps, the evaluation at each epoch end (a collective), the metrics lines, the
periodic checkpoints, the last sync of a run with local steps, and the run's summary."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Dict

import torch

from .board import tensorboard_record, tensorboard_step
from .common import LOG, model_digest
from .data import compute_loss
from .logs import ProgressReport, mb
from .options import describe_compression
from .resume import save_checkpoint
from .state import Job, Progress, counter_totals


def forward(job: Job, x: torch.Tensor) -> torch.Tensor:
    """The model's logits for ``x``, under bfloat16 autocast with ``--bf16`` (the logits come back as float32, so
    the loss is computed in float32)."""
    with torch.autocast(job.device.type, dtype=torch.bfloat16, enabled=bool(job.args.bf16)):
        logits = job.model(x)
    return logits.float()


@torch.no_grad()
def evaluate(job: Job) -> Dict[str, float]:
    """Collective: each rank scores its share (rank::world) of the test set; sums are allreduced."""
    args, model = job.args, job.model
    model.eval()
    x_all, y_all = job.test_set.tensors
    mine = torch.arange(job.rank, len(job.test_set), job.world)
    n_batches = math.ceil(mine.numel() / args.test_batch_size)
    if args.test_batches is not None:
        n_batches = min(n_batches, args.test_batches)
    loss_sum = correct = count = 0.0
    for b in range(n_batches):
        idx = mine[b * args.test_batch_size:(b + 1) * args.test_batch_size]
        x, y = x_all[idx].to(job.device), y_all[idx].to(job.device)
        logits = forward(job, x)
        loss_sum += float(compute_loss(logits, y, reduction="sum"))
        correct += float((logits.argmax(dim=-1) == y).sum())
        count += y.numel()
    model.train()
    totals = job.engine.sum(torch.tensor([loss_sum, correct, count], dtype=torch.float64), name="train.eval")
    return job.spec.score(*totals.tolist())


def _finite(x):
    return x if not isinstance(x, float) or math.isfinite(x) else None


def _fmt(x, spec: str = ".4f") -> str:
    return "nan" if x is None else format(x, spec)


def record(job: Job, progress: Progress, final: bool) -> dict:
    """Collective: evaluate and aggregate; rank 0 writes the metrics line (the final one in ``report``)."""
    args = job.args
    train_loss = job.engine.sum(torch.tensor([progress.loss_sum, float(progress.loss_count)], dtype=torch.float64),
                                name="train.loss").tolist()
    res = {"epoch": progress.epoch + 1 if progress.batch else progress.epoch,
           "epoch_progress": progress.step / job.steps_per_epoch, "step": progress.step,
           "train_loss": train_loss[0] / train_loss[1] if train_loss[1] else None}
    res.update(evaluate(job))
    res["wall_time"] = job.wall(progress)
    res.update(counter_totals(job, progress))
    res.update({"compressor": args.compressor, "ratio": args.ratio, "value_dtype": args.value_dtype,
                "world_size": job.world, "dataset": args.dataset, "model": args.model, "final": final})
    res = {k: _finite(v) for k, v in res.items()}
    if job.metrics_file is not None and not final:
        job.metrics_file.write(json.dumps(res) + "\n")
        job.metrics_file.flush()
    tensorboard_record(job, res)
    job.last_record = res
    return res


def train_step(job: Job, x: torch.Tensor, y: torch.Tensor) -> float:
    """One optimizer step on the batch ``(x, y)``; returns this rank's loss."""
    job.opt.zero_grad()
    loss = compute_loss(forward(job, x), y)
    loss.backward()
    job.engine.step(job.model, job.opt, job.args.clip_grad)
    job.scheduler.step()
    return float(loss.detach())


def _end_epoch(job: Job, progress: Progress, report: ProgressReport) -> None:
    report.line(progress)
    res = record(job, progress, final=progress.step >= job.total_steps or progress.epoch + 1 >= job.args.epochs)
    LOG.info(f"epoch {progress.epoch + 1}: train loss {_fmt(res['train_loss'])}, {job.spec.describe(res)}, "
             f"test loss {_fmt(res['test_loss'])}, {res['wall_time']:.1f} s")
    progress.epoch, progress.batch = progress.epoch + 1, 0
    progress.loss_sum, progress.loss_count = 0.0, 0


def schedule_end(job: Job) -> int:
    """The step where the schedule ends (``--epochs``); ``--max-steps`` may stop the run before it."""
    return job.args.epochs * job.steps_per_epoch


def finish_interval(job: Job, progress: Progress, epoch_done: bool = False) -> bool:
    """Local steps (``--sync-every``): a run whose last step falls inside an interval syncs the steps since the
    last sync (``opt.sync_now(average=True)``: their average as it is, no outer momentum step), so every rank
    ends with the same model and the final evaluation and checkpoint score and keep it. Where the run stops
    before the end of its schedule (``--max-steps``), a checkpoint of the open interval is written first, so
    ``--resume`` continues it as if the run had not stopped. Collective; returns whether it synced."""
    steps = open_interval(job)
    if not steps:
        return False
    if job.ckpt_dir is not None and progress.step < schedule_end(job) and job.last_ckpt_step != progress.step:
        # as the periodic checkpoint at an epoch's end would be: after the epoch's bookkeeping
        after = dataclasses.replace(progress, epoch=progress.epoch + 1, batch=0, loss_sum=0.0, loss_count=0) \
            if epoch_done else progress
        save_checkpoint(job, after)
    last_sync(job, steps)
    return True


def open_interval(job: Job) -> int:
    """Local steps (``--sync-every``): the steps taken since the last sync (0 without local steps)."""
    return job.opt.stats()["local_steps"]["step_in_interval"] if hasattr(job.opt, "sync_now") else 0


def last_sync(job: Job, steps: int) -> None:
    """Collective: sync the ``steps`` local steps of the open interval as their average (``sync_now(average=
    True)``), so that every rank ends with the same model (also the ``--elastic`` loop's end)."""
    job.opt.sync_now(average=True)
    LOG.info(f"last sync: the average of the {steps} local step(s) since the previous one (every rank now holds "
             "the same model)")


def train_epoch(job: Job, progress: Progress, report: ProgressReport) -> None:
    """Train from ``progress.batch`` to the end of the epoch (or to the last step), checkpointing every
    ``--checkpoint-every`` steps; at the epoch end evaluate and log the results."""
    args = job.args
    job.sampler.set_epoch(progress.epoch)  # reshuffle per epoch
    order = torch.as_tensor(list(iter(job.sampler)), dtype=torch.int64)
    x_train, y_train = job.train_set.tensors
    while progress.step < job.total_steps:
        idx = order[progress.batch * args.batch_size:(progress.batch + 1) * args.batch_size]
        x, y = x_train[idx].to(job.device, non_blocking=True), y_train[idx].to(job.device, non_blocking=True)
        lr = job.opt.param_groups[0]["lr"]
        loss = train_step(job, x, y)
        progress.step += 1
        if job.channels is not None:
            job.channels.observe(progress.step)
        progress.batch += 1
        progress.loss_sum += loss
        progress.loss_count += 1
        report.step(progress, loss)
        tensorboard_step(job, progress, loss, lr)
        epoch_done = progress.batch == job.steps_per_epoch
        if progress.step == job.total_steps:
            finish_interval(job, progress, epoch_done)
        if epoch_done:
            _end_epoch(job, progress, report)
        if job.ckpt_dir is not None and args.checkpoint_every and progress.step % args.checkpoint_every == 0 \
                and progress.step < job.total_steps:
            save_checkpoint(job, progress)
        if epoch_done:
            return


def replicas_identical(job: Job) -> bool:
    """Collective: whether every rank ends with bitwise the same parameters, as data-parallel replicas must
    (every aggregation rule here gives every rank the same bits). A difference is a bug, never a result:
    rank 0 says so loudly."""
    if job.engine.size == 1:
        return True
    digests = job.engine.allgather_object(model_digest(job.model, buffers=False), name="train.replicas")
    same = len(set(digests)) == 1
    if not same and job.rank == 0:
        groups = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        LOG.error("the ranks' parameters differ at the end of the run (ranks grouped by equal parameters: "
                  f"{sorted(groups.values())}): the replicas have diverged, so these results are not those of "
                  "data-parallel training. This is a bug: please report it with the command line")
    return same


def report(job: Job, progress: Progress) -> dict:
    """The run's summary: written as the last metrics line, to ``--summary-json`` and as the final log line.
    Collective (the replicas' check)."""
    res = dict(job.last_record)
    res["replicas_identical"] = replicas_identical(job)
    res["total_seconds"] = time.time() - job.process_start
    if job.rank != 0:
        return res
    if job.channels is not None:
        job.channels.write(job.opt.stats() if hasattr(job.opt, "stats") else None)
    text = json.dumps(res)
    if job.metrics_file is not None:
        job.metrics_file.write(text + "\n")
        job.metrics_file.flush()
    if job.args.summary_json:
        path = Path(job.args.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    if res["wire_bytes_dense"]:
        traffic = wire_summary(res, job.world)
    elif res["bytes_dense"] and (job.world > 1 or getattr(job.args, "exchange_when_alone", False)):
        traffic = (f"payload bytes sent {mb(res['bytes_sent'])} vs dense {mb(res['bytes_dense'])}, "
                   f"density {res['density']:.4f}")
    else:
        traffic = "no gradient communication (one process)"
    label = job.spec.describe(res)
    LOG.info(f"Final {label} (test loss {_fmt(res['test_loss'])}) after {progress.step} steps "
             f"({progress.step / job.steps_per_epoch:.2f} epochs) in {res['wall_time']:.1f} s of training "
             f"({res['total_seconds']:.1f} s total); {traffic}")
    if job.args.print_final_json:
        LOG.info("FINAL " + text)
    return res


def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN runs bfloat16 matrix products natively on this CPU (AVX512-BF16 or AMX); unknown: True."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True


def describe_run(job: Job) -> list:
    """The effective settings, as rank 0 prints them at start (two lines: the run, the compression)."""
    args, engine = job.args, job.engine
    return [f"{args.dataset}/{args.model}: {job.world} rank(s) ({engine.init_mode} init, {job.device.type}), "
            f"batch {args.batch_size}/rank, {args.optimizer} lr {args.lr}"
            f"{f' x {job.world}' if args.optimizer == 'sgd' else ' (not scaled)'} (warm-up {job.warmup} steps, "
            f"{args.lr_schedule}){', bf16 autocast' if args.bf16 else ''}, {job.steps_per_epoch} steps/epoch, "
            f"training to step {job.total_steps}",
            f"compressor {describe_compression(args)}"]


def train(job: Job, progress: Progress) -> dict:
    """Train to ``--epochs`` / ``--max-steps``, evaluate, checkpoint at the end, and report."""
    args = job.args
    for line in describe_run(job):
        LOG.info(line)
    if args.bf16 and job.device.type == "cpu" and not cpu_has_bf16_matmul():
        LOG.warning("--bf16: this CPU has no native bfloat16 matrix instructions (oneDNN reports none), so bfloat16 "
                    "autocast takes a slow fallback: the gpt step measured 9x slower than float32 on such a CPU "
                    "(AVX2 only). Drop --bf16 here")
    if job.rank == 0 and args.metrics_out:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
        job.metrics_file = open(args.metrics_out, "a" if job.last_ckpt_step is not None else "w")
    job.train_start = time.time()
    progress_report = ProgressReport(job, progress)
    job.model.train()
    try:
        while progress.step < job.total_steps and progress.epoch < args.epochs:
            train_epoch(job, progress, progress_report)
            if progress.batch:  # --max-steps stopped inside the epoch
                break
        progress_report.line(progress)
    finally:
        progress_report.close()
    synced = finish_interval(job, progress)  # a run resumed from a checkpoint of its last step's open interval
    if synced or job.last_record is None or job.last_record["step"] != progress.step:
        record(job, progress, final=True)
    if job.ckpt_dir is not None and (job.last_ckpt_step != progress.step
                                     or (synced and progress.step >= schedule_end(job))):
        save_checkpoint(job, progress)
    return report(job, progress)


def wire_summary(res: dict, world: int) -> str:
    """The summary's traffic: what each rank's link carried (mean over ranks; ``res`` sums them) against a
    dense fp32 ring allreduce at the same world size, then the payload figures."""
    sent, received = res["wire_bytes_sent"] / world, res["wire_bytes_received"] / world
    dense = res["wire_bytes_dense"] / world
    busier = max(sent, received)
    factor = dense / busier if busier else float("inf")
    return (f"wire per rank {mb(sent)} sent, {mb(received)} received vs dense allreduce {mb(dense)} at "
            f"W={world} ({factor:.1f}x less); payload bytes sent {mb(res['bytes_sent'])} vs dense "
            f"{mb(res['bytes_dense'])}, density {res['density']:.4f}")
