"""Counters of what the optimizer moved, exposed through ``opt.stats()``.

Bytes are what this rank hands to a collective (its payload), counted in one place (:meth:`Stats.record`):
for a sparse tensor the payload's bytes (plus ``wire.COUNT_BYTES`` for variable-size payloads; both
counted by :mod:`horovod_adtopk.wire`), for a dense
tensor ``numel * element_size`` of the dtype that is allreduced. ``bytes_dense`` is what a plain fp32
allreduce of the same gradients would hand over (``4 * numel``), the baseline of "bytes sent vs dense".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class TensorStats:
    path: str = "dense"
    reason: str = ""
    selection: Optional[dict] = None  # the compressor's selection_summary() on the sparse path
    numel: int = 0
    elements_sent: int = 0
    elements_total: int = 0
    bytes_sent: int = 0
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
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0
    nonfinite_steps: int = 0
    tensors: Dict[str, TensorStats] = field(default_factory=dict)

    def set_path(self, name: str, numel: int, sparse: bool, reason: str, path: Optional[str] = None,
                 selection: Optional[dict] = None) -> None:
        """Record the path of ``name``: "sparse" / "dense", or ``path`` when given (e.g. "hierarchical"), and
        how a sparse tensor is selected (``selection``)."""
        t = self.tensors.setdefault(name, TensorStats(numel=numel))
        t.path, t.reason = path or ("sparse" if sparse else "dense"), reason
        t.selection = selection if sparse else None

    def record(self, name: str, numel: int, elements_sent: int, bytes_sent: int) -> None:
        t = self.tensors.setdefault(name, TensorStats(numel=numel))
        t.elements_sent += elements_sent
        t.elements_total += numel
        t.bytes_sent += bytes_sent
        self.elements_total += numel
        self.elements_sent += elements_sent
        self.bytes_sent += bytes_sent
        self.bytes_dense += 4 * numel

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
            "compress_seconds": self.compress_seconds,
            "decompress_seconds": self.decompress_seconds,
            "nonfinite_steps": self.nonfinite_steps,
            "tensors": {name: {"path": t.path, "reason": t.reason, "selection": t.selection, "numel": t.numel,
                               "density": t.density,
                               "bytes_sent": t.bytes_sent, "compress_seconds": t.compress_seconds,
                               "decompress_seconds": t.decompress_seconds}
                        for name, t in sorted(self.tensors.items())},
        }
