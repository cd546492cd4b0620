"""Horovod's helper functions where stock Horovod refuses a layout: :func:`broadcast_parameters`.

``hvd.broadcast_parameters(model.state_dict())`` fails on a ``channels_last`` model ("Tensor is required to
be contiguous"): Horovod's broadcast works in place on contiguous tensors only. Here every tensor that is not
contiguous travels as a contiguous copy and is written back into the tensor itself, in its own layout, so a
``channels_last`` model starts from rank 0's weights and stays ``channels_last``.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple, Union

import torch

from .communicator import Communicator


def _named(params) -> List[Tuple[str, Optional[torch.Tensor]]]:
    """``(name, tensor)`` pairs in a rank-independent order, as Horovod takes them (a dict or a list)."""
    if isinstance(params, dict):
        return sorted(params.items())
    if isinstance(params, (list, tuple)) or hasattr(params, "__next__"):
        out = []
        for i, item in enumerate(params):
            name, t = item if isinstance(item, tuple) else (f"param.{i}", item)
            out.append((str(name), t))
        return out
    raise ValueError(f"params must be a dict (model.state_dict()) or a list of (name, tensor) pairs "
                     f"(model.named_parameters()), got {type(params).__name__}")


def broadcast_parameters(params: Union[dict, Iterable], root_rank: int = 0, process_set=None) -> None:
    """Overwrite every tensor in ``params`` with rank ``root_rank``'s, whatever its memory layout.

    A drop-in for ``hvd.broadcast_parameters(params, root_rank, process_set=...)``: ``params`` is a
    ``state_dict()`` or ``named_parameters()``. Contiguous tensors are broadcast in place as Horovod does;
    others (``channels_last``, transposed views) as a contiguous copy that is then copied back. All
    broadcasts are started before any is waited for. ``None`` entries are skipped.
    """
    comm = Communicator(process_set)
    pending = []
    with torch.no_grad():
        for name, t in _named(params):
            if t is None:
                continue
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor; use "
                                "hvd.broadcast_object for other values")
            buf = t if t.is_contiguous() else t.contiguous()
            pending.append((t, buf, comm.broadcast_async_(buf, root_rank, f"hat.broadcast.{name}")))
        for t, buf, handle in pending:
            comm.wait(handle)
            if buf is not t:
                t.copy_(buf)
