"""Set-up: start the engine and logging, pick the device, load the data, build model, optimizer and the
learning-rate schedule; everything a run needs, in one ``Job``."""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

from .board import open_tensorboard
from .common import agree
from .data import DATASETS, DatasetSpec, make_model
from .optim import start_engine
from .logs import setup_logging
from .resume import RESUME_KEYS
from .state import Job


def lr_factor(step: int, world: int, warmup: int, kind: str, horizon: int, scaled: bool = True) -> float:
    """Multiplier of the peak rate at optimizer step ``step`` (a pure function of the step).

    ``scaled`` (SGD): the peak is ``lr * world``, reached by a linear warm-up from ``lr`` over ``warmup`` steps
    (Goyal et al., as in Horovod's examples). Not ``scaled`` (AdamW, whose update size does not grow with the
    batch the way SGD's does): the peak is ``lr``, reached linearly from ``lr / warmup``. Either way times 1
    (``constant``) or ``0.5 (1 + cos(pi step / horizon))`` (``cosine``, annealing to 0 at the end of
    ``--epochs``).
    """
    if warmup <= 0 or step >= warmup:
        factor = 1.0
    elif scaled:
        factor = (1.0 + (world - 1) * step / warmup) / world
    else:
        factor = (step + 1) / warmup
    if kind == "cosine":
        factor *= 0.5 * (1.0 + math.cos(math.pi * min(step, horizon) / horizon))
    return factor


def pick_device(args: argparse.Namespace, local_rank: int) -> torch.device:
    """One GPU per rank (by local rank) unless ``--no-cuda`` or there is none; else the CPU."""
    if torch.cuda.is_available() and not args.no_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        device = torch.device("cuda", local_rank % torch.cuda.device_count())  # one rank per GPU
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = False
        return device
    return torch.device("cpu")


def load_data(args: argparse.Namespace, spec: DatasetSpec, engine) -> tuple:
    """Load on every rank; if any rank fails, all stop with status 2 and rank 0 says why."""
    data, error = None, None
    try:
        data = spec.load(args)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        error = f"could not load the {args.dataset} dataset: {type(exc).__name__}: {exc}"
    if getattr(args, "elastic", False) and args.engine == "horovod":
        # under hvd.elastic.run a worker that joins later runs this alone, while the others wait in the state's
        # sync: no collective may run before the elastic loop, so a failure stops this rank only
        if error is not None:
            raise SystemExit(f"error: {error}")
        return data
    agree(engine, error, "data")
    return data


def setup(args: argparse.Namespace, process_start: float) -> Job:
    """Start the engine and logging, load the data, build model, compressor, optimizer and lr scheduler."""
    engine = start_engine(args)
    rank, world = engine.rank, engine.size
    setup_logging(rank, world)
    spec = DATASETS[args.dataset]
    device = pick_device(args, engine.local_rank)
    torch.manual_seed(args.seed)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
    except Exception:  # very old torch; determinism on CPU holds anyway for the ops used here
        pass
    tensorboard = open_tensorboard(args, engine)
    train_set, test_set, vocab_size = load_data(args, spec, engine)
    if getattr(args, "train_samples", None) is not None:
        train_set = torch.utils.data.TensorDataset(*(t[:args.train_samples] for t in train_set.tensors))

    # identical on every rank (same seed); broadcast anyway. The DDP engine wraps it in DistributedDataParallel.
    model = engine.wrap_model(make_model(args, vocab_size).to(device))
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(len(sampler) / args.batch_size)
    warmup = steps_per_epoch if args.warmup_steps is None else args.warmup_steps
    horizon = args.epochs * steps_per_epoch
    # SGD's peak rate is scaled by the number of ranks; AdamW's is not, nor is the inner optimizer's with local
    # steps (each rank steps on its own batch, at the one-rank rate)
    scaled = args.optimizer == "sgd" and not getattr(args, "sync_every", 0)
    opt = engine.make_optimizer(model, args, args.lr * world if scaled else args.lr)
    schedule = dict(world=world, warmup=warmup, kind=args.lr_schedule, horizon=horizon, scaled=scaled)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, **schedule))

    config = {k: getattr(args, k) for k in RESUME_KEYS
              if k not in ("world_size", "warmup_steps", "schedule_horizon")}
    config.update(world_size=world, warmup_steps=warmup,
                  # the cosine schedule depends on the planned length (--epochs); the constant one does not
                  schedule_horizon=horizon if args.lr_schedule == "cosine" else None)
    total_steps = horizon if args.max_steps is None else min(horizon, args.max_steps)
    channels = None
    if args.channel_stats:
        from .channels import ChannelStats
        channels = ChannelStats(model, args.channel_stats, (args.dense_rounds or 0) + (args.density_warmup or 0))
    return Job(args=args, spec=spec, engine=engine, device=device,
               train_set=train_set, test_set=test_set, model=model, opt=opt, scheduler=scheduler,
               sampler=sampler, steps_per_epoch=steps_per_epoch, warmup=warmup, total_steps=total_steps,
               config=config, ckpt_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
               process_start=process_start, tensorboard=tensorboard, channels=channels)
