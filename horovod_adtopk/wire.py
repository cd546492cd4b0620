"""Wire format: how a rank's selected entries travel, and the one place bytes are counted.

A sparse payload is ONE 1-D ``uint8`` tensor per tensor and rank, a *block*::

    [ n values (wire value dtype) | pad to 8 bytes | n indices (narrowest int type) | pad to 8 bytes ]

One buffer per tensor means one collective per tensor, and since every payload is ``uint8``, Horovod's
fusion buffer fuses the allgathers of many tensors into one. Packing is two contiguous copies into the
block; after the allgather, each rank's values and indices are zero-copy views of the gathered buffer
(the 8-byte padding keeps every region aligned for its dtype). The receiver knows each rank's ``n``:
fixed-size rules send the same ``n`` everywhere, variable-size ones send their counts alongside.

Measured (BENCHMARKS.md, ADTopk at ratio 0.01 on the largest VGG-16/BERT/ResNet-50 tensors, CPU): a
row-interleaved ``[n, value_bytes + index_bytes]`` buffer costs about 2% of the selection time to pack and
4-8% to unpack; values and indices as two tensors cost 0.1-0.2% but need two collectives per tensor; this
block packs in 0.3-0.5% and unpacks in about 1% with one collective.

Index width: int16 when every index fits in 32767, int32 up to 2**31 - 1, else int64. ADTopk sends
indices local to the fiber, so a layer whose fibers are shorter than 32768 travels with 2-byte indices
whatever its size (fp32 value + int16 index = 6 bytes per entry instead of 12 with int64 indices).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

WIRE_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ALIGN = 8
#: bytes of the count a variable-size payload sends alongside (one int64 allgather)
COUNT_BYTES = 8
#: largest finite float16; larger finite values are clamped to it on a float16 wire
FP16_MAX = 65504.0


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


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def block_bytes(n: int, value_dtype: torch.dtype, index_dtype: torch.dtype) -> int:
    """Size of one rank's block holding ``n`` entries (padding included)."""
    return _padded(n * dtype_bytes(value_dtype)) + _padded(n * dtype_bytes(index_dtype))


def pack(values: torch.Tensor, indices: Optional[torch.Tensor], value_dtype: torch.dtype,
         index_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Pack 1-D ``values`` and ``indices`` into one ``uint8`` block (see the module docstring).

    With ``indices=None`` the payload is just the values cast to ``value_dtype``, for rules whose positions
    every rank knows already (Random-k); those are summed by allreduce.
    """
    if indices is None:
        return values.reshape(-1).to(value_dtype).contiguous()
    n = values.numel()
    vbytes, ibytes = n * dtype_bytes(value_dtype), n * dtype_bytes(index_dtype)
    vend = _padded(vbytes)
    block = torch.empty(vend + _padded(ibytes), dtype=torch.uint8, device=values.device)
    block[vbytes:vend].zero_()  # padding: deterministic bytes on the wire
    block[vend + ibytes:].zero_()
    block[:vbytes].view(value_dtype).copy_(values.reshape(-1))
    block[vend:vend + ibytes].view(index_dtype).copy_(indices.reshape(-1))
    return block


def unpack_blocks(gathered: torch.Tensor, counts: Sequence[int], value_dtype: torch.dtype,
                  index_dtype: torch.dtype) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Split an allgathered buffer into every rank's ``(values, indices)`` views (no copies), rank order."""
    vsize, isize = dtype_bytes(value_dtype), dtype_bytes(index_dtype)
    out, offset = [], 0
    for n in counts:
        vend = offset + _padded(n * vsize)
        out.append((gathered[offset:offset + n * vsize].view(value_dtype),
                    gathered[vend:vend + n * isize].view(index_dtype)))
        offset = vend + _padded(n * isize)
    if offset != gathered.numel():
        raise ValueError(f"gathered payload has {gathered.numel()} bytes, but counts {list(counts)} describe "
                         f"{offset}: ranks disagree on the wire format")
    return out


def unpack(gathered: torch.Tensor, counts: Sequence[int], value_dtype: torch.dtype,
           index_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every rank's values (wire dtype) and indices (int64), concatenated in rank order."""
    blocks = unpack_blocks(gathered, counts, value_dtype, index_dtype)
    if not blocks:
        return (torch.empty(0, dtype=value_dtype, device=gathered.device),
                torch.empty(0, dtype=torch.int64, device=gathered.device))
    values = torch.cat([v for v, _ in blocks])
    indices = torch.cat([i for _, i in blocks]).to(torch.int64)
    return values, indices


def payload_bytes(payload: torch.Tensor) -> int:
    """Bytes this rank puts on the wire for a payload (the only byte count the package uses)."""
    return payload.numel() * payload.element_size()


def join(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 1-D ``uint8`` blocks back to back in one tensor: a view when they already lie back to back in one
    buffer (a bucket selection packs them so), else a concatenated copy."""
    if not blocks:
        raise ValueError("no blocks to join")
    first = blocks[0]
    storage, end = first.untyped_storage(), first.data_ptr() + first.numel()
    for b in blocks[1:]:
        if b.untyped_storage().data_ptr() != storage.data_ptr() or b.data_ptr() != end or not b.is_contiguous():
            return torch.cat(list(blocks))
        end += b.numel()
    if not first.is_contiguous():
        return torch.cat(list(blocks))
    return first.new_empty(0).set_(storage, first.storage_offset(), (end - first.data_ptr(),))
