#!/usr/bin/env python
"""Data-parallel training with sparse gradient compression (horovod_adtopk).

Launch one process per slot with any of::

    horovodrun -np 2 python examples/train.py --dataset fashion-mnist --compressor adtopk --ratio 0.01 --epochs 1
    mpirun -np 2 python examples/train.py ...          # plain MPI launcher (Horovod built with MPI)
    srun python examples/train.py ...                  # Slurm (see examples/slurm_train.sbatch)
    python examples/train.py ...                       # a single process

Conventions follow Horovod's PyTorch examples: a ``DistributedSampler`` per rank (reshuffled per epoch
through ``set_epoch``), the learning rate scaled by the number of ranks with a linear warm-up, the
initial state broadcast from rank 0, metrics averaged over ranks, printing and checkpoints on rank 0.

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
with every rank's compression state (error-feedback residuals), every rank's RNG state and the cumulative
counters. A resumed run reproduces the parameters of an uninterrupted one bit for bit (CPU, fixed seed,
same number of ranks).

Output on rank 0: a progress bar (TTY only, or ``--progress``) or a log line every ``--log-every``
steps, one JSON line per epoch in ``--metrics-out`` (plus one when ``--max-steps`` stops mid-epoch), a
summary, and a last line ``FINAL {json}`` for scripts.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import horovod_adtopk as hat  # noqa: E402
import datasets  # noqa: E402  (examples/datasets.py, beside this script)
from models import build_model  # noqa: E402  (examples/models.py)

CKPT_FORMAT = 1
LATEST = "latest"
DATASET_MODELS = {"fashion-mnist": ("cnn", "resnet"), "shakespeare": ("lstm",)}
# Per-dataset defaults for the flags left unset (None) on the command line.
DATASET_DEFAULTS = {
    "fashion-mnist": {"batch_size": 64, "lr": 0.1, "clip_grad": 0.0},
    "shakespeare": {"batch_size": 32, "lr": 0.5, "clip_grad": 1.0},
}
VALUE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DENSE_COMPRESSORS = ("none", "fp16")
# Settings a checkpoint must share with the resuming run, or the continuation would not be the same run.
RESUME_KEYS = ("dataset", "model", "compressor", "ratio", "value_dtype", "threshold", "min_numel", "momentum_correction",
               "batch_size", "lr",
               "momentum", "weight_decay", "lr_schedule", "schedule_horizon", "warmup_steps", "clip_grad", "seed", "seq_len", "lstm_hidden",
               "lstm_layers", "world_size")


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------

def _compressor_name(text: str) -> str:
    return text.strip().lower().replace("-", "_")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=sorted(DATASET_MODELS), default="fashion-mnist")
    p.add_argument("--model", default=None,
                   help="cnn or resnet for fashion-mnist, lstm for shakespeare (default: cnn / lstm)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: the installed data)")
    p.add_argument("--compressor", type=_compressor_name, default="adtopk", choices=hat.Compression.names())
    p.add_argument("--ratio", type=float, default=0.01, help="density of the sparse compressors")
    p.add_argument("--value-dtype", choices=sorted(VALUE_DTYPES), default=None,
                   help="dtype of the sent values (sparse compressors; default: the gradient's dtype)")
    p.add_argument("--threshold", type=float, default=None, help="magnitude threshold of --compressor threshold")
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
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--metrics-out", default=None, help="JSONL file of per-epoch metrics (rank 0 writes it)")
    p.add_argument("--log-every", type=int, default=100, help="log line every N steps when there is no progress bar")
    p.add_argument("--progress", action="store_true", help="show the progress bar even when stdout is not a TTY")
    p.add_argument("--no-progress", action="store_true", help="never show the progress bar")
    args = p.parse_args(argv)

    allowed = DATASET_MODELS[args.dataset]
    args.model = (args.model or allowed[0]).lower()
    if args.model not in allowed:
        p.error(f"--model {args.model} does not fit --dataset {args.dataset}; choose {' or '.join(allowed)}")
    for key, value in DATASET_DEFAULTS[args.dataset].items():
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
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        p.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error("--warmup-steps must be >= 0")
    if args.compressor in DENSE_COMPRESSORS:
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
        if args.momentum_correction is None:
            args.momentum_correction = True
        if args.momentum_correction and not 0.0 <= args.momentum < 1.0:
            p.error("--momentum-correction needs --momentum in [0, 1)")
        args.momentum_correction = bool(args.momentum_correction and args.momentum > 0)
    return args


# ---------------------------------------------------------------------------------------------------------
# Horovod start-up
# ---------------------------------------------------------------------------------------------------------

HOROVODRUN_VARS = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_CONTROLLER")
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS")


def init_horovod() -> str:
    """``hvd.init()`` under horovodrun (or alone); over ``MPI.COMM_WORLD`` under mpirun / srun."""
    if not any(v in os.environ for v in HOROVODRUN_VARS) and any(v in os.environ for v in MPI_LAUNCHER_VARS):
        from mpi4py import MPI  # initialises MPI (thread level "multiple", as Horovod needs)
        hvd.init(comm=MPI.COMM_WORLD)
        return "mpi4py"
    hvd.init()
    return "horovod"


# ---------------------------------------------------------------------------------------------------------
# Data, model, compression
# ---------------------------------------------------------------------------------------------------------

def load_data(args) -> Tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset, Optional[int]]:
    if args.dataset == "fashion-mnist":
        train, test = datasets.load_fashion_mnist(args.data_dir)
        return train, test, None
    return datasets.load_shakespeare(args.data_dir, seq_len=args.seq_len)


def load_data_everywhere(args, rank: int):
    """Load on every rank; if any rank fails, all exit with status 2 and rank 0 prints why."""
    error = None
    data = None
    try:
        data = load_data(args)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    errors = hvd.allgather_object(error, name="train.data_errors")
    if any(e is not None for e in errors):
        if rank == 0:
            seen = []
            for r, e in enumerate(errors):
                if e is not None and e not in seen:
                    seen.append(e)
                    where = "" if hvd.size() == 1 else f" (rank {r})"
                    print(f"error: could not load the {args.dataset} dataset{where}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    return data


def make_model(args, vocab_size: Optional[int]) -> torch.nn.Module:
    if args.model == "lstm":
        return build_model("lstm", vocab_size=vocab_size, hidden=args.lstm_hidden, layers=args.lstm_layers)
    return build_model(args.model)


def make_compression(args):
    if args.compressor in DENSE_COMPRESSORS:
        return hat.Compression.get(args.compressor)
    kwargs = {"ratio": args.ratio, "value_dtype": VALUE_DTYPES.get(args.value_dtype)}
    if args.compressor == "threshold":
        kwargs["threshold"] = args.threshold
    if args.min_numel is not None:
        kwargs["min_numel"] = args.min_numel
    if args.momentum_correction:
        kwargs["momentum"] = args.momentum
    cls = getattr(hat.Compression, args.compressor)
    if "seed" in inspect.signature(cls.__init__).parameters:
        kwargs["seed"] = args.seed  # identical on every rank (Random-k draws the same positions everywhere)
    return hat.Compression.get(args.compressor, **kwargs)


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
                                   backward_passes_per_step=1, op=hvd.Average)
    if args.momentum_correction and world > 1:
        actual = {n for n, t in opt.stats()["tensors"].items() if t["path"] == "sparse"}
        if actual != sparse:
            raise RuntimeError(f"sparse-path parameters disagree: expected {sorted(sparse)}, got {sorted(actual)}")
    return opt


class LRSchedule:
    """Learning rate as a pure function of the optimizer step, so a resumed run follows the same schedule.

    Linear warm-up from ``lr`` to ``lr * world`` over ``warmup`` steps (Goyal et al., as in Horovod's
    examples), times a decay factor: 1 (``constant``) or ``0.5 (1 + cos(pi step / horizon))`` (``cosine``,
    annealing to 0 at the end of ``--epochs``).
    """

    def __init__(self, base_lr: float, world: int, warmup: int, kind: str, horizon: int) -> None:
        self.base_lr, self.world, self.warmup, self.kind, self.horizon = base_lr, world, warmup, kind, horizon

    def __call__(self, step: int) -> float:
        target = self.base_lr * self.world
        lr = target if self.warmup <= 0 or step >= self.warmup else \
            self.base_lr + (target - self.base_lr) * step / self.warmup
        if self.kind == "cosine":
            lr *= 0.5 * (1.0 + math.cos(math.pi * min(step, self.horizon) / self.horizon))
        return lr

    def state_dict(self) -> dict:
        return {"kind": self.kind, "base_lr": self.base_lr, "world_size": self.world, "warmup_steps": self.warmup,
                "horizon": self.horizon}


def compute_loss(logits: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if logits.dim() == 3:  # language model: [B, T, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction=reduction)
    return F.cross_entropy(logits, target, reduction=reduction)


@torch.no_grad()
def evaluate(model, test_set, args, rank: int, world: int, device: torch.device) -> Dict[str, float]:
    """Each rank scores its share (rank::world) of the test set; sums are allreduced."""
    model.eval()
    x_all, y_all = test_set.tensors
    mine = torch.arange(rank, len(test_set), world)
    n_batches = math.ceil(mine.numel() / args.test_batch_size)
    if args.test_batches is not None:
        n_batches = min(n_batches, args.test_batches)
    loss_sum = correct = count = 0.0
    for b in range(n_batches):
        idx = mine[b * args.test_batch_size:(b + 1) * args.test_batch_size]
        x, y = x_all[idx].to(device), y_all[idx].to(device)
        logits = model(x)
        loss_sum += float(compute_loss(logits, y, reduction="sum"))
        correct += float((logits.argmax(dim=-1) == y).sum())
        count += y.numel()
    model.train()
    totals = hvd.allreduce(torch.tensor([loss_sum, correct, count], dtype=torch.float64), op=hvd.Sum,
                           name="train.eval")
    loss_sum, correct, count = totals.tolist()
    test_loss = loss_sum / count if count else float("nan")
    out = {"test_loss": test_loss, ("test_tokens" if args.dataset == "shakespeare" else "test_examples"): int(count)}
    if args.dataset == "shakespeare":
        out["test_perplexity"] = math.exp(min(test_loss, 700.0)) if count else float("nan")
        out["test_char_accuracy"] = correct / count if count else float("nan")
    else:
        out["test_accuracy"] = correct / count if count else float("nan")
    return out


# ---------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------

def run_config(args, schedule: LRSchedule) -> dict:
    cfg = {k: getattr(args, k) for k in RESUME_KEYS if k not in ("world_size", "warmup_steps", "schedule_horizon")}
    cfg["world_size"] = schedule.world
    cfg["warmup_steps"] = schedule.warmup
    # The cosine schedule depends on the planned length (--epochs); the constant one does not.
    cfg["schedule_horizon"] = schedule.horizon if schedule.kind == "cosine" else None
    return cfg


def latest_checkpoint(directory: Path) -> Optional[Path]:
    pointer = directory / LATEST
    if pointer.is_file():
        path = directory / pointer.read_text().strip()
        if path.is_file():
            return path
    found = []
    for p in directory.glob("ckpt-step*.pt"):
        try:
            found.append((int(p.stem[len("ckpt-step"):]), p))
        except ValueError:
            continue
    return max(found)[1] if found else None


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


class Counters:
    """Cumulative totals over ranks, carried across resumes through the checkpoint."""

    KEYS = ("bytes_sent", "bytes_dense", "elements_sent", "elements_total")

    def __init__(self) -> None:
        self.offset = {k: 0.0 for k in self.KEYS}

    def totals(self, opt) -> Dict[str, float]:
        """Collective: this process's counters summed over ranks, plus the carried offset."""
        s = opt.stats()
        local = torch.tensor([float(s[k]) for k in self.KEYS], dtype=torch.float64)
        summed = hvd.allreduce(local, op=hvd.Sum, name="train.counters").tolist()
        out = {k: self.offset[k] + v for k, v in zip(self.KEYS, summed)}
        out["density"] = out["elements_sent"] / out["elements_total"] if out["elements_total"] else 0.0
        return out


def save_checkpoint(directory: Path, *, rank, step, epoch, batch, model, opt, config, lr_state, counters_now, wall_time,
                    loss_sum, loss_count) -> Optional[Path]:
    """Collective (every rank calls it); rank 0 writes ``ckpt-step{step}.pt`` and points ``latest`` at it."""
    optimizer_state = opt.gather_state_dict()
    per_rank = hvd.allgather_object({"torch_rng": torch.get_rng_state(),
                                     "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
                                     "loss_sum": float(loss_sum)},
                                    name="train.ckpt_rank_state")
    if rank != 0:
        return None
    ckpt = {
        "format": CKPT_FORMAT,
        "step": step,
        "epoch": epoch,
        "batch_in_epoch": batch,
        "model": model.state_dict(),
        "optimizer": optimizer_state,
        "lr_scheduler": lr_state,
        "rng": {"torch": [r["torch_rng"] for r in per_rank], "cuda": [r["cuda_rng"] for r in per_rank]},
        "train_loss_sum": [r["loss_sum"] for r in per_rank],
        "train_loss_count": int(loss_count),
        "counters": {k: float(counters_now[k]) for k in Counters.KEYS},
        "wall_time": float(wall_time),
        "config": config,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-step{step}.pt"
    _atomic_write(path, lambda tmp: torch.save(ckpt, tmp))
    _atomic_write(directory / LATEST, lambda tmp: tmp.write_text(path.name + "\n"))
    return path


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------

def _finite(x):
    return x if not isinstance(x, float) or math.isfinite(x) else None


def _fmt(x, spec: str = ".4f") -> str:
    return "nan" if x is None else format(x, spec)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def main(argv=None) -> int:
    process_start = time.time()
    args = parse_args(argv)
    init_mode = init_horovod()
    rank, world = hvd.rank(), hvd.size()
    log = print if rank == 0 else (lambda *a, **k: None)

    device = torch.device("cpu")
    if torch.cuda.is_available() and not args.no_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())  # one rank per GPU
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(args.seed)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception:  # very old torch; determinism on CPU holds anyway for the ops used here
        pass

    train_set, test_set, vocab_size = load_data_everywhere(args, rank)

    model = make_model(args, vocab_size).to(device)  # identical on every rank (same seed); broadcast anyway
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(len(sampler) / args.batch_size)
    warmup = steps_per_epoch if args.warmup_steps is None else args.warmup_steps
    schedule = LRSchedule(args.lr, world, warmup, args.lr_schedule, args.epochs * steps_per_epoch)
    config = run_config(args, schedule)

    compression = make_compression(args)
    opt = make_optimizer(model, compression, args, world, schedule(0))

    step = epoch = batch = 0
    loss_sum, loss_count = 0.0, 0
    counters = Counters()
    wall_offset = 0.0
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    resume_from = None
    if args.resume:
        found = latest_checkpoint(ckpt_dir) if rank == 0 and ckpt_dir.is_dir() else None
        resume_from = hvd.broadcast_object(str(found) if found else None, root_rank=0, name="train.resume_path")
        if resume_from is None:
            log(f"--resume: no checkpoint in {ckpt_dir}; starting from scratch", flush=True)
    if resume_from is not None:
        ckpt = torch.load(resume_from, map_location="cpu", weights_only=True)
        if ckpt.get("format") != CKPT_FORMAT:
            raise SystemExit(f"{resume_from}: unknown checkpoint format {ckpt.get('format')!r}")
        diffs = [f"{k}: checkpoint {ckpt['config'].get(k)!r}, now {config[k]!r}" for k in RESUME_KEYS
                 if ckpt["config"].get(k) != config[k]]
        if diffs:
            if rank == 0:
                print(f"error: cannot resume from {resume_from}, the run settings differ: " + "; ".join(diffs),
                      file=sys.stderr, flush=True)
            sys.exit(2)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])  # every rank picks its own residuals
        torch.set_rng_state(ckpt["rng"]["torch"][rank])
        cuda_states = ckpt["rng"].get("cuda") or []
        if device.type == "cuda" and rank < len(cuda_states) and cuda_states[rank] is not None:
            torch.cuda.set_rng_state(cuda_states[rank])
        step, epoch, batch = int(ckpt["step"]), int(ckpt["epoch"]), int(ckpt["batch_in_epoch"])
        loss_sum, loss_count = float(ckpt["train_loss_sum"][rank]), int(ckpt["train_loss_count"])
        counters.offset = {k: float(ckpt["counters"][k]) for k in Counters.KEYS}
        wall_offset = float(ckpt["wall_time"])
        log(f"resumed from {resume_from} at step {step} (epoch {epoch + 1}, batch {batch}/{steps_per_epoch})",
            flush=True)
        del ckpt
    else:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)
    sparse_desc = "dense" if args.compressor in DENSE_COMPRESSORS else (
        f"ratio {args.ratio}" + (", momentum correction" if args.momentum_correction else ""))
    log(f"{args.dataset}/{args.model}: {world} rank(s) ({init_mode} init, {device.type}), compressor {args.compressor} "
        f"({sparse_desc}), batch {args.batch_size}/rank, lr {args.lr} x {world} (warm-up {warmup} steps, "
        f"{args.lr_schedule}), "
        f"{steps_per_epoch} steps/epoch, training to step {total_steps}", flush=True)

    show_bar = rank == 0 and not args.no_progress and (args.progress or sys.stdout.isatty())
    bar = None
    if show_bar:
        from tqdm import tqdm
        bar = tqdm(total=total_steps, initial=min(step, total_steps), unit="step", file=sys.stdout,
                   dynamic_ncols=True)

    def say(text: str) -> None:
        if rank != 0:
            return
        if bar is not None:
            bar.write(text)
        else:
            print(text, flush=True)

    metrics_file = None
    if rank == 0 and args.metrics_out:
        Path(args.metrics_out).parent.mkdir(parents=True, exist_ok=True)
        metrics_file = open(args.metrics_out, "a" if resume_from is not None else "w")

    x_train, y_train = train_set.tensors
    train_start = time.time()
    window_start, window_steps = time.time(), 0
    last_ckpt_step = step if resume_from is not None else None
    last_record = None

    def wall() -> float:
        return wall_offset + time.time() - train_start

    def record(final: bool) -> dict:
        """Collective: evaluate, aggregate, write one metrics line (rank 0)."""
        nonlocal last_record
        train_loss = hvd.allreduce(torch.tensor([loss_sum, float(loss_count)], dtype=torch.float64), op=hvd.Sum,
                                   name="train.loss").tolist()
        res = {"epoch": epoch + 1 if batch else epoch, "epoch_progress": step / steps_per_epoch, "step": step,
               "train_loss": train_loss[0] / train_loss[1] if train_loss[1] else None}
        res.update(evaluate(model, test_set, args, rank, world, device))
        res["wall_time"] = wall()
        res.update(counters.totals(opt))
        res.update({"compressor": args.compressor, "ratio": args.ratio, "value_dtype": args.value_dtype,
                    "world_size": world, "dataset": args.dataset, "model": args.model, "final": final})
        res = {k: _finite(v) for k, v in res.items()}
        if metrics_file is not None:
            metrics_file.write(json.dumps(res) + "\n")
            metrics_file.flush()
        last_record = res
        return res

    def checkpoint():
        nonlocal last_ckpt_step
        path = save_checkpoint(ckpt_dir, rank=rank, step=step, epoch=epoch, batch=batch, model=model, opt=opt,
                               config=config, lr_state=schedule.state_dict(), counters_now=counters.totals(opt), wall_time=wall(),
                               loss_sum=loss_sum, loss_count=loss_count)
        last_ckpt_step = step
        if path is not None:
            say(f"checkpoint {path}")

    model.train()
    while step < total_steps and epoch < args.epochs:
        sampler.set_epoch(epoch)
        order = torch.as_tensor(list(iter(sampler)), dtype=torch.int64)
        while batch < steps_per_epoch and step < total_steps:
            idx = order[batch * args.batch_size:(batch + 1) * args.batch_size]
            x, y = x_train[idx].to(device, non_blocking=True), y_train[idx].to(device, non_blocking=True)
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            opt.zero_grad()
            loss = compute_loss(model(x), y)
            loss.backward()
            if args.clip_grad:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            step += 1
            batch += 1
            window_steps += 1
            value = float(loss.detach())
            loss_sum += value
            loss_count += 1
            if rank == 0 and (bar is not None or (args.log_every and step % args.log_every == 0)):
                rate = window_steps * args.batch_size * world / max(time.time() - window_start, 1e-9)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{value:.4f}", samples_per_s=f"{rate:.0f}", refresh=False)
                else:
                    print(f"step {step}/{total_steps} epoch {epoch + 1} loss {value:.4f} "
                          f"{rate:.0f} samples/s", flush=True)
                    window_start, window_steps = time.time(), 0
            if batch == steps_per_epoch:
                res = record(final=step >= total_steps or epoch + 1 >= args.epochs)
                main_metric = (f"test accuracy {_fmt(res['test_accuracy'])}" if "test_accuracy" in res
                               else f"test perplexity {_fmt(res['test_perplexity'], '.3f')}")
                say(f"epoch {epoch + 1}: train loss {_fmt(res['train_loss'])}, {main_metric}, "
                    f"test loss {_fmt(res['test_loss'])}, {res['wall_time']:.1f} s")
                epoch, batch = epoch + 1, 0
                loss_sum, loss_count = 0.0, 0
            if ckpt_dir is not None and args.checkpoint_every and step % args.checkpoint_every == 0 \
                    and step < total_steps:
                checkpoint()
            if batch == 0:  # epoch finished: reshuffle through sampler.set_epoch for the next one
                break
        if batch:  # --max-steps stopped inside the epoch
            break

    if bar is not None:
        bar.close()
    if last_record is None or last_record["step"] != step:
        record(final=True)
    if ckpt_dir is not None and last_ckpt_step != step:
        checkpoint()

    res = dict(last_record)
    res["total_seconds"] = time.time() - process_start
    if rank == 0:
        if "test_accuracy" in res:
            acc = res["test_accuracy"]
            headline = f"test accuracy {_fmt(None if acc is None else 100 * acc, '.2f')}%"
        else:
            headline = f"test perplexity {_fmt(res['test_perplexity'], '.3f')}"
        if res["bytes_dense"]:
            factor = res["bytes_dense"] / res["bytes_sent"] if res["bytes_sent"] else float("inf")
            traffic = (f"bytes sent {_mb(res['bytes_sent'])} vs dense {_mb(res['bytes_dense'])} "
                       f"({factor:.1f}x less), density {res['density']:.4f}")
        else:
            traffic = "no gradient communication (one process)"
        print(f"Final {headline} (test loss {_fmt(res['test_loss'])}) after {step} steps "
              f"({step / steps_per_epoch:.2f} epochs) in {res['wall_time']:.1f} s of training "
              f"({res['total_seconds']:.1f} s total); {traffic}", flush=True)
        print("FINAL " + json.dumps(res), flush=True)
    if metrics_file is not None:
        metrics_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
