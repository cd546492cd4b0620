"""Partial sparsification (ADTopk-P): send densely every tensor whose sparse path does not pay.

For the first ``profile_rounds`` rounds every eligible tensor is sent sparse while the compression and
decompression seconds of each are measured. Then a linear fit ``t(bytes) = alpha + bytes * beta`` of a
small and a large synchronous allreduce and allgather on the live process set prices both paths::

    dense_s  = ar_alpha + D * ar_beta
    sparse_s = compress_s + decompress_s + ag_alpha + P * ag_beta

(``D`` dense bytes, ``P`` one rank's nominal payload). A tensor stays sparse iff ``sparse_s < dense_s``.
Every measurement is averaged over the ranks (one allreduce) before deciding, so the decision is the same
everywhere; it is saved in checkpoints and reported in ``opt.stats()["partial_sparsification"]``.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch


class PartialSparsification:
    """Profiling counters and, once taken, the decision (``report``)."""

    def __init__(self, profile_rounds: int) -> None:
        self.profile_rounds = profile_rounds
        self.seconds: Dict[str, List[float]] = {}  # name -> [compress_s, decompress_s] summed over rounds
        self.report: Optional[dict] = None

    @property
    def profiling(self) -> bool:
        return self.report is None

    def record(self, name: str, which: int, seconds: float) -> None:
        if self.report is None:
            self.seconds.setdefault(name, [0.0, 0.0])[which] += seconds

    def keeps_sparse(self, name: str) -> bool:
        """False once the decision sent ``name`` dense."""
        return (self.report or {}).get("tensors", {}).get(name, {}).get("sparse", True)

    @staticmethod
    def _probe(comm, kind: str, nbytes: int, op_sum, repeats: int = 3) -> float:
        """Seconds for one synchronous collective of ``nbytes`` (per rank for allgather), best of ``repeats``."""
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        best = float("inf")
        for i in range(repeats):
            start = time.perf_counter()
            if kind == "allreduce":
                comm.wait(comm.allreduce_async_(buf.clone(), f"hat.probe.ar.{nbytes}.{i}", op_sum))
            else:
                comm.allgather(buf, f"hat.probe.ag.{nbytes}.{i}")
            best = min(best, time.perf_counter() - start)
        return best

    def decide_after(self, rounds_done: int, comm, compression, infos: dict, sparse_path: Dict[str, bool], op_sum,
                     op_average) -> bool:
        """Collective: once ``profile_rounds`` rounds are done, decide (see :meth:`decide`); True if it did."""
        if not self.profiling or rounds_done < self.profile_rounds:
            return False
        self.decide(comm, compression, infos, [n for n, s in sparse_path.items() if s], self.profile_rounds, op_sum,
                    op_average)
        return True

    def decide(self, comm, compression, infos: dict, sparse_names: List[str], rounds: int, op_sum,
               op_average) -> dict:
        """Collective: measure the link, average every number over the ranks, decide; returns the report."""
        names = sorted(sparse_names)
        small, large = 4096, 4 << 20
        probes = [self._probe(comm, "allreduce", small, op_sum), self._probe(comm, "allreduce", large, op_sum),
                  self._probe(comm, "allgather", small, op_sum), self._probe(comm, "allgather", large, op_sum)]
        rounds = max(rounds, 1)
        local = [v / rounds for n in names for v in self.seconds.get(n, [0.0, 0.0])] + probes
        shared = comm.wait(comm.allreduce_async_(torch.tensor(local, dtype=torch.float64), "hat.partial.decide",
                                                 op_average)).tolist()
        ar_small, ar_large, ag_small, ag_large = shared[-4:]
        ar_beta = max(ar_large - ar_small, 0.0) / (large - small)
        ag_beta = max(ag_large - ag_small, 0.0) / (large - small)
        tensors = {}
        for i, name in enumerate(names):
            comp, decomp = shared[2 * i], shared[2 * i + 1]
            payload, dense = compression.nominal_bytes(infos[name])
            dense_s = ar_small + dense * ar_beta
            sparse_s = comp + decomp + ag_small + payload * ag_beta
            tensors[name] = {"sparse": sparse_s < dense_s, "compress_s": comp, "decompress_s": decomp,
                             "predicted_sparse_s": sparse_s, "predicted_dense_s": dense_s}
        self.report = {"rounds_profiled": rounds,
                       "link": {"allreduce_alpha_s": ar_small, "allreduce_beta_s_per_byte": ar_beta,
                                "allgather_alpha_s": ag_small, "allgather_beta_s_per_byte": ag_beta},
                       "tensors": tensors}
        return self.report

    @staticmethod
    def reason(entry: dict) -> str:
        return (f"partial sparsification: sparse {entry['predicted_sparse_s'] * 1e3:.3f} ms >= dense "
                f"{entry['predicted_dense_s'] * 1e3:.3f} ms")
