"""The optimizer and the compressor the flags name, for either engine (no Horovod import here, so the DDP engine
runs where Horovod is not installed): the compressor from the registry, which parameters go sparse, SGD's and
AdamW's parameter groups, and the engine to start."""
from __future__ import annotations

import argparse
from typing import List, Set

import torch

import horovod_adtopk as hat

from .options import VALUE_DTYPES


def make_compression(args: argparse.Namespace):
    """The compressor named by --compressor, from the flags it takes (the registry knows which)."""
    return hat.Compression.from_options(
        args.compressor, ratio=args.ratio, value_dtype=VALUE_DTYPES.get(args.value_dtype), threshold=args.threshold,
        min_numel=args.min_numel, min_fiber_len=getattr(args, "min_fiber_len", None),
        join=getattr(args, "fiber_join", None),
        momentum=args.momentum if args.momentum_correction else None,
        seed=args.seed,  # identical on every rank (Random-k draws the same positions everywhere)
        density_warmup=args.density_warmup, density_start=args.density_start, rank=args.powersgd_rank)


def make_local_steps(args: argparse.Namespace) -> dict:
    """The local-steps keywords of --sync-every / --outer-lr / --outer-momentum / --outer-feedback-decay /
    --outer-value-bits / --outer-value-group ({} when off)."""
    if not getattr(args, "sync_every", 0):
        return {}
    decay = getattr(args, "outer_feedback_decay", 1.0)
    low_bit = {"value_bits": getattr(args, "outer_value_bits", None),
               "value_group": getattr(args, "outer_value_group", None),
               "exchange": getattr(args, "outer_exchange", "auto")}
    outer = (hat.Outer.nesterov(lr=args.outer_lr, momentum=args.outer_momentum, feedback_decay=decay, **low_bit)
             if args.outer_momentum else hat.Outer.sgd(lr=args.outer_lr, feedback_decay=decay, **low_bit))
    return {"sync_every": args.sync_every, "outer": outer}


def sparse_parameter_names(model: torch.nn.Module, compression, world: int) -> Set[str]:
    """Names of the parameters the optimizer will send sparsely (the compressor's own per-tensor rule)."""
    if not isinstance(compression, hat.SparseCompressor):
        return set()
    from horovod_adtopk.compressors import TensorInfo
    return {n for n, p in model.named_parameters() if p.requires_grad and
            compression.choose_path(TensorInfo(n, tuple(p.shape), p.numel(), p.dtype), world)[0]}


def sgd_groups(model: torch.nn.Module, sparse: Set[str], momentum: float) -> List[dict]:
    """SGD parameter groups: the sparse-path parameters without momentum (their error-feedback memory
    accumulates the velocity: DGC's momentum correction), the others with ``momentum``."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if n in sparse], "momentum": 0.0},
              {"params": [p for n, p in named if n not in sparse], "momentum": momentum}]
    return [g for g in groups if g["params"]]


def adamw_groups(model: torch.nn.Module, weight_decay: float) -> List[dict]:
    """AdamW parameter groups: decoupled weight decay on the weight matrices and embeddings (2-D and up), none
    on biases and LayerNorm gains (1-D), as GPT-2 and most transformer recipes do."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def base_optimizer(model: torch.nn.Module, args: argparse.Namespace, lr: float, sparse: Set[str],
                   sgd=torch.optim.SGD, adamw=torch.optim.AdamW) -> torch.optim.Optimizer:
    """The optimizer ``--optimizer`` names, before any wrapping: SGD (``sgd_groups``: momentum correction moves
    the sparse-path tensors' momentum into the error-feedback memory) or AdamW (``adamw_groups``). ``sgd`` and
    ``adamw`` are the classes to build (the DDP engine passes subclasses that carry its hook state)."""
    if args.optimizer == "adamw":
        return adamw(adamw_groups(model, args.weight_decay), lr=lr, betas=tuple(args.betas))
    return sgd(sgd_groups(model, sparse, args.momentum), lr=lr, momentum=args.momentum,
               weight_decay=args.weight_decay)


def start_engine(args: argparse.Namespace):
    """Start the engine the job runs on: Horovod (:mod:`job.engine`), or PyTorch DDP with ``--engine ddp``
    (:mod:`job.ddp_engine`, which needs no Horovod)."""
    if getattr(args, "engine", "horovod") == "ddp":
        from .ddp_engine import DDPEngine
        return DDPEngine(args)
    from .engine import HorovodEngine
    return HorovodEngine()
