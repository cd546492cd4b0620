"""The engine: the one module of the job that talks to Horovod.

It starts Horovod, wraps SGD in ``hat.DistributedOptimizer`` with the compressor the flags name, broadcasts
the initial state from rank 0, steps the optimizer (with gradient clipping between ``synchronize`` and
``step``) and runs the few collectives the job itself needs (metric sums, error agreement, checkpoint
bookkeeping). Every other module calls these methods, so another engine (e.g. PyTorch DDP with a
communication hook) is one more class with the same methods.
"""
from __future__ import annotations

import argparse
import os
from typing import Any, List

import torch

import horovod.torch as hvd

import horovod_adtopk as hat

from .common import HOROVODRUN_VARS, MPI_LAUNCHER_VARS
# the optimizer and compressor builders need no Horovod (the DDP engine uses them too); re-exported here
from .optim import (adamw_groups, base_optimizer, make_compression, make_local_steps,  # noqa: F401
                    sgd_groups, sparse_parameter_names)


def init_horovod() -> str:
    """``hvd.init()`` under horovodrun (or alone); over ``MPI.COMM_WORLD`` under mpirun / srun."""
    if not any(v in os.environ for v in HOROVODRUN_VARS) and any(v in os.environ for v in MPI_LAUNCHER_VARS):
        from mpi4py import MPI  # initialises MPI (thread level "multiple", as Horovod needs)
        hvd.init(comm=MPI.COMM_WORLD)
        return "mpi4py"
    hvd.init()
    return "horovod"


class HorovodEngine:
    """Horovod with ``hat.DistributedOptimizer``: started by the constructor (``init_mode`` says how)."""

    name = "horovod"

    def __init__(self) -> None:
        self.init_mode = init_horovod()

    @property
    def rank(self) -> int:
        return hvd.rank()

    @property
    def size(self) -> int:
        return hvd.size()

    @property
    def local_rank(self) -> int:
        return hvd.local_rank()

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the job runs (Horovod needs no wrapper)."""
        return model

    def make_optimizer(self, model: torch.nn.Module, args: argparse.Namespace, lr: float) -> torch.optim.Optimizer:
        """SGD or AdamW wrapped in hat.DistributedOptimizer. With momentum correction (SGD only) the sparse-path
        parameters get SGD without momentum and the dense-path ones (biases, small layers) keep SGD momentum."""
        world, compression = self.size, make_compression(args)
        # One process: nothing is communicated, so nothing is compressed; plain SGD momentum everywhere (unless
        # --exchange-when-alone runs the exchange over a world of one).
        alone = getattr(args, "exchange_when_alone", False)
        correct = args.momentum_correction and (world > 1 or alone)
        sparse = sparse_parameter_names(model, compression, world) if correct else set()
        base = base_optimizer(model, args, lr, sparse)
        opt = hat.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression,
                                       backward_passes_per_step=1, op=hvd.Average, warmup_steps=args.dense_rounds,
                                       overlap={"off": False, "on": True}.get(args.overlap, args.overlap),
                                       exchange_when_alone=alone, **make_local_steps(args),
                                       **({} if getattr(args, "sync_every", 0) else
                                          {"exchange": getattr(args, "exchange", "allgather")}))
        if correct:
            actual = {n for n, t in opt.stats()["tensors"].items() if t["path"] in ("sparse", "sharded")}
            if actual != sparse:
                raise RuntimeError(f"sparse-path parameters disagree: expected {sorted(sparse)}, got {sorted(actual)}")
        return opt

    def broadcast_initial_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """Every rank starts from rank 0's parameters and optimizer state."""
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)

    def step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, clip_grad: float) -> None:
        """Finish the gradient exchange and step; with ``clip_grad`` the averaged gradient is clipped first."""
        if clip_grad:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()

    def checkpoint_state(self, opt: torch.optim.Optimizer) -> dict:
        """Collective: the optimizer state with every rank's compression memory (for rank 0 to save)."""
        return opt.gather_state_dict()

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:
        """Collective: ``values`` summed over the ranks."""
        return hvd.allreduce(values, op=hvd.Sum, name=name)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Collective: every rank's ``obj``, in rank order."""
        return hvd.allgather_object(obj, name=name)

    def broadcast_object(self, obj: Any, name: str) -> Any:
        """Collective: rank 0's ``obj`` on every rank."""
        return hvd.broadcast_object(obj, root_rank=0, name=name)


def start_engine(args: argparse.Namespace):
    """Start the engine the job runs on (see :func:`job.optim.start_engine`)."""
    from .optim import start_engine as start
    return start(args)
