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
    ``memory`` or None, its parameter ``shapes``: name -> shape); return this rank's entry: its own for the
    same world size, folded from every rank's (:func:`fold`) for another world size, or None (with a warning
    when memory is lost) if the state lacks them. Nothing is changed: a state that does not fit raises here."""
    has_memory = memory is not None
    if ours.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown horovod_adtopk state format {ours.get('format')!r}; expected {STATE_FORMAT}")
    saved = ours.get("compression")
    if saved != description:
        raise ValueError(f"checkpoint was written with compression {saved}, but this optimizer uses "
                         f"{description}; resume with the same compressor settings")
    ranks = {int(k): v for k, v in ours["ranks"].items()}
    saved_size = int(ours["world_size"])
    entry = ranks.get(rank) if saved_size == size else None
    if entry is None and saved_size != size and sorted(ranks) == list(range(saved_size)):
        entry = fold(ranks, saved_size, size, rank)
    if entry is None:
        if has_memory:
            warnings.warn(f"horovod_adtopk: the state dict holds compression state for ranks "
                          f"{sorted(ours['ranks'])} of {ours['world_size']}, not for rank {rank} of {size}; "
                          "this rank's error-feedback memory starts empty. Save with opt.gather_state_dict() "
                          "to keep every rank's memory.")
        return None
    if memory is not None:  # a dry run on a scratch memory: refuses memory that does not fit the model
        ErrorFeedback(memory.momentum).load_state_dict(entry["memory"], shapes=shapes)
    return entry


def fold(ranks: dict, old_size: int, new_size: int, rank: int) -> dict:
    """This rank's entry of a world of ``new_size`` from every rank's entry of a world of ``old_size``
    (a gathered checkpoint resumed at another world size, e.g. after an elastic restart).

    Each residual is in units of its rank's own gradient and the exchange averages, so the update the ranks
    still owe is ``sum_i r_i / W``. New rank ``j`` takes the old ranks ``i`` with ``i mod W' == j``::

        r'_j = (W' / W) * sum_{i mod W' == j} r_i      =>   sum_j r'_j / W' == sum_i r_i / W

    (momentum-correction velocities alike), so nothing owed is lost or applied twice. The adaptive
    compressor state and, with local steps, the wrapped optimizer's state come from old rank ``j mod W``;
    the hierarchical block memory and mid-interval local parameters depend on the layout and are dropped.
    The owners' residuals of local steps' sharded exchange (in units of the average, each owner a range of
    fibers) are joined into ``owner_full``, from which every new owner takes its own range."""
    members = [i for i in range(old_size) if i % new_size == rank]
    factor = new_size / old_size
    memory: dict = {}
    for store in ("residuals", "velocities"):
        out: dict = {}
        for i in members:
            for name, t in ranks[i].get("memory", {}).get(store, {}).items():
                t = t.detach()
                out[name] = t.clone() if name not in out else out[name] + t
        memory[store] = {name: t.mul_(factor) for name, t in out.items()}
    source = ranks[rank % old_size]
    memory["momentum"] = source.get("memory", {}).get("momentum")
    entry = {"memory": memory if source.get("memory") else {}, "compressor": source.get("compressor", {}),
             "folded_from": members}
    if "inner_optimizer" in source:
        entry["inner_optimizer"] = source["inner_optimizer"]
    owners = [ranks[i].get("owner") for i in range(old_size)]
    if all(owners):  # local steps' owner-sharded exchange: every owner's shard, joined in fiber (= rank) order
        import torch
        entry["owner_full"] = {name: torch.cat([o[name].detach() for o in owners]) for name in owners[0]
                               if all(name in o for o in owners)}
    return entry


def restore(entry: dict, memory, compression, devices: Optional[dict] = None) -> None:
    """Load this rank's ``entry`` (from :func:`unwrap`) into its error-feedback ``memory`` (or None) and its
    sparse ``compression`` (or None), tensors onto ``devices`` (name -> device)."""
    if memory is not None:
        memory.load_state_dict(entry["memory"], devices)
    if compression is not None:
        compression.load_state_dict(entry["compressor"])
