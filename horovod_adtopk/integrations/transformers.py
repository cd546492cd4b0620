"""Transformers ``Trainer``: a callback that registers the DDP engine's hook and checkpoints its residuals.

    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=...)
    attach(trainer, hat.Compression.adtopk(ratio=0.01))
    trainer.train()                                   # or trainer.train(resume_from_checkpoint=path)

The Trainer has no communication-hook option at all, and builds its ``DistributedDataParallel`` (through
Accelerate) inside ``train()``, out of the user's reach. :func:`attach` adds a :class:`DDPCompressionCallback`
bound to the trainer: at ``on_train_begin`` (after the wrap) it registers :func:`horovod_adtopk.ddp.hook` on
``trainer.model_wrapped``; at ``on_save`` (every rank, after the Trainer wrote ``checkpoint-<step>``) it gathers
every rank's residuals and rank 0 writes them beside the Trainer's files as :data:`STATE_FILE`; on a resumed
``train()`` it loads them back from ``<output_dir>/checkpoint-<global_step>`` (or the ``resume_from_checkpoint``
given to :func:`attach`), and refuses to resume without them: a silently empty memory would drop every
rank's not-yet-sent gradient. (The Trainer's own callback state, ``ExportableState``, is JSON: no tensors.)

``gradient_accumulation_steps``: the Trainer runs the non-final micro-batches under Accelerate's ``no_sync``,
so a communication round is an optimizer step and error feedback sees the accumulated gradient.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from . import GatheredState, require

transformers = require("transformers", "transformers")

__all__ = ["STATE_FILE", "DDPCompressionCallback", "attach"]

STATE_FILE = "horovod_adtopk_ddp.pt"


class DDPCompressionCallback(transformers.TrainerCallback):
    """See the module docstring; build it with :func:`attach`. :attr:`state` is the CompressionState."""

    def __init__(self, trainer: Any, compression: Any, warmup_steps: int = 0,
                 resume_from_checkpoint: Optional[str] = None) -> None:
        self.trainer = trainer
        self.compression = compression
        self.warmup_steps = warmup_steps
        self.resume_from_checkpoint = resume_from_checkpoint
        self.state = None
        self._wrapped_id: Optional[int] = None

    def on_train_begin(self, args, state, control, **kwargs):
        from .. import ddp

        model = self.trainer.model_wrapped
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"horovod_adtopk's hook needs the Trainer's DistributedDataParallel model (launch with "
                            f"torchrun --nproc_per_node N, or accelerate launch); trainer.model_wrapped is a "
                            f"{type(model).__name__} (parallel mode {args.parallel_mode})")
        if self.state is None:
            self.state = ddp.register(model, self.compression, warmup_steps=self.warmup_steps)
        elif self._wrapped_id != id(model):  # a later train() re-wrapped the model: same state, new DDP
            self.state.bind(model.module.named_parameters())
            model.register_comm_hook(self.state, ddp.hook)
        self._wrapped_id = id(model)
        if state.global_step > 0:  # resuming: the Trainer restored model, optimizer and step; now the residuals
            folder = self.resume_from_checkpoint or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            path = os.path.join(folder, STATE_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"resuming at step {state.global_step} but {path} is missing: the error-feedback "
                                        "residuals would be lost; pass attach(..., resume_from_checkpoint=<the "
                                        "checkpoint folder>) if it is not under output_dir")
            self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def on_save(self, args, state, control, **kwargs):
        gathered = GatheredState(self.state).state_dict()  # collective: on_save runs on every rank
        if args.should_save:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            torch.save(gathered, os.path.join(folder, STATE_FILE))


def attach(trainer: Any, compression: Any, warmup_steps: int = 0,
           resume_from_checkpoint: Optional[str] = None) -> DDPCompressionCallback:
    """Add a :class:`DDPCompressionCallback` for ``compression`` to ``trainer``; returns it (``.state.stats()``
    after training starts)."""
    callback = DDPCompressionCallback(trainer, compression, warmup_steps, resume_from_checkpoint)
    trainer.add_callback(callback)
    return callback
