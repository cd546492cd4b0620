"""What rank 0 prints: log records one flushed line at a time, and the progress (a live bar for a single
process on a terminal, else a line every ``--log-every`` seconds and at each epoch end)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import List

from .common import HOROVODRUN_VARS, LAUNCHER_RANK_VARS, LOG


class _RankFormatter(logging.Formatter):
    """Rank 0's information lines as they are; warnings and errors say so (and which rank, on the others)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.prefix = f"rank {rank}: " if world > 1 and rank != 0 else ""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.ERROR:
            text = "error: " + text
        elif record.levelno >= logging.WARNING:
            text = "warning: " + text
        return self.prefix + text


class _LineHandler(logging.StreamHandler):
    """One flushed line per record; written above the progress bar while one is shown."""

    bar = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.bar is None:
            super().emit(record)  # StreamHandler flushes after every record
            return
        try:
            self.bar.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def setup_logging(rank: int, world: int) -> List[_LineHandler]:
    """Rank 0: information on stdout, warnings and errors on stderr. Other ranks: warnings and errors only."""
    LOG.handlers.clear()
    LOG.propagate = False
    fmt = _RankFormatter(rank, world)
    err = _LineHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    err.setFormatter(fmt)
    handlers = [err]
    if rank == 0:
        out = _LineHandler(sys.stdout)
        out.addFilter(_Below(logging.WARNING))
        out.setFormatter(fmt)
        handlers.append(out)
    for h in handlers:
        LOG.addHandler(h)
    LOG.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return handlers


def duration(seconds: float) -> str:
    """``"1h02m03s"``, ``"2m05s"`` or ``"7s"``."""
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def mb(n: float) -> str:
    """Bytes as ``"12.34 MB"`` (10^6 bytes)."""
    return f"{n / 1e6:.2f} MB"


def use_live_bar(args: argparse.Namespace, world: int) -> bool:
    """A redrawn bar needs rank 0's stderr to be a terminal and no launcher tagging or collecting output."""
    if args.no_progress:
        return False
    if args.progress:
        return True
    launched = any(v in os.environ for v in HOROVODRUN_VARS) or (
        world > 1 and any(v in os.environ for v in LAUNCHER_RANK_VARS))
    if world > 1 or launched or not sys.stderr.isatty() or os.environ.get("TERM", "") in ("", "dumb"):
        return False
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns >= 40  # 0: a pseudo-terminal with no size
    except (OSError, ValueError):
        return False


class ProgressReport:
    """Rank 0's progress: the live bar, or a line every ``--log-every`` seconds and at each epoch end."""

    def __init__(self, job, progress) -> None:
        self.job = job
        self.every = job.args.log_every
        self.bar = None
        self.start_step = progress.step
        self.start = self.window_start = time.time()
        self.window_steps, self.window_loss = 0, 0.0
        if job.rank == 0 and use_live_bar(job.args, job.world):
            from tqdm import tqdm
            self.bar = tqdm(total=job.total_steps, initial=min(progress.step, job.total_steps), unit="step",
                            file=sys.stderr, dynamic_ncols=True)
            for h in LOG.handlers:
                h.bar = self.bar

    def step(self, progress, loss: float) -> None:
        """After each optimizer step: redraw the bar, or write a line when ``--log-every`` seconds passed."""
        if self.job.rank != 0:
            return
        self.window_steps += 1
        self.window_loss += loss
        if self.bar is not None:
            rate = self.window_steps * self.job.args.batch_size * self.job.world / max(time.time() - self.window_start, 1e-9)
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{rate:.0f}", refresh=False)
        elif self.every and time.time() - self.window_start >= self.every:
            self.line(progress)

    def line(self, progress) -> None:
        """One progress line (rank 0, no bar): rank 0's own counters, no collective."""
        if self.job.rank != 0 or self.bar is not None or not self.window_steps:
            return
        job, now = self.job, time.time()
        rate = self.window_steps * job.args.batch_size * job.world / max(now - self.window_start, 1e-9)
        done = progress.step - self.start_step
        eta = (job.total_steps - progress.step) * (now - self.start) / done if done else 0.0
        stats = job.opt.stats()
        traffic = ""
        if stats.get("wire_bytes_dense"):
            traffic = (f" | wire sent {mb(stats['wire_bytes_sent'])}, received {mb(stats['wire_bytes_received'])} "
                       f"vs dense {mb(stats['wire_bytes_dense'])}, density {stats['density']:.4f} (rank 0)")
        elif stats["bytes_dense"]:
            traffic = (f" | sent {mb(stats['bytes_sent'])} vs dense {mb(stats['bytes_dense'])}, "
                       f"density {stats['density']:.4f} (rank 0)")
        LOG.info(f"step {progress.step}/{job.total_steps} epoch {progress.epoch + 1}/{job.args.epochs} "
                 f"loss {self.window_loss / self.window_steps:.4f} | {rate:.0f} samples/s | "
                 f"ETA {duration(eta)}{traffic}")
        self.window_start, self.window_steps, self.window_loss = now, 0, 0.0

    def close(self) -> None:
        """Remove the bar (log lines go straight to their streams again)."""
        if self.bar is not None:
            self.bar.close()
            for h in LOG.handlers:
                h.bar = None
            self.bar = None
