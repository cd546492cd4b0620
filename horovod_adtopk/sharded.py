"""The owner-sharded exchange: a two-stage compressed allreduce whose bytes per rank do not grow with the ranks.

An allgather delivers every other rank's payload, so a rank's link carries ``(W-1) x P`` for a ``P``-byte
payload. Here the tensor's fibers (the rows or columns that keep their own top-k, or the rows of a dense
low-bit tensor) are cut into ``W`` contiguous *shards*, one per rank, aligned to whole value groups (the runs
of fibers that share one set of levels), and the exchange runs in two stages::

    stage 1  all-to-all   rank r sends shard j of its payload to rank j (its owner); the blocks are encoded
                          exactly as the allgather path encodes them, so the sender's error feedback is the same
    owner    decode       avg_j = (1/W) sum_r D(block_rj)           every rank's shard, summed in rank order
             compensate   c_j   = avg_j + o_j                       o_j: the owner's residual (its own memory)
             select       ADTopk: each fiber of c_j keeps its k largest |entries| (ties: the lower position);
                          a dense low-bit tensor keeps every entry
             re-encode    block'_j, with the shard's format; o_j <- c_j - D(block'_j)
    stage 2  allgather    every owner's block'_j (padded to the largest shard); every rank decodes them all

Per rank and tensor, with ``b_j`` the bytes of shard ``j``'s block (``sum_j b_j`` about ``P``): stage 1 sends
``sum_{j != r} b_j`` and receives ``(W-1) b_r``; stage 2 moves ``(W-1) max_j b_j`` each way: about
``2 (W-1)/W x P`` in all, whatever ``W`` is, in ``2 (W-1)`` messages where an allgather has ``W-1``
(:func:`wire`). At 2 ranks both move ``P``; from 3 ranks on the shards move fewer bytes.

The averaged update every rank applies is ``sum_j D(block'_j)``: bitwise the same on every rank (each owner's
block is decoded by every rank the same way). The owners' residuals are in units of the average (already
divided by ``W``): the invariant ``sum of applied updates + sum_j o_j = sum of the averaged payloads``
holds exactly, so nothing is lost by the second compression. ``feedback_decay`` applies to the ranks' own
residuals only; the owners' are lossless.

Nothing here imports Horovod or ``torch.distributed`` or calls a collective: this module is the arithmetic
(plans, shard encoding, the owner's step, the assembly, the bytes). Its wire kind,
:class:`horovod_adtopk.payload.OwnerSharded`, is what every engine hands its sharded tensors to: local steps
run both stages through it in one call (one all-to-all for every sharded tensor of a sync); the per-step
engines run the stages with their own asynchronous collectives around the kind's pieces:
:class:`horovod_adtopk.exchange.ShardedExchange` (Horovod: one all-to-all per tensor from its gradient hook,
the owner's step and the allgather in ``advance()``) and the DDP bucket (one all-to-all per bucket, waited
for in the hook, one asynchronous allgather).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import netcost
from .quantize import QuantizedWire, fibers_per_group
from .wire import dtype_bytes, pack, unpack_blocks

#: accepted values of ``Outer(exchange=...)``, ``DistributedOptimizer(exchange=...)`` and
#: ``hat.ddp.CompressionState(exchange=...)``
EXCHANGES = ("auto", "allgather", "sharded")


def check_exchange(exchange) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES} (\"auto\": the exchange that moves the fewest bytes "
                         f"per rank at this world size), got {exchange!r}")
    return exchange


class PlainWire:
    """A shard's block without ``value_bits``: values in the wire dtype and fiber-local indices
    (:func:`horovod_adtopk.wire.pack`); what it carries is the values cast to the wire dtype."""

    def __init__(self, count: int, value_dtype: torch.dtype, index_dtype: torch.dtype) -> None:
        self.count, self.value_dtype, self.index_dtype = int(count), value_dtype, index_dtype
        pad = lambda n: -(-n // 8) * 8  # noqa: E731
        self.block_bytes = pad(self.count * dtype_bytes(value_dtype)) + pad(self.count * dtype_bytes(index_dtype))

    def encode(self, values: torch.Tensor, index: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        wire = values.to(self.value_dtype)
        return pack(wire, index.to(self.index_dtype), self.value_dtype, self.index_dtype), wire

    def decode(self, block: torch.Tensor, world: int = 1) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(v, i.to(torch.int64)) for v, i in unpack_blocks(block, [self.count] * world, self.value_dtype,
                                                                  self.index_dtype)]


@dataclass
class Plan:
    """How one tensor is sharded: its fiber matrix ``[fibers, fiber_len]`` (a view of the flat tensor:
    ``view(rows, cols)``, transposed when fibers are columns), ``k`` kept per fiber (``fiber_len`` for a dense
    low-bit tensor, which has no indices), ``run`` fibers per value group, and each owner's fiber range."""

    name: str
    rows: int
    cols: int
    axis: int  # 1: fibers are rows of the view, 0: columns
    k: int
    run: int
    indexed: bool
    bits: Optional[int]
    value_dtype: torch.dtype
    index_dtype: Optional[torch.dtype]
    bounds: List[Tuple[int, int]]

    @property
    def fibers(self) -> int:
        return self.rows if self.axis == 1 else self.cols

    @property
    def fiber_len(self) -> int:
        return self.cols if self.axis == 1 else self.rows

    def fits(self, layout) -> bool:
        """Whether this plan was made for ``layout`` (a density warm-up's ``k`` needs another plan)."""
        return (self.rows, self.cols, self.axis, self.k) == (layout.rows, layout.cols, layout.axis, layout.k)

    def wire(self, j: int):
        """The block format of shard ``j``."""
        lo, hi = self.bounds[j]
        n = (hi - lo) * self.k
        if self.bits is None:
            return PlainWire(n, self.value_dtype, self.index_dtype)
        if n == 0:
            return QuantizedWire(self.bits, 0, 1, self.fiber_len - 1 if self.indexed else None)
        return QuantizedWire(self.bits, n, self.k * self.run, self.fiber_len - 1 if self.indexed else None)

    def block_sizes(self) -> List[int]:
        return [self.wire(j).block_bytes for j in range(len(self.bounds))]

    def matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """The fiber matrix of a flat (1-D) tensor: a view, writes go through."""
        m = flat.view(self.rows, self.cols)
        return m if self.axis == 1 else m.t()


def split(groups: int, world: int) -> List[Tuple[int, int]]:
    """Owner ``j``'s groups: ``[G j // W, G (j+1) // W)`` (sizes differ by at most one)."""
    return [(groups * j // world, groups * (j + 1) // world) for j in range(world)]


def plan_sparse(name: str, layout, bits: Optional[int], value_group, world: int, value_dtype: torch.dtype,
                index_dtype: torch.dtype) -> Optional[Plan]:
    """The plan of an ADTopk tensor (a :class:`horovod_adtopk.selection.FiberLayout`), or None where the
    fibers cannot be shared among owners (fewer than two value groups)."""
    F, k = layout.num_fibers, layout.k
    if k < 1 or world < 2:
        return None
    run = fibers_per_group(F, k, value_group) if bits is not None else 1
    groups = F // run
    if groups < 2:
        return None
    bounds = [(lo * run, hi * run) for lo, hi in split(groups, world)]
    return Plan(name, layout.rows, layout.cols, layout.axis, k, run, True, bits, value_dtype, index_dtype, bounds)


def plan_dense(name: str, shape, bits: int, value_group, world: int) -> Optional[Plan]:
    """The plan of a dense low-bit tensor (every entry a code; levels per row of ``[d0, -1]`` or per run of
    rows), or None for fewer than two groups of rows (a 1-D tensor: one)."""
    if len(shape) < 2 or world < 2:
        return None
    rows = int(shape[0])
    numel = 1
    for d in shape:
        numel *= int(d)
    if rows == 0 or numel == 0:
        return None
    cols = numel // rows
    run = fibers_per_group(rows, cols, value_group)
    groups = rows // run
    if groups < 2:
        return None
    bounds = [(lo * run, hi * run) for lo, hi in split(groups, world)]
    return Plan(name, rows, cols, 1, cols, run, False, bits, torch.float32, None, bounds)


def wire(blocks: Sequence[int], rank: int, world: int) -> netcost.Wire:
    """This rank's bytes for one tensor: stage 1 (all-to-all of the shards) and stage 2 (allgather of the
    owners' blocks, padded to the largest)."""
    if world <= 1:
        return netcost.NONE
    widest = max(blocks)
    sent = sum(b for j, b in enumerate(blocks) if j != rank) + (world - 1) * widest
    received = (world - 1) * blocks[rank] + (world - 1) * widest
    return netcost.Wire(sent, received)


def worst(blocks: Sequence[int], world: int) -> netcost.Wire:
    """The busiest rank's bytes (the one whose link decides the time)."""
    ws = [wire(blocks, r, world) for r in range(world)]
    return netcost.Wire(max(w.sent for w in ws), max(w.received for w in ws))


def seconds(blocks: Sequence[int], world: int, link: netcost.Link) -> float:
    """Alpha-beta time: ``2 (W-1)`` messages and the busiest rank's bytes."""
    w = worst(blocks, world)
    return 2 * (world - 1) * link.latency + max(w.sent, w.received) / link.bandwidth


# --- the exchange ---------------------------------------------------------------------------------------------

@dataclass
class Contribution:
    """One rank's part of a tensor: the plan and the blocks of its shards (rank-side encoding done)."""
    plan: Plan
    blocks: List[torch.Tensor]
    dtype: torch.dtype
    numel: int


def encode_sparse(plan: Plan, values: torch.Tensor, index: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """A rank's selection (``k`` entries per fiber, fiber-major, fiber-local indices) cut into the shards'
    blocks; returns the blocks and the values they carry (float32, or the wire dtype without value_bits), in
    ``values``' order."""
    blocks, carried = [], []
    for j, (lo, hi) in enumerate(plan.bounds):
        w = plan.wire(j)
        b, c = w.encode(values[lo * plan.k:hi * plan.k], index[lo * plan.k:hi * plan.k])
        blocks.append(b)
        carried.append(c)
    return blocks, torch.cat(carried) if carried else values


def encode_dense(plan: Plan, a: torch.Tensor) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """A dense low-bit tensor ``a`` cut into the shards' blocks of rows; returns them and the flat values they
    carry (float32)."""
    m = a.reshape(plan.rows, plan.cols)
    blocks, carried = [], []
    for j, (lo, hi) in enumerate(plan.bounds):
        b, c = plan.wire(j).encode(m[lo:hi].reshape(-1))
        blocks.append(b)
        carried.append(c)
    return blocks, torch.cat(carried)


def owner_step(plan: Plan, j: int, received: List[torch.Tensor], residual: Optional[torch.Tensor], scale: float,
               dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """On owner ``j``: every rank's block of shard ``j`` (rank order) summed times ``scale`` (the average's
    ``1 / W``), compensated with the owner's residual, re-selected and re-encoded. Returns (block', new residual
    ``[n, fiber_len]``)."""
    lo, hi = plan.bounds[j]
    n, L = hi - lo, plan.fiber_len
    acc = torch.zeros(n * L, dtype=dtype, device=received[0].device if received else None)
    w = plan.wire(j)
    if n:
        if plan.indexed:
            rows = torch.arange(n, device=acc.device, dtype=torch.int64).repeat_interleave(plan.k) * L
            for block in received:  # rank order: the same sum on every owner's run, whatever the device
                (vals, idx), = w.decode(block, 1)
                acc.index_add_(0, rows + idx, vals.to(dtype) * scale)
        else:
            for block in received:
                (vals, _), = w.decode(block, 1)
                acc += vals.to(dtype)
            acc.mul_(scale)
    c = acc.view(n, L)
    if residual is not None:
        c = c + residual
    if n == 0:  # an owner without fibers (fewer groups than ranks)
        return torch.zeros(0, dtype=torch.uint8, device=c.device), c
    if plan.indexed:
        mag = torch.nan_to_num(c.abs(), nan=float("inf"))
        idx = torch.sort(mag, dim=1, descending=True, stable=True).indices[:, :plan.k]
        vals = c.gather(1, idx)
        block, carried = w.encode(vals.reshape(-1), idx.reshape(-1))
        left = c.clone()
        left.scatter_(1, idx, vals - carried.view(n, plan.k).to(dtype))
    else:
        block, carried = w.encode(c.reshape(-1))
        left = c - carried.view(n, L).to(dtype)
    left = torch.where(torch.isfinite(left), left, torch.zeros_like(left))  # NaN/Inf are sent once, not kept
    return block, left


def pack_alltoall(blocks: Sequence[List[torch.Tensor]], world: int, rank: int
                  ) -> Tuple[torch.Tensor, List[int], List[int]]:
    """Stage 1's buffer for several tensors' blocks (``blocks[t][j]``: tensor ``t``'s block for owner ``j``):
    destination ``j`` receives each tensor's block ``j``, in tensor order. Returns the buffer, its splits per
    destination, and the size of each tensor's block that this rank owns (what every source sends it)."""
    send = torch.cat([b[j] for j in range(world) for b in blocks])
    splits = [sum(b[j].numel() for b in blocks) for j in range(world)]
    return send, splits, [b[rank].numel() for b in blocks]


def unpack_alltoall(got: torch.Tensor, mine: Sequence[int], world: int) -> List[List[torch.Tensor]]:
    """Stage 1's received buffer cut per tensor into every source's block, in rank order."""
    owned: List[List[torch.Tensor]] = [[] for _ in mine]
    offset = 0
    for _src in range(world):
        for t, size in enumerate(mine):
            owned[t].append(got[offset:offset + size])
            offset += size
    return owned


def pad_block(plan: Plan, block: torch.Tensor) -> torch.Tensor:
    """An owner's block padded to the widest shard's (every rank's allgather contribution has one size)."""
    out = torch.zeros(max(plan.block_sizes()), dtype=torch.uint8, device=block.device)
    out[:block.numel()] = block
    return out


def assemble(plan: Plan, gathered: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Every owner's block (allgathered, padded, rank order) decoded into ``flat`` (1-D, zeros where no owner
    kept an entry; its dtype)."""
    m = plan.matrix(flat)
    sizes = plan.block_sizes()
    width = max(sizes)
    for j, (lo, hi) in enumerate(plan.bounds):
        if hi == lo:
            continue
        (vals, idx), = plan.wire(j).decode(gathered[j * width:j * width + sizes[j]], 1)
        if plan.indexed:
            m[lo:hi].scatter_(1, idx.view(hi - lo, plan.k), vals.to(flat.dtype).view(hi - lo, plan.k))
        else:
            m[lo:hi] = vals.to(flat.dtype).view(hi - lo, plan.fiber_len)
    return flat


def collective_name(prefix: str, plans) -> str:
    """A name that carries every shard's size (the same on every rank): Horovod's response cache keys an
    all-to-all by name, and a cached entry of another layout under the same name delivers stale splits."""
    return f"{prefix}.{zlib.crc32(repr([p.block_sizes() for p in plans]).encode()):08x}"


def restore(saved: Optional[dict], full: Optional[dict], plans: Dict[str, Plan], rank: int,
            devices: Dict[str, torch.device]) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """The owners' residuals of this rank from a checkpoint: its own shards (``saved``, same world size), or its
    range of every owner's residuals joined in fiber order (``full``: :func:`horovod_adtopk.state.fold`).
    Returns them and the names dropped because they do not fit this world's plans."""
    out, dropped = {}, []
    for name, t in (full if full is not None else (saved or {})).items():
        plan = plans.get(name)
        if plan is None:
            dropped.append(name)
            continue
        lo, hi = plan.bounds[rank]
        want = (plan.fibers, plan.fiber_len) if full is not None else (hi - lo, plan.fiber_len)
        if tuple(t.shape) != want:
            dropped.append(name)
            continue
        t = t[lo:hi] if full is not None else t
        out[name] = t.detach().to(devices[name], copy=True).contiguous()
    return out, dropped


def pick(plan: Optional[Plan], gather_bytes: Optional[int], dense_bytes: int, world: int,
         link: Optional[netcost.Link] = None) -> Tuple[str, str]:
    """The cheapest way for one tensor: "sharded", "allgather" (of ``gather_bytes``; None where the tensor
    cannot be gathered) or "allreduce" (of ``dense_bytes``), by alpha-beta time on ``link`` (default: the
    environment's, latency 0: by bytes). Returns (choice, reason)."""
    link = link or netcost.Link.from_env()
    options = {"allreduce": netcost.seconds(netcost.ALLREDUCE, dense_bytes, world, link)}
    if gather_bytes is not None:
        options["allgather"] = netcost.seconds(netcost.ALLGATHER, gather_bytes, world, link)
    if plan is not None:
        options["sharded"] = seconds(plan.block_sizes(), world, link)
    best = min(options, key=lambda k: (options[k], k != "allgather"))  # ties: the allgather (fewer messages)
    described = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(options.items(), key=lambda kv: kv[1]))
    return best, f"{best} ({described} at W={world}, {link.describe()})"
