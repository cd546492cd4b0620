"""The base of every compressor: codecs, :class:`Selection`, :class:`SparseCompressor` and the registry.

Every sparse compressor is a :class:`horovod.torch.compression.Compressor` subclass so that it can be
passed where Horovod expects one, but its payloads are (value, index) pairs that must be *gathered*, not
summed: inside stock ``hvd.DistributedOptimizer`` its ``compress`` raises a clear error pointing to
:class:`horovod_adtopk.DistributedOptimizer`. ``Compression.none`` and ``Compression.fp16`` are Horovod's
own dense compressors and take Horovod's allreduce path unchanged.

Per call the optimizer asks a compressor for a :class:`Selection` of the error-compensated gradient
``a``. A selection says which entries leave this rank and how the receivers will find their positions:

- :class:`FiberCodec`: fiber-local indices, a fixed count per rank (ADTopk); int16 for fibers < 32768.
- :class:`FlatCodec`: flat offsets, fixed count (Top-k) or variable count (threshold rules).
- :class:`SharedCodec`: no indices at all, every rank draws the same positions (Random-k); the values
  travel by allreduce.

The rules live one family per module beside this one and join the registry with :func:`register`.
"""
from __future__ import annotations

import inspect
import numbers
import zlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Type

import torch
try:  # Horovod is needed to train, not to select: benchmarks and GPU boxes without Horovod use the rules too
    from horovod.torch.compression import Compressor, FP16Compressor, NoneCompressor
except ImportError:  # pragma: no cover - exercised where Horovod is absent
    class Compressor:  # type: ignore[no-redef]
        """Stand-in for ``horovod.torch.compression.Compressor`` when Horovod is not installed."""

    NoneCompressor = FP16Compressor = None  # type: ignore[assignment]

from .. import kernels, netcost
from .. import selection as sel
from ..memory import check_momentum
from ..wire import COUNT_BYTES, WIRE_VALUE_DTYPES, dtype_bytes, entry_bytes, index_dtype_for

DEFAULT_MIN_NUMEL = 1024


# --- codecs: how positions travel -------------------------------------------------------------------------


class FiberCodec:
    """Fiber-local indices, ``layout.count`` entries per rank in fiber-major order."""

    def __init__(self, layout: sel.FiberLayout) -> None:
        self.layout = layout
        self.index_dtype = index_dtype_for(layout.fiber_len - 1)
        self.count: Optional[int] = layout.count
        self._bases: Dict[torch.device, torch.Tensor] = {}
        self._hint: Optional[torch.Tensor] = None

    def hint(self, a: torch.Tensor) -> Optional[torch.Tensor]:
        """The selection hint this tensor's fibers carry from step to step (:func:`kernels.adtopk_select`), where
        it helps: the native CPU kernel. Speed only: the selection is the same without it, so it is neither
        saved nor exchanged, and a new codec (a new layout) starts without one."""
        if kernels.backend(a) != "native-cpu":
            return None
        if self._hint is None:
            self._hint = kernels.new_hint(self.layout.num_fibers)
        return self._hint

    def bases(self, device: torch.device) -> torch.Tensor:
        b = self._bases.get(device)
        if b is None:
            b = self._bases[device] = sel.fiber_bases(self.layout, device)
        return b

    def to_flat(self, wire_index: torch.Tensor) -> torch.Tensor:
        """Flat positions of the indices of one or more rank blocks (length a multiple of ``count``)."""
        return sel.local_to_flat(wire_index, self.layout, self.bases(wire_index.device))


class FlatCodec:
    """Flat offsets; ``count=None`` means the number of entries varies per rank and step."""

    def __init__(self, numel: int, count: Optional[int]) -> None:
        self.index_dtype = index_dtype_for(max(numel - 1, 0))
        self.count = count

    def to_flat(self, wire_index: torch.Tensor) -> torch.Tensor:
        return wire_index.to(torch.int64)


class SharedCodec:
    """Positions every rank derives identically: only values travel, summed by allreduce."""

    index_dtype = None

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.count = flat.numel()


@dataclass
class Selection:
    """What one rank sends for one tensor this step."""

    values: torch.Tensor  # 1-D, signed, gradient dtype
    flat: torch.Tensor  # 1-D int64 flat positions of ``values`` (for the sender's memory)
    wire_index: Optional[torch.Tensor]  # what travels as indices, any integer dtype (None for SharedCodec)
    codec: object
    finite: Optional[torch.Tensor] = None  # 0-d bool: nothing non-finite left the rank unsent
    wire_values: Optional[torch.Tensor] = None  # ``values`` as they travel (scaled, wire dtype; set by the sender)
    block: Optional[torch.Tensor] = None  # the packed uint8 block, where the selection wrote it (bucket select)
    packed: Optional[tuple] = None  # (bucket_select plan, tensor index) of the bucket selection that packed it


@dataclass(frozen=True)
class TensorInfo:
    """Static facts about one parameter, fixed at the optimizer's first step."""

    name: str
    shape: Tuple[int, ...]
    numel: int
    dtype: torch.dtype


# --- base class ---------------------------------------------------------------------------------------------

#: wire value dtypes by name (``None``: the gradient's own dtype); the scripts' ``--value-dtype`` choices
VALUE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}


def _check_value_dtype(value_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    if value_dtype is None:
        return None
    if isinstance(value_dtype, str):
        value_dtype = VALUE_DTYPES.get(value_dtype, value_dtype)
    if value_dtype not in WIRE_VALUE_DTYPES:
        raise ValueError(f"value_dtype must be one of {', '.join(VALUE_DTYPES)} or None (the gradient's "
                         f"dtype), got {value_dtype!r}")
    return value_dtype


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


class _RefuseStockHorovod:
    """``compress`` / ``decompress`` of a sparse compressor, on the class or an instance: stock
    ``hvd.DistributedOptimizer`` would allreduce (sum) the indices, so refuse with a pointer to ours."""

    def __get__(self, obj, cls):
        def refuse(*_args, **_kwargs):
            how = (f"hat.Compression.{cls.name}(ratio=0.01)" if obj is None else repr(obj))
            raise TypeError(
                f"{cls.__name__} produces sparse (value, index) payloads that must be allgathered; "
                "hvd.DistributedOptimizer would allreduce (sum) the indices and silently corrupt the gradients. "
                f"Use horovod_adtopk.DistributedOptimizer(optimizer, named_parameters=..., compression={how}) "
                "instead.")
        return refuse


class SparseCompressor(Compressor):
    """Base of every sparse compressor. Subclasses implement :meth:`_select` (and :meth:`nominal_count`
    where the payload size is not ``max(1, floor(ratio * numel))``).

    Args:
        ratio: target density in (0, 1].
        value_dtype: dtype of values on the wire (None: the gradient's dtype).
        error_feedback: keep what was not sent and add it to the next gradient.
        min_numel: tensors with fewer elements travel dense (allreduce).
        momentum: DGC momentum correction factor (None: plain error feedback).
        hybrid: send a tensor dense when allgathering its sparse payload from every rank would move more
            bytes than a ring allreduce of the dense tensor (see :meth:`choose_path`).
        density_warmup: rounds of exponential density warm-up (DGC): the density at round ``s`` is
            ``density_start * (ratio / density_start) ** (s / density_warmup)``, reaching ``ratio`` at
            round ``density_warmup``. A function of the optimizer's round counter (saved in checkpoints),
            so identical on every rank. 0: off.
        density_start: the density of round 0 of the warm-up (default 0.25, DGC's).
    """

    name = "sparse"
    #: one line for the README table and ``--help``
    summary = ""
    #: payloads travel by allgather (False: values are summed by allreduce, as for Random-k)
    gathers = True
    #: how the engines exchange this rule's output: "payload" (one selection per tensor and round, packed by
    #: horovod_adtopk.wire) or "lowrank" (two dependent collective rounds, horovod_adtopk.lowrank)
    exchange_kind = "payload"
    #: the number of entries varies per rank and step (a count travels alongside)
    variable_count = False
    #: whether 1-D tensors may be sparse (fiber rules need 2 dims; all rules follow the paper and keep
    #: biases and norms dense)
    min_dims = 2

    compress = _RefuseStockHorovod()
    decompress = _RefuseStockHorovod()

    def __init__(self, ratio: float, value_dtype: Optional[torch.dtype] = None, error_feedback: bool = True,
                 min_numel: int = DEFAULT_MIN_NUMEL, momentum: Optional[float] = None, hybrid: bool = True,
                 density_warmup: int = 0, density_start: float = 0.25) -> None:
        self.ratio = sel.check_ratio(ratio)
        self.value_dtype = _check_value_dtype(value_dtype)
        self.error_feedback = _check_bool("error_feedback", error_feedback)
        self.min_numel = _check_int("min_numel", min_numel, 0)
        self.momentum = check_momentum(momentum)
        if self.momentum is not None and not error_feedback:
            raise ValueError("momentum correction needs error_feedback=True")
        self.hybrid = _check_bool("hybrid", hybrid)
        self.density_warmup = _check_int("density_warmup", density_warmup, 0)
        self.density_start = max(sel.check_ratio(density_start), self.ratio)

    # --- configuration --------------------------------------------------------------------------------------
    def config(self) -> dict:
        """Every setting that must agree across ranks (checked at the first step)."""
        return {"compressor": self.name, "ratio": self.ratio, "value_dtype": str(self.value_dtype),
                "error_feedback": self.error_feedback, "min_numel": self.min_numel,
                "momentum": self.momentum, "hybrid": self.hybrid, "density_warmup": self.density_warmup,
                "density_start": self.density_start, **self.extra_config()}

    def extra_config(self) -> dict:
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "compressor")
        return f"Compression.{self.name}({args})"

    def wire_value_dtype(self, grad_dtype: torch.dtype) -> torch.dtype:
        return self.value_dtype or grad_dtype

    def ratio_at(self, step: int) -> float:
        """The density of round ``step`` (the target ``ratio`` once the density warm-up is over)."""
        if step >= self.density_warmup or self.density_start <= self.ratio:
            return self.ratio
        return max(self.ratio, self.density_start * (self.ratio / self.density_start) ** (step / self.density_warmup))

    # --- per tensor -----------------------------------------------------------------------------------------
    def nominal_count(self, info: TensorInfo) -> int:
        """Entries a rank sends per step for this tensor (the target, for variable-size rules)."""
        return sel.keep_count(self.ratio, info.numel)

    def nominal_index_dtype(self, info: TensorInfo) -> Optional[torch.dtype]:
        return index_dtype_for(info.numel - 1)

    def selection_summary(self, info: TensorInfo) -> dict:
        """How this tensor is selected at the target ratio, for ``opt.stats()["tensors"][name]["selection"]``:
        the rule, entries per rank and step, and the wire's index dtype (rules by fibers add their layout)."""
        index = self.nominal_index_dtype(info)
        return {"rule": self.name, "count": self.nominal_count(info),
                "index_dtype": str(index).replace("torch.", "") if index is not None else None}

    def nominal_bytes(self, info: TensorInfo) -> Tuple[int, int]:
        """``(P, D)``: one rank's payload bytes per step (nominal for variable-size rules) and the dense
        tensor's bytes."""
        entry = entry_bytes(self.wire_value_dtype(info.dtype), self.nominal_index_dtype(info))
        return self.nominal_count(info) * entry, info.numel * dtype_bytes(info.dtype)

    def choose_path(self, info: TensorInfo, world_size: int, payload: Optional[int] = None,
                    link: Optional["netcost.Link"] = None) -> Tuple[bool, str]:
        """Decide once per tensor: ``(sparse?, reason)``.

        Dense for tensors under ``min_dims`` dimensions or ``min_numel`` entries, and when a rank's payload
        (``payload`` bytes where the caller's wire differs, e.g. low-bit codes; else :meth:`nominal_bytes`)
        is at least the dense tensor's bytes. With ``hybrid``, the cost model of :mod:`horovod_adtopk.netcost`
        then compares an allgather of the payload from ``world_size`` ranks (``(W-1) P`` per rank, plus the
        count of variable-size rules) with a ring allreduce of the dense tensor (``2 (W-1)/W D``) on ``link``
        (default :meth:`netcost.Link.from_env`): sparse iff the allgather is faster. With the default link (no
        latency: collectives are fused) this is ``W P < 2 D``.
        """
        if len(info.shape) < self.min_dims:
            return False, f"{len(info.shape)}-D tensor"
        if info.numel < self.min_numel:
            return False, f"numel {info.numel} < min_numel {self.min_numel}"
        nominal, dense = self.nominal_bytes(info)
        payload = nominal if payload is None else int(payload)
        if payload >= dense:
            return False, f"sparse payload {payload} B >= dense {dense} B"
        if self.hybrid and self.gathers:
            count = COUNT_BYTES if self.variable_count else 0
            gather, why = netcost.choose_gather(payload, dense, world_size, link, count)
            if not gather:
                return False, why
        return True, "sparse"

    def select(self, a: torch.Tensor, info: TensorInfo, step: int, grad: Optional[torch.Tensor] = None,
               zero_sent: bool = False) -> Selection:
        """Choose the entries of ``a`` (the error-compensated gradient of ``info.name``) to send at ``step``.

        With ``grad``, ``a`` is the residual memory and ``a += grad`` happens first (fused into the
        selection's pass where a kernel can); with ``zero_sent``, the sent entries of ``a`` are zeroed
        afterwards (the wire carries them exactly, so nothing of them remains).
        """
        if not a.is_floating_point():
            raise TypeError(f"{info.name}: gradient dtype {a.dtype} is not floating point; compressors select "
                            "from float16/bfloat16/float32/float64 gradients")
        if a.is_sparse:
            raise TypeError(f"{info.name}: sparse tensors are not supported; pass a dense gradient")
        s = self._select_fused(a, info, step, grad, zero_sent)
        if s.finite is None:
            s.finite = torch.isfinite(s.values).all()
        return s

    def _select_fused(self, a: torch.Tensor, info: TensorInfo, step: int, grad: Optional[torch.Tensor],
                      zero_sent: bool) -> Selection:
        """Default: the add, the selection and the zeroing as separate passes (rules without a kernel)."""
        if grad is not None:
            a.add_(grad)
        s = self._select(a, info, step)
        if zero_sent:
            a.view(-1)[s.flat] = 0
        return s

    def _select(self, a: torch.Tensor, info: TensorInfo, step: int) -> Selection:
        raise NotImplementedError

    def empty_selection(self, info: TensorInfo, step: int, device: torch.device) -> Selection:
        """What a rank without a gradient sends: nothing (variable-size rules) or zeros at valid positions
        of the agreed count (fixed-size rules), so the collective still matches and the sum is unchanged."""
        if self.variable_count:
            empty = torch.zeros(0, dtype=info.dtype, device=device)
            s = _flat_selection(empty, torch.zeros(0, dtype=torch.int64, device=device), info.numel, None)
        else:
            s = self._select(torch.zeros(info.shape, dtype=info.dtype, device=device), info, step)
            s.values = torch.zeros_like(s.values)
        s.finite = torch.tensor(True)
        return s

    # --- adaptive state (ADTopk-T) --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def reset_state(self) -> None:
        pass


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """The kernels read tensors in their logical (row-major) order: copy e.g. a channels_last gradient."""
    return t if t.is_contiguous() else t.contiguous()


def _flat_selection(values: torch.Tensor, flat: torch.Tensor, numel: int, count: Optional[int]) -> Selection:
    return Selection(values, flat, flat, FlatCodec(numel, count))


def stable_seed(*parts) -> int:
    """A seed from strings/ints that is the same in every process (Python's ``hash`` is salted)."""
    return zlib.crc32("\x1f".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


# --- registry -------------------------------------------------------------------------------------------------

_REGISTRY: Dict[str, Type[SparseCompressor]] = {}


def register(cls: Type[SparseCompressor]) -> Type[SparseCompressor]:
    """Add a compressor class to the registry under ``cls.name`` (and to :class:`Compression`)."""
    if cls.name in _REGISTRY or cls.name in ("none", "fp16"):
        raise ValueError(f"a compressor named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


_DENSE = {"none": NoneCompressor, "fp16": FP16Compressor}


class _CompressionNamespace(type):
    def __getattr__(cls, name):
        try:
            return _REGISTRY[name]
        except KeyError:
            raise AttributeError(f"Compression has no compressor {name!r}; choose one of "
                                 f"{', '.join(Compression.names())}") from None

    def __dir__(cls):
        return sorted(set(super().__dir__()) | set(_REGISTRY))


class Compression(metaclass=_CompressionNamespace):
    """Namespace of compressors, like ``horovod.torch.Compression``; every registered compressor (see
    :func:`register`) is an attribute.

    ``Compression.none`` / ``Compression.fp16`` are Horovod's dense compressors (use them as they are);
    every other attribute is a sparse compressor class: ``Compression.adtopk(ratio=0.01)``.
    """

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def names() -> list:
        """Every registered name, dense ones first."""
        return list(_DENSE) + sorted(_REGISTRY)

    @staticmethod
    def value_dtypes() -> Dict[str, torch.dtype]:
        """Wire value dtypes by name (for ``--value-dtype`` style flags)."""
        return dict(VALUE_DTYPES)

    @staticmethod
    def sparse_names() -> list:
        return sorted(_REGISTRY)

    @staticmethod
    def is_dense_name(name: str) -> bool:
        return str(name).lower() in _DENSE

    @staticmethod
    def summaries() -> Dict[str, str]:
        """``name -> one-line description`` of every sparse compressor (the README table is checked
        against it)."""
        return {name: _REGISTRY[name].summary for name in sorted(_REGISTRY)}

    @staticmethod
    def accepted_options(name: str) -> set:
        """The keyword arguments compressor ``name`` takes (its own and, through ``**kwargs``, the base's)."""
        cls = _REGISTRY[str(name).lower().replace("-", "_")]
        accepted = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is Compressor or klass is object:
                continue
            params = inspect.signature(init).parameters
            accepted |= {n for n, prm in params.items() if n != "self" and prm.kind is not prm.VAR_KEYWORD}
            if not any(prm.kind is prm.VAR_KEYWORD for prm in params.values()):
                break
        return accepted

    @staticmethod
    def from_options(name: str, **options):
        """Build compressor ``name`` from a pool of options (a script's flags): those it does not take, and
        those set to None, are left out; the compressor's own defaults and validation apply to the rest."""
        if Compression.is_dense_name(name):
            return Compression.get(name)
        accepted = Compression.accepted_options(name)
        return Compression.get(name, **{k: v for k, v in options.items() if k in accepted and v is not None})

    @staticmethod
    def get(name: str, **kwargs):
        """Build a compressor by name: ``Compression.get("dgc", ratio=0.01)``.

        Dense names ("none", "fp16") take no arguments except a ``ratio``/``value_dtype`` of None.
        """
        key = str(name).lower().replace("-", "_")
        if key in _DENSE:
            extra = {k: v for k, v in kwargs.items() if v is not None}
            if extra:
                raise ValueError(f"compressor {name!r} is dense and takes no arguments, got {sorted(extra)}")
            if _DENSE[key] is None:
                raise ImportError(f"compressor {name!r} is Horovod's own; install Horovod to use it")
            return _DENSE[key]
        cls = _REGISTRY.get(key)
        if cls is None:
            raise ValueError(f"unknown compressor {name!r}; choose one of {', '.join(Compression.names())}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


def is_sparse(compression) -> bool:
    return isinstance(compression, SparseCompressor)
