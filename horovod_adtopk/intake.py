"""Gradient intake: what one rank's parameter hands to its exchange in a round (Horovod's rules).

- No gradient (frozen with ``requires_grad=False``, or unused in this forward pass): ``p.grad`` becomes zeros,
  ready to receive what the other ranks send, and the rank contributes nothing (its memory is kept).
- A sparse (COO) gradient, e.g. ``nn.Embedding(sparse=True)``: without ``sparse_as_dense`` it travels as
  Horovod's sparse allreduce (values and indices allgathered, see
  :class:`horovod_adtopk.exchange.SparseGradExchange`) and stays sparse; with ``sparse_as_dense`` (or while
  a member has joined, when nothing may be allgathered) it travels dense and is handed back sparse by
  :meth:`GradientIntake.restore`, as ``hvd.DistributedOptimizer`` does (``torch.optim.SparseAdam`` needs it).
- A dense floating gradient travels as it is; a tensor of the sparse path that travels dense this round
  (warm-up, partial sparsification, a joined member) goes through its error-feedback memory
  (:meth:`GradientIntake.dense`), so nothing of its residual is lost.
"""
from __future__ import annotations

from typing import Dict, Optional, Set

import torch

from .sparsify import dense_contribution


class GradientIntake:
    """Per-round gradient intake for the parameters named in ``names`` (``{param: name}``)."""

    def __init__(self, names: Dict[torch.Tensor, str], sparse_as_dense: bool, memory) -> None:
        self.names, self.sparse_as_dense, self.memory = names, sparse_as_dense, memory
        self.densified: Set[torch.Tensor] = set()  # sparse gradients travelling dense this round
        self.hierarchical = None  # the optimizer's hierarchical exchange, whose block memory a dense round releases

    def gathers_sparse(self, p) -> bool:
        """Whether ``p``'s gradient is sparse and travels as Horovod's sparse allreduce (an allgather)."""
        return p.requires_grad and p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense

    def take(self, p) -> Optional[torch.Tensor]:
        """This rank's dense gradient of ``p``, or None when it has none (``p.grad`` is then zeros)."""
        if not p.requires_grad or p.grad is None:
            p.grad = torch.zeros_like(p)
            return None
        if p.grad.is_sparse:
            p.grad = p.grad.to_dense()
            self.densified.add(p)
        if not p.grad.is_floating_point():
            raise TypeError(f"gradient of {self.names[p]!r} has dtype {p.grad.dtype}; a floating dtype is needed")
        return p.grad

    def dense(self, name: str, p, grad: Optional[torch.Tensor], sparse_path: bool) -> torch.Tensor:
        """The gradient for the dense path: with ``g + r`` (the residual released) when ``name`` is on the
        sparse path or still holds memory; momentum correction keeps applying its momentum."""
        released = None if grad is None else dense_contribution(self.memory, name, grad, sparse_path)
        if released is not None:
            grad.copy_(released)
        if grad is not None and self.hierarchical is not None:
            self.hierarchical.release(name, grad)
        return p.grad

    def restore(self) -> None:
        """After the round: sparse gradients that travelled dense are handed back sparse."""
        for p in self.densified:
            p.grad = p.grad.to_sparse()
        self.densified.clear()
