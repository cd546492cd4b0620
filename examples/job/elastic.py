"""``--elastic`` on the Horovod engine: the training loop inside ``hvd.elastic.run``.

Launch it with horovodrun's elastic mode, e.g.::

    horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script ./hosts.sh \\
        python examples/train.py --elastic --commit-every 20 ...

What survives a membership change, and how:

* The state is one ``hvd.elastic.TorchState`` with the model, the optimizer (``hat.DistributedOptimizer``:
  ``import horovod_adtopk`` registers the handler that snapshots, rolls back and re-plans its compression
  state), an ``hvd.elastic.ElasticSampler`` and the plain attributes ``epoch``, ``batch`` (steps done in the
  epoch), ``step`` (steps done in the run), ``nominal_world`` and ``resumed``. It is committed every
  ``--commit-every`` steps and at each epoch end; a commit is also where Horovod tells the ranks that hosts
  were added or removed (``HostsUpdatedInterrupt``: no step is lost). A failed collective (a rank killed, a
  link down) raises ``HorovodInternalError``: every survivor rolls back to the last commit, so up to
  ``--commit-every`` steps are replayed.
* The data: ``ElasticSampler`` counts the samples consumed in the epoch and, after a change, deals the
  samples left in the epoch over the new ranks (rank r takes every W-th), so an epoch still visits each
  example once (plus the padding to a multiple of W), whatever the changes.
* The batch (``--elastic-batch``): ``per-rank`` (default, Horovod's convention) keeps ``--batch-size`` on
  every rank, so the global batch and SGD's scaled peak rate ``lr * W`` follow the current world size W and
  fewer ranks take more steps per epoch; ``global`` keeps the starting global batch ``B * W0`` and gives each
  rank ``B * W0 / W`` of it, with the rate of W0: the sampler deals the remaining samples rank::W, so step k
  trains on the same samples whatever W is, and a faulted run stays comparable step for step with a
  fault-free one.
* The learning rate is a function of the data consumed, not of the step count: the schedule position is
  ``(epoch * N + samples consumed in the epoch) / (B * W0)`` with ``W0`` the world size at the start
  (``nominal_world``). With no change it is the non-elastic job's schedule step for step; after a change the
  warm-up and the cosine still end where the data ends.
* The job itself runs no collective before the elastic loop (a worker that joins later would run it alone),
  so the initial broadcast of rank 0's state is the state's first ``sync()``.

``--elastic-log FILE``: every rank appends one JSON line per event (``O_APPEND`` writes of one line, so the
ranks on a shared file system do not interleave): ``synced`` when a membership starts training (its
members, world size, step and parameter digest), ``commit`` (step, digest, this rank's residual norm
``opt.stats()["memory"]["residual_norm"]`` and the norm of this rank's gradient of the step just done),
``failed`` (a collective failed at this step), ``reset`` (after Horovod re-initialised), ``first_step``
(the first step completed after the membership started) and ``end`` (the final digest). Times are
``time.time()`` so a test on the same machine can measure from its fault. Metrics lines and the summary are
written by the rank that is rank 0 when they are written (after a change it may be another process); a
metrics line of an epoch end that was rolled back is written again. The byte counters of the summary are
the current members' (a lost rank's counters go with it).

Hierarchical exchange: the job has no flag for it; under Horovod elastic the library falls back to the flat
exchange (its process sets would not survive a membership change).

Checkpoints (``--checkpoint-dir``) are written at commits (``--checkpoint-every`` a multiple of
``--commit-every``) and at the end, with the sampler's position; ``--resume`` restores them inside the
elastic loop at any world size (the optimizer re-deals the residuals of every rank's entry over the new
ranks).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

from .build import lr_factor
from .checkpoints import read_checkpoint
from .common import LOG, JobFailed, agree, model_digest
from .data import compute_loss
from .logs import ProgressReport
from .loop import describe_run, forward, last_sync, open_interval, record, report
from .resume import find_checkpoint, save_checkpoint
from .state import COUNTER_KEYS, Job, Progress


def residual_norm(opt: torch.optim.Optimizer) -> Tuple[float, int]:
    """``(L2 norm over this rank's error-feedback residuals, number of residual tensors)``:
    ``opt.stats()["memory"]``."""
    memory = opt.stats()["memory"]
    return float(memory["residual_norm"]), int(memory["tensors"])


class ElasticLog:
    """This rank's lines of ``--elastic-log`` (nothing without the flag)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = Path(path) if path else None
        self.host, self.pid = socket.gethostname(), os.getpid()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields) -> None:
        if self.path is None:
            return
        row = {"event": event, "time": time.time(), "host": self.host, "pid": self.pid, **fields}
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(row) + "\n").encode())
        finally:
            os.close(fd)


class ElasticTrainer:
    """The elastic loop of one process: its state, sampler, learning-rate clock and log."""

    def __init__(self, job: Job) -> None:
        self.job, args = job, job.args
        self.sampler = hvd.elastic.ElasticSampler(job.train_set, shuffle=True, seed=args.seed)
        job.sampler = self.sampler
        self.state = hvd.elastic.TorchState(model=job.model, optimizer=job.opt, sampler=self.sampler,
                                            epoch=0, batch=0, step=0, nominal_world=0, resumed=False)
        self.state.register_reset_callbacks([self._on_reset])
        self.log = ElasticLog(args.elastic_log)
        self.scaled = args.optimizer == "sgd" and not getattr(args, "sync_every", 0)
        self.progress = Progress(counters={k: 0.0 for k in COUNTER_KEYS})
        self.members: List[str] = []
        self.world_sizes: List[int] = []

    # --- the schedule -------------------------------------------------------------------------------------
    def _nominal(self) -> Tuple[int, int, int]:
        """``(steps per epoch, warm-up steps, horizon)`` at the world size the run started with."""
        args, world = self.job.args, max(1, self.state.nominal_world)
        steps_per_epoch = math.ceil(math.ceil(len(self.job.train_set) / world) / args.batch_size)
        warmup = steps_per_epoch if args.warmup_steps is None else args.warmup_steps
        return steps_per_epoch, warmup, args.epochs * steps_per_epoch

    def _rank_batch(self) -> int:
        """This step's per-rank batch: ``--batch-size``, or with ``--elastic-batch global`` this rank's share
        ``floor(B * W0 / W)`` of the starting global batch."""
        args = self.job.args
        if args.elastic_batch == "per-rank":
            return args.batch_size
        return max(1, args.batch_size * max(1, self.state.nominal_world) // hvd.size())

    def _rate_world(self) -> int:
        """The world size SGD's rate is scaled by: the current one, or the starting one for a fixed global batch."""
        return hvd.size() if self.job.args.elastic_batch == "per-rank" else max(1, self.state.nominal_world)

    def _set_lr(self) -> float:
        """The rate for the next step: ``peak(W) * lr_factor(clock)`` with the clock in nominal steps,
        ``clock = (epoch * N + consumed) / (batch * W0)``."""
        args, world = self.job.args, self._rate_world()
        steps_per_epoch, warmup, horizon = self._nominal()
        consumed = self.state.epoch * len(self.job.train_set) + self.sampler.processed_num
        clock = consumed / (args.batch_size * max(1, self.state.nominal_world))
        lr = (args.lr * world if self.scaled else args.lr) * lr_factor(
            clock, world=world, warmup=warmup, kind=args.lr_schedule, horizon=horizon, scaled=self.scaled)
        for group in self.job.opt.param_groups:
            group["lr"] = lr
        return lr

    # --- membership --------------------------------------------------------------------------------------
    def _on_reset(self) -> None:
        """After Horovod re-initialised with the new members (before the state's sync)."""
        self.sampler.reset()  # removals skip the sync, which would re-deal the samples otherwise
        self.log.write("reset", size=hvd.size(), rank=hvd.rank())

    def _start_membership(self) -> None:
        """Collective, at each entry into the loop (after the sync): who is here, and the digest to compare."""
        state, job = self.state, self.job
        if state.nominal_world == 0:  # the run's first start: every rank is in its first sync
            state.nominal_world = hvd.size()
            state.save()  # so that a failure before the first commit keeps it
        job.steps_per_epoch, job.warmup, job.total_steps = self._nominal()
        who = hvd.allgather_object(f"{socket.gethostname()}:{os.getpid()}", name="elastic.members")
        self.members = who
        self.world_sizes.append(hvd.size())
        self.entry_time = time.time()
        self.first_step_logged = False
        self.log.write("synced", rank=hvd.rank(), size=hvd.size(), members=hashlib.sha256(
            "|".join(who).encode()).hexdigest()[:16], hosts=sorted({w.split(":")[0] for w in who}),
            step=state.step, epoch=state.epoch, batch=state.batch, digest=model_digest(job.model))
        if job.rank == 0 and len(self.world_sizes) > 1:
            LOG.info(f"elastic: training on {hvd.size()} rank(s) from step {state.step} "
                     f"(epoch {state.epoch + 1}, {self.sampler.processed_num} samples of the epoch done), "
                     f"batch {self._rank_batch()}/rank")
        if job.rank == 0 and job.args.elastic_batch == "global" and job.args.batch_size * state.nominal_world % hvd.size():
            LOG.warning(f"elastic: the global batch {job.args.batch_size * state.nominal_world} does not split "
                        f"over {hvd.size()} ranks; it is {self._rank_batch() * hvd.size()} while they train")

    def _members_id(self) -> str:
        return hashlib.sha256("|".join(self.members).encode()).hexdigest()[:16]

    # --- steps and commits -------------------------------------------------------------------------------
    def _train_step(self, x: torch.Tensor, y: torch.Tensor, want_grad_norm: bool) -> Tuple[float, Optional[float]]:
        """One optimizer step; with ``want_grad_norm`` also the L2 norm of this rank's own gradient (taken
        with ``torch.autograd.grad``, which accumulates nothing, so the optimizer's hooks do not fire)."""
        job = self.job
        job.opt.zero_grad()
        loss = compute_loss(forward(job, x), y)
        grad_norm = None
        if want_grad_norm:
            params = [p for p in job.model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            grad_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
        loss.backward()
        job.engine.step(job.model, job.opt, job.args.clip_grad)
        return float(loss.detach()), grad_norm

    def _commit(self, grad_norm: Optional[float]) -> None:
        """Commit (may raise HostsUpdatedInterrupt), log this rank's view, checkpoint when due."""
        state, job, args = self.state, self.job, self.job.args
        norm, tensors = residual_norm(job.opt)
        self.log.write("commit", rank=hvd.rank(), size=hvd.size(), members=self._members_id(), step=state.step,
                       epoch=state.epoch, batch=state.batch, digest=model_digest(job.model), residual_norm=norm,
                       residual_tensors=tensors, grad_norm=grad_norm)
        if job.ckpt_dir is not None and args.checkpoint_every and state.step % args.checkpoint_every == 0:
            save_checkpoint(job, self._progress(), extra=self._checkpoint_extra())
        state.commit()

    def _progress(self) -> Progress:
        p, s = self.progress, self.state
        p.step, p.epoch, p.batch = s.step, s.epoch, s.batch
        return p

    def _checkpoint_extra(self) -> dict:
        s = self.state
        return {"elastic": {"sampler": self.sampler.state_dict(), "nominal_world": s.nominal_world,
                            "batch": s.batch}}

    # --- resume ------------------------------------------------------------------------------------------
    def _resume(self) -> None:
        """Collective: ``--resume`` from the newest good checkpoint, at whatever world size runs now."""
        job = self.job
        path, ckpt = find_checkpoint(job)
        if path is not None:
            error = None
            if ckpt is None:
                ckpt, why = read_checkpoint(Path(path))
                error = None if ckpt is not None else f"checkpoint {path} is {why}"
            agree(job.engine, error, "resume_read")
            if ckpt.get("elastic") is None:
                if job.rank == 0:
                    LOG.error(f"cannot resume --elastic from {path}: it was written without --elastic")
                raise JobFailed(2)
            diffs = [f"{k}: checkpoint {ckpt['config'].get(k)!r}, now {job.config[k]!r}" for k in job.config
                     if k not in ("world_size", "warmup_steps", "schedule_horizon")
                     and ckpt["config"].get(k) != job.config[k]]
            if diffs:
                if job.rank == 0:
                    LOG.error(f"cannot resume from {path}, the run settings differ: " + "; ".join(diffs))
                raise JobFailed(2)
            job.model.load_state_dict(ckpt["model"])
            job.opt.load_state_dict(ckpt["optimizer"])
            rngs = ckpt["rng"]["torch"]
            torch.set_rng_state(rngs[job.rank % len(rngs)])
            el, s = ckpt["elastic"], self.state
            s.step, s.epoch, s.batch, s.nominal_world = (int(ckpt["step"]), int(ckpt["epoch"]), int(el["batch"]),
                                                         int(el["nominal_world"]))
            self.sampler.load_state_dict(el["sampler"])
            self.progress.counters = {k: float(ckpt["counters"].get(k, 0.0)) for k in COUNTER_KEYS}
            self.progress.wall_offset = float(ckpt["wall_time"])
            job.last_ckpt_step = s.step
            LOG.info(f"resumed from {path} at step {s.step} (epoch {s.epoch + 1}, "
                     f"{self.sampler.processed_num} samples of the epoch done) on {hvd.size()} rank(s)")
        self.state.resumed = True
        self.state.commit()

    # --- the loop ----------------------------------------------------------------------------------------
    def _epochs(self, state) -> None:
        """The body of ``hvd.elastic.run``: train from the state's position to the end of ``--epochs``."""
        job, args = self.job, self.job.args
        self._start_membership()
        if args.resume and not state.resumed:
            self._resume()
            job.steps_per_epoch, job.warmup, job.total_steps = self._nominal()
        report = ProgressReport(job, self._progress())
        try:
            while state.epoch < args.epochs:
                order = torch.as_tensor(list(iter(self.sampler)), dtype=torch.int64)
                x_train, y_train = job.train_set.tensors
                batch = self._rank_batch()
                steps = math.ceil(len(order) / batch)
                for b in range(steps):
                    idx = order[b * batch:(b + 1) * batch]
                    x, y = x_train[idx].to(job.device), y_train[idx].to(job.device)
                    self._set_lr()
                    # the epoch's last step commits at the epoch end, after the evaluation
                    commit_now = (state.step + 1) % args.commit_every == 0 and b + 1 < steps
                    try:
                        loss, grad_norm = self._train_step(x, y, want_grad_norm=commit_now)
                    except HorovodInternalError as exc:
                        self.log.write("failed", rank=hvd.rank(), size=hvd.size(), step=state.step,
                                       error=str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
                        raise
                    self.sampler.record_batch(b, batch)
                    state.step += 1
                    state.batch += 1
                    self.progress.loss_sum += loss
                    self.progress.loss_count += 1
                    if not self.first_step_logged:
                        self.first_step_logged = True
                        self.log.write("first_step", rank=hvd.rank(), size=hvd.size(), step=state.step,
                                       members=self._members_id(), since_entry=time.time() - self.entry_time)
                    report.step(self._progress(), loss)
                    if commit_now:
                        self._commit(grad_norm)
                # local steps: where the run's end falls inside an interval, one model on every rank, evaluated
                # and kept (a failure in this sync rolls back to the last commit like any other)
                open_steps = open_interval(job) if state.epoch + 1 >= args.epochs else 0
                if open_steps:
                    last_sync(job, open_steps)
                self._end_epoch(report)
            self._finish()
        finally:
            report.close()

    def _finish(self) -> None:
        """Collective, after the last epoch: the final record (when ``--resume`` found nothing left to train),
        the final checkpoint, and this rank's ``end`` line."""
        job, state = self.job, self.state
        if job.last_record is None or job.last_record["step"] != state.step:
            record(job, self._progress(), final=True)
        if job.ckpt_dir is not None and job.last_ckpt_step != state.step:
            save_checkpoint(job, self._progress(), extra=self._checkpoint_extra())
        self.log.write("end", rank=hvd.rank(), size=hvd.size(), members=self._members_id(), step=state.step,
                       digest=model_digest(job.model), world_sizes=self.world_sizes,
                       library=job.opt.stats().get("elastic"), test_accuracy=job.last_record.get("test_accuracy"))

    def _end_epoch(self, report: ProgressReport) -> None:
        """Collective: evaluate, log, move the sampler to the next epoch and commit."""
        job, state = self.job, self.state
        report.line(self._progress())
        last = state.epoch + 1 >= job.args.epochs
        res = record(job, self._progress(), final=last)
        LOG.info(f"epoch {state.epoch + 1}: train loss {res['train_loss']}, {job.spec.describe(res)}, "
                 f"{res['wall_time']:.1f} s, {hvd.size()} rank(s)")
        state.epoch, state.batch = state.epoch + 1, 0
        self.progress.loss_sum, self.progress.loss_count = 0.0, 0
        self.sampler.set_epoch(state.epoch)
        if not last:  # after the last epoch the run ends (_finish): nothing to commit
            self._commit(None)

    def run(self) -> dict:
        """Train under ``hvd.elastic.run`` and report (rank 0 writes the summary)."""
        job = self.job
        for line in describe_run(job):
            LOG.info(line)
        LOG.info(f"elastic: commit every {job.args.commit_every} steps; the learning rate follows the data "
                 f"consumed (world size at start: the nominal one)")
        if job.rank == 0 and job.args.metrics_out:
            Path(job.args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
            job.metrics_file = open(job.args.metrics_out, "a" if job.args.resume else "w")
        job.train_start = time.time()
        job.model.train()
        hvd.elastic.run(self._epochs)(self.state)
        res = report(job, self._progress())
        return res


def train_elastic(job: Job) -> dict:
    """Run the job under Horovod elastic (``--elastic``, ``--engine horovod``)."""
    return ElasticTrainer(job).run()
