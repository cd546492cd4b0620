"""The DDP engine's communicator: the only module of :mod:`horovod_adtopk.ddp` that calls ``torch.distributed``.

A thin layer over one process group. Asynchronous collectives return ``torch.futures.Future`` objects (what a
DDP communication hook must return); the blocking ones serve the configuration check
(:func:`horovod_adtopk.config_check.check` takes any object with ``allgather`` and ``allgather_object``).
Every collective is issued from the hook's own thread, in bucket order, never from a future's callback: so
all ranks issue the same collectives in the same order whatever thread completes a future.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
import torch.distributed as dist

#: ``all_gather_single`` (newer PyTorch) or its older name
_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class PeerLostError(RuntimeError):
    """A collective of the DDP hook failed: almost always a peer rank died, hung or became unreachable."""


def peer_lost(exc: BaseException) -> PeerLostError:
    """The error to raise when a collective failed with ``exc``."""
    return PeerLostError("horovod_adtopk.ddp: a collective failed; a peer rank was probably lost (killed, crashed "
                         "or unreachable), or the process group's timeout expired (set it with "
                         f"torch.distributed.init_process_group(..., timeout=...)). torch.distributed said: {exc}")


class ProcessGroupComm:
    """Collectives over one ``torch.distributed`` process group (``None``: the default group)."""

    def __init__(self, process_group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("horovod_adtopk.ddp needs an initialised torch.distributed process group: call "
                               "torch.distributed.init_process_group(...) before building "
                               "DistributedDataParallel and the compression state")
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(self.group)).lower()
        self._single_ok = True  # whether all_gather_single works here (else all_gather into views)
        #: collectives this communicator has started (every kind; the tests count them)
        self.collectives = 0

    def size(self) -> int:
        return dist.get_world_size(self.group)

    def rank(self) -> int:
        return dist.get_rank(self.group)

    def control_device(self, like: Optional[torch.Tensor] = None) -> torch.device:
        """Where small control tensors (counts, digests) live: the bucket's device, or CUDA for NCCL."""
        if like is not None:
            return like.device
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def allreduce_async(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Sum ``tensor`` in place across ranks; the future completes when it holds the sum."""
        self.collectives += 1
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future()

    def gather_async(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.futures.Future:
        """Every rank's equally sized 1-D ``tensor`` into ``out`` (rank order). One ``all_gather_single``;
        where the backend lacks it for these tensors, an ``all_gather`` into views of ``out`` (no copy)."""
        self.collectives += 1
        if self._single_ok:
            try:
                return _GATHER_SINGLE(out, tensor, group=self.group, async_op=True).get_future()
            except (RuntimeError, NotImplementedError) as exc:
                if "support" not in str(exc).lower():
                    raise
                self._single_ok = False
        views = list(out.view(self.size(), -1).unbind(0))
        return dist.all_gather(views, tensor, group=self.group, async_op=True).get_future()

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Blocking: every rank's equally sized 1-D ``tensor``, concatenated in rank order."""
        out = torch.empty(self.size() * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        try:
            self.gather_async(out, tensor).wait()
        except RuntimeError as exc:
            raise peer_lost(exc) from exc
        return out

    # --- the interface of horovod_adtopk.config_check ---------------------------------------------------------
    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:  # noqa: ARG002 (names are Horovod's)
        return self.gather(tensor.to(self.control_device()))

    def allgather_object(self, obj: Any, name: str) -> List[Any]:  # noqa: ARG002
        out: List[Any] = [None] * self.size()
        self.collectives += 1
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise peer_lost(exc) from exc
        return out

    # --- the interface of horovod_adtopk.local_steps (blocking; started together, then waited for) -------------
    @staticmethod
    def _wait(futures: List[torch.futures.Future]) -> None:
        try:
            for f in futures:
                f.wait()
        except RuntimeError as exc:
            raise peer_lost(exc) from exc

    def sum_tensors(self, tensors: List[torch.Tensor], names: List[str]) -> List[torch.Tensor]:  # noqa: ARG002
        """Every tensor summed over the group, in place, in order."""
        self._wait([self.allreduce_async(t) for t in tensors])
        return list(tensors)

    def gather_tensors(self, tensors: List[torch.Tensor], names: List[str]) -> List[torch.Tensor]:  # noqa: ARG002
        """Every rank's equally sized 1-D tensors, each concatenated in rank order."""
        outs = [torch.empty(self.size() * t.numel(), dtype=t.dtype, device=t.device) for t in tensors]
        self._wait([self.gather_async(o, t) for o, t in zip(outs, tensors)])
        return outs

    def alltoall(self, tensor: torch.Tensor, send_splits: List[int], recv_splits: List[int],
                 name: str) -> torch.Tensor:  # noqa: ARG002
        """Blocking all-to-all of a 1-D tensor (``all_to_all_single``; Gloo on CPU tensors, NCCL on CUDA):
        ``send_splits[j]`` elements go to rank ``j``; returns what every rank sent this one, in rank order."""
        out = torch.empty(sum(recv_splits), dtype=tensor.dtype, device=tensor.device)
        self.collectives += 1
        try:
            dist.all_to_all_single(out, tensor.contiguous(), list(recv_splits), list(send_splits), group=self.group)
        except RuntimeError as exc:
            raise peer_lost(exc) from exc
        return out

    def active_members(self, name: str) -> int:  # noqa: ARG002
        """Every member is active (the DDP engine has no join protocol)."""
        return self.size()

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Blocking: ``tensor`` becomes rank ``src``'s (``src`` is a rank of the group)."""
        self.collectives += 1
        try:
            dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group is not dist.group.WORLD
                           else src, group=self.group)
        except RuntimeError as exc:
            raise peer_lost(exc) from exc
