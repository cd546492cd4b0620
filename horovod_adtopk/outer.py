"""The outer optimizer of local steps (:mod:`horovod_adtopk.local_steps`): its settings, and the checks that refuse
settings the outer exchange cannot run.

:class:`Outer` holds what every rank must agree on (learning rate, momentum, the error-feedback decay, the
values' bits, the exchange) and builds the ``torch.optim`` optimizer that applies the averaged
pseudo-gradient: ``torch.optim.SGD`` for the built-in shorthands, any optimizer for :meth:`Outer.custom`.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, List, Optional

import torch

from . import lowrank, sharded
from .compressors import is_sparse
from .quantize import check_value_bits, check_value_group


class Outer:
    """Settings of the outer optimizer: SGD with optional (Nesterov) momentum on the averaged pseudo-gradient.

    ``Outer.nesterov(lr=0.7, momentum=0.9)`` is DiLoCo's; ``Outer.sgd(lr=1.0)`` applies the average as it is
    (with ``sync_every=1`` and a dense exchange this is ordinary data parallelism: ``theta_outer - mean(delta)``
    is the mean of the ranks' parameters after their step)."""

    def __init__(self, lr: float, momentum: float = 0.0, nesterov: bool = False, feedback_decay: float = 1.0,
                 value_bits: Optional[int] = None, value_group: Optional[int] = None, exchange: str = "auto",
                 optimizer: Optional[Callable[[List[torch.Tensor]], torch.optim.Optimizer]] = None) -> None:
        if isinstance(lr, bool) or not isinstance(lr, numbers.Real) or not (0 < float(lr) < math.inf):
            raise ValueError(f"outer lr must be a finite number > 0, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real) or not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"outer momentum must be a number in [0, 1), got {momentum!r}")
        if not isinstance(nesterov, bool):
            raise TypeError(f"nesterov must be True or False, got {nesterov!r}")
        if nesterov and momentum == 0:
            raise ValueError("Nesterov needs an outer momentum > 0; use Outer.sgd(lr) for none")
        if (isinstance(feedback_decay, bool) or not isinstance(feedback_decay, numbers.Real)
                or not 0.0 < float(feedback_decay) <= 1.0):
            raise ValueError(f"feedback_decay must be a number in (0, 1] (1: lossless error feedback), "
                             f"got {feedback_decay!r}")
        self.lr, self.momentum, self.nesterov = float(lr), float(momentum), nesterov
        self.feedback_decay = float(feedback_decay)
        self.value_bits = check_value_bits(value_bits)
        self.value_group = check_value_group(value_group, self.value_bits)
        self.exchange = sharded.check_exchange(exchange)
        if optimizer is not None and not callable(optimizer):
            raise TypeError(f"Outer.custom(optimizer) takes a callable that builds a torch.optim.Optimizer from a "
                            f"list of tensors, e.g. functools.partial(torch.optim.Adam, lr=1e-3); got {optimizer!r}")
        self.optimizer = optimizer

    @classmethod
    def custom(cls, optimizer: Callable[[List[torch.Tensor]], torch.optim.Optimizer], feedback_decay: float = 1.0,
               value_bits: Optional[int] = None, value_group: Optional[int] = None, exchange: str = "auto") -> "Outer":
        """Any ``torch.optim`` optimizer as the outer step (torchft's ``local_sgd`` model): ``optimizer(params)``
        builds it over the outer parameters (one tensor per trainable parameter, in the model's order), the
        averaged pseudo-gradient is their ``.grad``, and one ``step()`` per sync applies it. E.g.
        ``hat.Outer.custom(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))`` is
        ``Outer.nesterov()``; its state (``optimizer.state``, per parameter name) is saved in checkpoints and
        kept identical on every rank. Learning-rate schedules: call them on the built optimizer through
        ``opt.outer_optimizer()``. The other arguments as in :meth:`sgd`."""
        outer = cls(1.0, 0.0, False, feedback_decay, value_bits, value_group, exchange, optimizer=optimizer)
        outer.build([torch.zeros(1)])  # refuse a factory that does not build an optimizer now, not at the first sync
        return outer

    def build(self, params: List[torch.Tensor]) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer of the outer step over ``params``: the custom one, or ``torch.optim.SGD``
        with this setting's lr, momentum and Nesterov flag (the same arithmetic as DiLoCo's outer step)."""
        if self.optimizer is None:
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov)
        opt = self.optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"Outer.custom(optimizer): optimizer(params) returned {type(opt).__name__}, not a "
                            "torch.optim.Optimizer")
        return opt

    @classmethod
    def nesterov(cls, lr: float = 0.7, momentum: float = 0.9, feedback_decay: float = 1.0,
                 value_bits: Optional[int] = None, value_group: Optional[int] = None, exchange: str = "auto") -> "Outer":
        """DiLoCo's outer optimizer (defaults from the paper)."""
        return cls(lr, momentum, nesterov=True, feedback_decay=feedback_decay, value_bits=value_bits,
                   value_group=value_group, exchange=exchange)

    @classmethod
    def momentum_sgd(cls, lr: float, momentum: float, feedback_decay: float = 1.0,
                     value_bits: Optional[int] = None, value_group: Optional[int] = None,
                     exchange: str = "auto") -> "Outer":
        """Heavy-ball momentum: ``theta <- theta - lr b``."""
        return cls(lr, momentum, nesterov=False, feedback_decay=feedback_decay, value_bits=value_bits,
                   value_group=value_group, exchange=exchange)

    @classmethod
    def sgd(cls, lr: float = 1.0, feedback_decay: float = 1.0, value_bits: Optional[int] = None,
            value_group: Optional[int] = None, exchange: str = "auto") -> "Outer":
        """No momentum: ``theta <- theta - lr Delta`` (SparseLoCo's choice: error feedback replaces momentum;
        ``feedback_decay`` < 1 makes the error-feedback memory forget, as SparseLoCo's does; ``value_bits=2``
        sends its values as 2-bit codes, :mod:`horovod_adtopk.quantize`; ``value_group=64`` lets whole fibers
        share their levels until a set serves at least 64 entries). ``value_bits`` also works on a dense
        exchange (``Compression.none``): every entry then travels as a code, with error feedback.

        ``exchange``: how a sparse or low-bit payload travels. ``"auto"`` (default) picks per tensor, by the cost
        model at the current world size, the cheapest of an allgather, an allreduce of the dense tensor and the
        owner-sharded two-stage exchange (:mod:`horovod_adtopk.sharded`: all-to-all of fiber shards, the owner
        averages, re-selects and re-encodes with its own error feedback, allgather of the owners' blocks; about
        2 payloads per rank at any world size, where an allgather moves W - 1). ``"allgather"``: never sharded;
        ``"sharded"``: every tensor that can be sharded is (ADTopk rules; dense low-bit tensors of 2 or more
        row groups)."""
        return cls(lr, 0.0, nesterov=False, feedback_decay=feedback_decay, value_bits=value_bits,
                   value_group=value_group, exchange=exchange)

    def config(self) -> dict:
        # the built-in settings' keys as before (their checkpoints keep their layout); a custom optimizer instead
        head = ({"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov} if self.optimizer is None
                else {"optimizer": _describe_factory(self.optimizer)})
        return {**head, "feedback_decay": self.feedback_decay, "value_bits": self.value_bits,
                "value_group": self.value_group, "exchange": self.exchange}

    def __repr__(self) -> str:
        if self.optimizer is not None:
            return (f"Outer.custom({_describe_factory(self.optimizer)}, feedback_decay={self.feedback_decay}, "
                    f"value_bits={self.value_bits}, value_group={self.value_group}, exchange={self.exchange!r})")
        return (f"Outer(lr={self.lr}, momentum={self.momentum}, nesterov={self.nesterov}, "
                f"feedback_decay={self.feedback_decay}, value_bits={self.value_bits}, value_group={self.value_group}, "
                f"exchange={self.exchange!r})")



def _describe_factory(factory) -> str:
    """A rank-independent description of an outer optimizer factory (for the configuration check)."""
    if isinstance(factory, functools.partial):
        args = [repr(a) for a in factory.args] + [f"{k}={v!r}" for k, v in sorted(factory.keywords.items())]
        return f"{_describe_factory(factory.func)}({', '.join(args)})"
    return f"{getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', type(factory).__qualname__)}"


def check_settings(sync_every, outer, compression) -> None:
    """Refuse settings the outer exchange cannot run (before anything is built)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1 (the number of local steps between syncs), got {sync_every!r}")
    if not isinstance(outer, Outer):
        raise TypeError(f"outer must be a horovod_adtopk.Outer, e.g. hat.Outer.nesterov(lr=0.7, momentum=0.9), "
                        f"got {outer!r}")
    low_bit_dense = outer.value_bits is not None and is_plain(compression)
    if outer.feedback_decay != 1.0 and not (is_sparse(compression) and compression.error_feedback) and not low_bit_dense:
        raise ValueError(f"feedback_decay={outer.feedback_decay} decays the error-feedback memory of a sparse "
                         f"compressor or of low-bit values, and {compression!r} keeps none; use adtopk or topk, "
                         "value_bits with Compression.none, or feedback_decay=1")
    if outer.value_bits is not None and not is_sparse(compression) and not low_bit_dense:
        raise ValueError(f"value_bits={outer.value_bits} quantizes the values of the outer exchange, and "
                         f"{compression!r} already sets its own; use value_bits with adtopk, topk or Compression.none "
                         "(every entry as a low-bit code), or value_bits=None")
    if outer.exchange == "sharded" and not (low_bit_dense or (is_sparse(compression) and hasattr(compression, "layout"))):
        raise ValueError(f"Outer(exchange=\"sharded\") shards the fibers of an ADTopk payload or the rows of a dense "
                         f"low-bit one, and {compression!r} has neither; use adtopk / adtopk_i, value_bits with "
                         "Compression.none, or exchange=\"auto\"")
    if is_sparse(compression):
        if lowrank.runs_own_rounds(compression) or not compression.gathers:
            raise ValueError(f"{compression!r} cannot compress the pseudo-gradient (it needs its own collective "
                             "rounds or shared positions); with sync_every use adtopk, adtopk_i, topk, fp16 or none")
        if compression.variable_count:
            raise ValueError(f"{compression!r} sends a variable number of entries, which the outer exchange does "
                             "not carry; with sync_every use a fixed-size rule: adtopk, adtopk_i or topk")


def is_plain(compression) -> bool:
    """A dense exchange in the tensors' own dtype: None or Horovod's ``Compression.none``."""
    return compression is None or getattr(compression, "__name__", None) == "NoneCompressor"
