#!/usr/bin/env python
"""Data-parallel training with sparse gradient compression (horovod_adtopk).

What the job does: every rank loads the dataset (Fashion-MNIST images or Shakespeare characters), builds the
same model, wraps SGD in ``hat.DistributedOptimizer`` with the chosen ``hat.Compression`` and trains on its
own shard of the training set for ``--epochs`` (or ``--max-steps``). Gradients are averaged across ranks,
sparsely for the tensors the compressor selects. At each epoch end the model is scored on the test set;
rank 0 logs progress, writes the metrics and the checkpoints.

Launch one process per slot with any of::

    horovodrun -np 2 python examples/train.py --dataset fashion-mnist --compressor adtopk --ratio 0.01 --epochs 1
    mpirun -np 2 python examples/train.py ...          # plain MPI launcher (Horovod built with MPI)
    srun python examples/train.py ...                  # Slurm (see examples/slurm_train.sbatch)
    python examples/train.py ...                       # a single process

Conventions follow Horovod's PyTorch examples: a ``DistributedSampler`` per rank (reshuffled per epoch
through ``set_epoch``), the learning rate scaled by the number of ranks with a linear warm-up
(``torch.optim.lr_scheduler.LambdaLR``), the initial state broadcast from rank 0, metrics averaged over ranks,
logging and checkpoints on rank 0.

Horovod starts with ``hvd.init()`` under horovodrun's Gloo mode or alone, and with
``hvd.init(comm=MPI.COMM_WORLD)`` (mpi4py) whenever an MPI launcher is detected without horovodrun's
``HOROVOD_*`` variables: mpirun, srun, and horovodrun's own MPI mode (which launches through mpirun).

Sparse compressors use DGC's momentum correction by default (``--no-momentum-correction`` to turn it
off): the sparse-path tensors accumulate the momentum in their error-feedback memory and are stepped by
SGD without momentum, while dense-path tensors (biases, small layers) keep SGD momentum. With plain SGD
momentum on top of error feedback, one epoch of Fashion-MNIST with ADTopk at ratio 0.01 (lr 0.05, constant
after warm-up) reached 81% test accuracy, against 86% with momentum correction.

Checkpoints (``--checkpoint-dir``) hold everything a run needs to continue *exactly* under ``--resume``:
step, epoch and position inside the epoch (the batches already consumed are skipped), model, optimizer
with every rank's compression state (error-feedback residuals), learning-rate scheduler, every rank's RNG
state and the cumulative counters. A resumed run reproduces the parameters of an uninterrupted one bit for
bit (CPU, fixed seed, same number of ranks). The newest ``--keep-checkpoints`` files are kept (default 2):
a damaged newest checkpoint (truncated, overwritten) is reported by name and ``--resume`` falls back to
the previous one. Temporary files left by a save that was killed are removed at the next save; a save that
fails (disk full) leaves no partial file and stops every rank with the reason.

Output (rank 0, through Python's ``logging``, one flushed line at a time): a live progress bar only for a
single process whose stderr is a terminal (launchers such as horovodrun, mpirun and srun tag or buffer
output, so there is none under them), otherwise a progress line every ``--log-every`` seconds and at each
epoch end (step, epoch, loss, samples/s, ETA, bytes sent vs dense, density); an evaluation line per epoch;
and one final line starting with ``Final test accuracy`` / ``Final test perplexity``. Other ranks log only
warnings and errors, prefixed with their rank. Machine-readable results: one JSON line per evaluation in
``--metrics-out`` (the last one, ``"final": true``, is the run's summary), the summary alone in
``--summary-json``, and a ``FINAL {json}`` line in the log only with ``--print-final-json``.
``--tensorboard DIR`` writes TensorBoard scalars and a per-layer density histogram.
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd

import horovod_adtopk as hat
import datasets  # examples/datasets.py, beside this script
from models import build_model  # examples/models.py

LOG = logging.getLogger("horovod_adtopk.train")

CKPT_FORMAT = 2  # 2: the learning rate lives in a LambdaLR state dict
LATEST = "latest"
CKPT_GLOB = "ckpt-step*.pt"
TMP_GLOBS = (".ckpt-step*.pt.tmp*", f".{LATEST}.tmp*")
VALUE_DTYPES = hat.Compression.value_dtypes()
# Settings a checkpoint must share with the resuming run, or the continuation would not be the same run.
RESUME_KEYS = ("dataset", "model", "compressor", "ratio", "value_dtype", "threshold", "min_numel", "momentum_correction",
               "batch_size", "lr", "momentum", "weight_decay", "lr_schedule", "schedule_horizon", "warmup_steps",
               "clip_grad", "seed", "seq_len", "lstm_hidden", "lstm_layers", "world_size", "dense_rounds",
               "density_warmup", "density_start", "powersgd_rank")


class JobFailed(Exception):
    """A failure every rank agreed on; rank 0 has logged why. ``main`` turns it into the exit status."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


# ---------------------------------------------------------------------------------------------------------
# The datasets: everything that differs between them
# ---------------------------------------------------------------------------------------------------------

def _score_classification(loss_sum: float, correct: float, count: float) -> Dict[str, float]:
    nan = float("nan")
    return {"test_loss": loss_sum / count if count else nan, "test_examples": int(count),
            "test_accuracy": correct / count if count else nan}


def _score_language_model(loss_sum: float, correct: float, count: float) -> Dict[str, float]:
    nan = float("nan")
    loss = loss_sum / count if count else nan
    return {"test_loss": loss, "test_tokens": int(count),
            "test_perplexity": math.exp(min(loss, 700.0)) if count else nan,
            "test_char_accuracy": correct / count if count else nan}


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: how to load it, which models fit, its default flags and its headline metric."""
    load: Callable[[argparse.Namespace], tuple]  # args -> (train, test, vocab size or None)
    models: Tuple[str, ...]  # the first is the default
    defaults: Dict[str, float]  # values for the flags left unset on the command line
    score: Callable[[float, float, float], Dict[str, float]]  # (loss sum, correct, count) -> test metrics
    metric: str  # key of the headline test metric
    metric_label: str
    metric_format: Callable[[float], str]

    def describe(self, res: dict) -> str:
        value = res.get(self.metric)
        return f"{self.metric_label} {'nan' if value is None else self.metric_format(value)}"


DATASETS: Dict[str, DatasetSpec] = {
    "fashion-mnist": DatasetSpec(
        load=lambda args: (*datasets.load_fashion_mnist(args.data_dir), None),
        models=("cnn", "resnet"),
        defaults={"batch_size": 64, "lr": 0.1, "clip_grad": 0.0},
        score=_score_classification,
        metric="test_accuracy", metric_label="test accuracy", metric_format=lambda v: f"{100 * v:.2f}%"),
    "shakespeare": DatasetSpec(
        load=lambda args: datasets.load_shakespeare(args.data_dir, seq_len=args.seq_len),
        models=("lstm",),
        defaults={"batch_size": 32, "lr": 0.5, "clip_grad": 1.0},
        score=_score_language_model,
        metric="test_perplexity", metric_label="test perplexity", metric_format=lambda v: f"{v:.3f}"),
}


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def _compressor_name(text: str) -> str:
    return text.strip().lower().replace("-", "_")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASETS), default="fashion-mnist")
    p.add_argument("--model", default=None,
                   help="cnn or resnet for fashion-mnist, lstm for shakespeare (default: cnn / lstm)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the installed data)")
    p.add_argument("--compressor", type=_compressor_name, default="adtopk", choices=hat.Compression.names())
    p.add_argument("--ratio", type=float, default=0.01, help="density of the sparse compressors")
    p.add_argument("--value-dtype", choices=sorted(VALUE_DTYPES), default=None,
                   help="dtype of the sent values (sparse compressors; default: the gradient's dtype)")
    p.add_argument("--threshold", type=float, default=None, help="magnitude threshold of --compressor threshold")
    p.add_argument("--dense-rounds", type=int, default=0,
                   help="compression warm-up: send every gradient dense for the first N steps (the optimizer's "
                        "warmup_steps)")
    p.add_argument("--density-warmup", type=int, default=0,
                   help="sparse compressors: exponential density warm-up over N steps, from --density-start down to "
                        "--ratio (DGC's)")
    p.add_argument("--density-start", type=float, default=0.25, help="density at the start of --density-warmup")
    p.add_argument("--powersgd-rank", type=int, default=1, help="rank of --compressor powersgd")
    p.add_argument("--min-numel", type=int, default=None,
                   help="tensors with fewer elements travel dense (sparse compressors; default: the package's 1024)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (across epochs and resumes)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (default: 64 fashion-mnist, 32 shakespeare)")
    p.add_argument("--lr", type=float, default=None,
                   help="single-rank learning rate; scaled by the number of ranks (default: 0.1 fashion-mnist, 0.5 shakespeare)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=None,
                   help="sparse compressors: apply --momentum inside the error-feedback memory of the sparse tensors "
                        "(DGC's momentum correction) instead of in SGD; dense-path tensors keep SGD momentum "
                        "(default: on for sparse compressors)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                   help="after (and on top of) the warm-up: constant, or cosine annealing to 0 at the end of --epochs")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="linear lr warm-up from lr to lr*ranks over this many steps (default: one epoch)")
    p.add_argument("--clip-grad", type=float, default=None,
                   help="clip the averaged gradient to this global norm; 0: off (default: off / 1.0 for lstm)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even when a GPU is available")
    p.add_argument("--seq-len", type=int, default=64, help="shakespeare window length")
    p.add_argument("--lstm-hidden", type=int, default=256)
    p.add_argument("--lstm-layers", type=int, default=2)
    p.add_argument("--test-batches", type=int, default=None, help="evaluate on at most this many batches per rank")
    p.add_argument("--test-batch-size", type=int, default=500)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2,
                   help="keep the newest N checkpoint files, delete older ones (0: keep all); with 2 or more a "
                        "damaged newest checkpoint leaves a previous one to resume from")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --checkpoint-dir")
    p.add_argument("--metrics-out", default=None,
                   help="JSONL file: one line per evaluation; the last (\"final\": true) is the run's summary")
    p.add_argument("--summary-json", default=None, help="also write the run's summary (one JSON object) here")
    p.add_argument("--print-final-json", action="store_true",
                   help="also log the summary as a last line 'FINAL {json}' (for scripts reading the log)")
    p.add_argument("--log-every", type=float, default=10.0,
                   help="seconds between progress lines when there is no progress bar (0: only at epoch ends)")
    p.add_argument("--progress", action="store_true",
                   help="show the live progress bar even when stderr is not a terminal or a launcher runs the job")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard scalars and a per-layer density histogram here (needs "
                        "'pip install tensorboard')")
    args = p.parse_args(argv)

    spec = DATASETS[args.dataset]
    args.model = (args.model or spec.models[0]).lower()
    if args.model not in spec.models:
        p.error(f"--model {args.model} does not fit --dataset {args.dataset}; choose {' or '.join(spec.models)}")
    for key, value in spec.defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if args.max_steps is not None and args.max_steps < 0:
        p.error("--max-steps must be >= 0")
    for name in ("batch_size", "test_batch_size", "seq_len", "lstm_hidden", "lstm_layers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.test_batches is not None and args.test_batches < 0:
        p.error("--test-batches must be >= 0")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be >= 0")
    if args.keep_checkpoints < 0:
        p.error("--keep-checkpoints must be >= 0")
    if args.log_every < 0:
        p.error("--log-every must be >= 0")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        p.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.dense_rounds < 0 or args.density_warmup < 0:
        p.error("--dense-rounds and --density-warmup must be >= 0")
    if args.compressor != "powersgd":
        args.powersgd_rank = None
    if hat.Compression.is_dense_name(args.compressor):
        args.density_warmup = 0
        args.density_start = None
        if args.value_dtype is not None:
            p.error(f"--value-dtype applies to sparse compressors; --compressor {args.compressor} is dense "
                    "(use --compressor fp16 for a float16 dense allreduce)")
        args.ratio = None  # dense: the whole gradient travels
        args.threshold = None
        args.min_numel = None
        if args.momentum_correction:
            p.error("--momentum-correction needs a sparse compressor")
        args.momentum_correction = False
    else:
        if not 0.0 < args.ratio <= 1.0:
            p.error("--ratio must lie in (0, 1]")
        if args.compressor == "threshold" and args.threshold is None:
            p.error("--compressor threshold needs --threshold")
        if args.compressor != "threshold":
            args.threshold = None
        if args.compressor == "powersgd":
            if args.momentum_correction:
                p.error("--momentum-correction applies to the sparse compressors; PowerSGD uses SGD momentum")
            args.momentum_correction = False
            args.ratio = args.density_start = None
            args.density_warmup = 0
        if args.momentum_correction is None:
            args.momentum_correction = True
        if args.momentum_correction and not 0.0 <= args.momentum < 1.0:
            p.error("--momentum-correction needs --momentum in [0, 1)")
        args.momentum_correction = bool(args.momentum_correction and args.momentum > 0)
    return args


# ---------------------------------------------------------------------------------------------------------
# Horovod start-up, logging, agreement between ranks
# ---------------------------------------------------------------------------------------------------------

HOROVODRUN_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_CONTROLLER")
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS")
# Variables that launchers set in each process they start; with more than one process (or under horovodrun,
# which tags even one) the output is prefixed or collected by the launcher, so a redrawn bar would break.
LAUNCHER_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


def init_horovod() -> str:
    """``hvd.init()`` under horovodrun (or alone); over ``MPI.COMM_WORLD`` under mpirun / srun."""
    if not any(v in os.environ for v in HOROVODRUN_VARS) and any(v in os.environ for v in MPI_LAUNCHER_VARS):
        from mpi4py import MPI  # initialises MPI (thread level "multiple", as Horovod needs)
        hvd.init(comm=MPI.COMM_WORLD)
        return "mpi4py"
    hvd.init()
    return "horovod"


class _RankFormatter(logging.Formatter):
    """Rank 0's information lines as they are; warnings and errors say so (and which rank, on the others)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.prefix = f"rank {rank}: " if world > 1 and rank != 0 else ""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            text = "error: " + text
        elif record.levelno >= logging.WARNING:
            text = "warning: " + text
        return self.prefix + text


class _LineHandler(logging.StreamHandler):
    """One flushed line per record; written above the progress bar while one is shown."""

    bar = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is None:
            super().emit(record)  # StreamHandler flushes after every record
            return
        try:
            self.bar.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def setup_logging(rank: int, world: int) -> List[_LineHandler]:
    """Rank 0: information on stdout, warnings and errors on stderr. Other ranks: warnings and errors only."""
    LOG.handlers.clear()
    LOG.propagate = False
    fmt = _RankFormatter(rank, world)
    err = _LineHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    err.setFormatter(fmt)
    handlers = [err]
    if rank == 0:
        out = _LineHandler(sys.stdout)
        out.addFilter(_Below(logging.WARNING))
        out.setFormatter(fmt)
        handlers.append(out)
    for h in handlers:
        LOG.addHandler(h)
    LOG.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return handlers


def agree(error: Optional[str], what: str, status: int = 2) -> None:
    """Collective: if any rank reports an error, rank 0 logs each distinct one and every rank stops."""
    errors = hvd.allgather_object(error, name=f"train.agree.{what}")
    if all(e is None for e in errors):
        return
    if hvd.rank() == 0:
        seen = []
        for r, e in enumerate(errors):
            if e is not None and e not in seen:
                seen.append(e)
                LOG.error(e + ("" if hvd.size() == 1 else f" (rank {r})"))
    raise JobFailed(status)


# ---------------------------------------------------------------------------------------------------------
# Model, compression, optimizer, learning rate
# ---------------------------------------------------------------------------------------------------------

def make_model(args, vocab_size: Optional[int]) -> torch.nn.Module:
    if args.model == "lstm":
        return build_model("lstm", vocab_size=vocab_size, hidden=args.lstm_hidden, layers=args.lstm_layers)
    return build_model(args.model)


def make_compression(args):
    """The compressor named by --compressor, from the flags it takes (the registry knows which)."""
    return hat.Compression.from_options(
        args.compressor, ratio=args.ratio, value_dtype=VALUE_DTYPES.get(args.value_dtype), threshold=args.threshold,
        min_numel=args.min_numel, momentum=args.momentum if args.momentum_correction else None,
        seed=args.seed,  # identical on every rank (Random-k draws the same positions everywhere)
        density_warmup=args.density_warmup, density_start=args.density_start, rank=args.powersgd_rank)


def sparse_parameter_names(model: torch.nn.Module, compression, world: int) -> set:
    """Names of the parameters the optimizer will send sparsely (the compressor's own per-tensor rule)."""
    if not isinstance(compression, hat.SparseCompressor):
        return set()
    from horovod_adtopk.compressors import TensorInfo
    return {n for n, p in model.named_parameters() if p.requires_grad and
            compression.choose_path(TensorInfo(n, tuple(p.shape), p.numel(), p.dtype), world)[0]}


def make_optimizer(model, compression, args, world: int, lr: float):
    """SGD wrapped in hat.DistributedOptimizer. With momentum correction the sparse-path parameters get
    SGD without momentum (their error-feedback memory accumulates the velocity) and the dense-path ones
    (biases, small layers) keep ordinary SGD momentum."""
    # One process: nothing is communicated, so nothing is compressed; plain SGD momentum everywhere.
    sparse = sparse_parameter_names(model, compression, world) if args.momentum_correction and world > 1 else set()
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in sparse], "momentum": 0.0},
              {"params": [p for n, p in named if n not in sparse], "momentum": args.momentum}]
    base = torch.optim.SGD([g for g in groups if g["params"]], lr=lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)
    opt = hat.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=1, op=hvd.Average, warmup_steps=args.dense_rounds)
    if args.momentum_correction and world > 1:
        actual = {n for n, t in opt.stats()["tensors"].items() if t["path"] == "sparse"}
        if actual != sparse:
            raise RuntimeError(f"sparse-path parameters disagree: expected {sorted(sparse)}, got {sorted(actual)}")
    return opt


def lr_factor(step: int, world: int, warmup: int, kind: str, horizon: int) -> float:
    """Multiplier of the peak rate ``lr * world`` at optimizer step ``step`` (a pure function of the step).

    Linear warm-up from ``lr`` to ``lr * world`` over ``warmup`` steps (Goyal et al., as in Horovod's
    examples), times 1 (``constant``) or ``0.5 (1 + cos(pi step / horizon))`` (``cosine``, annealing to 0 at
    the end of ``--epochs``).
    """
    factor = 1.0 if warmup <= 0 or step >= warmup else (1.0 + (world - 1) * step / warmup) / world
    if kind == "cosine":
        factor *= 0.5 * (1.0 + math.cos(math.pi * min(step, horizon) / horizon))
    return factor


def compute_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if logits.dim() == 3:  # language model: [B, T, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction)
    return F.cross_entropy(logits, target, reduction=reduction)


# ---------------------------------------------------------------------------------------------------------
# Set-up: everything a run needs, in one object
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Progress:
    """Where the run stands; saved in checkpoints and restored by ``--resume``."""
    step: int = 0
    epoch: int = 0
    batch: int = 0  # batches of ``epoch`` already consumed
    loss_sum: float = 0.0  # this rank's training loss over the current epoch
    loss_count: int = 0
    counters: Dict[str, float] = field(default_factory=dict)  # totals carried over from earlier processes
    wall_offset: float = 0.0  # training seconds of earlier processes


@dataclass
class Job:
    args: argparse.Namespace
    spec: DatasetSpec
    rank: int
    world: int
    init_mode: str
    device: torch.device
    train_set: object
    test_set: object
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: DistributedSampler
    steps_per_epoch: int
    warmup: int
    total_steps: int
    config: dict
    ckpt_dir: Optional[Path]
    process_start: float
    metrics_file: Optional[object] = None
    tensorboard: Optional[object] = None
    train_start: float = 0.0
    last_record: Optional[dict] = None
    last_ckpt_step: Optional[int] = None

    def wall(self, progress: Progress) -> float:
        return progress.wall_offset + time.time() - self.train_start


COUNTER_KEYS = ("bytes_sent", "bytes_dense", "elements_sent", "elements_total")


def counter_totals(job: Job, progress: Progress) -> Dict[str, float]:
    """Collective: the optimizer's counters summed over ranks, plus those carried over by resumes."""
    s = job.opt.stats()
    local = torch.tensor([float(s[k]) for k in COUNTER_KEYS], dtype=torch.float64)
    summed = hvd.allreduce(local, op=hvd.Sum, name="train.counters").tolist()
    out = {k: progress.counters.get(k, 0.0) + v for k, v in zip(COUNTER_KEYS, summed)}
    out["density"] = out["elements_sent"] / out["elements_total"] if out["elements_total"] else 0.0
    return out


def pick_device(args) -> torch.device:
    if torch.cuda.is_available() and not args.no_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())  # one rank per GPU
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False
        return device
    return torch.device("cpu")


def load_data(args, spec: DatasetSpec):
    """Load on every rank; if any rank fails, all stop with status 2 and rank 0 says why."""
    data, error = None, None
    try:
        data = spec.load(args)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        error = f"could not load the {args.dataset} dataset: {type(exc).__name__}: {exc}"
    agree(error, "data")
    return data


def open_tensorboard(args, rank: int):
    """Rank 0's SummaryWriter for ``--tensorboard`` (imported only then); every rank stops if it is missing."""
    if not args.tensorboard:
        return None
    error, writer_class = None, None
    try:
        from torch.utils.tensorboard import SummaryWriter as writer_class
    except ImportError as exc:
        error = f"--tensorboard needs the tensorboard package ({exc}); install it with: pip install tensorboard"
    agree(error, "tensorboard")
    return writer_class(log_dir=args.tensorboard) if rank == 0 else None


def setup(args, process_start: float) -> Job:
    """Start Horovod and logging, load the data, build model, compressor, optimizer and lr scheduler."""
    init_mode = init_horovod()
    rank, world = hvd.rank(), hvd.size()
    setup_logging(rank, world)
    spec = DATASETS[args.dataset]
    device = pick_device(args)
    torch.manual_seed(args.seed)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception:  # very old torch; determinism on CPU holds anyway for the ops used here
        pass
    tensorboard = open_tensorboard(args, rank)
    train_set, test_set, vocab_size = load_data(args, spec)

    model = make_model(args, vocab_size).to(device)  # identical on every rank (same seed); broadcast anyway
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(len(sampler) / args.batch_size)
    warmup = steps_per_epoch if args.warmup_steps is None else args.warmup_steps
    horizon = args.epochs * steps_per_epoch
    opt = make_optimizer(model, make_compression(args), args, world, args.lr * world)
    schedule = dict(world=world, warmup=warmup, kind=args.lr_schedule, horizon=horizon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, **schedule))

    config = {k: getattr(args, k) for k in RESUME_KEYS
              if k not in ("world_size", "warmup_steps", "schedule_horizon")}
    config.update(world_size=world, warmup_steps=warmup,
                  # the cosine schedule depends on the planned length (--epochs); the constant one does not
                  schedule_horizon=horizon if args.lr_schedule == "cosine" else None)
    total_steps = horizon if args.max_steps is None else min(horizon, args.max_steps)
    return Job(args=args, spec=spec, rank=rank, world=world, init_mode=init_mode, device=device,
               train_set=train_set, test_set=test_set, model=model, opt=opt, scheduler=scheduler,
               sampler=sampler, steps_per_epoch=steps_per_epoch, warmup=warmup, total_steps=total_steps,
               config=config, ckpt_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
               process_start=process_start, tensorboard=tensorboard)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: save (collective, rank 0 writes), find, load with fallback
# ---------------------------------------------------------------------------------------------------------

def _step_of(path: Path) -> Optional[int]:
    try:
        return int(path.name[len("ckpt-step"):-len(".pt")])
    except ValueError:
        return None


def checkpoint_files(directory: Path) -> List[Tuple[int, Path]]:
    """``(step, path)`` of the checkpoint files in ``directory``, newest step first."""
    found = [(_step_of(p), p) for p in directory.glob(CKPT_GLOB)]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def resume_candidates(directory: Path) -> List[Path]:
    """The file ``latest`` names, then every other checkpoint, newest step first."""
    order = []
    pointer = directory / LATEST
    if pointer.is_file():
        try:
            named = directory / pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = None
        if named is not None and named.is_file():
            order.append(named)
    order += [p for _, p in checkpoint_files(directory) if p not in order]
    return order


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def remove_stale_temporaries(directory: Path) -> List[Path]:
    """Delete temporary files of saves that never finished (their process is gone)."""
    removed = []
    for pattern in TMP_GLOBS:
        for tmp in directory.glob(pattern):
            pid = tmp.name.rsplit(".tmp", 1)[-1]
            if pid.isdigit() and (int(pid) == os.getpid() or _pid_alive(int(pid))):
                continue  # ours (in use) or another live process's
            try:
                tmp.unlink()
                removed.append(tmp)
            except FileNotFoundError:
                pass
    return removed


def _write_error(path: Path, exc: BaseException) -> str:
    """'could not write checkpoint PATH: the OS error', with a hint when the disk is full."""
    os_error, e = None, exc
    while e is not None and os_error is None:  # torch.save wraps the OSError of the failed write
        os_error = e if isinstance(e, OSError) else None
        e = e.__cause__ or e.__context__
    if os_error is not None and os_error.errno is not None:
        reason = f"{os.strerror(os_error.errno)} (errno {errno.errorcode.get(os_error.errno, os_error.errno)})"
        full = os_error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    else:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            full = os.statvfs(path.parent).f_bavail == 0
        except OSError:
            full = False
    return f"could not write checkpoint {path}: {reason}" + ("; disk full?" if full else "")


def _atomic_write(path: Path, write: Callable) -> None:
    """Write through a temporary file renamed over ``path``: readers see the old file or the new one, and a
    failed write leaves no partial file (the temporary one is removed)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as f:  # unbuffered: a failed write raises its OSError inside torch.save
            write(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_checkpoint(directory: Path, ckpt: dict, keep: int) -> Path:
    """Rank 0: write ``ckpt-step{step}.pt``, point ``latest`` at it, delete stale temporaries and old files.

    Raises ``OSError`` with the message to show when the file could not be written."""
    path = directory / f"ckpt-step{ckpt['step']}.pt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for tmp in remove_stale_temporaries(directory):
            LOG.info(f"removed {tmp.name}, left by a checkpoint save that did not finish")
        _atomic_write(path, lambda f: torch.save(ckpt, f))
        _atomic_write(directory / LATEST, lambda f: f.write((path.name + "\n").encode()))
    except (OSError, RuntimeError) as exc:
        raise OSError(_write_error(path, exc)) from exc
    if keep:
        # Keep this file and the newest keep-1 before it. Files of later steps (an abandoned, damaged
        # continuation) are left alone.
        older = [p for s, p in checkpoint_files(directory) if s < ckpt["step"]]
        for old in older[keep - 1:]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
    return path


def save_checkpoint(job: Job, progress: Progress) -> None:
    """Collective (every rank calls it); rank 0 writes. If the write fails every rank stops (status 1)."""
    optimizer_state = job.opt.gather_state_dict()
    per_rank = hvd.allgather_object({"torch_rng": torch.get_rng_state(),
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
        }
        try:
            path = write_checkpoint(job.ckpt_dir, ckpt, job.args.keep_checkpoints)
        except OSError as exc:
            error = str(exc)
    error = hvd.broadcast_object(error, root_rank=0, name="train.ckpt_written")  # the others must not wait on
    if error is not None:
        if job.rank == 0:
            LOG.error(error)
        raise JobFailed(1)
    job.last_ckpt_step = progress.step
    LOG.info(f"checkpoint {path}")


def _load_error(exc: BaseException) -> str:
    text = str(exc).strip()
    if "weights_only" in text or "Weights only load failed" in text:
        return "its contents cannot be read as a checkpoint"
    first = text.split(". ")[0].splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def read_checkpoint(path: Path) -> Tuple[Optional[dict], Optional[str]]:
    """``(checkpoint, None)``, or ``(None, why it is unusable)``."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, overwritten, not a torch file: all mean "damaged" here
        return None, f"damaged ({_load_error(exc)})"
    if not isinstance(ckpt, dict) or "config" not in ckpt or "format" not in ckpt:
        return None, "damaged (not a checkpoint of this script)"
    if ckpt["format"] != CKPT_FORMAT:
        return None, f"written in checkpoint format {ckpt['format']!r}, this script reads format {CKPT_FORMAT}"
    return ckpt, None


def find_checkpoint(job: Job) -> Tuple[Optional[str], Optional[dict]]:
    """Collective: rank 0 picks the newest readable checkpoint (warning about every damaged one it skips);
    returns its path (None: start from scratch) and, on rank 0, the loaded checkpoint."""
    chosen, ckpt, error = None, None, None
    if job.rank == 0:
        candidates = resume_candidates(job.ckpt_dir) if job.ckpt_dir.is_dir() else []
        skipped = []
        for path in candidates:
            ckpt, why = read_checkpoint(path)
            if ckpt is not None:
                chosen = str(path)
                if skipped:
                    LOG.warning(f"using the previous checkpoint {path} instead of the newest")
                for bad, why in skipped:  # set aside, so they neither count as kept checkpoints nor get tried again
                    if not why.startswith("damaged"):
                        continue
                    try:
                        bad.rename(bad.with_name(bad.name + ".damaged"))
                        LOG.warning(f"renamed the damaged {bad.name} to {bad.name}.damaged")
                    except OSError:
                        pass
                break
            skipped.append((path, why))
            LOG.warning(f"checkpoint {path} is {why}; "
                        + ("trying the previous one" if path != candidates[-1] else "no other checkpoint is left"))
        if candidates and chosen is None:
            error = (f"--resume: no usable checkpoint in {job.ckpt_dir} (none of its {len(candidates)} checkpoint "
                     f"files can be read, see above); restore a good copy, or remove them to start from scratch")
        elif not candidates:
            LOG.info(f"--resume: no checkpoint in {job.ckpt_dir}; starting from scratch")
    chosen, error = hvd.broadcast_object((chosen, error), root_rank=0, name="train.resume_path")
    if error is not None:
        if job.rank == 0:
            LOG.error(error)
        raise JobFailed(2)
    return chosen, ckpt


def resume(job: Job) -> Progress:
    """Restore a run from ``--checkpoint-dir`` (``--resume``) or broadcast rank 0's fresh state."""
    progress = Progress(counters={k: 0.0 for k in COUNTER_KEYS})
    path, ckpt = find_checkpoint(job) if job.args.resume else (None, None)
    if path is None:
        hvd.broadcast_parameters(job.model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(job.opt, root_rank=0)
        return progress
    error = None
    if ckpt is None:  # ranks other than 0 read the file rank 0 chose
        ckpt, why = read_checkpoint(Path(path))
        error = None if ckpt is not None else f"checkpoint {path} is {why}"
    agree(error, "resume_read")
    diffs = [f"{k}: checkpoint {ckpt['config'].get(k)!r}, now {job.config[k]!r}" for k in RESUME_KEYS
             if ckpt["config"].get(k) != job.config[k]]
    if diffs:
        if job.rank == 0:
            LOG.error(f"cannot resume from {path}, the run settings differ: " + "; ".join(diffs))
        raise JobFailed(2)
    job.model.load_state_dict(ckpt["model"])
    job.opt.load_state_dict(ckpt["optimizer"])  # every rank picks its own residuals
    job.scheduler.load_state_dict(ckpt["lr_scheduler"])
    for group, lr in zip(job.opt.param_groups, job.scheduler.get_last_lr()):
        group["lr"] = lr
    torch.set_rng_state(ckpt["rng"]["torch"][job.rank])
    cuda_states = ckpt["rng"].get("cuda") or []
    if job.device.type == "cuda" and job.rank < len(cuda_states) and cuda_states[job.rank] is not None:
        torch.cuda.set_rng_state(cuda_states[job.rank])
    progress.step, progress.epoch, progress.batch = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["batch_in_epoch"])
    progress.loss_sum, progress.loss_count = float(ckpt["train_loss_sum"][job.rank]), int(ckpt["train_loss_count"])
    progress.counters = {k: float(ckpt["counters"][k]) for k in COUNTER_KEYS}
    progress.wall_offset = float(ckpt["wall_time"])
    job.last_ckpt_step = progress.step
    LOG.info(f"resumed from {path} at step {progress.step} "
             f"(epoch {progress.epoch + 1}, batch {progress.batch}/{job.steps_per_epoch})")
    return progress


# ---------------------------------------------------------------------------------------------------------
# Progress: a live bar in a terminal, else timed log lines
# ---------------------------------------------------------------------------------------------------------

def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def use_live_bar(args, world: int) -> bool:
    """A redrawn bar needs rank 0's stderr to be a terminal and no launcher tagging or collecting output."""
    if args.no_progress:
        return False
    if args.progress:
        return True
    launched = any(v in os.environ for v in HOROVODRUN_VARS) or (
        world > 1 and any(v in os.environ for v in LAUNCHER_RANK_VARS))
    if world > 1 or launched or not sys.stderr.isatty() or os.environ.get("TERM", "") in ("", "dumb"):
        return False
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns >= 40  # 0: a pseudo-terminal with no size
    except (OSError, ValueError):
        return False


class ProgressReport:
    """Rank 0's progress: the live bar, or a line every ``--log-every`` seconds and at each epoch end."""

    def __init__(self, job: Job, progress: Progress) -> None:
        self.job = job
        self.every = job.args.log_every
        self.bar = None
        self.start_step = progress.step
        self.start = self.window_start = time.time()
        self.window_steps, self.window_loss = 0, 0.0
        if job.rank == 0 and use_live_bar(job.args, job.world):
            from tqdm import tqdm
            self.bar = tqdm(total=job.total_steps, initial=min(progress.step, job.total_steps), unit="step",
                            file=sys.stderr, dynamic_ncols=True)
            for h in LOG.handlers:
                h.bar = self.bar

    def step(self, progress: Progress, loss: float) -> None:
        if self.job.rank != 0:
            return
        self.window_steps += 1
        self.window_loss += loss
        if self.bar is not None:
            rate = self.window_steps * self.job.args.batch_size * self.job.world / max(time.time() - self.window_start, 1e-9)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:.0f}", refresh=False)
        elif self.every and time.time() - self.window_start >= self.every:
            self.line(progress)

    def line(self, progress: Progress) -> None:
        """One progress line (rank 0, no bar): rank 0's own counters, no collective."""
        if self.job.rank != 0 or self.bar is not None or not self.window_steps:
            return
        job, now = self.job, time.time()
        rate = self.window_steps * job.args.batch_size * job.world / max(now - self.window_start, 1e-9)
        done = progress.step - self.start_step
        eta = (job.total_steps - progress.step) * (now - self.start) / done if done else 0.0
        stats = job.opt.stats()
        traffic = ""
        if stats["bytes_dense"]:
            traffic = (f" | sent {_mb(stats['bytes_sent'])} vs dense {_mb(stats['bytes_dense'])}, "
                       f"density {stats['density']:.4f} (rank 0)")
        LOG.info(f"step {progress.step}/{job.total_steps} epoch {progress.epoch + 1}/{job.args.epochs} "
                 f"loss {self.window_loss / self.window_steps:.4f} | {rate:.0f} samples/s | "
                 f"ETA {_duration(eta)}{traffic}")
        self.window_start, self.window_steps, self.window_loss = now, 0, 0.0

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            for h in LOG.handlers:
                h.bar = None
            self.bar = None


def tensorboard_step(job: Job, progress: Progress, loss: float, lr: float) -> None:
    tb = job.tensorboard
    if tb is None:
        return
    stats = job.opt.stats()  # rank 0's own counters (no collective on one rank's schedule)
    tb.add_scalar("train/loss", loss, progress.step)
    tb.add_scalar("train/learning_rate", lr, progress.step)
    tb.add_scalar("compression/bytes_sent", stats["bytes_sent"], progress.step)
    tb.add_scalar("compression/bytes_dense", stats["bytes_dense"], progress.step)
    tb.add_scalar("compression/density", stats["density"], progress.step)
    tb.add_scalar("compression/compress_seconds", stats["compress_seconds"], progress.step)


def tensorboard_record(job: Job, res: dict) -> None:
    tb = job.tensorboard
    if tb is None:
        return
    step = res["step"]
    for key in ("test_loss", job.spec.metric):
        if res.get(key) is not None:
            tb.add_scalar(f"test/{key[len('test_'):]}", res[key], step)
    densities = [t["density"] for t in job.opt.stats()["tensors"].values()]
    if densities:
        tb.add_histogram("compression/layer_density", torch.tensor(densities, dtype=torch.float64), step)
    tb.flush()


# ---------------------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------------------

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
        logits = model(x)
        loss_sum += float(compute_loss(logits, y, reduction="sum"))
        correct += float((logits.argmax(dim=-1) == y).sum())
        count += y.numel()
    model.train()
    totals = hvd.allreduce(torch.tensor([loss_sum, correct, count], dtype=torch.float64), op=hvd.Sum,
                           name="train.eval")
    return job.spec.score(*totals.tolist())


def _finite(x):
    return x if not isinstance(x, float) or math.isfinite(x) else None


def _fmt(x, spec: str = ".4f") -> str:
    return "nan" if x is None else format(x, spec)


def record(job: Job, progress: Progress, final: bool) -> dict:
    """Collective: evaluate and aggregate; rank 0 writes the metrics line (the final one in ``report``)."""
    args = job.args
    train_loss = hvd.allreduce(torch.tensor([progress.loss_sum, float(progress.loss_count)], dtype=torch.float64),
                               op=hvd.Sum, name="train.loss").tolist()
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
    opt = job.opt
    opt.zero_grad()
    loss = compute_loss(job.model(x), y)
    loss.backward()
    if job.args.clip_grad:
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(job.model.parameters(), job.args.clip_grad)
        with opt.skip_synchronize():
            opt.step()
    else:
        opt.step()
    job.scheduler.step()
    return float(loss.detach())


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
        progress.batch += 1
        progress.loss_sum += loss
        progress.loss_count += 1
        report.step(progress, loss)
        tensorboard_step(job, progress, loss, lr)
        epoch_done = progress.batch == job.steps_per_epoch
        if epoch_done:
            report.line(progress)
            res = record(job, progress, final=progress.step >= job.total_steps or progress.epoch + 1 >= args.epochs)
            LOG.info(f"epoch {progress.epoch + 1}: train loss {_fmt(res['train_loss'])}, {job.spec.describe(res)}, "
                     f"test loss {_fmt(res['test_loss'])}, {res['wall_time']:.1f} s")
            progress.epoch, progress.batch = progress.epoch + 1, 0
            progress.loss_sum, progress.loss_count = 0.0, 0
        if job.ckpt_dir is not None and args.checkpoint_every and progress.step % args.checkpoint_every == 0 \
                and progress.step < job.total_steps:
            save_checkpoint(job, progress)
        if epoch_done:
            return


def report(job: Job, progress: Progress) -> dict:
    """The run's summary: written as the last metrics line, to ``--summary-json`` and as the final log line."""
    res = dict(job.last_record)
    res["total_seconds"] = time.time() - job.process_start
    if job.rank != 0:
        return res
    text = json.dumps(res)
    if job.metrics_file is not None:
        job.metrics_file.write(text + "\n")
        job.metrics_file.flush()
    if job.args.summary_json:
        path = Path(job.args.summary_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    if res["bytes_dense"]:
        factor = res["bytes_dense"] / res["bytes_sent"] if res["bytes_sent"] else float("inf")
        traffic = (f"bytes sent {_mb(res['bytes_sent'])} vs dense {_mb(res['bytes_dense'])} "
                   f"({factor:.1f}x less), density {res['density']:.4f}")
    else:
        traffic = "no gradient communication (one process)"
    label = job.spec.describe(res)
    LOG.info(f"Final {label} (test loss {_fmt(res['test_loss'])}) after {progress.step} steps "
             f"({progress.step / job.steps_per_epoch:.2f} epochs) in {res['wall_time']:.1f} s of training "
             f"({res['total_seconds']:.1f} s total); {traffic}")
    if job.args.print_final_json:
        LOG.info("FINAL " + text)
    return res


def train(job: Job, progress: Progress) -> dict:
    args = job.args
    sparse = "dense" if hat.Compression.is_dense_name(args.compressor) else (
        f"rank {args.powersgd_rank}" if args.compressor == "powersgd" else
        f"ratio {args.ratio}" + (", momentum correction" if args.momentum_correction else ""))
    LOG.info(f"{args.dataset}/{args.model}: {job.world} rank(s) ({job.init_mode} init, {job.device.type}), "
             f"compressor {args.compressor} ({sparse}), batch {args.batch_size}/rank, lr {args.lr} x {job.world} "
             f"(warm-up {job.warmup} steps, {args.lr_schedule}), {job.steps_per_epoch} steps/epoch, "
             f"training to step {job.total_steps}")
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
    if job.last_record is None or job.last_record["step"] != progress.step:
        record(job, progress, final=True)
    if job.ckpt_dir is not None and job.last_ckpt_step != progress.step:
        save_checkpoint(job, progress)
    return report(job, progress)


def main(argv=None) -> int:
    process_start = time.time()
    args = parse_args(argv)
    job = None
    try:
        job = setup(args, process_start)
        progress = resume(job)
        train(job, progress)
    except JobFailed as failed:
        return failed.status
    finally:
        if job is not None:
            if job.metrics_file is not None:
                job.metrics_file.close()
            if job.tensorboard is not None:
                job.tensorboard.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
