"""Local steps on the DDP engine: the outer exchange of :mod:`horovod_adtopk.local_steps` over a process group.

    model = torch.nn.parallel.DistributedDataParallel(model)            # or the plain module
    opt = hat.ddp.local_steps(torch.optim.AdamW(model.parameters()), model, sync_every=50,
                              outer=hat.Outer.nesterov(lr=0.7, momentum=0.9),
                              compression=hat.Compression.adtopk(ratio=0.05))
    for x, y in loader:                       # the ordinary loop: forward, backward, opt.step()
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

Inner steps must not communicate. Given a ``DistributedDataParallel`` model, :func:`local_steps` registers a
communication hook that hands every bucket back untouched (DDP's gradient allreduce becomes a no-op, so the
loop needs no ``no_sync()``); DDP still broadcasts buffers at every forward unless it was built with
``broadcast_buffers=False`` (or the model has none). Given a plain module (no DDP), nothing runs between
syncs at all; the parameters are broadcast from rank 0 once, here, as DDP's constructor would. Buffers (e.g.
batch-norm statistics) are never averaged: each rank keeps its own.
"""
# (no ``from __future__ import annotations``: DDP compares the hook's return annotation itself)

from typing import Optional

import torch

from .. import config_check
from ..local_optimizer import wrap_optimizer
from ..local_steps import LocalSteps, Outer, check_settings
from .communicator import ProcessGroupComm
from .state import _check_compression, describe_compression


def _local_hook(_state, bucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that communicates nothing: each rank keeps its own gradients."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def local_steps(optimizer: torch.optim.Optimizer, model: torch.nn.Module, sync_every: int,
                outer: Optional[Outer] = None, compression=None, warmup_steps: int = 0,
                process_group=None) -> torch.optim.Optimizer:
    """``optimizer`` made to run ``sync_every`` local steps between outer exchanges (see the module docstring).

    Args:
        optimizer: the inner optimizer over ``model``'s parameters (e.g. AdamW).
        model: the ``DistributedDataParallel`` model (a no-communication hook is registered on it) or the
            plain module (its parameters and buffers are broadcast from rank 0 now: a collective).
        sync_every: H, inner steps per sync.
        outer: the outer optimizer (default ``Outer.nesterov(lr=0.7, momentum=0.9)``, DiLoCo's; with a sparse
            compressor SparseLoCo's ``Outer.sgd(lr=1.0, feedback_decay=0.95)`` measured better).
        compression: a fixed-size sparse compressor (``hat.Compression.adtopk(ratio=0.05)``, ``topk``,
            ``adtopk_i``), a dense one (``fp16``) or None (dense; with ``outer``'s ``value_bits`` every entry
            travels as a low-bit code).
        warmup_steps: the first N syncs travel dense.
        process_group: the ``torch.distributed`` group (None: the default group).

    Returns a subclass of ``optimizer``'s class: ``step()``, ``state_dict()`` / ``gather_state_dict()`` /
    ``load_state_dict()`` (the outer state and the residuals, Horovod engine's layout), ``stats()``.
    """
    outer = Outer.nesterov() if outer is None else outer
    compression = _check_compression(compression)
    check_settings(sync_every, outer, compression)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    comm = ProcessGroupComm(process_group)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        module = model.module
        model.register_comm_hook(None, _local_hook)
    else:
        module = model
        if comm.size() > 1:
            with torch.no_grad():
                for t in list(module.parameters()) + list(module.buffers()):
                    comm.broadcast_(t.data, 0)
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    named = [(n, p) for n, p in module.named_parameters() if id(p) in in_opt]
    if len(named) != len(in_opt):
        raise ValueError("the optimizer holds parameters that are not the model's; pass the model it optimizes")
    local = LocalSteps(named, sync_every, outer, compression, warmup_steps, comm)
    description = {"compression": describe_compression(compression), "engine": "ddp", "process_set": comm.size(),
                   "params": {n: [list(i.shape), str(i.dtype)] for n, i in sorted(local.infos.items())},
                   **local.describe()}
    return wrap_optimizer(optimizer, local, lambda d: config_check.check(comm, d), comm.size, description)
