"""Error feedback: the per-parameter, per-rank memory of what was not sent.

Plain error feedback (Seide et al. 2014; Karimireddy et al. 2019), for gradient ``g_t`` of a parameter::

    a_t     = g_t + r_{t-1}          (compensate)
    send      C(a_t)                 (selection + wire format)
    r_t     = a_t - D(C(a_t))        (update: what this rank's payload did not carry)

so that ``sum_t D(C(a_t)) + r_T == sum_t g_t`` exactly: nothing a rank computed is ever dropped, only
delayed. ``D(C(a))`` is what the wire really carried (after the cast to the wire value dtype), so the
rounding of a float16 wire is fed back too.

The contract every sender keeps, whatever the wire: ``a`` is always the compensated tensor ``g + r`` (the
memory tensor itself, so ``r`` is updated in place), the residual is updated before anything is sent, and it
becomes ``a`` minus exactly what the block carries. Three forms:

- a selection (:class:`horovod_adtopk.sparsify.Sparsifier`, the low-bit sparse kinds of
  :mod:`horovod_adtopk.payload`): :meth:`compensate`, select, then :meth:`update` at the sent positions
  (``a - carried`` there; the unsent entries keep ``a``);
- a dense rendering of the whole tensor (bfloat16, low-bit codes, an owner's shards): :meth:`carry`;
- a fused kernel (plain error feedback only): :meth:`buffer` hands the residual to the selection kernel,
  which adds ``g`` while it reads and zeroes what it sends when the wire carries it exactly (the
  compressor's ``select(a, ..., grad=g, zero_sent=True)``); PowerSGD's ``a - P Q^T`` is its own kernel
  (:mod:`horovod_adtopk.lowrank`).

Momentum correction (DGC, Lin et al. 2018), ``momentum=m``: the memory accumulates the *velocity*::

    u_t = m * u_{t-1} + g_t ;  v_t = v_{t-1} + u_t ;  a_t = v_t
    after sending: v_t[sent] -= D(C(a_t))[sent] ;  u_t[sent] = 0   (momentum factor masking)

Use it with a wrapped optimizer without momentum (the memory already applies it).

Non-finite policy: entries that were sent leave the memory as they left (their residual is the finite
difference, or 0), and :meth:`ErrorFeedback.scrub` zeroes any NaN/Inf left in a memory, so one bad step
reaches the user's code (AMP's GradScaler can skip it) without poisoning later steps.

The memory is all tensors and plain dicts: :meth:`state_dict` round-trips through
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import numbers
from typing import Dict, Optional

import torch


def check_momentum(momentum) -> Optional[float]:
    """``None`` or a number in [0, 1) (the one place the momentum range is defined)."""
    if momentum is None:
        return None
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not (0.0 <= float(momentum) < 1.0):
        raise ValueError(f"momentum must be None or a number in [0, 1), got {momentum!r}")
    return float(momentum)


def _fresh(g: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: memory tensors are flat-indexable whatever the gradient's layout (channels_last)."""
    return g.clone(memory_format=torch.contiguous_format)


class ErrorFeedback:
    """Residual memory for the parameters of one rank; ``momentum=None`` gives plain error feedback."""

    def __init__(self, momentum: Optional[float] = None) -> None:
        self.momentum = check_momentum(momentum)
        self.residuals: Dict[str, torch.Tensor] = {}
        self.velocities: Dict[str, torch.Tensor] = {}

    def _accumulate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """With momentum correction, the velocity ``u = m u + g`` (the memory tensor itself); else ``g``."""
        if self.momentum is None:
            return grad
        u = self.velocities.get(name)
        if u is None:
            u = self.velocities[name] = _fresh(grad)
        else:
            u.mul_(self.momentum).add_(grad)
        return u

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Return ``a = g + r`` (or the DGC accumulated velocity). The result IS the memory tensor: the
        caller must call :meth:`update` before the next compensate of ``name``."""
        g = self._accumulate(name, grad.detach())
        r = self.residuals.get(name)
        if r is None:
            r = self.residuals[name] = _fresh(g)
        else:
            r.add_(g)
        return r

    def carry(self, name: str, grad: torch.Tensor, encode) -> object:
        """Error feedback around a dense rendering of the whole tensor (bfloat16, low-bit codes, an owner's
        shards): ``a = g + r``; ``(block, carried) = encode(a)``; ``r <- a - carried`` (``carried``: what the
        block carries, any dtype, ``a``'s number of entries). Returns the block."""
        a = self.compensate(name, grad)
        block, carried = encode(a)
        a.sub_(carried.to(a.dtype).view(a.shape))
        return block

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """The residual of ``name`` (zeros the first time), for kernels that add the gradient themselves
        (plain error feedback only)."""
        r = self.residuals.get(name)
        if r is None:
            r = self.residuals[name] = torch.zeros(like.shape, dtype=like.dtype, device=like.device)
        return r

    def update(self, name: str, flat_index: torch.Tensor, remainder: torch.Tensor) -> None:
        """After a send: the memory at the sent positions becomes ``remainder`` (a - what was carried)."""
        r = self.residuals[name].view(-1)
        r[flat_index] = remainder.to(r.dtype)
        if self.momentum is not None:
            self.velocities[name].view(-1)[flat_index] = 0

    def holds(self, name: str) -> bool:
        return name in self.residuals or name in self.velocities

    def dense(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """What a tensor of the sparse path sends when it travels dense (warm-up rounds, or switched dense by
        partial sparsification): ``g + r``, the residual released. With momentum correction the velocity
        ``u = m u + g`` is kept and sent instead of ``g`` (plain SGD momentum: the wrapped optimizer runs
        without momentum for these tensors)."""
        out = self._accumulate(name, grad)
        r = self.residuals.pop(name, None)
        return out.clone() if r is None else out + r

    def scrub(self, name: str) -> None:
        """Zero any NaN/Inf in the memory of ``name``."""
        for store in (self.residuals, self.velocities):
            t = store.get(name)
            if t is not None:
                torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)

    def scale_(self, factor: float, velocities: bool = True) -> None:
        """Multiply every residual (and velocity) by ``factor``: a survivor of an elastic membership change
        (:mod:`horovod_adtopk.elastic`), or, residuals only, an error-feedback memory that forgets (SparseLoCo's
        ``e <- beta e + delta``, :class:`horovod_adtopk.outer.Outer` ``feedback_decay``)."""
        for store in (self.residuals, self.velocities) if velocities else (self.residuals,):
            for t in store.values():
                t.mul_(factor)

    def norm(self) -> float:
        """The L2 norm over every residual of this rank (what it would lose if it died now)."""
        total = sum(float(t.detach().double().pow(2).sum()) for t in self.residuals.values())
        return total ** 0.5

    def reset(self) -> None:
        """Forget everything (``reset_compression_state()``)."""
        self.residuals.clear()
        self.velocities.clear()

    def state_dict(self) -> dict:
        return {"momentum": self.momentum,
                "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
                "velocities": {k: v.detach().clone() for k, v in self.velocities.items()}}

    def load_state_dict(self, state: dict, device_of: Optional[Dict[str, torch.device]] = None,
                        shapes: Optional[Dict[str, tuple]] = None) -> None:
        """Restore residuals (and velocities). ``shapes`` (name -> shape), when given, is checked first: a
        memory that does not fit the model is refused here rather than failing at the next step."""
        if shapes is not None:
            for store in ("residuals", "velocities"):
                for k, v in state.get(store, {}).items():
                    if k not in shapes:
                        raise ValueError(f"error-feedback memory for {k!r} in the state dict, but the optimizer has "
                                         "no such (trainable) parameter: the checkpoint belongs to another model")
                    if tuple(v.shape) != tuple(shapes[k]):
                        raise ValueError(f"error-feedback memory for {k!r} has shape {tuple(v.shape)}, but the "
                                         f"parameter has shape {tuple(shapes[k])}: the checkpoint belongs to another "
                                         "model")

        def place(name: str, t: torch.Tensor) -> torch.Tensor:
            dev = device_of.get(name) if device_of else None
            t = t.detach().contiguous()
            return t.clone() if dev is None else t.to(dev, copy=True)

        self.residuals = {k: place(k, v) for k, v in state.get("residuals", {}).items()}
        self.velocities = {k: place(k, v) for k, v in state.get("velocities", {}).items()}
