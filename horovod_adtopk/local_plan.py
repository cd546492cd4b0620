"""How each tensor of local steps travels at a sync (:class:`horovod_adtopk.local_steps.LocalSteps`'s routing
plan, a mixin): its path by the compressor's per-step rule at the current world size, the owner-sharded plan
where the cost model (:mod:`horovod_adtopk.netcost`, :func:`horovod_adtopk.sharded.pick`) finds it cheaper
than an allgather or an allreduce, and whether a dense tensor with ``value_bits`` is gathered as bfloat16 or
low-bit codes or summed exactly.
"""
from __future__ import annotations

from typing import Dict, Optional

from . import netcost, sharded
from .compressors import FlatCodec, TensorInfo
from .quantize import QuantizedWire
from .wire import index_dtype_for


class LocalStepsPlan:
    """The routing plan of :class:`horovod_adtopk.local_steps.LocalSteps` (its methods use its fields)."""

    def plan(self) -> None:
        """Each tensor's path, by the compressor's per-step rule at the current world size."""
        world = self.comm.size()
        self.half_gather: Dict[str, bool] = {}
        self.shard_plans = {}
        if world != self.owner_world:  # the shards moved: the owners' residuals are dropped (module docstring)
            self.owner, self.owner_world = {}, world
        for name, info in self.infos.items():
            path = None
            if self.sparse:
                sparse, reason = self.compression.choose_path(info, world, payload=self.payload_bytes(info))
                plan = self._shard_plan(info, world)
                if plan is not None:
                    choice, why = self._pick(plan, info, world, self._gather_bytes(info) if sparse else None)
                    if choice == "sharded":
                        sparse, reason, path = True, why, "sharded"
                        self.shard_plans[name] = plan
                if not sparse and self.outer.value_bits is not None:
                    self.half_gather[name] = self._gathers(2 * info.numel, info, world)
                    reason += "; bfloat16 allgather" if self.half_gather[name] else "; exact allreduce"
            elif self.low_bit_dense:
                sparse = False
                block = QuantizedWire.dense(self.outer.value_bits, info.shape, self.outer.value_group).block_bytes
                gather = self._gathers(block, info, world)
                self.half_gather[name] = gather
                reason = (f"dense, {self.outer.value_bits}-bit values" if gather else
                          f"dense, exact allreduce ({self.outer.value_bits}-bit codes gathered from {world} ranks "
                          "would move more)")
                plan = self._shard_plan(info, world)
                if plan is not None:
                    choice, why = self._pick(plan, info, world, block if gather else None)
                    if choice == "sharded":
                        self.shard_plans[name], self.half_gather[name] = plan, True
                        reason, path = f"dense, {self.outer.value_bits}-bit values, {why}", "sharded"
            else:
                sparse, reason = False, "dense compressor"
            self.sparse_path[name] = sparse
            self.stats.set_path(name, info.numel, sparse, reason, path=path)

    def _shard_plan(self, info: TensorInfo, world: int, layout=None) -> Optional[sharded.Plan]:
        """The owner-sharded plan of a tensor (None: it cannot be sharded, or ``exchange="allgather"``)."""
        if self.outer.exchange == "allgather" or world < 2:
            return None
        bits, group = self.outer.value_bits, self.outer.value_group
        if self.low_bit_dense:
            return sharded.plan_dense(info.name, info.shape, bits, group, world)
        c = self.compression
        if not self.sparse or len(info.shape) < c.min_dims or info.numel < c.min_numel or not hasattr(c, "codec"):
            return None
        layout = layout if layout is not None else getattr(c.codec(info), "layout", None)
        if layout is None:
            return None
        return sharded.plan_sparse(info.name, layout, bits, group, world, c.wire_value_dtype(info.dtype),
                                   index_dtype_for(layout.fiber_len - 1))

    def _gather_bytes(self, info: TensorInfo) -> int:
        """One rank's sparse payload for an allgather (low-bit block, or values and indices)."""
        quantized = self.payload_bytes(info)
        if quantized is not None:
            return quantized
        c = self.compression
        codec = c.codec(info)
        return sharded.PlainWire(codec.count, c.wire_value_dtype(info.dtype), codec.index_dtype).block_bytes

    def _pick(self, plan: sharded.Plan, info: TensorInfo, world: int, gather: Optional[int]):
        if self.outer.exchange == "sharded":
            return "sharded", f"sharded (forced: {sharded.worst(plan.block_sizes(), world).received} B per rank)"
        return sharded.pick(plan, gather, info.numel * info.dtype.itemsize, world)

    def payload_bytes(self, info: TensorInfo) -> Optional[int]:
        """One rank's bytes per sync for a sparse tensor where the wire differs from the per-step one
        (``value_bits``: the low-bit block of :mod:`horovod_adtopk.quantize`), else None."""
        bits, c = self.outer.value_bits, self.compression
        if bits is None or len(info.shape) < c.min_dims or info.numel < c.min_numel:
            return None  # dense by the shape rules whatever the payload
        count = c.nominal_count(info)
        if count < 1:
            return None
        codec = c.codec(info) if hasattr(c, "codec") else FlatCodec(info.numel, count)
        return QuantizedWire.for_codec(bits, codec, info.numel, self.outer.value_group).block_bytes

    @staticmethod
    def _gathers(block: int, info: TensorInfo, world: int) -> bool:
        """Whether gathering a ``block``-byte rendering of a dense tensor (bfloat16, or low-bit codes; its
        rounding kept in e_r) moves fewer bytes than an fp32 allreduce of it (bfloat16: up to 3 ranks)."""
        return netcost.allgather(block, world).received < netcost.allreduce(4 * info.numel, world).received
