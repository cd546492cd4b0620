"""Counters of what the optimizer moved, exposed through ``opt.stats()``, counted in one place
(:meth:`Stats.record`, or its two halves :meth:`Stats.baseline` and :meth:`Stats.traffic`).

Two kinds of bytes, per tensor and in total:

- *Wire bytes* (``wire_bytes_sent``, ``wire_bytes_received``): what this rank's link carries for the
  collectives actually used, as their algorithms move them (:mod:`horovod_adtopk.netcost`: a ring allreduce
  ``2 (W-1)/W`` of its buffer each way, an allgather ``(W-1)`` payloads). ``wire_bytes_dense`` is what a
  dense fp32 ring allreduce of the same gradients would move per rank at the same world size, and
  ``wire_compression`` = ``wire_bytes_dense / max(sent, received)``: "x less than dense" on the busier
  direction of the link. These grow with the world size for an allgather, not for an allreduce.
- *Payload bytes* (``bytes_sent``, ``bytes_dense``): what this rank hands to a collective (for a sparse
  tensor the payload's bytes, plus ``wire.COUNT_BYTES`` for variable-size payloads; for a dense tensor
  ``numel * element_size`` of the dtype that is allreduced), against ``4 * numel``. Independent of the world
  size, so not what the link carries beyond 2 ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from .netcost import Wire, dense_baseline


@dataclass
class TensorStats:
    path: str = "dense"
    reason: str = ""
    selection: Optional[dict] = None  # the compressor's selection_summary() on the sparse path
    numel: int = 0
    elements_sent: int = 0
    elements_total: int = 0
    bytes_sent: int = 0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    wire_bytes_dense: int = 0
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0

    @property
    def density(self) -> float:
        return self.elements_sent / self.elements_total if self.elements_total else 0.0


@dataclass
class Stats:
    steps: int = 0
    elements_total: int = 0
    elements_sent: int = 0
    bytes_sent: int = 0
    bytes_dense: int = 0
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    wire_bytes_dense: int = 0
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0
    nonfinite_steps: int = 0
    bucket_decodes: int = 0  # DDP buckets whose sparse payload was decoded at once (bucket_select.decode)
    tensors: Dict[str, TensorStats] = field(default_factory=dict)

    def set_path(self, name: str, numel: int, sparse: bool, reason: str, path: Optional[str] = None,
                 selection: Optional[dict] = None) -> None:
        """Record the path of ``name``: "sparse" / "dense", or ``path`` when given (e.g. "hierarchical"), and
        how a sparse tensor is selected (``selection``)."""
        t = self.tensors.setdefault(name, TensorStats(numel=numel))
        t.path, t.reason = path or ("sparse" if sparse else "dense"), reason
        t.selection = selection if sparse else None

    def record(self, name: str, numel: int, elements_sent: int, bytes_sent: int, *, wire: Wire,
               world: int) -> None:
        """One exchange of ``name`` at one step: its dense baseline (:meth:`baseline`) and what it moved
        (:meth:`traffic`)."""
        self.baseline(name, numel, world)
        self.traffic(name, elements_sent, bytes_sent, wire)

    def baseline(self, name: str, numel: int, world: int) -> None:
        """One step's dense baseline of ``name``: ``4 * numel`` payload bytes, and the wire bytes of a dense
        fp32 ring allreduce at ``world`` ranks."""
        t = self.tensors.setdefault(name, TensorStats(numel=numel))
        dense = dense_baseline(numel, world).received
        t.elements_total += numel
        t.wire_bytes_dense += dense
        self.elements_total += numel
        self.bytes_dense += 4 * numel
        self.wire_bytes_dense += dense

    def traffic(self, name: str, elements_sent: int, bytes_sent: int, wire: Wire) -> None:
        """What an exchange of ``name`` moved: ``elements_sent`` entries in a ``bytes_sent``-byte payload, and
        ``wire`` (:mod:`horovod_adtopk.netcost`) on this rank's link."""
        t = self.tensors.setdefault(name, TensorStats())
        t.elements_sent += elements_sent
        t.bytes_sent += bytes_sent
        t.wire_bytes_sent += wire.sent
        t.wire_bytes_received += wire.received
        self.elements_sent += elements_sent
        self.bytes_sent += bytes_sent
        self.wire_bytes_sent += wire.sent
        self.wire_bytes_received += wire.received

    def add_seconds(self, name: str, which: int, seconds: float) -> None:
        """Compression (``which=0``) or decompression (1) time spent on ``name``."""
        t = self.tensors.setdefault(name, TensorStats())
        if which == 0:
            t.compress_seconds += seconds
            self.compress_seconds += seconds
        else:
            t.decompress_seconds += seconds
            self.decompress_seconds += seconds

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "elements_total": self.elements_total,
            "elements_sent": self.elements_sent,
            "density": self.elements_sent / self.elements_total if self.elements_total else 0.0,
            "bytes_sent": self.bytes_sent,
            "bytes_dense": self.bytes_dense,
            "compression_ratio": self.bytes_dense / self.bytes_sent if self.bytes_sent else 0.0,
            "wire_bytes_sent": self.wire_bytes_sent,
            "wire_bytes_received": self.wire_bytes_received,
            "wire_bytes_dense": self.wire_bytes_dense,
            "wire_compression": _wire_ratio(self.wire_bytes_dense, self.wire_bytes_sent, self.wire_bytes_received),
            "compress_seconds": self.compress_seconds,
            "decompress_seconds": self.decompress_seconds,
            "nonfinite_steps": self.nonfinite_steps,
            "bucket_decodes": self.bucket_decodes,
            "tensors": {name: {"path": t.path, "reason": t.reason, "selection": t.selection, "numel": t.numel,
                               "density": t.density,
                               "bytes_sent": t.bytes_sent, "wire_bytes_sent": t.wire_bytes_sent,
                               "wire_bytes_received": t.wire_bytes_received,
                               "wire_bytes_dense": t.wire_bytes_dense, "compress_seconds": t.compress_seconds,
                               "decompress_seconds": t.decompress_seconds}
                        for name, t in sorted(self.tensors.items())},
        }


def _wire_ratio(dense: int, sent: int, received: int) -> float:
    """``dense / max(sent, received)``; 0.0 when nothing moved (one process, or no step yet)."""
    busier = max(sent, received)
    return dense / busier if busier else 0.0
