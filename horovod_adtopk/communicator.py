"""The only module that calls Horovod collectives.

It knows process sets and names; it knows nothing of which selection made a payload. Every collective
is named deterministically from a parameter name (``hat.sparse.<param>``, ``hat.dense.<param>``), so all
ranks submit the same names whatever order their gradient hooks fire in (Horovod's controller matches
collectives by name, and the optimizer submits leftovers in sorted-name order).
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any, List, Sequence, Tuple

import torch
import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError


class PeerLostError(HorovodInternalError):
    """A collective failed, almost always because a peer rank died or its network went away.

    A subclass of Horovod's ``HorovodInternalError``, so Horovod elastic still treats it as recoverable.
    """


class Communicator:
    """Collectives over one Horovod process set."""

    def __init__(self, process_set=None) -> None:
        self.process_set = hvd.global_process_set if process_set is None else process_set
        #: collectives this communicator has started (every kind; the tests count them)
        self.collectives = 0

    def included(self) -> bool:
        return self.process_set.included()

    def size(self) -> int:
        return self.process_set.size()

    def rank(self) -> int:
        return self.process_set.rank()

    def allreduce_async_(self, tensor: torch.Tensor, name: str, op, prescale: float = 1.0, postscale: float = 1.0):
        self.collectives += 1
        return hvd.allreduce_async_(tensor, name=name, op=op, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=self.process_set)

    def grouped_allreduce_async_(self, tensors: Sequence[torch.Tensor], name: str, op, prescale: float = 1.0,
                                 postscale: float = 1.0):
        self.collectives += 1
        return hvd.grouped_allreduce_async_(list(tensors), name=name, op=op, prescale_factor=prescale,
                                            postscale_factor=postscale, process_set=self.process_set)

    def allgather_async(self, tensor: torch.Tensor, name: str):
        self.collectives += 1
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def reducescatter_async(self, tensor: torch.Tensor, name: str):
        """Sum ``tensor`` over the set; member ``i`` receives the ``i``-th slice of dim 0 (Horovod splits dim 0
        as evenly as it can, the first ``n % size`` members one row more)."""
        self.collectives += 1
        return hvd.reducescatter_async(tensor, name=name, op=hvd.Sum, process_set=self.process_set)

    def is_global(self) -> bool:
        return self.process_set.process_set_id == 0

    def sparse_allreduce_async(self, tensor: torch.Tensor, name: str, op):
        """Horovod's aggregation of a sparse (COO) gradient: values and indices allgathered, averaged for
        ``hvd.Average``; :meth:`wait` returns the aggregated sparse tensor."""
        self.collectives += 1
        return hvd.sparse_allreduce_async(tensor, name=name, op=op, process_set=self.process_set)

    def broadcast_async_(self, tensor: torch.Tensor, root_rank: int, name: str):
        self.collectives += 1
        return hvd.broadcast_async_(tensor, root_rank, name=name, process_set=self.process_set)

    @staticmethod
    def wait(handle) -> Any:
        try:
            if callable(handle):  # sparse_allreduce_async hands back a function that waits
                return handle()
            return hvd.synchronize(handle)
        except HorovodInternalError as exc:
            raise PeerLostError(f"horovod_adtopk: a collective failed; a peer rank was probably lost (killed, "
                                f"crashed or unreachable). Horovod said: {exc}") from exc

    @staticmethod
    def poll(handle) -> bool:
        """Whether an asynchronous collective has finished (never blocks)."""
        return hvd.poll(handle)

    def allgather(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return self.wait(self.allgather_async(tensor, name))

    # --- the interface of horovod_adtopk.local_steps (blocking, started together so Horovod fuses them) ---------
    def sum_tensors(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> List[torch.Tensor]:
        """Every tensor summed over the set (in place where Horovod can), in order; one name per tensor."""
        handles = [self.allreduce_async_(t, n, hvd.Sum) for t, n in zip(tensors, names)]
        return [self.wait(h) for h in handles]

    def gather_tensors(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> List[torch.Tensor]:
        """Every member's tensors, each concatenated in rank order; one name per tensor."""
        handles = [self.allgather_async(t, n) for t, n in zip(tensors, names)]
        return [self.wait(h) for h in handles]

    def alltoall_async(self, tensor: torch.Tensor, send_splits: Sequence[int], name: str):
        """All-to-all of a 1-D tensor (``send_splits[j]`` elements to member ``j``); :meth:`wait` returns
        ``(received, received_splits)``."""
        self.collectives += 1
        return hvd.alltoall_async(tensor, splits=torch.tensor(list(send_splits), dtype=torch.int32), name=name,
                                  process_set=self.process_set)

    def alltoall(self, tensor: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int],
                 name: str) -> torch.Tensor:
        """Blocking all-to-all of a 1-D tensor: ``send_splits[j]`` elements go to member ``j``; returns what every
        member sent this one, in rank order (``recv_splits[j]`` from member ``j``)."""
        self.collectives += 1
        try:
            out = hvd.alltoall(tensor, splits=torch.tensor(list(send_splits), dtype=torch.int32), name=name,
                               process_set=self.process_set)
        except HorovodInternalError as exc:
            raise PeerLostError(f"horovod_adtopk: a collective failed; a peer rank was probably lost (killed, "
                                f"crashed or unreachable). Horovod said: {exc}") from exc
        out = out[0] if isinstance(out, (tuple, list)) else out
        if out.numel() != sum(recv_splits):
            raise RuntimeError(f"horovod_adtopk: all-to-all {name} received {out.numel()} elements, expected "
                               f"{sum(recv_splits)}: ranks disagree on the shards")
        return out

    def active_members_async(self, name: str):
        """Start counting the members that have not called ``hvd.join()`` (joined members add zeros to an
        allreduce); :meth:`wait` returns a one-element tensor."""
        return self.allreduce_async_(torch.ones(1), name, hvd.Sum)

    def active_members(self, name: str) -> int:
        """How many members have not called ``hvd.join()``."""
        return int(self.wait(self.active_members_async(name)).item())

    def broadcast_object(self, obj: Any, name: str, root_rank: int = 0) -> Any:
        """Rank ``root_rank``'s ``obj`` on every member (Horovod's ``broadcast_object`` on this process set)."""
        return hvd.broadcast_object(obj, root_rank=root_rank, name=name, process_set=self.process_set)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every member's ``obj`` (plain data only: pickled with the standard library), in rank order."""
        buf = io.BytesIO()
        pickle.dump(obj, buf, protocol=pickle.HIGHEST_PROTOCOL)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sizes = self.allgather(torch.tensor([data.numel()], dtype=torch.int64), name + ".size").tolist()
        gathered = self.allgather(data, name + ".data").numpy().tobytes()
        out, offset = [], 0
        for n in sizes:
            out.append(pickle.loads(gathered[offset:offset + n]))
            offset += n
        return out


def world_size() -> int:
    """Horovod's global world size (``hvd.size()``)."""
    return hvd.size()


def global_rank() -> int:
    """This process's rank in Horovod's global set (``hvd.rank()``)."""
    return hvd.rank()


def local_size() -> int:
    """Ranks on this host (``hvd.local_size()``)."""
    return hvd.local_size()


def host_layout() -> Tuple[int, int, int, int]:
    """This rank's place among the hosts: ``(cross_rank, local_rank, local_size, cross_size)`` (Horovod's
    numbering: ``cross_rank`` is the host's index when every host runs the same number of ranks)."""
    return hvd.cross_rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_size()


def dynamic_process_sets() -> bool:
    """Whether process sets may be added after ``hvd.init()`` (``HOROVOD_DYNAMIC_PROCESS_SETS=1``, which
    ``hvd.init(process_sets="dynamic")`` also sets)."""
    return os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower() in ("1", "true", "yes")


def process_sets(rank_lists: Sequence[Sequence[int]]) -> List[Communicator]:
    """Communicators over the process sets with exactly these ranks, in order. Collective: every rank calls
    it with the same lists. A set that already exists (passed to ``hvd.init(process_sets=...)`` or made by an
    earlier optimizer) is reused; a missing one is added, which needs dynamic process sets."""
    from horovod.torch.mpi_ops import _basics
    existing = {tuple(r): i for i, r in _basics._get_process_set_ids_and_ranks().items()}
    missing = [sorted(r) for r in rank_lists if tuple(sorted(r)) not in existing]
    if missing and not dynamic_process_sets():
        raise RuntimeError(
            "horovod_adtopk: hierarchical=True needs Horovod process sets for the ranks of each host and for the "
            f"ranks with the same local rank on every host ({missing} do not exist). Set "
            "HOROVOD_DYNAMIC_PROCESS_SETS=1 in the environment of every rank (or call "
            "hvd.init(process_sets=\"dynamic\")), or pass these sets to hvd.init(process_sets=[hvd.ProcessSet(ranks), "
            "...]); or use hierarchical=False.")
    out = []
    for ranks in rank_lists:
        key = tuple(sorted(ranks))
        if key in existing:
            ps = hvd.ProcessSet(list(key))
            ps.process_set_id = existing[key]
        else:
            ps = hvd.add_process_set(list(key))
            existing[key] = ps.process_set_id
        out.append(Communicator(ps))
    return out
