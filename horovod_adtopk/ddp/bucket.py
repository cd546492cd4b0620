"""One DDP bucket's exchange: every gradient of the bucket dense or sparse, at most three collectives.

For a bucket with gradients ``g_1 .. g_n`` (views into ``bucket.buffer()``), in the hook's thread:

1. each gradient takes its path (the compressor's ``choose_path``, as in the Horovod optimizer; dense during
   the first ``warmup_steps`` rounds). A sparse one goes through error feedback and selection
   (:class:`horovod_adtopk.sparsify.Sparsifier`: the same kernels) and is packed into its ``uint8`` block by its
   wire kind (:class:`horovod_adtopk.payload.SparseGather`, as the Horovod engine and local steps pack theirs).
   CUDA gradients of plain ADTopk with plain error feedback are selected together, the whole bucket in a few
   launches (:meth:`Sparsifier.select_bucket`, ``BUCKET_SELECT``), bit for bit as one by one;
2. the dense gradients are concatenated (and compressed, for a dense compressor such as fp16) and
   allreduced together: one asynchronous ``all_reduce``; Random-k's values (positions every rank knows)
   are summed by one more;
3. the sparse blocks are concatenated into one ``uint8`` buffer and exchanged with one asynchronous
   ``all_gather_single`` (``all_gather_into_tensor``). Fixed-size rules (ADTopk, Top-k, ADTopk-I) need
   nothing else. Variable-size rules (thresholds, DGC, ADTopk-T) first exchange their per-tensor counts
   (one small blocking gather of ``8 * n`` bytes), then pad every rank's buffer to the largest rank's;
4. the returned future's callback decodes and sums rank by rank through the same kind
   (:meth:`horovod_adtopk.payload.SparseGather.sum_into`: bitwise the same on every rank), averages, and writes
   everything back into the bucket buffer, which is the future's result.

The callback does local work only; no collective is ever issued from it.
"""
from __future__ import annotations

import time
from typing import List, Tuple

import torch

from .. import bucket_select, payload, sharded
from ..compressors import SharedCodec, TensorInfo
from ..sparsify import dense_contribution
from ..wire import COUNT_BYTES, block_bytes, payload_bytes
from ..wire import join as wire_join
from .communicator import peer_lost


#: Whole-bucket selection (:meth:`BucketExchange._select_together`): ``"auto"`` for CUDA gradients (Triton's
#: fused launches; the CPU keeps one native call per tensor, as fast), ``"off"`` never, ``"loop"`` / ``"triton"``
#: for every device (``horovod_adtopk.bucket_select``'s ``impl``; the tests' way to run the path on the CPU).
#: The environment's ``HOROVOD_ADTOPK_BUCKET_SELECT`` sets it at import.
BUCKET_SELECT = bucket_select.env_mode()


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _flat_out(view: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor to aggregate into: the view itself when contiguous, else a scratch tensor."""
    return view.view(-1) if view.is_contiguous() else torch.empty(view.numel(), dtype=view.dtype, device=view.device)


def _store(view: torch.Tensor, flat: torch.Tensor) -> None:
    if flat.data_ptr() != view.data_ptr():
        view.copy_(flat.view(view.shape))


class BucketExchange:
    """Built and launched by the hook for one bucket; :meth:`launch` returns DDP's future."""

    def __init__(self, state, comm, bucket) -> None:
        self.state, self.comm, self.bucket = state, comm, bucket
        self.world = comm.size()
        self.step = state.round
        self.dense: List[Tuple[torch.Tensor, str]] = []  # (view, name)
        self.shared: List[Tuple[torch.Tensor, TensorInfo, object]] = []  # (view, info, selection)
        self.sparse: List[Tuple[torch.Tensor, TensorInfo, object]] = []  # (view, info, selection)
        self.sharded: List[Tuple[torch.Tensor, TensorInfo, object, object]] = []  # (view, info, selection, plan)
        self.futures: List[torch.futures.Future] = []
        self.decode_plan = None  # see _whole_plan

    def launch(self) -> torch.futures.Future:
        buffer = self.bucket.buffer()
        if buffer.is_sparse:
            raise TypeError("horovod_adtopk.ddp: this bucket holds a sparse gradient (e.g. nn.Embedding(sparse=True)); "
                            "use a dense embedding, or DDP without this hook for that model")
        start = time.perf_counter()
        taken = [self._take(p, view) for p, view in zip(self.bucket.parameters(), self.bucket.gradients())]
        taken = [t for t in taken if t is not None]
        self._select_together(buffer, taken)
        for view, info, s in taken:
            self._place(view, info, s)
        self._launch_dense()
        self._launch_shared()
        self._launch_sparse()
        self._launch_sharded()
        self.state.stats_.compress_seconds += time.perf_counter() - start
        if not self.futures:
            return _done(buffer)
        if buffer.device.type != "cuda":
            return torch.futures.collect_all(self.futures).then(self._finish)
        # CUDA: collect_all's future knows no devices, so a plain then() would hand DDP a future whose wait()
        # orders nothing on its stream, and the decode would run on whatever stream the collective's thread
        # had current. Decode on the hook's stream instead and complete a future of that device, whose
        # result records an event there for DDP's wait() to sync with.
        stream = torch.cuda.current_stream(buffer.device)
        out: torch.futures.Future = torch.futures.Future(devices=[buffer.device])

        def finish_on_stream(fut: torch.futures.Future) -> None:
            with torch.cuda.device(buffer.device), torch.cuda.stream(stream):
                try:
                    result = self._finish(fut)
                except BaseException as exc:  # noqa: BLE001 (every failure reaches DDP's wait(), none is lost)
                    out.set_exception(exc)
                    return
                out.set_result(result)

        torch.futures.collect_all(self.futures).add_done_callback(finish_on_stream)
        return out

    # --- in the hook -----------------------------------------------------------------------------------------
    def _take(self, p, view: torch.Tensor):
        """Route one gradient; a sparse one returns ``(view, info, selection)`` for :meth:`_place`, its selection
        None where :meth:`_select_together` makes it. ``p.grad is None`` means this rank did not use ``p`` in
        this forward pass (DDP with ``find_unused_parameters``): it contributes nothing and keeps its memory."""
        state = self.state
        name, info = state.tensor_info(p)
        has_grad = p.grad is not None
        if state.sends_sparse(name):
            sparsifier = state.sparsifier
            if has_grad and self._together(view, info):
                return view, info, None
            s = sparsifier.select(view, info, self.step) if has_grad else sparsifier.empty(info, self.step, view.device)
            return view, info, s
        if not has_grad:
            view.zero_()
        else:
            released = dense_contribution(state.memory, name, view, state.on_sparse_path(name))
            if released is not None:
                view.copy_(released)
        self.dense.append((view, name))

    def _together(self, view: torch.Tensor, info: TensorInfo) -> bool:
        """Whether this gradient's selection runs with the bucket's others (:meth:`_select_together`): CUDA
        tensors of plain ADTopk with plain error feedback (``BUCKET_SELECT``; on the CPU the per-tensor native
        kernel is kept), contiguous in the bucket's buffer."""
        mode = BUCKET_SELECT
        if mode == "off" or (mode == "auto" and view.device.type != "cuda"):
            return False
        return self.state.sparsifier.batches(info) and view.is_contiguous()

    def _select_together(self, buffer: torch.Tensor, taken: list) -> None:
        """The deferred selections of :meth:`_take`, all at once (:meth:`Sparsifier.select_bucket`), in bucket
        order: bit for bit what one :meth:`Sparsifier.select` per tensor gives."""
        todo = [i for i, (_, _, s) in enumerate(taken) if s is None]
        if not todo:
            return
        start, size = buffer.data_ptr(), buffer.element_size()
        end = start + buffer.numel() * size
        for i in list(todo):  # a gradient that is not a view of the buffer is selected on its own
            view, info, _ = taken[i]
            ptr = view.data_ptr()
            if view.dtype != buffer.dtype or not start <= ptr <= end - view.numel() * size or (ptr - start) % size:
                taken[i] = (view, info, self.state.sparsifier.select(view, info, self.step))
                todo.remove(i)
        if not todo:
            return
        got = self.state.sparsifier.select_bucket(buffer.view(-1), [taken[i][:2] for i in todo], self.step,
                                                  impl=BUCKET_SELECT)
        for i, s in zip(todo, got):
            taken[i] = (taken[i][0], taken[i][1], s)

    def _place(self, view: torch.Tensor, info: TensorInfo, s) -> None:
        """A sparse gradient's selection to its exchange: owner-sharded, shared positions, or allgathered."""
        name = info.name
        plan, layout = self.state.shard_plans.get(name), getattr(s.codec, "layout", None)
        if plan is not None and layout is not None:
            if not plan.fits(layout):
                plan = sharded.plan_sparse(name, layout, None, None, self.world, self._wire_dtype(info),
                                           s.codec.index_dtype)  # a density warm-up's k
            if plan is not None:
                self.sharded.append((view, info, s, plan))
                return
        (self.shared if isinstance(s.codec, SharedCodec) else self.sparse).append((view, info, s))

    def _launch_dense(self) -> None:
        if not self.dense:
            self.dense_wire = None
            return
        self.dense_kind = payload.DenseSum(self.world, compression=self.state.dense_compression)
        self.dense_item = payload.Item("hat.ddp.dense", None, torch.cat([v.reshape(-1) for v, _ in self.dense]))
        self.dense_wire = self.dense_kind.encode(self.dense_item)
        for v, name in self.dense:
            nbytes = v.numel() * self.dense_wire.element_size()
            self.state.stats_.record(name, v.numel(), v.numel(), nbytes, wire=self.dense_kind.wire_of(nbytes),
                                     world=self.world)
        self.futures.append(self.comm.allreduce_async(self.dense_wire))

    def _launch_shared(self) -> None:
        if not self.shared:
            return
        kind = payload.SharedSum(self.world)  # float32 at least, as the Horovod engine sums them
        self.shared_items = [payload.Item(info.name, info, s) for _, info, s in self.shared]
        values = [kind.encode(item) for item in self.shared_items]
        self.shared_wire = torch.cat(values)
        for (_, info, _), v in zip(self.shared, values):
            self.state.stats_.record(info.name, info.numel, v.numel(), payload_bytes(v), wire=kind.wire(v),
                                     world=self.world)
        self.futures.append(self.comm.allreduce_async(self.shared_wire))

    def _launch_sparse(self) -> None:
        if not self.sparse:
            return
        self.sparse_kind = payload.SparseGather(self.world, self.state.compression)
        self.sparse_items = [payload.Item(info.name, info, s) for _, info, s in self.sparse]
        blocks = [self.sparse_kind.encode(item) for item in self.sparse_items]
        local = wire_join(blocks)  # a view where the bucket selection packed them back to back
        self.variable = any(s.codec.count is None for _, _, s in self.sparse)
        if self.variable:  # counts first (blocking, tiny), then every rank's buffer padded to the largest
            counts = torch.tensor([s.values.numel() for _, _, s in self.sparse], dtype=torch.int64,
                                  device=self.comm.control_device(local))
            self.counts = self.comm.gather(counts).view(self.world, -1).tolist()
            self.row_bytes = max(self._rank_bytes(r) for r in range(self.world))
            local = torch.cat([local, torch.zeros(self.row_bytes - local.numel(), dtype=torch.uint8,
                                                  device=local.device)])
        else:
            self.counts = [[s.codec.count for _, _, s in self.sparse]] * self.world
            self.row_bytes = local.numel()
            self.decode_plan = self._whole_plan(local)
        # the padding to the largest rank's buffer travels too: counted on the bucket's first sparse tensor
        padding = self.row_bytes - sum(payload_bytes(b) for b in blocks)
        for i, ((view, info, s), block) in enumerate(zip(self.sparse, blocks)):
            sent = payload_bytes(block) + (COUNT_BYTES if self.variable else 0)
            wire = self.sparse_kind.wire_of(sent + (padding if i == 0 else 0))
            self.state.stats_.record(info.name, info.numel, s.values.numel(), sent, wire=wire, world=self.world)
        self.gathered = torch.empty(self.world * self.row_bytes, dtype=torch.uint8, device=local.device)
        self.futures.append(self.comm.gather_async(self.gathered, local))

    def _launch_sharded(self) -> None:
        """The owner-sharded exchange of the bucket's sharded tensors through their wire kind
        (:class:`horovod_adtopk.payload.OwnerSharded`): one all-to-all of every tensor's shards, waited for here
        (the owner's step needs it, and every collective is issued from this thread), the owner's step, then one
        asynchronous allgather of the owners' blocks."""
        if not self.sharded:
            return
        rank = self.comm.rank()
        self.sharded_kind = kind = payload.OwnerSharded(self.world, None, None, self.state.owner)
        blocks = [kind.contribution(payload.Item(info.name, info, (plan, s))).blocks
                  for _, info, s, plan in self.sharded]
        send, splits, mine = sharded.pack_alltoall(blocks, self.world, rank)
        got = self.comm.alltoall(send, splits, [sum(mine)] * self.world, "hat.ddp.shards")
        padded = []
        for (view, info, s, plan), received in zip(self.sharded, sharded.unpack_alltoall(got, mine, self.world)):
            padded.append(kind.owner_block(info.name, plan, rank, received, 1.0 / self.world, view.dtype))
            sent, wire = kind.traffic(plan, rank)
            self.state.stats_.record(info.name, info.numel, s.values.numel(), sent, wire=wire, world=self.world)
        local = torch.cat(padded)
        self.owner_widths = [p.numel() for p in padded]
        self.owners = torch.empty(self.world * local.numel(), dtype=torch.uint8, device=local.device)
        self.futures.append(self.comm.gather_async(self.owners, local))

    def _finish_sharded(self) -> None:
        if not self.sharded:
            return
        rows = self.owners.view(self.world, -1)
        offset = 0
        for (view, info, s, plan), width in zip(self.sharded, self.owner_widths):
            out = self.sharded_kind.assemble(plan, rows[:, offset:offset + width].reshape(-1), _flat_out(view))
            _store(view, out)
            offset += width

    def _wire_dtype(self, info: TensorInfo) -> torch.dtype:
        return self.state.compression.wire_value_dtype(info.dtype)

    def _block_bytes(self, i: int, count: int) -> int:
        _, info, s = self.sparse[i]
        return block_bytes(count, self._wire_dtype(info), s.codec.index_dtype)

    def _rank_bytes(self, rank: int) -> int:
        return sum(self._block_bytes(i, c) for i, c in enumerate(self.counts[rank]))

    # --- in the future's callback ------------------------------------------------------------------------------
    def _finish(self, fut: torch.futures.Future) -> torch.Tensor:
        try:
            # wait(), not value(): a future of CUDA tensors (Gloo's copies back to the device, NCCL) then makes
            # the current stream (the hook's, see launch) wait for the collective's before the decode reads.
            for f in fut.value():
                f.wait()
        except RuntimeError as exc:
            raise peer_lost(exc) from exc
        start = time.perf_counter()
        self._finish_dense()
        self._finish_shared()
        self._finish_sparse()
        self._finish_sharded()
        self.state.stats_.decompress_seconds += time.perf_counter() - start
        return self.bucket.buffer()

    def _finish_dense(self) -> None:
        if self.dense_wire is None:
            return
        flat = self.dense_kind.decode(self.dense_item, self.dense_wire.div_(self.world))
        offset = 0
        for view, _ in self.dense:
            n = view.numel()
            view.copy_(flat[offset:offset + n].view(view.shape))
            offset += n

    def _finish_shared(self) -> None:
        if not self.shared:
            return
        summed = self.shared_wire.div_(self.world)
        offset = 0
        for (view, _, s), item in zip(self.shared, self.shared_items):
            n = s.flat.numel()
            _store(view, payload.SharedSum.place(_flat_out(view), item, summed[offset:offset + n]))
            offset += n

    def _whole_plan(self, local: torch.Tensor):
        """The bucket selection's plan when it packed exactly this bucket's sparse payload (every tensor, in
        order, back to back in ``local``) from gradients at its offsets in the bucket buffer: then
        :meth:`_finish_sparse` decodes all of it at once (:func:`horovod_adtopk.bucket_select.decode`)."""
        packed = [s.packed for _, _, s in self.sparse]
        if any(pk is None for pk in packed):
            return None
        p = packed[0][0]
        buffer = self.bucket.buffer()
        if (any(pk[0] is not p for pk in packed) or [pk[1] for pk in packed] != list(range(len(p.specs)))
                or local.numel() != p.wire_bytes or p.wire_dtype != self._wire_dtype(self.sparse[0][1])
                or buffer.dtype != p.dtype or buffer.device != p.device or not buffer.is_contiguous()):
            return None
        start, size = buffer.data_ptr(), buffer.element_size()
        for (view, _, _), off in zip(self.sparse, p.g_offsets):
            if view.data_ptr() != start + off * size or not view.is_contiguous():
                return None
        return p

    def _finish_sparse(self) -> None:
        if not self.sparse:
            return
        if self.decode_plan is not None:  # the whole bucket at once, into the bucket buffer
            rows = self.gathered.view(self.world, self.row_bytes)
            bucket_select.decode(self.decode_plan, rows, self.bucket.buffer().view(-1), self.sparse_kind.scale)
            self.state.stats_.bucket_decodes += 1
            return
        rows = self.gathered.view(self.world, self.row_bytes)
        offsets = [0] * self.world
        for i, ((view, info, s), item) in enumerate(zip(self.sparse, self.sparse_items)):
            counts = [self.counts[r][i] for r in range(self.world)]
            sizes = [self._block_bytes(i, c) for c in counts]
            blocks = torch.cat([rows[r, offsets[r]:offsets[r] + sizes[r]] for r in range(self.world)])
            offsets = [o + b for o, b in zip(offsets, sizes)]
            _store(view, self.sparse_kind.sum_into(_flat_out(view), item, blocks, counts))
