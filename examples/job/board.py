"""``--tensorboard DIR``: rank 0's SummaryWriter, its scalars per step and per evaluation, and the
per-layer density histogram. TensorBoard is imported only when the flag is given."""
from __future__ import annotations

import argparse
from typing import Optional

import torch

from .common import agree


def open_tensorboard(args: argparse.Namespace, engine) -> Optional[object]:
    """Rank 0's SummaryWriter for ``--tensorboard``; every rank stops (status 2) if tensorboard is missing."""
    if not args.tensorboard:
        return None
    error, writer_class = None, None
    try:
        from torch.utils.tensorboard import SummaryWriter as writer_class
    except ImportError as exc:
        error = f"--tensorboard needs the tensorboard package ({exc}); install it with: pip install tensorboard"
    agree(engine, error, "tensorboard")
    return writer_class(log_dir=args.tensorboard) if engine.rank == 0 else None


def tensorboard_step(job, progress, loss: float, lr: float) -> None:
    """Scalars after an optimizer step: loss, learning rate, rank 0's compression counters."""
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


def tensorboard_record(job, res: dict) -> None:
    """An evaluation: test loss and headline metric, and the histogram of the tensors' densities."""
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
