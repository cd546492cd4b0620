"""Hugging Face Accelerate: the DDP engine's hook on an Accelerate-prepared model, its residuals in ``save_state``.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = horovod_adtopk.integrations.accelerate.register(accelerator, model, hat.Compression.adtopk(ratio=0.01))

The traps it removes: ``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own enum (no
PowerSGD-style state, no function: one is silently not registered), and ``accelerator.register_for_checkpointing``
given the CompressionState itself would save rank 0's residuals only (``save_state`` writes custom objects from
the main process). :func:`register` registers :func:`horovod_adtopk.ddp.hook` on the prepared
``DistributedDataParallel`` and registers a :class:`~horovod_adtopk.integrations.GatheredState` (every rank's
residuals, keyed by rank) for checkpointing, so ``accelerator.save_state`` / ``load_state`` carry them. Call it
before ``load_state`` (Accelerate matches custom objects by registration order).

``accelerator.accumulate(model)`` runs the non-final micro-batches under DDP's ``no_sync()``: a communication
round is an optimizer step, and error feedback sees the accumulated gradient.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import GatheredState, require

require("accelerate", "accelerate")

__all__ = ["register"]


def register(accelerator: Any, model: torch.nn.Module, compression: Any, warmup_steps: int = 0,
             process_group: Optional[Any] = None, checkpoint: bool = True):
    """Register ``hat.ddp.hook`` on ``model`` (what ``accelerator.prepare`` returned) and, with ``checkpoint``,
    every rank's residuals for ``accelerator.save_state``; returns the
    :class:`~horovod_adtopk.ddp.CompressionState` (``stats()``)."""
    from .. import ddp

    handler = getattr(accelerator, "ddp_handler", None)
    if handler is not None and getattr(handler, "comm_hook", None) not in (None, "no"):
        raise ValueError(f"the Accelerator was given DistributedDataParallelKwargs(comm_hook={handler.comm_hook!r}); "
                         "a DDP model takes one communication hook: drop comm_hook to use horovod_adtopk's")
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() takes the model accelerator.prepare() returned, wrapped in DistributedDataParallel "
                        f"(a multi-process launch: accelerate launch --multi_gpu --num_processes N ...); got "
                        f"{type(model).__name__} (distributed type {getattr(accelerator, 'distributed_type', '?')})")
    state = ddp.register(model, compression, process_group=process_group, warmup_steps=warmup_steps)
    if checkpoint:
        accelerator.register_for_checkpointing(GatheredState(state))
    return state
