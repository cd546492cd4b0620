"""Checkpoint state of the compression: what ``opt.state_dict()`` adds under ``"horovod_adtopk"``.

Layout (all tensors, numbers and strings, so ``torch.load(weights_only=True)`` reads it)::

    {"format": 1, "round": int, "world_size": int, "compression": {...settings...},
     "partial_sparsification": report or None,
     "ranks": {rank: {"memory": ErrorFeedback.state_dict(), "compressor": compressor.state_dict(),
                      "hierarchical": Hierarchical.state_dict() (only with the hierarchical exchange)}}}

``ranks`` holds this rank's entry (``state_dict()``) or every rank's (``gather_state_dict()``, a
collective, for a checkpoint written by rank 0 alone). Loading picks the loading rank's own entry.
"""
from __future__ import annotations

import warnings
from typing import Optional

from .memory import ErrorFeedback

STATE_KEY = "horovod_adtopk"
STATE_FORMAT = 1


def local_entry(memory, compression, sparse: bool, hierarchical=None) -> dict:
    """This rank's private state: error-feedback memory, adaptive compressor state and (with the
    hierarchical exchange) the block memory with its layout."""
    entry = {"memory": memory.state_dict() if memory is not None else {},
             "compressor": compression.state_dict() if sparse else {}}
    if hierarchical is not None:
        entry["hierarchical"] = hierarchical.state_dict()
    return entry


def wrap(round_: int, world_size: int, description: dict, ranks: dict, partial_report: Optional[dict]) -> dict:
    return {"format": STATE_FORMAT, "round": round_, "world_size": world_size, "compression": description,
            "ranks": ranks, "partial_sparsification": partial_report}


def unwrap(ours: dict, description: dict, rank: int, size: int, memory=None,
           shapes: Optional[dict] = None) -> Optional[dict]:
    """Validate a saved state against this optimizer (its compression ``description``, its error-feedback
    ``memory`` or None, its parameter ``shapes``: name -> shape); return this rank's entry, or None (with a
    warning when memory is lost) if the state has none for this rank of this world size. Nothing is changed:
    a state that does not fit raises here."""
    has_memory = memory is not None
    if ours.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown horovod_adtopk state format {ours.get('format')!r}; expected {STATE_FORMAT}")
    saved = ours.get("compression")
    if saved != description:
        raise ValueError(f"checkpoint was written with compression {saved}, but this optimizer uses "
                         f"{description}; resume with the same compressor settings")
    entry = {int(k): v for k, v in ours["ranks"].items()}.get(rank)
    if entry is None or int(ours["world_size"]) != size:
        if has_memory:
            warnings.warn(f"horovod_adtopk: the state dict holds compression state for ranks "
                          f"{sorted(ours['ranks'])} of {ours['world_size']}, not for rank {rank} of {size}; "
                          "this rank's error-feedback memory starts empty. Save with opt.gather_state_dict() "
                          "to keep every rank's memory.")
        return None
    if memory is not None:  # a dry run on a scratch memory: refuses memory that does not fit the model
        ErrorFeedback(memory.momentum).load_state_dict(entry["memory"], shapes=shapes)
    return entry
