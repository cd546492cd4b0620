"""The configuration check: every member rank must agree on everything that decides which collectives run.

Horovod matches collectives by name; if two ranks disagree on, say, the ratio (payload sizes), the
parameter list, the groups or the partial-sparsification schedule, their collectives stop matching and the
job hangs or corrupts gradients. So before the first exchange every rank allgathers a 56-bit digest of its
description; if they differ, the descriptions themselves are allgathered and every rank raises the same
error naming the difference.
"""
from __future__ import annotations

import hashlib
import json
from typing import List, Optional

import torch

#: top-level settings compared one by one in the error message (``params`` is compared per parameter)
SETTINGS = ("compression", "op", "backward_passes_per_step", "gradient_predivide_factor", "groups",
            "sparse_as_dense", "partial_sparsification", "profile_rounds", "warmup_steps", "process_set", "hierarchical",
            "sync_every", "outer", "engine")


def describe(compression: dict, op, backward_passes_per_step: int, gradient_predivide_factor: float,
             groups: Optional[dict], names: dict, sparse_as_dense: bool, partial, warmup_steps: int,
             process_set_size: Optional[int], infos: dict, hierarchical: Optional[dict] = None) -> dict:
    """The optimizer's description: every setting that decides which collectives run (``groups``: the
    explicit groups ``{param: group}`` or None; ``names``: ``{param: name}``; ``infos``: name -> TensorInfo)."""
    return {"compression": compression, "op": str(op), "backward_passes_per_step": backward_passes_per_step,
            "gradient_predivide_factor": gradient_predivide_factor,
            "groups": sorted([names[p] for p in g] for g in set(groups.values())) if groups is not None else None,
            "sparse_as_dense": sparse_as_dense, "partial_sparsification": partial is not None,
            "profile_rounds": partial.profile_rounds if partial is not None else None,
            "warmup_steps": warmup_steps, "process_set": process_set_size,
            "params": {n: [list(i.shape), str(i.dtype)] for n, i in sorted(infos.items())},
            "hierarchical": hierarchical}


def digest(description: dict) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(description, sort_keys=True).encode()).digest()[:7], "big")


def check(comm, description: dict) -> None:
    """Collective over ``comm``: raise on every rank if any member's ``description`` differs."""
    digests = comm.allgather(torch.tensor([digest(description)], dtype=torch.int64), "hat.config.digest").tolist()
    if len(set(digests)) == 1:
        return
    descriptions = comm.allgather_object(description, "hat.config.describe")
    raise RuntimeError("horovod_adtopk: ranks disagree on the optimizer configuration, so their collectives "
                       "would not match. " + explain(descriptions) +
                       " Build the model and hat.DistributedOptimizer identically on every rank.")


def explain(descriptions: List[dict]) -> str:
    """What differs between rank 0's description and every other rank's."""
    ref = descriptions[0]
    parts = []
    for rank, d in enumerate(descriptions[1:], start=1):
        for key in SETTINGS:
            if d.get(key) != ref.get(key):
                parts.append(f"{key}: rank 0 has {ref.get(key)}, rank {rank} has {d.get(key)}")
        p0, p1 = ref["params"], d["params"]
        only0, only1 = sorted(set(p0) - set(p1)), sorted(set(p1) - set(p0))
        if only0:
            parts.append(f"parameters only on rank 0 (not rank {rank}): {only0[:5]}")
        if only1:
            parts.append(f"parameters only on rank {rank}: {only1[:5]}")
        for n in [n for n in sorted(set(p0) & set(p1)) if p0[n] != p1[n]][:5]:
            parts.append(f"parameter {n!r}: rank 0 has shape/dtype {p0[n]}, rank {rank} has {p1[n]}")
    return "; ".join(parts) if parts else "(configurations differ)"
