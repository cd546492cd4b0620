"""Where a run stands (``Progress``, saved in checkpoints) and everything it runs with (``Job``)."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import torch
from torch.utils.data.distributed import DistributedSampler

from .data import DatasetSpec

# The optimizer's cumulative counters the job sums over ranks and carries across resumes.
COUNTER_KEYS = ("bytes_sent", "bytes_dense", "elements_sent", "elements_total", "wire_bytes_sent",
                "wire_bytes_received", "wire_bytes_dense")


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
    """Everything a run needs, built once by ``job.build.setup``."""
    args: argparse.Namespace
    spec: DatasetSpec
    engine: object  # job.engine.HorovodEngine (or another engine with its methods)
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
    channels: Optional[object] = None  # job.channels.ChannelStats with --channel-stats

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world(self) -> int:
        return self.engine.size

    def wall(self, progress: Progress) -> float:
        """Training seconds so far, earlier processes' included."""
        return progress.wall_offset + time.time() - self.train_start


def counter_totals(job: Job, progress: Progress) -> Dict[str, float]:
    """Collective: the optimizer's counters summed over ranks, plus those carried over by resumes."""
    s = job.opt.stats()
    local = torch.tensor([float(s.get(k, 0)) for k in COUNTER_KEYS], dtype=torch.float64)
    summed = job.engine.sum(local, name="train.counters").tolist()
    out = {k: progress.counters.get(k, 0.0) + v for k, v in zip(COUNTER_KEYS, summed)}
    out["density"] = out["elements_sent"] / out["elements_total"] if out["elements_total"] else 0.0
    return out
