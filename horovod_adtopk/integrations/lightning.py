"""PyTorch Lightning: a Callback that puts the DDP engine's hook on the model Lightning wraps, on any device.

    from horovod_adtopk.integrations.lightning import DDPCompression
    trainer = pl.Trainer(devices=2, strategy="ddp",
                         callbacks=[DDPCompression(hat.Compression.adtopk(ratio=0.01))])

The trap it removes: ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, Lightning's documented way to set
a communication hook, registers the hook only when the root device is CUDA; on CPU training runs without error
and plain allreduce, the hook never called. :class:`DDPCompression` registers :func:`horovod_adtopk.ddp.hook`
itself in ``on_fit_start`` (after the strategy wrapped the module in ``DistributedDataParallel``), whatever the
device, and refuses a strategy that was given a hook as well (on CUDA both would register; on CPU the
strategy's would be silently skipped).

Checkpoints: the callback's ``state_dict`` is the CompressionState with every rank's residuals (gathered:
Lightning builds the checkpoint on every rank and writes rank 0's; see
:class:`horovod_adtopk.integrations.GatheredState`), so ``ModelCheckpoint`` saves it and
``trainer.fit(..., ckpt_path=...)`` restores it: a resumed run is bitwise the run that did not stop.
Gradient accumulation (``accumulate_grad_batches``) runs the non-final micro-batches under DDP's
``no_sync()``, so a communication round is an optimizer step and error feedback sees the accumulated gradient.

Uses ``pytorch_lightning`` (the ``pytorch-lightning`` package) or, when that is missing, ``lightning.pytorch``:
the callback must come from the package whose Trainer you use.
"""
from __future__ import annotations

import importlib
from typing import Any, Optional

import torch

from . import GatheredState


def _lightning():
    for name in ("pytorch_lightning", "lightning.pytorch"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("horovod_adtopk.integrations.lightning needs PyTorch Lightning: pip install pytorch-lightning "
                      "(or pip install 'horovod_adtopk[integrations]')")


pl = _lightning()

__all__ = ["DDPCompression"]


class DDPCompression(pl.Callback):
    """Register ``hat.ddp.hook`` on ``trainer.strategy.model`` (the ``DistributedDataParallel``) at fit start.

    Args:
        compression: ``hat.Compression.adtopk(ratio=0.01)`` or any compressor the DDP engine takes.
        warmup_steps: the first N rounds dense (see :class:`horovod_adtopk.ddp.CompressionState`).
        process_group: the group to average over (None: the default group Lightning created).

    After fit start, :attr:`state` is the :class:`~horovod_adtopk.ddp.CompressionState` (``state.stats()``).
    """

    def __init__(self, compression: Any, warmup_steps: int = 0, process_group: Optional[Any] = None) -> None:
        super().__init__()
        self.compression = compression
        self.warmup_steps = warmup_steps
        self.process_group = process_group
        self.state = None
        self._pending: Optional[dict] = None  # a checkpoint's state, loaded before the model was wrapped

    @property
    def state_key(self) -> str:
        return "horovod_adtopk.DDPCompression"

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        strategy = trainer.strategy
        if getattr(strategy, "_ddp_comm_hook", None) is not None or getattr(strategy, "_ddp_comm_state", None) is not None:
            raise ValueError(
                "DDPCompression registers the communication hook itself; remove ddp_comm_hook/ddp_comm_state from "
                "DDPStrategy (Lightning registers those only on CUDA: on CPU they are silently skipped, on CUDA the "
                "hook would be registered twice)")

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from .. import ddp

        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"DDPCompression needs a DDP strategy (Trainer(strategy='ddp', devices=N)); the model "
                            f"Lightning trains is a {type(model).__name__}, not a DistributedDataParallel")
        if self.state is None:
            self.state = ddp.register(model, self.compression, process_group=self.process_group,
                                      warmup_steps=self.warmup_steps)
        else:  # a second fit with the same callback: a new DDP wrapper, the same state and memory
            self.state.bind(model.module.named_parameters())
            model.register_comm_hook(self.state, ddp.hook)
        if self._pending is not None:
            self.state.load_state_dict(self._pending)
            self._pending = None

    def state_dict(self) -> dict:
        """Collective (Lightning calls it on every rank): every rank's residuals, keyed by rank."""
        return GatheredState(self.state).state_dict() if self.state is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self.state is None:  # Lightning restores callbacks before the strategy wraps the model
            self._pending = state_dict
        else:
            self.state.load_state_dict(state_dict)
