"""Hierarchical exchange: dense inside a host, sparse between hosts.

A flat sparse exchange allgathers one payload from each of the ``W`` ranks, so every rank receives
``W - 1`` payloads and the bytes crossing the hosts' links grow with ``W``. With ``H`` hosts of ``L``
ranks each (``W = H L``), this exchange kind sends a sparse tensor in four steps:

    (a) the ``L`` ranks of a host sum their gradients densely, by reduce-scatter over the host's process
        set: local rank ``j`` receives block ``j`` of ``S_h = sum_j g_(h,j)``. Blocks are whole fibers (rows
        of ``M = g.reshape(d0, -1)`` when fibers are rows, ``axis=1``, columns when ``axis=0``), split as
        Horovod splits dim 0: ``n // L`` fibers each, the first ``n % L`` ranks one more.
    (b) local rank ``j`` applies error feedback and the compressor to block ``j`` alone, as to a tensor of
        its own: ``a = S_h[j] + r_(h,j)``; send ``C(a)``; ``r_(h,j) <- a - D(C(a))``. The memory is per rank and
        per block (of the host's summed gradient). ADTopk keeps exactly its per-fiber rule (same fibers,
        same ``k``); a rule over the whole tensor (Top-k, thresholds, Random-k) keeps the block's share of
        it: ``k = max(1, floor(ratio * block_numel))`` of the block.
    (c) the ranks with local rank ``j`` on every host (a cross-host process set of ``H`` ranks) allgather
        their payloads and scatter-add them: ``G[j] = scale * sum_h D(C(a_(h,j)))``, with ``scale = 1/W``
        for Average, 1 for Sum.
    (d) the host's ranks allgather the blocks densely: every rank ends with the same full ``G``.

So each rank's inter-host payload is one block's (``1/L`` of the tensor's), and the allgather's group is
``H``, not ``W``. Every rank computes bitwise the same ``G``: a block's sum is formed by one rank per host
from the same payloads in host order, and copied inside the host.

Fall-backs to the flat exchange, with the reason in ``opt.stats()["hierarchical"]``: one host, one rank
per host, hosts with different numbers of ranks, a process set other than the global one, PowerSGD (its
own collectives), DGC momentum correction (a per-rank velocity of the full gradient), and per tensor a
tensor with fewer fibers than local ranks. ``hierarchical="auto"`` also asks :func:`hierarchical_wins`
(the alpha-beta cost model below, with :data:`DEFAULT_LINKS`).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from . import lowrank, netcost
from .communicator import Communicator, dynamic_process_sets, host_layout, process_sets
from .compressors import ADTopkCompressor, SparseCompressor, TensorInfo
from .exchange import UPCAST, Exchange, SparseSender, store_grad
from .memory import ErrorFeedback
from .selection import matrix_view_shape
from .stats import Stats
from .wire import COUNT_BYTES, block_bytes, dtype_bytes

STATE_FORMAT = 1


# --- cost model ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkModel:
    """Alpha-beta links: ``alpha`` seconds per message, ``bandwidth`` bytes per second, inside a host
    (``intra``) and between hosts (``inter``; one link per host, shared by its ranks). The times are
    :mod:`horovod_adtopk.netcost`'s, on :attr:`intra` or :attr:`inter`."""

    intra_alpha: float
    intra_bandwidth: float
    inter_alpha: float
    inter_bandwidth: float

    @property
    def intra(self) -> netcost.Link:
        return netcost.Link(bandwidth=self.intra_bandwidth, latency=self.intra_alpha)

    @property
    def inter(self) -> netcost.Link:
        return netcost.Link(bandwidth=self.inter_bandwidth, latency=self.inter_alpha)


#: what ``hierarchical="auto"`` assumes: 10 Gbit/s Ethernet between hosts, 100 Gbit/s-class inside a host
DEFAULT_LINKS = LinkModel(intra_alpha=10e-6, intra_bandwidth=12.5e9, inter_alpha=50e-6, inter_bandwidth=1.25e9)


def flat_allgather_seconds(payload: float, hosts: int, local: int, links: LinkModel) -> float:
    """A ring allgather of ``payload`` bytes per rank over all ``W = hosts * local`` ranks, ordered by host:
    ``W - 1`` steps; each host's link carries ``W - 1`` payloads each way (one ring edge leaves the host)."""
    return netcost.seconds(netcost.ALLGATHER, int(payload), hosts * local, links.inter if hosts > 1 else links.intra)


def dense_allreduce_seconds(dense: float, hosts: int, local: int, links: LinkModel) -> float:
    """A ring allreduce of ``dense`` bytes over all ranks: ``2 (W - 1)`` steps of ``dense / W`` bytes."""
    return netcost.seconds(netcost.ALLREDUCE, int(dense), hosts * local, links.inter if hosts > 1 else links.intra)


def hierarchical_seconds(dense: float, payload: float, hosts: int, local: int, links: LinkModel) -> float:
    """Reduce-scatter and allgather of ``dense`` bytes inside the host (rings of ``L``), plus ``L`` cross-host
    ring allgathers of one block's payload (``payload / L``) that share the host's link: on that link, one
    allgather of ``payload`` among the ``H`` hosts."""
    intra = (netcost.seconds(netcost.REDUCESCATTER, int(dense), local, links.intra)
             + netcost.seconds(netcost.ALLGATHER, int(dense // max(local, 1)), local, links.intra))
    return intra + netcost.seconds(netcost.ALLGATHER, int(payload), hosts, links.inter)


def hierarchical_wins(dense: float, payload: float, flat_sparse: bool, hosts: int, local: int,
                      links: LinkModel = DEFAULT_LINKS) -> Tuple[bool, str]:
    """Whether the hierarchical exchange is predicted faster than the flat path (sparse allgather when the
    flat rule keeps the tensor sparse, else dense allreduce); with the two predictions as the reason."""
    flat = (flat_allgather_seconds(payload, hosts, local, links) if flat_sparse
            else dense_allreduce_seconds(dense, hosts, local, links))
    hier = hierarchical_seconds(dense, payload, hosts, local, links)
    what = "flat allgather" if flat_sparse else "dense allreduce"
    return hier < flat, f"cost model: hierarchical {hier * 1e3:.3f} ms vs {what} {flat * 1e3:.3f} ms"


# --- layout -------------------------------------------------------------------------------------------------

def split_fibers(num_fibers: int, parts: int) -> List[Tuple[int, int]]:
    """``[start, stop)`` fiber ranges of the ``parts`` blocks, as Horovod's reduce-scatter splits dim 0."""
    base, extra = divmod(num_fibers, parts)
    bounds, start = [], 0
    for j in range(parts):
        stop = start + base + (1 if j < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class Topology:
    """The job's hosts: ``hosts`` x ``local_size`` ranks; this rank is ``local_rank`` on host ``host``."""

    hosts: int
    local_size: int
    host: int
    local_rank: int
    local: Communicator  # the ranks of this host
    cross: Communicator  # the ranks with this local rank, one per host

    def describe(self) -> List[int]:
        return [self.hosts, self.local_size]


def discover(comm: Communicator) -> Tuple[Optional[Topology], str]:
    """This job's :class:`Topology` (creating the process sets; collective), or None and why not. Decided
    from every rank's place (one allgather), so all ranks reach the same answer."""
    if not comm.is_global():
        return None, "process_set is not the global process set"
    host, local_rank, local_size, _ = host_layout()
    places = comm.allgather(torch.tensor([[host, local_rank, local_size]], dtype=torch.int64),
                            "hat.hier.layout").tolist()
    sizes = sorted({s for _, _, s in places})
    hosts = sum(1 for _, j, _ in places if j == 0)
    if hosts <= 1:
        return None, "one host"
    if len(sizes) > 1:
        return None, f"hosts run different numbers of ranks {sizes} (uneven layout)"
    if local_size <= 1:
        return None, "one rank per host"
    by_host = [[r for r, (h, _, _) in enumerate(places) if h == i] for i in range(hosts)]
    by_local = [[r for r, (_, j, _) in enumerate(places) if j == i] for i in range(local_size)]
    if any(len(g) != local_size for g in by_host) or any(len(g) != hosts for g in by_local):
        return None, f"ranks' (host, local rank) places are not a full {hosts} x {local_size} grid"
    sets = process_sets(by_host + by_local)
    return Topology(hosts, local_size, host, local_rank, sets[host], sets[hosts + local_rank]), "hierarchical"


@dataclass(frozen=True)
class BlockPlan:
    """How one tensor is cut: matrix view ``rows x cols``; blocks of whole fibers along ``axis`` (1: blocks
    of rows, 0: blocks of columns); this rank owns fibers ``[start, stop)``."""

    name: str
    rows: int
    cols: int
    axis: int
    bounds: Tuple[Tuple[int, int], ...]
    local_rank: int

    @property
    def start(self) -> int:
        return self.bounds[self.local_rank][0]

    @property
    def stop(self) -> int:
        return self.bounds[self.local_rank][1]

    def block_info(self, dtype: torch.dtype) -> TensorInfo:
        """The block as a tensor of its own (a matrix whose fibers are the tensor's)."""
        n = self.stop - self.start
        shape = (n, self.cols) if self.axis == 1 else (self.rows, n)
        return TensorInfo(f"{self.name}@block{self.local_rank}of{len(self.bounds)}", shape, shape[0] * shape[1], dtype)

    def fibers_major(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as ``[num_fibers, fiber_len]`` (contiguous), the layout reduce-scatter splits."""
        m = grad.reshape(self.rows, self.cols)
        return m.contiguous() if self.axis == 1 else m.t().contiguous()

    def block_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's block of a tensor (a view into ``flat``, shaped as :meth:`block_info`)."""
        m = flat.view(self.rows, self.cols)
        return m[self.start:self.stop] if self.axis == 1 else m[:, self.start:self.stop]


# --- the exchange -------------------------------------------------------------------------------------------

class _BlockSlot:
    """Stands in for the parameter in the block's own sparse exchange: its ``grad`` is the block, which
    receives the block's aggregate."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad
        self.device = grad.device


class HierarchicalExchange(Exchange):
    """One tensor's four steps: reduce-scatter (started here), block selection and cross-host allgather
    (:meth:`advance`), scatter-add and intra-host allgather of the blocks (:meth:`finish`)."""

    def __init__(self, owner: "Hierarchical", p, grad: torch.Tensor, info: TensorInfo, plan: BlockPlan,
                 step: int) -> None:
        self.params, self.owner, self.info, self.plan, self.step = (p,), owner, info, plan, step
        wire = plan.fibers_major(grad)
        up = UPCAST.get(wire.dtype)
        self.handle = owner.topology.local.reducescatter_async(wire.to(up) if up is not None else wire,
                                                               f"hat.hier.rs.{info.name}")
        owner.intra_bytes += wire.numel() * wire.element_size()
        self.inner: Optional[Exchange] = None

    def advance(self) -> None:
        owner, plan = self.owner, self.plan
        part = owner.topology.local.wait(self.handle)
        start = time.perf_counter()  # compute only: the waits are communication
        if part.shape[0] != plan.stop - plan.start:
            raise RuntimeError(f"horovod_adtopk: {self.info.name}: the reduce-scatter gave {part.shape[0]} fibers to "
                               f"local rank {plan.local_rank}, expected {plan.stop - plan.start} (Horovod's split of "
                               "dim 0 changed?)")
        block = part if plan.axis == 1 else part.t()
        block = block.to(self.info.dtype).contiguous()
        self.slot = _BlockSlot(block)
        sender = owner.senders[plan.axis]
        sender.timed(self.info.name, 0, time.perf_counter() - start)
        self.inner = sender.send(self.slot, block, plan.block_info(self.info.dtype), self.step)

    def finish(self) -> None:
        if self.inner is None:
            self.advance()
        self.inner.finish()  # the block now holds its aggregate over the hosts (scaled)
        plan, local = self.plan, self.owner.topology.local
        block = self.slot.grad
        major = block if plan.axis == 1 else block.t().contiguous()
        full = local.wait(local.allgather_async(major, f"hat.hier.ag.{self.info.name}"))
        self.owner.intra_bytes += major.numel() * major.element_size()
        start = time.perf_counter()
        result = full.view(plan.rows, plan.cols) if plan.axis == 1 else full.t()
        grad = self.params[0].grad
        if grad.is_contiguous():
            grad.view(plan.rows, plan.cols).copy_(result)
        else:
            store_grad(grad, result.contiguous())
        self.owner.senders[plan.axis].timed(self.info.name, 1, time.perf_counter() - start)


# --- the exchange kind ----------------------------------------------------------------------------------------

def _unsupported(compression: SparseCompressor, elastic: bool) -> Optional[str]:
    if lowrank.runs_own_rounds(compression):
        return f"{compression.name} runs its own collectives (not a sparse payload)"
    if compression.momentum is not None:
        return "momentum correction keeps a per-rank velocity of the whole gradient"
    if elastic:
        return "Horovod elastic: process sets are not re-created after a membership change"
    return None


def _block_compressor(compression: SparseCompressor, axis: int) -> SparseCompressor:
    """The compressor a block is selected with: ADTopk rules select it with the tensor's resolved fiber axis
    (:meth:`ADTopkCompressor.for_block`), the other rules as they are."""
    return compression.for_block(axis) if isinstance(compression, ADTopkCompressor) else compression


class Hierarchical:
    """The hierarchical exchange of one optimizer: its topology (process sets), the plan of every tensor
    it carries, and its error-feedback memory per block (see the module docstring).

    Args:
        setting: ``True`` or ``"auto"`` (the optimizer keeps ``None`` for ``False``).
        compression: the optimizer's sparse compressor.
        comm: the optimizer's communicator (must be the global process set).
        op, sum_op, op_is_average, prescale, postscale: as for :class:`horovod_adtopk.exchange.SparseSender`.
        elastic: the job runs under Horovod elastic (falls back to flat).
    """

    def __init__(self, setting, compression: SparseCompressor, comm: Communicator, op, sum_op,
                 op_is_average: bool, prescale: float, postscale: float, elastic: bool = False) -> None:
        self.setting, self.compression = setting, compression
        self.plans: Dict[str, BlockPlan] = {}
        self.reasons: Dict[str, str] = {}
        self._memory_plans: Dict[str, BlockPlan] = {}  # which block each memory entry belongs to
        self.memory = ErrorFeedback() if compression.error_feedback else None
        self.stats = Stats()
        self.intra_bytes = 0
        self.topology = None
        self.senders: Dict[int, SparseSender] = {}  # by fiber axis (see _block_compressor)
        self.reason = _unsupported(compression, elastic)
        if self.reason is None:
            self.topology, self.reason = discover(comm)
        if self.topology is not None:
            scale = postscale / self.topology.local_size if op_is_average else postscale
            self.senders = {axis: SparseSender(_block_compressor(compression, axis), self.memory, self.topology.cross,
                                               self.stats, op, sum_op, op_is_average, prescale, scale)
                            for axis in (0, 1)}

    # --- planning -----------------------------------------------------------------------------------------
    def replan(self) -> None:
        """Forget every tensor's plan (the optimizer calls :meth:`decide` again)."""
        self.plans.clear()
        self.reasons.clear()

    def decide(self, info: TensorInfo, flat_sparse: bool, flat_reason: str) -> Tuple[bool, str]:
        """Whether ``info`` travels hierarchically, and why (or why not)."""
        ok, why = self._decide(info, flat_sparse)
        self.reasons[info.name] = why
        return ok, why

    def _decide(self, info: TensorInfo, flat_sparse: bool) -> Tuple[bool, str]:
        topo, c = self.topology, self.compression
        if topo is None:
            return False, f"flat: {self.reason}"
        sparse, why = c.choose_path(info, topo.hosts)  # the hybrid rule over the H hosts of a block's allgather
        if not sparse:
            return False, f"flat: {why}"
        if isinstance(c, ADTopkCompressor):  # its matrix view (joined rows or columns with min_fiber_len)
            lay = c.layout(info)
            rows, cols, axis = lay.rows, lay.cols, lay.axis
        else:
            (rows, cols), axis = matrix_view_shape(info.shape), 1
        fibers = rows if axis == 1 else cols
        if fibers < topo.local_size:
            return False, f"flat: {fibers} fibers < {topo.local_size} local ranks"
        if self.setting == "auto":
            payload, dense = c.nominal_bytes(info)
            wins, why = hierarchical_wins(dense, payload, flat_sparse, topo.hosts, topo.local_size)
            if not wins:
                return False, f"flat: {why}"
        self.plans[info.name] = BlockPlan(info.name, rows, cols, axis, tuple(split_fibers(fibers, topo.local_size)),
                                          topo.local_rank)
        return True, f"hierarchical ({topo.hosts} hosts x {topo.local_size})"

    def owns(self, name: str) -> bool:
        return name in self.plans

    # --- one round ------------------------------------------------------------------------------------------
    def send(self, p, grad: Optional[torch.Tensor], info: TensorInfo, step: int) -> Exchange:
        """Start the exchange of ``p``; a rank without a gradient contributes the zeros in ``p.grad``."""
        plan = self.plans[info.name]
        self._memory_plans[info.name] = plan
        exchange = HierarchicalExchange(self, p, p.grad if grad is None else grad, info, plan, step)
        return exchange

    def traffic(self, info: TensorInfo) -> Tuple[int, int, netcost.Wire]:
        """One round of ``info`` as this rank's link sees it: ``(entries, payload bytes, wire)`` of its block's
        payload (nominal for variable-size rules), allgathered among the ``H`` ranks with its local rank on the
        other hosts. The reduce-scatter and the allgather inside the host do not cross the host's link
        (``report()["intra_host_bytes"]`` counts them)."""
        plan = self.plans[info.name]
        block = plan.block_info(info.dtype)
        c = self.senders[plan.axis].compression
        count, hosts = c.nominal_count(block), self.topology.hosts
        index = c.nominal_index_dtype(block)
        value = c.wire_value_dtype(info.dtype)
        if not c.gathers or index is None:  # values at shared positions, summed
            payload = count * dtype_bytes(torch.promote_types(value, torch.float32))
            return count, payload, netcost.allreduce(payload, hosts)
        payload = block_bytes(count, value, index) + (COUNT_BYTES if c.variable_count else 0)
        return count, payload, netcost.allgather(payload, hosts)

    def release(self, name: str, grad: torch.Tensor) -> None:
        """A dense round of a tensor this exchange carried: add this rank's block memory into its block of
        ``grad`` (summed over all ranks that is every host's memory of every block: nothing is lost)."""
        plan = self._memory_plans.pop(name, None)
        if plan is None or self.memory is None:
            return
        key = plan.block_info(grad.dtype).name
        residual = self.memory.residuals.pop(key, None)
        if residual is not None:
            flat = grad.view(-1) if grad.is_contiguous() else None
            if flat is None:
                raise RuntimeError(f"horovod_adtopk: {name}: a non-contiguous gradient cannot take its block memory")
            plan.block_slice(flat).add_(residual.to(grad.dtype))

    def end_round(self) -> int:
        """Scrub non-finite values from the block memory; returns how many blocks had one."""
        return sum(sender.scrub_nonfinite() for sender in self.senders.values())

    def reset(self) -> None:
        """Forget the block memory (elastic reset, or a checkpoint from another layout)."""
        if self.memory is not None:
            self.memory.reset()
        self._memory_plans.clear()
        for sender in self.senders.values():
            sender.nonfinite.clear()

    # --- description, stats, state ------------------------------------------------------------------------------
    def layout(self) -> Optional[List[int]]:
        return self.topology.describe() if self.topology is not None else None

    def describe(self) -> dict:
        """For the configuration check: the setting, the layout and which tensors go hierarchical."""
        return {"setting": str(self.setting), "layout": self.layout(), "reason": self.reason,
                "tensors": sorted(self.plans)}

    def report(self) -> dict:
        """``opt.stats()["hierarchical"]``."""
        return {"setting": str(self.setting), "active": self.topology is not None and bool(self.plans),
                "layout": self.layout(), "reason": self.reason, "tensors": dict(sorted(self.reasons.items())),
                "inter_host_payload_bytes": self.stats.bytes_sent, "intra_host_bytes": self.intra_bytes,
                "blocks": self.stats.as_dict()["tensors"]}

    def state_dict(self) -> dict:
        """This rank's block memory, with the layout and blocks it belongs to."""
        return {"format": STATE_FORMAT, "layout": self.layout(),
                "blocks": {n: [p.axis, p.start, p.stop] for n, p in sorted(self._memory_plans.items())},
                "memory": self.memory.state_dict() if self.memory is not None else {}}

    def load_state_dict(self, saved: Optional[dict], devices: Optional[Dict[str, torch.device]] = None) -> None:
        """Restore the block memory if it was saved on this layout with the same blocks (onto the devices of
        ``devices``, parameter name -> device); else start empty with a warning."""
        self.reset()
        if not saved or not saved.get("memory", {}).get("residuals"):
            return
        blocks = {n: [p.axis, p.start, p.stop] for n, p in self.plans.items() if n in saved.get("blocks", {})}
        if saved.get("layout") != self.layout() or blocks != saved.get("blocks"):
            warnings.warn(f"horovod_adtopk: the checkpoint's hierarchical error-feedback memory belongs to layout "
                          f"{saved.get('layout')} (hosts x ranks per host), this job's is {self.layout()}: the "
                          "block memory starts empty")
            return
        self._memory_plans = {n: self.plans[n] for n in blocks}
        where = {p.block_info(torch.float32).name: (devices or {}).get(n) for n, p in self._memory_plans.items()}
        self.memory.load_state_dict(saved["memory"], {k: v for k, v in where.items() if v is not None})


def load_state(owner: Optional[Hierarchical], saved: Optional[dict],
               devices: Optional[Dict[str, torch.device]] = None) -> None:
    """Load a checkpoint's hierarchical entry into ``owner`` (None: the optimizer runs flat, and any saved
    block memory is dropped with a warning)."""
    if owner is not None:
        owner.load_state_dict(saved, devices)
    elif saved and saved.get("memory", {}).get("residuals"):
        warnings.warn("horovod_adtopk: the checkpoint holds hierarchical block memory, but this optimizer runs "
                      "flat (hierarchical=False): that memory is dropped")
