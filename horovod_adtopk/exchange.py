"""In-flight gradient exchanges: what one parameter (or one group) sends, and how the result comes back.

The optimizer turns every gradient into one :class:`Exchange` as soon as it is ready; ``synchronize()``
calls :meth:`Exchange.advance` on all of them (a second collective round, only PowerSGD uses it) and
then :meth:`Exchange.finish`, which waits and writes the aggregated gradient into ``p.grad``.

- :class:`DenseExchange` / :class:`GroupExchange`: Horovod allreduce (fused by Horovod's tensor fusion),
  exactly as ``hvd.DistributedOptimizer`` does, for tensors on the dense path.
- :class:`SparseExchange`: one packed ``uint8`` payload per rank, allgathered (plus an 8-byte count for
  variable-size rules), unpacked and scatter-added by :func:`aggregate_blocks`.
- :class:`SharedExchange`: values at positions every rank knows (Random-k), summed by allreduce.
- :class:`SparseGradExchange`: a sparse (COO) gradient, e.g. ``nn.Embedding(sparse=True)``'s, aggregated
  as Horovod does it (values and indices allgathered, averaged for ``hvd.Average``), handed back sparse.

:class:`SparseSender` builds the sparse ones: error feedback -> selection -> wire -> collective. The optimizer's
sender collects plain-ADTopk CUDA gradients into groups (``BUCKET_SELECT``) and selects each group with one
:meth:`Sparsifier.select_bucket` call; every tensor's exchange is then built from its selection as alone.
"""
from __future__ import annotations

import time
from typing import List, Optional

import torch

from . import bucket_select, lowrank, payload, sharded
from .compressors import SharedCodec, SparseCompressor, TensorInfo
from .memory import ErrorFeedback
from .sparsify import Sparsifier, aggregate_blocks  # noqa: F401  (aggregate_blocks: re-exported)
from .stats import Stats
from .wire import COUNT_BYTES, payload_bytes

#: dtypes Horovod's collectives cannot reduce on the CPU: carried as float32 and cast back.
UPCAST = {torch.bfloat16: torch.float32}

#: Group selection (:meth:`SparseSender.send`): ``"auto"`` groups CUDA gradients (the CPU keeps one native call
#: per tensor), ``"off"`` none, ``"loop"`` / ``"triton"`` those of every device (the tests' way to run it on the
#: CPU). ``HOROVOD_ADTOPK_BUCKET_SELECT`` sets it at import, as for the DDP engine.
BUCKET_SELECT = bucket_select.env_mode()
#: Gradient bytes of one selection group (as DDP's ``bucket_cap_mb=25``).
GROUP_CAP_BYTES = 25 * 1024 * 1024


def store_grad(grad: torch.Tensor, result: torch.Tensor) -> None:
    """Write ``result`` into the gradient's own storage (keeps its dtype and memory format)."""
    if result.data_ptr() != grad.data_ptr() or result.dtype != grad.dtype:
        grad.copy_(result.view(grad.shape) if result.is_contiguous() else result.reshape(grad.shape))


class Exchange:
    """One in-flight collective for ``params``."""

    params: tuple = ()

    def advance(self) -> None:
        """Optional second round (called on every exchange before any :meth:`finish`)."""

    def finish(self) -> None:
        raise NotImplementedError


def _wire_tensor(grad: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of a dtype Horovod reduces (channels_last and bfloat16 gradients included)."""
    t = grad if grad.is_contiguous() else grad.contiguous()
    up = UPCAST.get(t.dtype)
    return t.to(up) if up is not None else t


class DenseExchange(Exchange):
    """One dense gradient through its wire kind (:class:`horovod_adtopk.payload.DenseSum`: the dense compressor's
    rendering) and Horovod's allreduce, which averages for ``hvd.Average``. ``bytes`` / ``wire``: what this rank
    hands over and what its link carries."""

    def __init__(self, comm, p, grad: torch.Tensor, compression, name: str, op, scales) -> None:
        self.params, self.comm = (p,), comm
        self.kind = payload.DenseSum(comm.size(), compression=compression)
        self.item = payload.Item(name, None, _wire_tensor(grad))
        tensor = self.kind.encode(self.item)
        self.bytes, self.wire = payload_bytes(tensor), self.kind.wire(tensor)
        self.handle = comm.allreduce_async_(tensor, f"hat.dense.{name}", op, *scales)

    def finish(self) -> None:
        store_grad(self.params[0].grad, self.kind.decode(self.item, self.comm.wait(self.handle)))


class GroupExchange(Exchange):
    """The dense gradients of one ``groups=`` group through :class:`horovod_adtopk.payload.DenseSum` and one
    grouped allreduce; ``bytes`` / ``wire`` per gradient."""

    def __init__(self, comm, group: tuple, grads: List[torch.Tensor], compression, names: List[str], op,
                 scales) -> None:
        self.params, self.comm = group, comm
        self.kind = payload.DenseSum(comm.size(), compression=compression)
        self.items = [payload.Item(n, None, _wire_tensor(g)) for n, g in zip(names, grads)]
        tensors = [self.kind.encode(item) for item in self.items]
        self.bytes, self.wire = [payload_bytes(t) for t in tensors], [self.kind.wire(t) for t in tensors]
        self.handle = comm.grouped_allreduce_async_(tensors, f"hat.group.{names[0]}", op, *scales)

    def finish(self) -> None:
        outputs = self.comm.wait(self.handle)
        for p, out, item in zip(self.params, outputs, self.items):
            store_grad(p.grad, self.kind.decode(item, out))


class SparseGradExchange(Exchange):
    """A sparse (COO) gradient through Horovod's own sparse allreduce, exactly as ``hvd.DistributedOptimizer``
    carries it without ``sparse_as_dense`` (so the result, and e.g. ``torch.optim.SparseAdam``'s update, is
    bitwise the stock one). No compressor or memory applies: the gradient is already sparse."""

    def __init__(self, comm, p, name: str, op) -> None:
        self.params, self.comm = (p,), comm
        grad = p.grad
        self.elements = grad._values().numel()
        self.bytes = payload_bytes(grad._indices()) + payload_bytes(grad._values())
        self.handle = comm.sparse_allreduce_async(grad, f"hat.sparsegrad.{name}", op)

    def finish(self) -> None:
        aggregated = self.comm.wait(self.handle)
        self.params[0].grad.zero_().add_(aggregated)  # sparse tensors have no set_(): Horovod's equivalent


class SparseExchange(Exchange):
    """An allgathered sparse payload (fixed count, or variable with a count allgather alongside), decoded by its
    wire kind (:class:`horovod_adtopk.payload.SparseGather`)."""

    def __init__(self, sender: "SparseSender", p, item: payload.Item, kind: payload.SparseGather, handle,
                 count_handle) -> None:
        self.params, self.sender, self.info, self.item, self.kind = (p,), sender, item.info, item, kind
        self.handle, self.count_handle = handle, count_handle

    def finish(self) -> None:
        start = time.perf_counter()
        comm = self.sender.comm
        gathered = comm.wait(self.handle)
        counts = comm.wait(self.count_handle).tolist() if self.count_handle is not None else None
        grad = self.params[0].grad
        # The local gradient was consumed when the payload was built, so its storage takes the aggregate.
        dense = grad.view(-1) if grad.is_contiguous() else torch.empty(self.info.numel, dtype=grad.dtype,
                                                                         device=grad.device)
        self.kind.sum_into(dense, self.item, gathered, counts)
        store_grad(grad, dense)
        self.sender.timed(self.info.name, 1, time.perf_counter() - start)


class CollectedExchange(Exchange):
    """A sparse gradient waiting in its selection group (:meth:`SparseSender.send`); ``inner`` is its exchange
    once the group is selected (when it is full, or at :meth:`SparseSender.flush`)."""

    def __init__(self, sender: "SparseSender", p) -> None:
        self.params, self.sender, self.inner = (p,), sender, None

    def advance(self) -> None:
        if self.inner is None:
            self.sender.flush()
        self.inner.advance()

    def finish(self) -> None:
        if self.inner is None:
            self.sender.flush()
        self.inner.finish()


class SharedExchange(Exchange):
    """Values at positions every rank drew identically (Random-k), summed (and averaged) by allreduce."""

    def __init__(self, sender: "SparseSender", p, item: payload.Item, handle) -> None:
        self.params, self.sender, self.info, self.item, self.handle = (p,), sender, item.info, item, handle

    def finish(self) -> None:
        start = time.perf_counter()
        summed = self.sender.comm.wait(self.handle)
        grad = self.params[0].grad
        dense = grad.view(-1) if grad.is_contiguous() else torch.empty(self.info.numel, dtype=grad.dtype,
                                                                         device=grad.device)
        payload.SharedSum.place(dense, self.item, summed)
        store_grad(grad, dense)
        self.sender.timed(self.info.name, 1, time.perf_counter() - start)


class ShardedExchange(Exchange):
    """The owner-sharded two-stage exchange of one tensor through its wire kind
    (:class:`horovod_adtopk.payload.OwnerSharded`): stage 1 (the all-to-all of this rank's shards) starts when
    the gradient is ready; :meth:`advance` waits for it, runs the owner's step on this rank's shard (average,
    its own residual, ADTopk again, re-encode) and starts stage 2 (the allgather of the owners' blocks);
    :meth:`finish` decodes every owner's block into the gradient."""

    def __init__(self, sender: "SparseSender", p, info: TensorInfo, plan, kind: payload.OwnerSharded,
                 handle) -> None:
        self.params, self.sender, self.info, self.plan, self.kind = (p,), sender, info, plan, kind
        self.handle, self.gather = handle, None

    def advance(self) -> None:
        start = time.perf_counter()
        sender, plan, name = self.sender, self.plan, self.info.name
        comm = sender.comm
        received, _ = comm.wait(self.handle)
        world, rank = comm.size(), comm.rank()
        (blocks,) = sharded.unpack_alltoall(received, [plan.block_sizes()[rank]], world)
        block = self.kind.owner_block(name, plan, rank, blocks, sender.average_scale(), self.params[0].grad.dtype)
        self.gather = comm.allgather_async(block, sharded.collective_name(f"hat.owners.{name}", [plan]))
        sender.timed(name, 0, time.perf_counter() - start)

    def finish(self) -> None:
        if self.gather is None:
            self.advance()
        start = time.perf_counter()
        gathered = self.sender.comm.wait(self.gather)
        grad = self.params[0].grad
        dense = grad.view(-1) if grad.is_contiguous() else torch.empty(self.info.numel, dtype=grad.dtype,
                                                                         device=grad.device)
        store_grad(grad, self.kind.assemble(self.plan, gathered, dense))
        self.sender.timed(self.info.name, 1, time.perf_counter() - start)


class SparseSender:
    """Builds sparse exchanges: ``a = g + r`` -> selection -> wire -> collective -> ``r <- a - D(C(a))``.

    A rank without a gradient for a parameter (frozen, or unused in this forward pass) contributes nothing
    and keeps its memory: it sends an all-zero payload of the agreed size, so the collective still matches.
    """

    def __init__(self, compression: SparseCompressor, memory: Optional[ErrorFeedback], comm, stats: Stats,
                 op, sum_op, op_is_average: bool, prescale: float, postscale: float) -> None:
        self.compression, self.memory, self.comm, self.stats = compression, memory, comm, stats
        self.op, self.sum_op, self.op_is_average = op, sum_op, op_is_average
        self.prescale, self.postscale = prescale, postscale
        self.sparsifier = Sparsifier(compression, memory, prescale)  # error feedback around selection
        self.nonfinite: List[tuple] = self.sparsifier.nonfinite  # (name, 0-d bool: every sent value finite, scrubbed)
        self.profile = None  # a PartialSparsification while it profiles
        self.overlap = None  # a horovod_adtopk.overlap.Overlap: selection off the hook's thread
        # the owner-sharded exchange: each sharded tensor's plan (horovod_adtopk.paths), this rank's owner residuals
        self.shard_plans: dict = {}
        self.owner: dict = {}
        # selection groups of this round: (device, dtype) -> [step, bytes, [(p, grad, info, CollectedExchange)]];
        # only where the owner flushes them (the optimizer's sender, not the hierarchical exchange's)
        self.grouping = False
        self.groups: dict = {}
        self.group_selections = 0  # groups selected so far (select_bucket calls)

    def timed(self, name: str, which: int, seconds: float) -> None:
        """Account ``seconds`` of compression (``which=0``) or decompression (1) work on ``name``."""
        self.stats.add_seconds(name, which, seconds)
        if self.profile is not None:
            self.profile.record(name, which, seconds)

    def average_scale(self) -> float:
        """What the summed payloads are multiplied by: ``predivide / size`` for Average, 1 for Sum."""
        return self.postscale / self.comm.size() if self.op_is_average else 1.0

    def send(self, p, grad: Optional[torch.Tensor], info: TensorInfo, step: int) -> Exchange:
        c = self.compression
        if lowrank.runs_own_rounds(c):  # two dependent collective rounds (PowerSGD)
            return lowrank.start(self, p, grad, info, step)
        if self.overlap is not None and self.overlap.applies(grad):
            # Built by the worker thread; the counters are written on this thread when it is waited for.
            return self.overlap.submit(lambda: self._build(p, grad, info, step), (p,), self._account)
        if self._collects(grad, info):
            return self._collect(p, grad, info, step)
        exchange, accounting = self._build(p, grad, info, step)
        self._account(accounting)
        return exchange

    # --- selection groups: the gradients ready together, selected by one Sparsifier.select_bucket ---------------
    def _collects(self, grad: Optional[torch.Tensor], info: TensorInfo) -> bool:
        """Whether ``grad`` waits for its group: plain ADTopk with plain error feedback (``Sparsifier.batches``),
        a contiguous dense gradient, on CUDA (or any device when ``BUCKET_SELECT`` is loop / triton)."""
        mode = BUCKET_SELECT
        if not self.grouping or mode == "off" or grad is None or (mode == "auto" and grad.device.type != "cuda"):
            return False
        return (self.sparsifier.batches(info) and grad.layout == torch.strided and grad.is_contiguous()
                and grad.dtype == info.dtype)

    def _collect(self, p, grad: torch.Tensor, info: TensorInfo, step: int) -> Exchange:
        key = (grad.device, grad.dtype)
        group = self.groups.get(key)
        if group is not None and group[0] != step:  # cannot happen within a round; select the old one first
            self._select_group(self.groups.pop(key))
            group = None
        if group is None:
            group = self.groups[key] = [step, 0, []]
        placeholder = CollectedExchange(self, p)
        group[2].append((p, grad, info, placeholder))
        group[1] += grad.numel() * grad.element_size()
        if group[1] >= GROUP_CAP_BYTES:
            self._select_group(self.groups.pop(key))
        return placeholder

    def flush(self) -> None:
        """Select the groups not yet full (``synchronize()``, before any exchange is waited for)."""
        while self.groups:
            self._select_group(self.groups.pop(next(iter(self.groups))))

    def discard(self) -> None:
        """Forget the groups of an abandoned round (their gradients are not sent)."""
        self.groups.clear()

    def _select_group(self, group: list) -> None:
        """Stage the group's gradients into one buffer, select them all with :meth:`Sparsifier.select_bucket`
        (bit for bit one :meth:`Sparsifier.select` per tensor), then build every tensor's exchange from its
        selection exactly as :meth:`_build` does alone; the selection's seconds are shared by size."""
        step, _, entries = group
        start = time.perf_counter()
        grads = [g for _, g, _, _ in entries]
        buffer = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].view(-1)
        items, offset = [], 0
        for g, (_, _, info, _) in zip(grads, entries):
            items.append((buffer[offset:offset + g.numel()].view(g.shape), info))
            offset += g.numel()
        selections = self.sparsifier.select_bucket(buffer, items, step, impl=BUCKET_SELECT)
        self.group_selections += 1
        seconds = time.perf_counter() - start
        for (p, grad, info, placeholder), s in zip(entries, selections):
            placeholder.inner, accounting = self._build(p, grad, info, step, s,
                                                        seconds * grad.numel() / max(1, buffer.numel()))
            self._account(accounting)

    def _account(self, accounting: tuple) -> None:
        name, numel, elements, sent, wire, seconds = accounting
        self.stats.record(name, numel, elements, sent, wire=wire, world=self.comm.size())
        self.timed(name, 0, seconds)

    def _build(self, p, grad: Optional[torch.Tensor], info: TensorInfo, step: int, s=None, seconds: float = 0.0):
        """The exchange and its accounting ``(name, numel, elements, bytes, wire, seconds)``; touches no
        counter, so the overlap worker can run it. ``s``: the selection when a group made it (``seconds``:
        its share of the group's time)."""
        c = self.compression
        start = time.perf_counter() - seconds
        wire_dtype = c.wire_value_dtype(info.dtype)
        if s is None and grad is None:
            s = self.sparsifier.empty(info, step, p.device)
        elif s is None:
            s = self.sparsifier.select(grad, info, step)
        tag = f"hat.sparse.{info.name}"
        plan = self.shard_plans.get(info.name)
        layout = getattr(s.codec, "layout", None)
        if plan is not None and layout is not None:
            if not plan.fits(layout):
                plan = sharded.plan_sparse(info.name, layout, None, None, self.comm.size(), wire_dtype,
                                           s.codec.index_dtype)  # a density warm-up's k
            if plan is not None:
                kind = payload.OwnerSharded(self.comm.size(), None, None, self.owner)
                blocks = kind.contribution(payload.Item(info.name, info, (plan, s))).blocks
                handle = self.comm.alltoall_async(torch.cat(blocks), [b.numel() for b in blocks],
                                                  sharded.collective_name(f"hat.shards.{info.name}", [plan]))
                sent, wire = kind.traffic(plan, self.comm.rank())
                exchange = ShardedExchange(self, p, info, plan, kind, handle)
                return exchange, (info.name, info.numel, s.values.numel(), sent, wire, time.perf_counter() - start)
        item = payload.Item(info.name, info, s)
        if isinstance(s.codec, SharedCodec):  # Random-k: summed by Horovod (Average: postscale / size)
            kind = payload.SharedSum(self.comm.size())
            values = kind.encode(item)
            handle = self.comm.allreduce_async_(values, tag, self.op, 1.0, self.postscale)
            exchange = SharedExchange(self, p, item, handle)
            sent, wire = payload_bytes(values), kind.wire(values)
        else:
            kind = payload.SparseGather(self.comm.size(), c, self.average_scale())
            block = kind.encode(item)
            count_handle = None
            if s.codec.count is None:
                count_handle = self.comm.allgather_async(torch.tensor([s.values.numel()], dtype=torch.int64),
                                                         f"hat.count.{info.name}")
            handle = self.comm.allgather_async(block, tag)
            exchange = SparseExchange(self, p, item, kind, handle, count_handle)
            sent, wire = payload_bytes(block), kind.wire(block)
            if count_handle is not None:
                sent, wire = sent + COUNT_BYTES, wire + kind.wire_of(COUNT_BYTES)
        return exchange, (info.name, info.numel, s.values.numel(), sent, wire, time.perf_counter() - start)

    def scrub_nonfinite(self) -> int:
        """Zero NaN/Inf left in the memory of tensors that sent a non-finite value this round; returns how
        many tensors had one."""
        return self.sparsifier.scrub_nonfinite()
