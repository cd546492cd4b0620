"""Checkpoint files on disk, without any collective: the names, the rotation of the newest
``--keep-checkpoints``, atomic writes (a failed or killed save leaves no partial file), clear messages for
failed writes, and reading with the reason a file is unusable."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from .common import LOG

CKPT_FORMAT = 2  # 2: the learning rate lives in a LambdaLR state dict
LATEST = "latest"
CKPT_GLOB = "ckpt-step*.pt"
TMP_GLOBS = (".ckpt-step*.pt.tmp*", f".{LATEST}.tmp*")


def _step_of(path: Path) -> Optional[int]:
    try:
        return int(path.name[len("ckpt-step"):-len(".pt")])
    except ValueError:
        return None


def checkpoint_files(directory: Path) -> List[Tuple[int, Path]]:
    """``(step, path)`` of the checkpoint files in ``directory``, newest step first."""
    found = [(_step_of(p), p) for p in directory.glob(CKPT_GLOB)]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def resume_candidates(directory: Path) -> List[Path]:
    """The file ``latest`` names, then every other checkpoint, newest step first."""
    order = []
    pointer = directory / LATEST
    if pointer.is_file():
        try:
            named = directory / pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            named = None
        if named is not None and named.is_file():
            order.append(named)
    order += [p for _, p in checkpoint_files(directory) if p not in order]
    return order


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def remove_stale_temporaries(directory: Path) -> List[Path]:
    """Delete temporary files of saves that never finished (their process is gone)."""
    removed = []
    for pattern in TMP_GLOBS:
        for tmp in directory.glob(pattern):
            pid = tmp.name.rsplit(".tmp", 1)[-1]
            if pid.isdigit() and (int(pid) == os.getpid() or _pid_alive(int(pid))):
                continue  # ours (in use) or another live process's
            try:
                tmp.unlink()
                removed.append(tmp)
            except FileNotFoundError:
                pass
    return removed


def write_error(path: Path, exc: BaseException) -> str:
    """'could not write checkpoint PATH: the OS error', with a hint when the disk is full."""
    os_error, e = None, exc
    while e is not None and os_error is None:  # torch.save wraps the OSError of the failed write
        os_error = e if isinstance(e, OSError) else None
        e = e.__cause__ or e.__context__
    if os_error is not None and os_error.errno is not None:
        reason = f"{os.strerror(os_error.errno)} (errno {errno.errorcode.get(os_error.errno, os_error.errno)})"
        full = os_error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    else:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        try:
            full = os.statvfs(path.parent).f_bavail == 0
        except OSError:
            full = False
    return f"could not write checkpoint {path}: {reason}" + ("; disk full?" if full else "")


def atomic_write(path: Path, write: Callable) -> None:
    """Write through a temporary file renamed over ``path``: readers see the old file or the new one, and a
    failed write leaves no partial file (the temporary one is removed)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as f:  # unbuffered: a failed write raises its OSError inside torch.save
            write(f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_checkpoint(directory: Path, ckpt: dict, keep: int) -> Path:
    """Rank 0: write ``ckpt-step{step}.pt``, point ``latest`` at it, delete stale temporaries and old files.

    Raises ``OSError`` with the message to show when the file could not be written."""
    path = directory / f"ckpt-step{ckpt['step']}.pt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for tmp in remove_stale_temporaries(directory):
            LOG.info(f"removed {tmp.name}, left by a checkpoint save that did not finish")
        atomic_write(path, lambda f: torch.save(ckpt, f))
        atomic_write(directory / LATEST, lambda f: f.write((path.name + "\n").encode()))
    except (OSError, RuntimeError) as exc:
        raise OSError(write_error(path, exc)) from exc
    if keep:
        # Keep this file and the newest keep-1 before it. Files of later steps (an abandoned, damaged
        # continuation) are left alone.
        older = [p for s, p in checkpoint_files(directory) if s < ckpt["step"]]
        for old in older[keep - 1:]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
    return path


def _load_error(exc: BaseException) -> str:
    text = str(exc).strip()
    if "weights_only" in text or "Weights only load failed" in text:
        return "its contents cannot be read as a checkpoint"
    first = text.split(". ")[0].splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def read_checkpoint(path: Path) -> Tuple[Optional[dict], Optional[str]]:
    """``(checkpoint, None)``, or ``(None, why it is unusable)``."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, overwritten, not a torch file: all mean "damaged" here
        return None, f"damaged ({_load_error(exc)})"
    if not isinstance(ckpt, dict) or "config" not in ckpt or "format" not in ckpt:
        return None, "damaged (not a checkpoint of this script)"
    if ckpt["format"] != CKPT_FORMAT:
        return None, f"written in checkpoint format {ckpt['format']!r}, this script reads format {CKPT_FORMAT}"
    return ckpt, None
