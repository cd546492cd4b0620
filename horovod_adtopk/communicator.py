"""The only module that calls Horovod collectives.

It knows process sets and names; it knows nothing of which selection made a payload. Every collective
is named deterministically from a parameter name (``hat.sparse.<param>``, ``hat.dense.<param>``), so all
ranks submit the same names whatever order their gradient hooks fire in (Horovod's controller matches
collectives by name, and the optimizer submits leftovers in sorted-name order).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, List, Sequence

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

    def included(self) -> bool:
        return self.process_set.included()

    def size(self) -> int:
        return self.process_set.size()

    def rank(self) -> int:
        return self.process_set.rank()

    def allreduce_async_(self, tensor: torch.Tensor, name: str, op, prescale: float = 1.0, postscale: float = 1.0):
        return hvd.allreduce_async_(tensor, name=name, op=op, prescale_factor=prescale,
                                    postscale_factor=postscale, process_set=self.process_set)

    def grouped_allreduce_async_(self, tensors: Sequence[torch.Tensor], name: str, op, prescale: float = 1.0,
                                 postscale: float = 1.0):
        return hvd.grouped_allreduce_async_(list(tensors), name=name, op=op, prescale_factor=prescale,
                                            postscale_factor=postscale, process_set=self.process_set)

    def allgather_async(self, tensor: torch.Tensor, name: str):
        return hvd.allgather_async(tensor, name=name, process_set=self.process_set)

    def sparse_allreduce_async(self, tensor: torch.Tensor, name: str, op):
        """Horovod's aggregation of a sparse (COO) gradient: values and indices allgathered, averaged for
        ``hvd.Average``; :meth:`wait` returns the aggregated sparse tensor."""
        return hvd.sparse_allreduce_async(tensor, name=name, op=op, process_set=self.process_set)

    def broadcast_async_(self, tensor: torch.Tensor, root_rank: int, name: str):
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
