"""Wire format: how a rank's selected entries travel, and the one place bytes are counted.

A sparse payload is ONE ``uint8`` tensor of shape ``[n, entry_bytes]``: row ``j`` holds the bytes of value
``j`` (in the wire value dtype) followed by the bytes of index ``j`` (in the narrowest integer type that
holds the largest index). One buffer per tensor means one collective per tensor, and since every payload
is ``uint8``, Horovod's fusion buffer can fuse the allgathers of many tensors into one.

Measured (see BENCHMARKS.md): row-interleaved packing costs one ``torch.cat`` of ``n * entry_bytes``
bytes and unpacking two strided copies; both are below 3% of the selection time, and a single buffer
halves the number of collectives compared with separate value and index tensors.

Index width: int16 when every index fits in 32767, int32 up to 2**31 - 1, else int64. ADTopk sends
indices local to the fiber, so a layer whose fibers are shorter than 32768 travels with 2-byte indices
whatever its size (fp32 value + int16 index = 6 bytes per entry instead of 12 with int64 indices).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

WIRE_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def index_dtype_for(max_index: int) -> torch.dtype:
    """Narrowest signed integer dtype holding ``0 .. max_index``: int16, int32 or int64."""
    if max_index <= 32767:
        return torch.int16
    if max_index <= 2**31 - 1:
        return torch.int32
    return torch.int64


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def entry_bytes(value_dtype: torch.dtype, index_dtype: Optional[torch.dtype]) -> int:
    """Bytes per entry on the wire (value + index; index may be None when positions are implied)."""
    return dtype_bytes(value_dtype) + (dtype_bytes(index_dtype) if index_dtype is not None else 0)


def pack(values: torch.Tensor, indices: Optional[torch.Tensor], value_dtype: torch.dtype,
         index_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Pack 1-D ``values`` (and ``indices``) into a ``uint8`` payload ``[n, entry_bytes]``.

    With ``indices=None`` the payload is just the values cast to ``value_dtype`` (shape ``[n]``), for rules
    whose positions every rank knows already (Random-k).
    """
    v = values.reshape(-1).to(value_dtype).contiguous()
    if indices is None:
        return v
    n = v.numel()
    i = indices.reshape(-1).to(index_dtype).contiguous()
    vb = v.view(torch.uint8).reshape(n, v.element_size())
    ib = i.view(torch.uint8).reshape(n, i.element_size())
    return torch.cat([vb, ib], dim=1)


def unpack(payload: torch.Tensor, value_dtype: torch.dtype, index_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack` for a (possibly gathered) ``[N, entry_bytes]`` payload: ``(values, int64 indices)``."""
    vbytes = dtype_bytes(value_dtype)
    if payload.numel() == 0:
        return (torch.empty(0, dtype=value_dtype, device=payload.device),
                torch.empty(0, dtype=torch.int64, device=payload.device))
    n = payload.shape[0]
    # Copy each column block into a fresh, aligned buffer before reinterpreting its bytes (a strided or
    # single-row slice may not be aligned for the wider dtype).
    vcol = torch.empty((n, vbytes), dtype=torch.uint8, device=payload.device).copy_(payload[:, :vbytes])
    icol = torch.empty((n, payload.shape[1] - vbytes), dtype=torch.uint8, device=payload.device).copy_(payload[:, vbytes:])
    values = vcol.view(value_dtype).reshape(-1)
    indices = icol.view(index_dtype).reshape(-1).to(torch.int64)
    return values, indices


def payload_bytes(payload: torch.Tensor) -> int:
    """Bytes this rank puts on the wire for a payload (the only byte count the package uses)."""
    return payload.numel() * payload.element_size()
