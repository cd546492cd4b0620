"""The one cost model: what a collective puts on each rank's link, and how long it takes (alpha-beta).

Every byte figure the package reports as *wire bytes* and every choice of collective it makes comes from
here, so a new exchange kind enters both by giving its collectives.

Per rank, with ``W`` ranks, ``D`` the bytes of the buffer a rank hands to an allreduce and ``P`` the bytes
of the payload it hands to an allgather (the algorithms Gloo uses, which Horovod's CPU operations and
torch's ``ProcessGroupGloo`` both run):

==================  ===================================  =========================================
collective          sent (and received) per rank         messages per rank (the latency term)
==================  ===================================  =========================================
allreduce, ring     ``2 (W-1)/W * D``                    ``2 (W-1)``
allgather, ring     ``(W-1) * P``                        ``W - 1``
reduce-scatter      ``(W-1)/W * D``                      ``W - 1``
all-to-all          ``(W-1)/W * D``                      ``W - 1``
broadcast           ``D`` (pipelined chain)              ``1``
==================  ===================================  =========================================

The latency column counts the ring's steps; Gloo pipelines an allreduce step in two segments, so it sends
``4 (W-1)`` messages, each with its headers (measured on 8 emulated hosts: a few hundred bytes per collective
beyond these formulas, about 5% of PowerSGD's small factors' bytes, under 2% for the other exchanges).

An allgather of payloads of different sizes (variable-count rules) receives every other rank's payload:
``sum_j P_j - P_own``; a ring sends every payload but its successor's. This rank's share is reported as
``(W-1) * P_own`` both ways, which is exact summed over the ranks (and per rank when sizes agree).

Where other implementations differ (stated, not assumed away; give :class:`Link` the one you run on):

- NCCL runs rings or double binary trees; both move about ``2 D`` per rank for an allreduce
  (``reduction="ring"``). NVLS (NVLink SHARP) and CollNet / SHARP reduce in the switch: each rank sends
  and receives ``D`` once (``reduction="in_network"``).
- Open MPI's tuned allreduce uses recursive doubling below about 10 kB (``log2 W * D`` per rank) and a
  segmented ring above, where gradients live; its allgather is a ring or neighbour exchange for large
  payloads (``(W-1) P`` either way).

The time of a collective is ``messages * latency + max(sent, received) / bandwidth`` (a full-duplex link).
Under Horovod's tensor fusion and DDP's buckets a tensor's allreduce or allgather rides in a fused
collective either way, so the choice of one tensor's path adds no message: the default latency is 0 and
the choice is by bytes. Give ``latency`` (``HOROVOD_ADTOPK_LINK="10Gbit/s,50us"``) where collectives are not
fused; then a sparse allgather may be chosen with slightly more bytes than the allreduce, because it has
half the messages.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional, Tuple

#: the collectives the package issues
ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL, BROADCAST = (
    "allreduce", "allgather", "reducescatter", "alltoall", "broadcast")
COLLECTIVES = (ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL, BROADCAST)
#: allreduce algorithms: the ring (Gloo, NCCL ring/tree, MPI for large buffers), reduction in the network
REDUCTIONS = ("ring", "in_network")
#: environment variable read by :meth:`Link.from_env`
LINK_ENV = "HOROVOD_ADTOPK_LINK"


@dataclass(frozen=True)
class Wire:
    """Bytes one rank sends and receives on its link."""

    sent: int = 0
    received: int = 0

    def __add__(self, other: "Wire") -> "Wire":
        return Wire(self.sent + other.sent, self.received + other.received)

    def scaled(self, factor: int) -> "Wire":
        return Wire(self.sent * factor, self.received * factor)


NONE = Wire(0, 0)


@dataclass(frozen=True)
class Link:
    """One rank's link: ``bandwidth`` in bytes per second (each way), ``latency`` in seconds per message,
    and how an allreduce reduces (``"ring"`` or ``"in_network"``)."""

    bandwidth: float = 1.25e9
    latency: float = 0.0
    reduction: str = "ring"

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"link latency must be >= 0 s, got {self.latency!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"link reduction must be one of {REDUCTIONS}, got {self.reduction!r}")

    @classmethod
    def parse(cls, text: str) -> "Link":
        """``"25Gbit/s"``, ``"10Gbit/s,50us"``, ``"100Gbit/s,5us,in_network"`` (units: bit/s with k, M, G
        prefixes, or B/s; latency in s, ms or us)."""
        bandwidth, latency, reduction = cls().bandwidth, 0.0, "ring"
        for part in (p.strip() for p in str(text).split(",") if p.strip()):
            low = part.lower()
            if low in REDUCTIONS:
                reduction = low
                continue
            m = re.fullmatch(r"([0-9.]+(?:e[-+]?[0-9]+)?)\s*([kmg]?)(bit|b)(?:/s|ps)?", low)
            if m:
                scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]
                bandwidth = float(m.group(1)) * scale / (8 if m.group(3) == "bit" else 1)
                continue
            m = re.fullmatch(r"([0-9.]+(?:e[-+]?[0-9]+)?)\s*(s|ms|us)", low)
            if m:
                latency = float(m.group(1)) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]
                continue
            raise ValueError(f"cannot read {part!r} in link {text!r}: give e.g. '10Gbit/s,50us' "
                             f"(bandwidth, optional latency, optional one of {REDUCTIONS})")
        return cls(bandwidth, latency, reduction)

    @classmethod
    def from_env(cls) -> "Link":
        """The link given by ``HOROVOD_ADTOPK_LINK``, else the default (10 Gbit/s, latency 0: fused)."""
        text = os.environ.get(LINK_ENV, "").strip()
        return cls.parse(text) if text else cls()

    def describe(self) -> str:
        return f"{self.bandwidth * 8 / 1e9:g} Gbit/s, {self.latency * 1e6:g} us, {self.reduction}"


def _ring_share(nbytes: int, world: int, factor: int) -> int:
    return int(round(factor * (world - 1) * nbytes / world))


def allreduce(nbytes: int, world: int, link: Optional[Link] = None) -> Wire:
    """A rank's bytes for an allreduce of ``nbytes`` (ring: ``2 (W-1)/W`` of them each way)."""
    if world <= 1 or nbytes <= 0:
        return NONE
    if link is not None and link.reduction == "in_network":
        return Wire(nbytes, nbytes)
    share = _ring_share(nbytes, world, 2)
    return Wire(share, share)


def allgather(nbytes: int, world: int) -> Wire:
    """A rank's bytes for an allgather of its ``nbytes`` payload (every other rank's arrives: ``(W-1) P``)."""
    if world <= 1 or nbytes <= 0:
        return NONE
    return Wire((world - 1) * nbytes, (world - 1) * nbytes)


def reducescatter(nbytes: int, world: int) -> Wire:
    """A rank's bytes for a reduce-scatter of an ``nbytes`` buffer (ring: ``(W-1)/W`` of it each way)."""
    if world <= 1 or nbytes <= 0:
        return NONE
    share = _ring_share(nbytes, world, 1)
    return Wire(share, share)


def alltoall(nbytes: int, world: int) -> Wire:
    """A rank's bytes for an all-to-all of an ``nbytes`` buffer (it keeps its own ``1/W``)."""
    return reducescatter(nbytes, world)


def broadcast(nbytes: int, world: int) -> Wire:
    """A rank's bytes for a pipelined broadcast of ``nbytes`` (a chain: each rank receives and forwards once)."""
    if world <= 1 or nbytes <= 0:
        return NONE
    return Wire(nbytes, nbytes)


def wire(collective: str, nbytes: int, world: int, link: Optional[Link] = None) -> Wire:
    """Dispatch on ``collective`` (one of :data:`COLLECTIVES`)."""
    if collective == ALLREDUCE:
        return allreduce(nbytes, world, link)
    if collective == ALLGATHER:
        return allgather(nbytes, world)
    if collective == REDUCESCATTER:
        return reducescatter(nbytes, world)
    if collective == ALLTOALL:
        return alltoall(nbytes, world)
    if collective == BROADCAST:
        return broadcast(nbytes, world)
    raise ValueError(f"unknown collective {collective!r}; one of {COLLECTIVES}")


def messages(collective: str, world: int, link: Optional[Link] = None) -> int:
    """Messages a rank sends in one such collective (the latency term's count)."""
    if world <= 1:
        return 0
    if collective == ALLREDUCE:
        return 2 if link is not None and link.reduction == "in_network" else 2 * (world - 1)
    if collective == BROADCAST:
        return 1
    return world - 1


def seconds(collective: str, nbytes: int, world: int, link: Link) -> float:
    """Alpha-beta time of one collective: ``messages * latency + max(sent, received) / bandwidth``."""
    w = wire(collective, nbytes, world, link)
    return messages(collective, world, link) * link.latency + max(w.sent, w.received) / link.bandwidth


def dense_baseline(numel: int, world: int, link: Optional[Link] = None) -> Wire:
    """What a dense fp32 allreduce of ``numel`` gradients moves per rank at ``world`` ranks."""
    return allreduce(4 * numel, world, link)


def ratio(baseline: Wire, moved: Wire) -> float:
    """How many times fewer bytes than dense ("x less than dense"), on the busier direction of the link."""
    busier = max(moved.sent, moved.received)
    return max(baseline.sent, baseline.received) / busier if busier else float("inf")


def choose_gather(payload: int, dense: int, world: int, link: Optional[Link] = None,
                  count_bytes: int = 0) -> Tuple[bool, str]:
    """Whether an allgather of a ``payload``-byte payload per rank (plus a ``count_bytes`` allgather for
    variable-size payloads) beats an allreduce of the ``dense``-byte tensor: ``(gather?, reason)``.

    Never a payload of at least the dense bytes; never an allgather that moves more bytes than the
    allreduce unless its fewer messages pay for them (a latency given by ``link``)."""
    link = link or Link.from_env()
    if payload >= dense:
        return False, f"payload {payload} B >= dense {dense} B"
    if world <= 1:
        return True, "sparse"
    gather = seconds(ALLGATHER, payload, world, link)
    if count_bytes:
        gather += seconds(ALLGATHER, count_bytes, world, link)
    reduce = seconds(ALLREDUCE, dense, world, link)
    g, r = allgather(payload + count_bytes, world), allreduce(dense, world, link)
    if gather < reduce:
        return True, "sparse"
    return False, (f"allgather moves {g.received} B per rank at W={world} >= allreduce {r.received} B "
                   f"({gather * 1e3:.3f} vs {reduce * 1e3:.3f} ms at {link.describe()})")
