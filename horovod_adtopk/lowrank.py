"""The low-rank exchange kind: PowerSGD's two collective rounds per tensor (the ``Exchange`` protocol).

A compressor whose ``exchange_kind`` is ``"lowrank"`` (:class:`~horovod_adtopk.compressors.powersgd.
PowerSGDCompressor`) holds the rule's arithmetic and its warm-start ``Q``; this module issues its collectives
through the sender's communicator and records the bytes through ``Stats.record``:

    round 1 (in the gradient hook):  P_i = M_i Q, allreduce-sum
    round 2 (``advance``):           P <- orthonormal columns; Q_i = M_i^T P; e_i = M_i - P Q_i^T;
                                     allreduce-average Q_i
    ``finish``:                      grad <- P Q^T; Q kept for the next round
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from . import netcost
from .compressors import TensorInfo
from .compressors.powersgd import orthogonalize

KIND = "lowrank"


def runs_own_rounds(compression) -> bool:
    """True for a compressor whose exchange is two dependent collective rounds (PowerSGD), not one payload."""
    return getattr(compression, "exchange_kind", None) == KIND


def start(sender, p, grad: Optional[torch.Tensor], info: TensorInfo, step: int) -> "LowRankExchange":
    """Round one (in the hook): ``P_i = M_i Q`` and its allreduce; returns the in-flight exchange."""
    began = time.perf_counter()
    rule, memory = sender.compression, sender.memory
    n, m = rule._matrix(info)
    if grad is None:  # no gradient on this rank: contribute nothing, keep the memory
        matrix = torch.zeros(n, m, dtype=info.dtype, device=p.device)
        keep_error = False
    else:
        a = memory.compensate(info.name, grad) if memory is not None else grad.detach().contiguous()
        matrix = a.view(n, m)
        keep_error = memory is not None
    q = rule.start_q(info, step, matrix.device, matrix.dtype)
    p_local = matrix @ q
    handle = sender.comm.allreduce_async_(p_local, f"hat.psgd.p.{info.name}", sender.sum_op, 1.0, 1.0)
    world, size = sender.comm.size(), p_local.element_size()
    # two allreduces: P (n x rank) now, Q (m x rank) in advance()
    sender.stats.record(info.name, info.numel, (n + m) * q.shape[1], (n + m) * q.shape[1] * size,
                        wire=netcost.allreduce(n * q.shape[1] * size, world)
                        + netcost.allreduce(m * q.shape[1] * size, world), world=world)
    sender.timed(info.name, 0, time.perf_counter() - began)
    return LowRankExchange(sender, p, info, matrix, handle, keep_error)


class LowRankExchange:
    """Both PowerSGD rounds of one tensor (the ``Exchange`` protocol: ``advance`` then ``finish``)."""

    def __init__(self, sender, p, info: TensorInfo, matrix: torch.Tensor, handle, keep_error: bool) -> None:
        self.sender, self.params, self.info = sender, (p,), info
        self.matrix, self.handle, self.keep_error = matrix, handle, keep_error
        self.p_matrix: Optional[torch.Tensor] = None

    def advance(self) -> None:
        began = time.perf_counter()
        sender = self.sender
        p_matrix = orthogonalize(sender.comm.wait(self.handle))
        q_local = self.matrix.t() @ p_matrix
        if self.keep_error:  # e_i = M_i - P Q_i^T, written into the memory tensor M_i itself
            self.matrix.sub_(p_matrix @ q_local.t())
            sender.nonfinite.append((self.info.name, torch.isfinite(q_local).all(), False))
        self.p_matrix = p_matrix
        self.handle = sender.comm.allreduce_async_(q_local, f"hat.psgd.q.{self.info.name}", sender.op,
                                                   sender.prescale, sender.postscale)
        sender.timed(self.info.name, 0, time.perf_counter() - began)

    def finish(self) -> None:
        began = time.perf_counter()
        q = self.sender.comm.wait(self.handle)
        grad = self.params[0].grad
        update = self.p_matrix @ q.t()
        grad.copy_(update.view(grad.shape) if grad.is_contiguous() else update.reshape(grad.shape))
        self.sender.compression.end_round(self.info, q)
        self.sender.timed(self.info.name, 1, time.perf_counter() - began)
