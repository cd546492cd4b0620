"""PowerSGD (Vogels et al., NeurIPS 2019): rank-``r`` gradient compression by one step of power iteration.

The strongest low-rank peer of sparsification, in the same engine (error feedback, checkpoints, stats,
warm-up), so it is compared with ADTopk on equal terms. Per tensor with matrix view ``M = a.reshape(n, m)``
(``a = g + e``, the gradient plus this rank's error-feedback memory) and a warm-started ``Q`` ``[m, r]``
identical on every rank::

    P_i = M_i Q                 (in the gradient hook)        allreduce-sum  P = sum_i P_i
    P  <- orthonormal columns (Gram-Schmidt, deterministic: P is bitwise the same on every rank)
    Q_i = M_i^T P ;  e_i = M_i - P Q_i^T                      (this rank's error, Vogels' local rule)
                                                              allreduce-average  Q = mean_i Q_i
    update = P Q^T = mean_i P Q_i^T ;  next round starts from this Q (warm start)

Error feedback is exact per rank: what rank ``i`` contributed (``P Q_i^T``) plus its new memory equals what
it had to send. PyTorch's DDP hook (``powerSGD_hook``) computes the error against the averaged
approximation instead; here the invariant ``sent + residual == sum of gradients`` holds as for the sparse
rules. Two collectives per tensor; the first overlaps the backward pass, the second runs in
``synchronize()`` (all tensors' second rounds are launched before any is waited for). The compressor holds
the arithmetic and the warm-start state; :mod:`horovod_adtopk.lowrank` runs the collectives.

Tensors with one dimension, fewer than ``min_numel`` entries, or a compression rate
``n m / ((n + m) r)`` below ``min_compression_rate`` travel dense.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .base import SparseCompressor, TensorInfo, _check_bool, _check_int, register, stable_seed

_EPS = 1e-8


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns by modified Gram-Schmidt, in place; a zero column stays (numerically) zero."""
    for i in range(p.shape[1]):
        col = p[:, i:i + 1]
        col.div_(col.norm() + _EPS)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(col @ (col.t() @ rest))
    return p


@register
class PowerSGDCompressor(SparseCompressor):
    """PowerSGD rank-``rank`` compression (see the module docstring).

    Args:
        rank: the approximation's rank ``r`` (1 to 4 is typical).
        warm_start: start each round from the previous round's averaged ``Q`` (else a fresh random ``Q``).
        error_feedback: keep ``M - P Q_i^T`` and add it to the next gradient.
        min_compression_rate: send dense when ``n m / ((n + m) r)`` is below this.
        min_numel: tensors with fewer entries travel dense.
        seed: seeds the initial ``Q`` (identical on every rank).
    """

    name = "powersgd"
    summary = ("PowerSGD: rank-`r` approximation `P Q^T` by one power iteration, warm-started, error feedback; "
               "two allreduces of `P` and `Q`")
    gathers = False
    exchange_kind = "lowrank"

    def __init__(self, rank: int = 1, warm_start: bool = True, error_feedback: bool = True,
                 min_compression_rate: float = 2.0, min_numel: int = 1024, seed: int = 0,
                 density_warmup: int = 0) -> None:
        super().__init__(1.0, error_feedback=error_feedback, min_numel=min_numel, hybrid=False)
        self.rank = _check_int("rank", rank, 1)
        self.warm_start = _check_bool("warm_start", warm_start)
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
                or not min_compression_rate > 0:
            raise ValueError(f"min_compression_rate must be a number > 0, got {min_compression_rate!r}")
        self.min_compression_rate = float(min_compression_rate)
        self.seed = _check_int("seed", seed, 0)
        if density_warmup:
            raise ValueError("PowerSGD has no density warm-up; use hat.DistributedOptimizer(warmup_steps=N)")
        self._q: Dict[str, torch.Tensor] = {}

    def config(self) -> dict:
        return {"compressor": self.name, "rank": self.rank, "warm_start": self.warm_start,
                "error_feedback": self.error_feedback, "min_compression_rate": self.min_compression_rate,
                "min_numel": self.min_numel, "seed": self.seed}

    def state_dict(self) -> dict:
        return {"q": {name: q.detach().cpu().clone() for name, q in self._q.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._q = {name: q.clone() for name, q in state.get("q", {}).items()}

    def reset_state(self) -> None:
        self._q.clear()

    @staticmethod
    def _matrix(info: TensorInfo) -> Tuple[int, int]:
        return info.shape[0], info.numel // max(info.shape[0], 1)

    def _rank_for(self, info: TensorInfo) -> int:
        n, m = self._matrix(info)
        return min(self.rank, n, m)

    def nominal_count(self, info: TensorInfo) -> int:
        n, m = self._matrix(info)
        return (n + m) * self._rank_for(info)

    def nominal_index_dtype(self, info: TensorInfo):
        return None

    def choose_path(self, info: TensorInfo, world_size: int, payload=None, link=None) -> Tuple[bool, str]:
        """Low rank for matrices compressed at least ``min_compression_rate`` (its factors are allreduced,
        so the world size does not enter: ``payload`` and ``link`` are accepted for the common signature)."""
        if len(info.shape) < 2:
            return False, f"{len(info.shape)}-D tensor"
        if info.numel < self.min_numel:
            return False, f"numel {info.numel} < min_numel {self.min_numel}"
        rate = info.numel / self.nominal_count(info)
        if rate < self.min_compression_rate:
            return False, f"compression rate {rate:.2f} < min_compression_rate {self.min_compression_rate}"
        return True, "low rank"

    def _initial_q(self, info: TensorInfo, step: int, device, dtype) -> torch.Tensor:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed("powersgd", self.seed, info.name, 0 if self.warm_start else step))
        _, m = self._matrix(info)
        return torch.randn(m, self._rank_for(info), generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)

    # --- the rule's arithmetic; its two collective rounds are horovod_adtopk.lowrank's ---------------------

    def start_q(self, info: TensorInfo, step: int, device, dtype) -> torch.Tensor:
        """The ``Q`` [m, r] this round starts from: the previous round's averaged ``Q`` (warm start), else a
        seeded random one; identical on every rank."""
        q = self._q.get(info.name) if self.warm_start else None
        return self._initial_q(info, step, device, dtype) if q is None else q.to(device)

    def end_round(self, info: TensorInfo, q: torch.Tensor) -> None:
        """Keep the averaged ``Q`` of this round for the next one (warm start)."""
        if self.warm_start:
            self._q[info.name] = q
