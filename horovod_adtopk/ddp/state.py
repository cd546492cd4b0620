"""``CompressionState``: everything the DDP hook keeps between buckets and iterations (one object per model).

Like PyTorch's ``PowerSGDState`` it holds all mutable state of the hook: the settings, the process group,
the round counter, and this rank's error-feedback memory and adaptive compressor state. The memory is keyed
by *parameter* (its name), never by bucket index: DDP rebuilds its buckets after the first iteration (and
again whenever ``bucket_cap_mb`` or the graph changes), and a parameter's residual must follow it.

Parameter names: from ``named_parameters`` (``hat.ddp.register`` passes the model's, so they equal the names
``hat.DistributedOptimizer`` would use), else ``param.<i>`` in the order the hook first meets them: bucket
by bucket in the first iteration, where DDP's bucket assignment depends only on the model, so the names are
the same on every rank and in every run of the same model (what a resumed run needs).
"""
from __future__ import annotations

import numbers
import warnings
from typing import Dict, Optional, Tuple

import torch

from .. import config_check, lowrank, paths, sharded
from .. import state as layout
from ..compressors import SparseCompressor, TensorInfo, is_sparse
from ..memory import ErrorFeedback
from ..sparsify import Sparsifier
from ..stats import Stats
from .communicator import ProcessGroupComm


def _check_compression(compression):
    """A configured sparse compressor, a dense Horovod-style compressor (``compress``/``decompress``), or None."""
    if isinstance(compression, type) and issubclass(compression, SparseCompressor):
        raise TypeError(f"pass a configured compressor, e.g. compression=hat.Compression.{compression.name}(ratio=0.01)")
    if is_sparse(compression):
        if lowrank.runs_own_rounds(compression):
            raise TypeError(f"{compression!r} runs two dependent collective rounds per tensor, which a DDP hook "
                            "cannot issue in a fixed order across ranks; under DDP use PyTorch's own PowerSGD hook "
                            "(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook)")
        return compression
    if compression is None or (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        return compression
    raise TypeError(f"compression must be a horovod_adtopk.Compression entry (e.g. hat.Compression.adtopk(ratio=0.01)), "
                    f"a dense compressor, or None; got {compression!r}")


def describe_compression(compression) -> dict:
    if is_sparse(compression):
        return compression.config()
    if compression is None:
        return {"compressor": "none"}
    name = getattr(compression, "__name__", type(compression).__name__)
    return {"compressor": "none" if name == "NoneCompressor" else name}


class CompressionState:
    """State of :func:`horovod_adtopk.ddp.hook` for one DDP model (see the module docstring).

    Args:
        process_group: the ``torch.distributed`` group to average over (None: the default group).
        compression: ``hat.Compression.adtopk(ratio=0.01)`` or any other sparse compressor except PowerSGD;
            ``hat.Compression.none`` / ``fp16`` or None for dense allreduce.
        warmup_steps: the first N communication rounds send every gradient dense (PyTorch's PowerSGD hook
            calls it ``start_powerSGD_iter``); its memory (and momentum correction) keeps running.
        named_parameters: ``model.named_parameters()`` of the module DDP wraps (optional, see above).
        exchange_when_alone: with one process, run the whole exchange anyway (compression, error feedback,
            the collectives over a group of one) instead of passing gradients through untouched; for checking
            a backend end to end on a single device (``scripts/gpu_check.sh`` does, over NCCL).
        exchange: how an ADTopk rule's sparse payloads travel: ``"allgather"`` (default; ``(W-1) x P`` per
            rank), ``"sharded"`` (the owner-sharded two-stage exchange, :mod:`horovod_adtopk.sharded`: about
            ``2 (W-1)/W x P`` per rank at any ``W``, with a second selection and error feedback on the owner; its
            all-to-all runs in the hook, blocking, its allgather asynchronously) or ``"auto"`` (per tensor, the
            cheapest of allgather, sharded and allreduce by the cost model at this world size).
    """

    def __init__(self, process_group=None, compression=None, warmup_steps: int = 0, named_parameters=None,
                 exchange_when_alone: bool = False, exchange: str = "allgather") -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        self.process_group = process_group
        self.compression = _check_compression(compression)
        self.warmup_steps = int(warmup_steps)
        if not isinstance(exchange_when_alone, bool):
            raise TypeError(f"exchange_when_alone must be True or False, got {exchange_when_alone!r}")
        self.exchange_when_alone = exchange_when_alone
        self.exchange = sharded.check_exchange(exchange)
        self.owner: Dict[str, torch.Tensor] = {}  # this rank's owner residuals (the sharded exchange)
        self._owner_pending: Optional[Tuple[Optional[dict], Optional[dict]]] = None  # loaded, placed when planned
        self.round = 0  # communication rounds completed: drives the warm-ups, ADTopk-I, Random-k's seeds
        sparse = is_sparse(self.compression)
        self.dense_compression = None if sparse else self.compression
        self.memory = ErrorFeedback(self.compression.momentum) if sparse and self.compression.error_feedback else None
        self.sparsifier = Sparsifier(self.compression, self.memory) if sparse else None
        self.stats_ = Stats()
        self._bound: Optional[Dict[str, Tuple[list, str]]] = None  # name -> (shape, dtype) when names were given
        self._reset_runtime()
        if named_parameters is not None:
            self.bind(named_parameters)

    def _reset_runtime(self) -> None:
        self._comm: Optional[ProcessGroupComm] = None
        self._names: Dict[int, str] = {}  # id(parameter) -> name (not pickled: ids belong to one process)
        self._infos: Dict[str, TensorInfo] = {}
        self._sparse_path: Dict[str, bool] = {}
        self._devices: Dict[str, torch.device] = {}
        self._config_checked = False
        self.shard_plans: Dict[str, sharded.Plan] = {}

    # --- parameters -------------------------------------------------------------------------------------------
    def bind(self, named_parameters) -> None:
        """Name the parameters (``model.module.named_parameters()``); needed again after unpickling a state
        that was built with names."""
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters must have unique names")
        self._names = {id(p): n for n, p in named}
        self._bound = {n: [list(p.shape), str(p.dtype)] for n, p in named}

    def tensor_info(self, p) -> Tuple[str, TensorInfo]:
        """``(name, TensorInfo)`` of a parameter met in a bucket (its path is planned on first sight)."""
        name = self._names.get(id(p))
        if name is None:
            if self._bound is not None:
                raise RuntimeError("horovod_adtopk.ddp: a bucket holds a parameter that is not among the "
                                   "named_parameters given to the state (after unpickling a state, call "
                                   "state.bind(model.module.named_parameters()))")
            name = self._names[id(p)] = f"param.{len(self._names)}"
        info = self._infos.get(name)
        if info is None:
            if not p.is_floating_point():
                raise TypeError(f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be "
                                "trained with horovod_adtopk")
            info = self._infos[name] = TensorInfo(name, tuple(p.shape), p.numel(), p.dtype)
            self._plan(info)
            self._devices[name] = p.device
            self._place_memory(name, p.device)
        return name, info

    def _plan(self, info: TensorInfo) -> None:
        if self.sparsifier is None:
            sparse, reason = False, "dense compressor"
        else:
            sparse, reason = self.compression.choose_path(info, self.comm().size())
        path = None
        if self.sparsifier is not None and self.exchange != "allgather":
            why = paths.shard(info, sparse, self.compression, self.comm().size(), self)
            if why is not None:
                sparse, reason, path = True, why, "sharded"
                self._restore_owner(info.name)
        self._sparse_path[info.name] = sparse
        self.stats_.set_path(info.name, info.numel, sparse, reason, path,
                             selection=self.compression.selection_summary(info) if sparse else None)

    def _restore_owner(self, name: str) -> None:
        """A loaded checkpoint's owner residual of ``name``, once its plan exists (plans are made on first sight)."""
        if self._owner_pending is None:
            return
        saved, full = self._owner_pending
        one = lambda d: {name: d[name]} if d is not None and name in d else None  # noqa: E731
        got, dropped = sharded.restore(one(saved), one(full), {name: self.shard_plans[name]}, self.comm().rank(),
                                       {name: self._devices.get(name, torch.device("cpu"))})
        self.owner.update(got)
        if dropped:
            warnings.warn(f"horovod_adtopk.ddp: the owner residual of {name!r} does not fit this world's shards "
                          "and is dropped (the update it held is lost once)")

    def on_sparse_path(self, name: str) -> bool:
        return self._sparse_path.get(name, False)

    def sends_sparse(self, name: str) -> bool:
        """Sparse this round: on the sparse path and past the warm-up."""
        return self.on_sparse_path(name) and self.round >= self.warmup_steps

    def _place_memory(self, name: str, device: torch.device) -> None:
        """Memory loaded from a checkpoint lives on the CPU until its parameter is first met."""
        if self.memory is None:
            return
        for store in (self.memory.residuals, self.memory.velocities):
            t = store.get(name)
            if t is not None and t.device != device:
                store[name] = t.to(device)

    # --- communication --------------------------------------------------------------------------------------
    def comm(self) -> ProcessGroupComm:
        if self._comm is None:
            self._comm = ProcessGroupComm(self.process_group)
        return self._comm

    def check_config(self) -> None:
        """Collective, once: every rank must agree on the settings (else every rank raises, never a hang)."""
        if self._config_checked:
            return
        self._config_checked = True
        params = self._bound if self._bound is not None else {
            n: [list(i.shape), str(i.dtype)] for n, i in self._infos.items()}
        config_check.check(self.comm(), {"engine": "ddp", "compression": describe_compression(self.compression),
                                         "warmup_steps": self.warmup_steps, "process_set": self.comm().size(),
                                         "params": params, "exchange": self.exchange})

    def end_round(self) -> None:
        """After the last bucket of an iteration: scrub non-finite memory, count the round."""
        if self.sparsifier is not None and self.sparsifier.scrub_nonfinite():
            self.stats_.nonfinite_steps += 1
        self.round += 1
        self.stats_.steps += 1

    # --- checkpoints, pickling, counters ------------------------------------------------------------------------
    def _entry(self) -> dict:
        entry = layout.local_entry(self.memory, self.compression, self.sparsifier is not None)
        if self.owner:
            entry["owner"] = {n: t.detach().clone() for n, t in self.owner.items()}
        return entry

    def state_dict(self) -> dict:
        """This rank's round counter, residuals and adaptive compressor state (all tensors, numbers and
        strings: ``torch.load(path, weights_only=True)`` reads it), in the Horovod engine's layout."""
        comm = self.comm()
        return layout.wrap(self.round, comm.size(), describe_compression(self.compression),
                           {comm.rank(): self._entry()}, None)

    def gather_state_dict(self) -> dict:
        """Collective: :meth:`state_dict` with every rank's entry, for one file written by rank 0."""
        comm = self.comm()
        entries = comm.allgather_object(self._entry(), "hat.ddp.gather_state")
        return layout.wrap(self.round, comm.size(), describe_compression(self.compression), dict(enumerate(entries)),
                           None)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (before the first backward of the resumed run). A different compressor
        configuration is refused; a state without this rank's entry warns and starts with an empty memory."""
        comm = self.comm()
        shapes = {n: shape for n, (shape, _) in self._bound.items()} if self._bound is not None else None
        entry = layout.unwrap(state, describe_compression(self.compression), comm.rank(), comm.size(), self.memory,
                              shapes)
        self.round = int(state["round"])
        if self.memory is not None:
            self.memory.load_state_dict(entry["memory"] if entry is not None else {})
            for name, device in self._devices.items():
                self._place_memory(name, device)
        if self.sparsifier is not None:
            self.compression.load_state_dict(entry["compressor"] if entry is not None else {})
            if entry is None:
                self.compression.reset_state()
        self.owner = {}
        self._owner_pending = (entry or {}).get("owner"), (entry or {}).get("owner_full")
        for name in list(self.shard_plans):
            self._restore_owner(name)

    def stats(self) -> dict:
        """Cumulative counters of this rank (bytes sent vs dense, density, per-tensor path, seconds)."""
        out = self.stats_.as_dict()
        out.update({"compressor": describe_compression(self.compression), "round": self.round,
                    "world_size": self.comm().size(), "engine": "ddp"})
        return out

    def __getstate__(self) -> dict:
        """Everything but the process group and the per-process parameter map (as PowerSGD's state)."""
        return {k: v for k, v in self.__dict__.items()
                if k not in ("process_group", "_comm", "_names", "_infos", "_sparse_path", "_devices",
                             "_config_checked", "shard_plans")}

    def __setstate__(self, state: dict) -> None:
        """The process group becomes the default group; re-``bind`` names if the state had them."""
        self.__dict__.update(state)
        self.process_group = None
        self._reset_runtime()
