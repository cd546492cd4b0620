"""The payload layer: how one tensor's contribution is encoded, moved by one collective and summed.

A *wire kind* is a small class that knows three things about a tensor's contribution:

- ``encode(item)``: the block this rank hands to the collective (and what error feedback keeps back: a kind
  that rounds or drops part of ``a`` puts it into the memory here, before anything is sent);
- which collective moves the blocks (``allreduce``: summed as they travel; ``allgather``: every rank's block
  delivered, decoded and summed in rank order, so every rank gets the same bits);
- ``finish(item, block, received)``: the averaged tensor from what arrived.

:func:`run` is the one loop over kinds: encode every tensor of a kind, one named collective per tensor through
the engine's communicator (``sum_tensors`` / ``gather_tensors``), then decode and sum, and count the bytes
through :meth:`horovod_adtopk.stats.Stats.traffic` with the wire bytes of the collective actually used
(:mod:`horovod_adtopk.netcost`). A kind whose exchange takes rounds of its own (the owner-sharded exchange:
an all-to-all, then an allgather) provides ``run_kind`` instead and is called with all its tensors at once.

A new wire kind (an int8 dense wire, a two-stage compressed allreduce, a whole-bucket selection's packed
buffer) is a new class handed to :func:`run`; no engine changes. The local-steps exchange
(:mod:`horovod_adtopk.local_steps`) runs every tensor through :func:`run`. The per-step engines issue their
own asynchronous collectives (from gradient hooks, fused per DDP bucket) and encode, decode and count
through the same kinds: :class:`DenseSum`, :class:`SparseGather`, :class:`SharedSum` and
:class:`OwnerSharded` (:mod:`horovod_adtopk.exchange`, :mod:`horovod_adtopk.hierarchical`,
:mod:`horovod_adtopk.ddp.bucket`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from . import netcost, sharded
from .compressors import TensorInfo
from .memory import ErrorFeedback
from .quantize import QuantizedWire
from .sparsify import aggregate_blocks, sum_in_rank_order
from .wire import pack, payload_bytes


@dataclass
class Item:
    """One tensor's contribution: its name, its :class:`TensorInfo` (None where the engine has none: a dense
    gradient, a DDP bucket's concatenated dense gradients) and what the kind encodes (a dense tensor, a
    selection, ``(plan, selection)`` of the owner-sharded exchange)."""
    name: str
    info: Optional[TensorInfo]
    data: Any


class Kind:
    """A wire kind (module docstring). ``prefix`` names its collectives (``prefix.<tensor name>``)."""
    prefix = "hat.payload"
    collective = "allgather"

    def __init__(self, world: int) -> None:
        self.world = world

    def encode(self, item: Item) -> torch.Tensor:
        raise NotImplementedError

    def entries(self, item: Item) -> int:
        """Entries this rank sends for ``item`` (for ``stats()``'s density)."""
        return item.info.numel

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def wire(self, block: torch.Tensor) -> netcost.Wire:
        return self.wire_of(payload_bytes(block))

    def wire_of(self, nbytes: int) -> netcost.Wire:
        """What a rank's link carries when each rank hands ``nbytes`` to this kind's collective."""
        return netcost.allreduce(nbytes, self.world) if self.collective == "allreduce" else \
            netcost.allgather(nbytes, self.world)


def run(comm, stats, groups: Sequence[Tuple[Kind, List[Item]]]) -> Dict[str, torch.Tensor]:
    """Every group's tensors through their kind, groups in order; returns each tensor's averaged update."""
    out: Dict[str, torch.Tensor] = {}
    for kind, items in groups:
        if not items:
            continue
        if hasattr(kind, "run_kind"):
            out.update(kind.run_kind(comm, stats, items))
            continue
        blocks = [kind.encode(it) for it in items]
        names = [f"{kind.prefix}.{it.name}" for it in items]
        move = comm.sum_tensors if kind.collective == "allreduce" else comm.gather_tensors
        for it, block, got in zip(items, blocks, move(blocks, names)):
            stats.traffic(it.name, kind.entries(it), payload_bytes(block), kind.wire(block))
            out[it.name] = kind.finish(it, block, got)
    return out


# --- the local-steps exchange's kinds -----------------------------------------------------------------------------

class DenseSum(Kind):
    """A dense tensor, rendered by a Horovod-style dense compressor when one is given (``compress`` /
    ``decompress``: fp16), summed by allreduce. Every engine's dense path encodes and decodes through it: the
    Horovod per-step exchange (one tensor or a group; Horovod's op averages), the DDP bucket (its dense gradients
    concatenated; divided by the world before :meth:`decode`) and local steps (:func:`run`: :meth:`finish`
    divides by the ``active`` members, joined members add zeros)."""
    prefix, collective = "hat.outer.dense", "allreduce"

    def __init__(self, world: int, active: Optional[int] = None, compression=None) -> None:
        super().__init__(world)
        self.active, self.compression = active, compression
        self._ctx: Dict[str, Any] = {}

    def encode(self, item: Item) -> torch.Tensor:
        if self.compression is None:
            return item.data
        wire, self._ctx[item.name] = self.compression.compress(item.data)
        return wire

    def decode(self, item: Item, received: torch.Tensor) -> torch.Tensor:
        """What arrived for ``item``, decompressed (no averaging: the engine's collective or caller does it)."""
        if self.compression is None:
            return received
        return self.compression.decompress(received, self._ctx.pop(item.name))

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        return self.decode(item, received).to(item.info.dtype).div_(self.active).view(item.info.shape)


class SparseGather(Kind):
    """A selection's values and indices packed into one block (:func:`horovod_adtopk.wire.pack`), gathered, and
    every rank's entries summed in rank order, times ``scale`` (``1 / world`` unless given: e.g. Horovod's
    ``postscale / size`` for Average, 1 for Sum). Every engine's flat sparse exchange decodes through
    :meth:`sum_into`: the Horovod per-step exchange and the hierarchical one (one block per tensor), the DDP
    bucket (the blocks of a bucket in one buffer) and local steps (:func:`run`)."""
    prefix = "hat.outer.sparse"

    def __init__(self, world: int, compression, scale: Optional[float] = None) -> None:
        super().__init__(world)
        self.compression = compression
        self.scale = 1.0 / world if scale is None else scale

    def value_dtype(self, info: TensorInfo) -> torch.dtype:
        return self.compression.wire_value_dtype(info.dtype)

    def encode(self, item: Item) -> torch.Tensor:
        s = item.data
        if s.block is not None and s.wire_values.dtype == self.value_dtype(item.info):
            return s.block  # packed by the selection (bucket select)
        return pack(s.wire_values, s.wire_index, self.value_dtype(item.info), s.codec.index_dtype)

    def entries(self, item: Item) -> int:
        return item.data.values.numel()

    def sum_into(self, out: torch.Tensor, item: Item, received: torch.Tensor,
                 counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Every rank's block of ``received`` (concatenated in rank order; ``counts[r]`` entries from rank ``r``,
        the codec's fixed count by default) decoded and summed into ``out`` (flat, overwritten), times ``scale``."""
        codec = item.data.codec
        aggregate_blocks(out, received, counts if counts is not None else [codec.count] * self.world, codec,
                         self.value_dtype(item.info), self.scale)
        return out

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        avg = torch.empty(item.info.numel, dtype=item.info.dtype, device=block.device)
        return self.sum_into(avg, item, received).view(item.info.shape)


class SharedSum(Kind):
    """Values at positions every rank drew identically (Random-k), summed by allreduce in float32 at least (each
    rank's rounding to the wire dtype is fed back by its memory, and a float16 sum over ranks can neither
    overflow nor round); :meth:`place` writes the summed values at their positions."""
    prefix, collective = "hat.shared", "allreduce"

    def encode(self, item: Item) -> torch.Tensor:
        v = item.data.wire_values
        return v.to(torch.promote_types(v.dtype, torch.float32))

    def entries(self, item: Item) -> int:
        return item.data.values.numel()

    @staticmethod
    def place(out: torch.Tensor, item: Item, summed: torch.Tensor) -> torch.Tensor:
        """``out`` (flat, overwritten): zero except the summed values at the selection's positions."""
        out.zero_()
        out[item.data.flat] = summed.to(out.dtype)
        return out

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        out = torch.empty(item.info.numel, dtype=item.info.dtype, device=received.device)
        return self.place(out, item, received.div_(self.world)).view(item.info.shape)


class LowBitSparseGather(Kind):
    """A selection's values as b-bit codes and its indices bit-packed (:mod:`horovod_adtopk.quantize`); what the
    codes cannot carry goes back into the error-feedback memory; decoded and summed in rank order."""
    prefix = "hat.outer.sparse"

    def __init__(self, world: int, bits: int, group: Optional[int], memory: Optional[ErrorFeedback]) -> None:
        super().__init__(world)
        self.bits, self.group, self.memory = bits, group, memory
        self._wires: Dict[str, QuantizedWire] = {}

    def encode(self, item: Item) -> torch.Tensor:
        s = item.data
        wire = self._wires[item.name] = QuantizedWire.for_codec(self.bits, s.codec, item.info.numel, self.group)
        block, carried = wire.encode(s.values, s.wire_index)
        if self.memory is not None:
            self.memory.update(item.name, s.flat, s.values - carried.to(s.values.dtype))
        return block

    def entries(self, item: Item) -> int:
        return item.data.values.numel()

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        wire, info = self._wires.pop(item.name), item.info
        decoded = wire.decode(received, self.world)
        avg = torch.empty(info.numel, dtype=info.dtype, device=block.device)
        sum_in_rank_order(avg, torch.cat([v for v, _ in decoded]), torch.cat([i for _, i in decoded]),
                          [wire.count] * self.world, item.data.codec, 1.0 / self.world)
        return avg.view(info.shape)


class Bfloat16Gather(Kind):
    """A dense tensor ``a = delta + beta e`` as bfloat16, gathered and summed in rank order in the tensor's
    dtype; the rounding stays in the error-feedback memory (when there is one)."""
    prefix = "hat.outer.bf16"

    def __init__(self, world: int, memory: Optional[ErrorFeedback]) -> None:
        super().__init__(world)
        self.memory = memory

    def encode(self, item: Item) -> torch.Tensor:
        def to_bf16(a: torch.Tensor):
            half = a.reshape(-1).to(torch.bfloat16)
            return half.view(torch.uint8), half
        if self.memory is None:
            return to_bf16(item.data)[0]
        return self.memory.carry(item.name, item.data, to_bf16)  # e <- a - what bfloat16 carries

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        info = item.info
        parts = received.contiguous().view(torch.bfloat16).view(self.world, info.numel)
        total = torch.zeros(info.numel, dtype=info.dtype, device=received.device)
        for r in range(self.world):
            total += parts[r].to(info.dtype)
        return total.mul_(1.0 / self.world).view(info.shape)


class LowBitDenseGather(Kind):
    """Every entry of ``a = delta + beta e`` as a b-bit code (levels per row or per ``group`` entries, no
    indices: :meth:`horovod_adtopk.quantize.QuantizedWire.dense`); ``e <- a - carried``; decoded and summed in
    rank order in the tensor's dtype."""
    prefix = "hat.outer.codes"

    def __init__(self, world: int, bits: int, group: Optional[int], memory: ErrorFeedback) -> None:
        super().__init__(world)
        self.bits, self.group, self.memory = bits, group, memory
        self._wires: Dict[str, QuantizedWire] = {}

    def encode(self, item: Item) -> torch.Tensor:
        wire = self._wires[item.name] = QuantizedWire.dense(self.bits, item.info.shape, self.group)
        return self.memory.carry(item.name, item.data, lambda a: wire.encode(a.reshape(-1)))

    def finish(self, item: Item, block: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
        wire, info = self._wires.pop(item.name), item.info
        total = torch.zeros(info.numel, dtype=info.dtype, device=received.device)
        for values, _ in wire.decode(received.contiguous().view(-1), self.world):
            total += values.to(info.dtype)
        return total.mul_(1.0 / self.world).view(info.shape)


class OwnerSharded(Kind):
    """The owner-sharded exchange (:mod:`horovod_adtopk.sharded`): each tensor cut into its owners' shards (an
    item's ``data`` is ``(plan, selection)`` for a sparse tensor, ``(plan, delta)`` for a dense low-bit one),
    one all-to-all for all of them, each owner averages, re-selects with its own residual and re-encodes its
    shard, then an allgather of the owners' blocks. ``owner``: this rank's owner residuals, updated in place.

    :meth:`run_kind` runs both stages (local steps); the per-step engines issue the collectives themselves,
    asynchronously, around the same pieces: :meth:`contribution` (the blocks of stage 1),
    :func:`horovod_adtopk.sharded.pack_alltoall` / ``unpack_alltoall`` (several tensors in one all-to-all),
    :meth:`owner_block` (the owner's step and stage 2's block), :meth:`assemble` (the update from stage 2) and
    :meth:`traffic` (the bytes)."""
    prefix = "hat.outer.sharded"

    def __init__(self, world: int, bits: Optional[int], memory: Optional[ErrorFeedback],
                 owner: Dict[str, torch.Tensor]) -> None:
        super().__init__(world)
        self.bits, self.memory, self.owner = bits, memory, owner

    def contribution(self, item: Item) -> sharded.Contribution:
        plan, x = item.data
        if torch.is_tensor(x):  # dense low-bit: a = delta + beta e cut into shards of rows, e <- a - carried
            blocks = self.memory.carry(item.name, x, lambda a: sharded.encode_dense(plan, a))
        else:  # a selection, encoded as the allgather path encodes it (the same error feedback)
            quantized = self.bits is not None
            blocks, carried = sharded.encode_sparse(plan, x.values if quantized else x.wire_values, x.wire_index)
            if quantized and self.memory is not None:
                self.memory.update(item.name, x.flat, x.values - carried.to(x.values.dtype))
        return sharded.Contribution(plan, blocks, item.info.dtype, item.info.numel)

    def owner_block(self, name: str, plan: sharded.Plan, rank: int, received: List[torch.Tensor], scale: float,
                    dtype: torch.dtype) -> torch.Tensor:
        """The owner's step on this rank's shard of ``name`` (every source's block in rank order, summed times
        ``scale``, this rank's owner residual added, re-selected and re-encoded; the residual kept): the block
        this rank hands to stage 2's allgather, padded to the widest owner's."""
        block, self.owner[name] = sharded.owner_step(plan, rank, received, self.owner.get(name), scale, dtype)
        return sharded.pad_block(plan, block)

    @staticmethod
    def assemble(plan: sharded.Plan, gathered: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (flat, overwritten): every owner's block of ``gathered`` decoded, zeros elsewhere."""
        return sharded.assemble(plan, gathered, out.zero_())

    def traffic(self, plan: sharded.Plan, rank: int) -> Tuple[int, netcost.Wire]:
        """The bytes of the shards this rank hands over (payload) and what its link carries in both stages."""
        sizes = plan.block_sizes()
        return sum(sizes), sharded.wire(sizes, rank, self.world)

    def run_kind(self, comm, stats, items: List[Item]) -> Dict[str, torch.Tensor]:
        rank = comm.rank()
        parts = [self.contribution(it) for it in items]
        send, splits, mine = sharded.pack_alltoall([p.blocks for p in parts], self.world, rank)
        got = comm.alltoall(send, splits, [sum(mine)] * self.world,
                            sharded.collective_name(self.prefix + ".shards", [p.plan for p in parts]))
        padded = [self.owner_block(it.name, p.plan, rank, received, 1.0 / self.world, p.dtype)
                  for it, p, received in zip(items, parts, sharded.unpack_alltoall(got, mine, self.world))]
        gathered = comm.gather_tensors(padded, [f"{self.prefix}.owners.{it.name}" for it in items])
        out = {}
        for it, p, buf in zip(items, parts, gathered):
            _, wire = self.traffic(p.plan, rank)
            count = sum((hi - lo) for lo, hi in p.plan.bounds) * p.plan.k
            stats.traffic(it.name, count, sum(b.numel() for b in p.blocks), wire)
            update = self.assemble(p.plan, buf, torch.empty(p.numel, dtype=p.dtype, device=buf.device))
            out[it.name] = update.view(it.info.shape)
        return out
