"""Which way each parameter's gradient travels: dense (allreduce), sparse (flat allgather) or hierarchical.

Per tensor, in order: a dense compressor sends everything dense; partial sparsification
(:mod:`horovod_adtopk.partial`) may have switched the tensor dense; otherwise the compressor's
``choose_path`` decides (shape, ``min_numel`` and the hybrid rule); a sparse tensor that the hierarchical
exchange kind (:mod:`horovod_adtopk.hierarchical`) takes travels that way. The reasons go to
``opt.stats()["tensors"]``. Warm-up rounds and joined members are per-round exceptions decided at submit time.
"""
from __future__ import annotations

from typing import Dict

from . import sharded
from .partial import PartialSparsification


def plan(sparse_path: Dict[str, bool], infos: dict, compression, partial, hierarchical, world_size: int, stats,
         sender) -> None:
    """Fill ``sparse_path`` (name -> on the sparse path?, updated in place) for every tensor of ``infos``.

    ``compression`` is the sparse compressor or None (a dense one); ``partial`` a PartialSparsification or
    None; ``hierarchical`` a :class:`~horovod_adtopk.hierarchical.Hierarchical` or None; ``sender`` the
    SparseSender (its profiling hook follows the partial sparsification's state) or None."""
    if hierarchical is not None:
        hierarchical.replan()
    if sender is not None:
        sender.shard_plans.clear()
    for name, info in infos.items():
        path = None
        if compression is None:
            sparse, reason = False, "dense compressor"
        elif partial is not None and not partial.keeps_sparse(name):
            sparse, reason = False, PartialSparsification.reason(partial.report["tensors"][name])
        else:
            sparse, reason = compression.choose_path(info, world_size)
            if hierarchical is not None and hierarchical.decide(info, sparse, reason)[0]:
                sparse, reason, path = True, hierarchical.reasons[name], "hierarchical"
            elif sender is not None and getattr(sender, "exchange", "allgather") != "allgather":
                why = shard(info, sparse, compression, world_size, sender)
                if why is not None:
                    sparse, reason, path = True, why, "sharded"
        sparse_path[name] = sparse
        stats.set_path(name, info.numel, sparse, reason, path,
                       compression.selection_summary(info) if sparse else None)
    if sender is not None:
        sender.profile = partial if partial is not None and partial.profiling else None


def shard(info, sparse: bool, compression, world_size: int, sender):
    """The owner-sharded exchange for ``info`` where ``sender.exchange`` asks for it ("sharded": wherever the
    tensor can be sharded; "auto": where the cost model finds it cheapest); records the plan in
    ``sender.shard_plans`` and returns the reason, else None."""
    c = compression
    if (world_size < 2 or len(info.shape) < c.min_dims or info.numel < c.min_numel or not hasattr(c, "codec")
            or getattr(c, "variable_count", False)):
        return None
    codec = c.codec(info)
    layout = getattr(codec, "layout", None)
    if layout is None:
        return None
    plan = sharded.plan_sparse(info.name, layout, None, None, world_size, c.wire_value_dtype(info.dtype),
                               codec.index_dtype)
    if plan is None:
        return None
    if sender.exchange == "sharded":
        why = f"sharded (forced: {sharded.worst(plan.block_sizes(), world_size).received} B per rank)"
    else:
        gather = sharded.PlainWire(codec.count, c.wire_value_dtype(info.dtype), codec.index_dtype).block_bytes
        dense = info.numel * max(info.dtype.itemsize, 4)  # bfloat16 is allreduced as float32
        choice, why = sharded.pick(plan, gather if sparse else None, dense, world_size)
        if choice != "sharded":
            return None
    sender.shard_plans[info.name] = plan
    return why
