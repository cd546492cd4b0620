"""Low-bit values and bit-packed indices for the outer exchange of local steps (SparseLoCo-style).

A sparse pseudo-gradient at 5% density with float32 values and int16 fiber-local indices costs about 6 bytes
per kept entry; the indices then weigh as much as the values. This module shrinks both:

- **Values, ``bits`` per entry** (1 sign bit + ``bits - 1`` level bits). The entries are cut into *groups*
  (one group per fiber for ADTopk: its ``k`` entries; with ``value_group=n``, the fewest consecutive whole
  fibers that hold at least ``n`` entries and divide the fiber count; the whole payload for a flat rule such as
  Top-k). In a
  group the magnitudes are ranked and split into ``L = 2 ** (bits - 1)`` bins of equal count; each bin sends
  one level, the mean magnitude of its entries, as a bfloat16. An entry travels as its sign and its bin:
  ``value = +-level[group, bin]``. With 2 bits a fiber sends its larger and its smaller half as two
  magnitudes; with 1 bit it sends signs and one mean magnitude.
- **Indices, ``ceil(log2(max_index + 1))`` bits per entry**, packed LSB first (a 768-long fiber: 10 bits
  instead of an int16's 16).

A *dense* block (:meth:`QuantizedWire.dense`, for ``value_bits`` with ``Compression.none``) carries every entry of
a tensor in order: no indices; groups are its rows (dim 0) or runs of whole rows that hold ``value_group`` entries.

One rank's block (the same size on every rank; ``block_bytes``)::

    [ G * L bfloat16 levels | n * bits packed codes | n * index_bits packed indices | pad to 8 bytes ]

What was carried (``decode(encode(v))``) differs from ``v``; the caller puts ``v - carried`` back into the
error-feedback memory, so that nothing is lost (the invariant "sent + residual = sum of the deltas" holds with
"sent" the carried values). Every step is plain PyTorch (CPU or CUDA, the tensors stay on their device), the
same bits on every rank.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import List, Optional, Tuple

import torch

from .wire import ALIGN

#: accepted ``value_bits``
VALUE_BITS = tuple(range(1, 9))


def check_value_bits(value_bits):
    """``None`` (the compressor's own value dtype) or an int in 1..8."""
    if value_bits is None:
        return None
    if isinstance(value_bits, bool) or not isinstance(value_bits, numbers.Integral) or value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits must be None (values travel in the compressor's value dtype) or an int in "
                         f"1..8 (1 sign bit + value_bits - 1 bits of magnitude level), got {value_bits!r}")
    return int(value_bits)


def check_value_group(value_group, value_bits):
    """``None`` (one set of levels per fiber) or an int >= 1, and only with ``value_bits``."""
    if value_group is None:
        return None
    if isinstance(value_group, bool) or not isinstance(value_group, numbers.Integral) or value_group < 1:
        raise ValueError(f"value_group must be None (one set of levels per fiber) or an int >= 1 (the least number "
                         f"of kept entries that share one set of levels), got {value_group!r}")
    if value_bits is None:
        raise ValueError(f"value_group={value_group} groups the levels of low-bit values; set value_bits too "
                         "(e.g. value_bits=2), or leave value_group=None")
    return int(value_group)


def fibers_per_group(fibers: int, k: int, value_group) -> int:
    """The fewest whole fibers (a divisor of ``fibers``) whose ``k`` entries each add up to ``value_group``."""
    if not value_group or fibers <= 1 or k >= value_group:
        return 1
    for d in range(1, fibers + 1):
        if fibers % d == 0 and d * k >= value_group:
            return d
    return fibers


def width_for(max_index: int) -> int:
    """Bits that hold every integer in ``0 .. max_index`` (at least 1)."""
    return max(1, int(max_index).bit_length())


def packed_bytes(n: int, width: int) -> int:
    return -(-n * width // 8)


def _words(width: int) -> int:
    """64-bit words that hold 8 entries of ``width`` bits (8 entries fill ``width`` whole bytes)."""
    return -(-width // 8)


def bitpack(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pack the low ``width`` bits (1..56) of each non-negative integer of 1-D ``x`` into bytes, LSB first:
    entry i occupies bits ``i * width .. (i + 1) * width - 1`` of the little-endian byte string.

    Eight entries at a time fill ``width`` whole bytes: they are OR-ed into ``ceil(width / 8)`` 64-bit words
    (the few shifts are per column, vectorised over the rows), whose bytes are the packed bytes."""
    n = x.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=x.device)
    rows = -(-n // 8)
    v = torch.zeros(rows * 8, dtype=torch.int64, device=x.device)
    v[:n] = x.reshape(-1).to(torch.int64) & ((1 << width) - 1)
    v = v.view(rows, 8)
    K = _words(width)
    words = torch.zeros(rows, K, dtype=torch.int64, device=x.device)
    for j in range(8):
        off = j * width
        word, sh = off // 64, off % 64
        words[:, word] |= v[:, j] << sh  # bits shifted past bit 63 are dropped here ...
        if sh + width > 64:
            words[:, word + 1] |= v[:, j] >> (64 - sh)  # ... and land in the next word
    packed = _bytes_of(words)[:, :width].reshape(-1)
    return packed[:packed_bytes(n, width)].contiguous()


def bitunpack(data: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """The ``n`` integers (int64) that :func:`bitpack` packed at ``width`` bits into ``data`` (uint8)."""
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    rows, K = -(-n // 8), _words(width)
    raw = torch.zeros(rows * width, dtype=torch.uint8, device=data.device)
    raw[:data.numel()] = data.reshape(-1)
    padded = torch.zeros(rows, 8 * K, dtype=torch.uint8, device=data.device)
    padded[:, :width] = raw.view(rows, width)
    words = _words_of(padded)
    mask = (1 << width) - 1
    out = torch.empty(rows, 8, dtype=torch.int64, device=data.device)
    for j in range(8):
        off = j * width
        word, sh = off // 64, off % 64
        val = words[:, word] >> sh  # arithmetic shift: the sign-extended bits lie above bit 63 - sh
        if sh + width > 64:
            val = (val & ((1 << (64 - sh)) - 1)) | (words[:, word + 1] << (64 - sh))
        out[:, j] = val & mask
    return out.view(-1)[:n]


def _bytes_of(words: torch.Tensor) -> torch.Tensor:
    """[rows, K] int64 -> [rows, 8K] uint8, least significant byte first."""
    if sys.byteorder == "little":
        return words.contiguous().view(torch.uint8)
    shifts = torch.arange(0, 64, 8, device=words.device)
    return ((words.unsqueeze(2) >> shifts) & 0xFF).to(torch.uint8).reshape(words.shape[0], -1)


def _words_of(data: torch.Tensor) -> torch.Tensor:
    """[rows, 8K] uint8 -> [rows, K] int64 (the inverse of :func:`_bytes_of`)."""
    if sys.byteorder == "little":
        return data.contiguous().view(torch.int64)
    shifts = torch.arange(0, 64, 8, device=data.device)
    return (data.view(data.shape[0], -1, 8).to(torch.int64) << shifts).sum(2)


class QuantizedWire:
    """The block format of one tensor's sparse outer payload (module docstring).

    Args:
        bits: bits per value (1..8).
        count: entries per rank (the compressor's fixed count).
        group: entries per group (``count`` must be a multiple; ADTopk: ``k`` per fiber).
        max_index: the largest wire index (fiber length - 1, or numel - 1 for flat indices); None for a dense
            block (every entry in order, no indices: :meth:`dense`).
    """

    def __init__(self, bits: int, count: int, group: int, max_index: Optional[int]) -> None:
        if group < 1 or count % group:
            raise ValueError(f"count {count} is not a whole number of groups of {group}")
        self.bits, self.count, self.group = check_value_bits(bits), int(count), int(group)
        self.groups = self.count // self.group
        self.levels = 2 ** (self.bits - 1)
        self.indexed = max_index is not None
        self.index_bits = width_for(max_index) if self.indexed else 0
        self.level_bytes = self.groups * self.levels * 2
        self.code_bytes = packed_bytes(self.count, self.bits)
        self.index_bytes = packed_bytes(self.count, self.index_bits)
        used = self.level_bytes + self.code_bytes + self.index_bytes
        self.block_bytes = -(-used // ALIGN) * ALIGN

    @classmethod
    def for_codec(cls, bits: int, codec, numel: int, value_group=None) -> "QuantizedWire":
        """The format for a fixed-size codec: groups are fibers (or runs of whole fibers, at least
        ``value_group`` entries) for fiber-local indices, else the payload."""
        layout = getattr(codec, "layout", None)
        if layout is not None:
            k = max(layout.k, 1)
            per = fibers_per_group(codec.count // k, k, value_group)
            return cls(bits, codec.count, k * per, layout.fiber_len - 1)
        return cls(bits, codec.count, max(codec.count, 1), max(numel - 1, 0))

    @classmethod
    def dense(cls, bits: int, shape, value_group=None) -> "QuantizedWire":
        """The format of a whole tensor, every entry in order and no indices (a dense low-bit outer exchange):
        groups are its rows (dim 0; a 1-D tensor is one row), or runs of whole rows that hold at least
        ``value_group`` entries."""
        numel = math.prod(shape)
        if numel == 0:
            return cls(bits, 0, 1, None)
        rows = int(shape[0]) if len(shape) >= 2 else 1
        row = numel // rows
        return cls(bits, numel, row * fibers_per_group(rows, row, value_group), None)

    def _quantize(self, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes int64 [n], levels bfloat16 [G, L], carried float32 [n])."""
        v = values.detach().to(torch.float32).reshape(self.groups, self.group)
        mag = v.abs()
        negative = torch.signbit(v).to(torch.int64)
        if self.levels == 1:  # one bin: its level is the group's mean magnitude, no ranking needed
            level = (mag.sum(1, dtype=torch.float64, keepdim=True) / self.group).to(torch.float32).to(torch.bfloat16)
            carried = level.to(torch.float32).expand(self.groups, self.group)
            carried = torch.where(negative.bool(), -carried, carried)
            return (negative << (self.bits - 1)).reshape(-1), level, carried.reshape(-1)
        ranked, order = torch.sort(mag, dim=1, stable=True)  # ascending, ties by position
        # equal-count bins by magnitude rank (0 = smallest): rank p falls in bin p * L // group
        edges = [-(-b * self.group // self.levels) for b in range(self.levels + 1)]
        levels = torch.zeros(self.groups, self.levels, dtype=torch.float64, device=v.device)
        for b in range(self.levels):
            lo, hi = edges[b], edges[b + 1]
            if hi > lo:
                levels[:, b] = ranked[:, lo:hi].sum(1, dtype=torch.float64) / (hi - lo)
        levels = levels.to(torch.float32).to(torch.bfloat16)
        rank_bin = torch.arange(self.group, device=v.device) * self.levels // self.group
        bins = torch.empty_like(order)
        bins.scatter_(1, order, rank_bin.expand(self.groups, -1))
        codes = (negative << (self.bits - 1)) | bins
        carried = torch.gather(levels.to(torch.float32), 1, bins)
        carried = torch.where(negative.bool(), -carried, carried)
        return codes.reshape(-1), levels, carried.reshape(-1)

    def encode(self, values: torch.Tensor, index: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's block and the values it carries (float32, in ``values``' order); ``index`` None for a
        dense block."""
        if self.indexed != (index is not None):
            raise ValueError("an indexed block needs the indices, a dense one (QuantizedWire.dense) takes none")
        if values.numel() != self.count or (index is not None and index.numel() != self.count):
            raise ValueError(f"expected {self.count} values and indices, got {values.numel()} and "
                             f"{None if index is None else index.numel()}")
        block = torch.zeros(self.block_bytes, dtype=torch.uint8, device=values.device)
        if self.count == 0:
            return block, values.detach().to(torch.float32)
        codes, levels, carried = self._quantize(values)
        a, b = self.level_bytes, self.level_bytes + self.code_bytes
        block[:a].view(torch.bfloat16).copy_(levels.reshape(-1))
        block[a:b].copy_(bitpack(codes, self.bits))
        if self.indexed:
            block[b:b + self.index_bytes].copy_(bitpack(index.reshape(-1), self.index_bits))
        return block, carried

    def decode(self, gathered: torch.Tensor, world: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's ``(values float32, wire indices int64)``, rank order, from the allgathered blocks (the
        indices None for a dense block)."""
        if gathered.numel() != world * self.block_bytes:
            raise ValueError(f"gathered payload has {gathered.numel()} bytes, but {world} blocks of "
                             f"{self.block_bytes} were expected: ranks disagree on the outer wire format")
        out = []
        a, b = self.level_bytes, self.level_bytes + self.code_bytes
        for r in range(world):
            block = gathered[r * self.block_bytes:(r + 1) * self.block_bytes]
            if self.count == 0:
                out.append((torch.empty(0, dtype=torch.float32, device=gathered.device),
                            torch.empty(0, dtype=torch.int64, device=gathered.device) if self.indexed else None))
                continue
            levels = block[:a].view(torch.bfloat16).to(torch.float32).view(self.groups, self.levels)
            codes = bitunpack(block[a:b], self.count, self.bits).view(self.groups, self.group)
            bins = codes & (self.levels - 1)
            vals = torch.gather(levels, 1, bins)
            vals = torch.where((codes >> (self.bits - 1)).bool(), -vals, vals).reshape(-1)
            index = bitunpack(block[b:b + self.index_bytes], self.count, self.index_bits) if self.indexed else None
            out.append((vals, index))
        return out

    def describe(self) -> dict:
        return {"value_bits": self.bits, "index_bits": self.index_bits, "group": self.group,
                "block_bytes": self.block_bytes, "bytes_per_entry": self.block_bytes / max(self.count, 1)}


def bytes_per_entry(bits: int, group: int, max_index: int) -> float:
    """Wire bytes per kept entry (padding left out): codes + packed index + the group's levels."""
    return (bits + width_for(max_index)) / 8 + (2 ** (bits - 1)) * 2 / group


__all__ = ["QuantizedWire", "VALUE_BITS", "bitpack", "bitunpack", "bytes_per_entry", "check_value_bits",
           "check_value_group", "fibers_per_group", "width_for"]
