"""The PyTorch DDP engine of the job (``--engine ddp``, launched with ``torchrun --nproc-per-node N``).

The same methods as :class:`job.engine.HorovodEngine`, over ``torch.distributed``: the model runs inside
``DistributedDataParallel`` with ``horovod_adtopk.ddp``'s communication hook and the compressor the flags
name (``--compressor powersgd`` means PyTorch's own ``powerSGD_hook``; ``none`` plain DDP). The optimizer is
SGD whose ``state_dict`` carries the hook's state (every rank's residuals in a checkpoint) and whose
``stats()`` gives the same counters as ``hat.DistributedOptimizer``'s.
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
from datetime import timedelta
from typing import Any, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_adtopk as hat
from horovod_adtopk import netcost

from .common import LOG
from .optim import base_optimizer, make_compression, make_local_steps, sparse_parameter_names

HOOK_STATE_KEY = "horovod_adtopk_ddp"


class _Hooked:
    """Mixin for an optimizer class: checkpoints the DDP hook's state with its own and reports the hook's
    counters (``HookedSGD``, ``HookedAdamW``)."""

    hook_state = None  # a hat.ddp.CompressionState, or None (plain DDP, PyTorch's PowerSGD)
    numel = 0  # parameters (for the counters without our hook)
    step_bytes = 0  # bytes one rank hands to allreduce per step without our hook (an estimate for PowerSGD)
    dense_steps = 0  # PowerSGD's dense iterations (start_powerSGD_iter)
    steps = 0

    def step(self, closure=None):
        self.steps += 1
        return super().step(closure)

    def base_state_dict(self) -> dict:
        """The wrapped optimizer's own state, without the hook's."""
        return super().state_dict()

    def state_dict(self):
        sd = super().state_dict()
        if self.hook_state is not None:
            sd[HOOK_STATE_KEY] = self.hook_state.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        if self.dense_steps and dist.is_initialized() and dist.get_rank() == 0:
            LOG.warning("--compressor powersgd on the DDP engine: PyTorch's powerSGD_hook keeps its error-feedback "
                        "memory and low-rank warm start outside any state_dict, so the resumed run starts them "
                        f"afresh (its first {self.dense_steps} steps dense again) and does not repeat the run "
                        "it resumes bitwise; our compressors keep their state in the optimizer's state_dict")
        hook = state_dict.pop(HOOK_STATE_KEY, None)
        if hook is not None and self.hook_state is not None:
            self.hook_state.load_state_dict(hook)
        super().load_state_dict(state_dict)

    def stats(self) -> dict:
        if self.hook_state is not None:
            return self.hook_state.stats()
        dense = min(self.steps, self.dense_steps)
        sent = dense * 4 * self.numel + (self.steps - dense) * self.step_bytes
        elements = self.steps * self.numel
        world = dist.get_world_size() if dist.is_initialized() else 1
        wire = netcost.allreduce(sent, world).received  # PyTorch's hooks allreduce (P and Q, or the dense bucket)
        return {"bytes_sent": sent, "bytes_dense": 4 * elements, "elements_sent": sent // 4,
                "elements_total": elements, "density": sent / (4 * elements) if elements else 0.0,
                "wire_bytes_sent": wire, "wire_bytes_received": wire,
                "wire_bytes_dense": netcost.dense_baseline(elements, world).received, "tensors": {}}


class HookedSGD(_Hooked, torch.optim.SGD):
    """SGD with the DDP hook's state in its checkpoints and the hook's counters in ``stats()``."""


class HookedAdamW(_Hooked, torch.optim.AdamW):
    """AdamW with the DDP hook's state in its checkpoints and the hook's counters in ``stats()``."""


def powersgd_step_bytes(model: torch.nn.Module, rank: int, min_rate: float = 2.0) -> int:
    """Bytes PyTorch's PowerSGD hook allreduces per step (its rule: a matrix ``n x m`` goes as ``P`` and ``Q``
    when ``n m / ((n + m) r) >= min_compression_rate``, else dense; 1-D tensors dense)."""
    total = 0
    for p in model.parameters():
        n = p.shape[0] if p.dim() > 1 else p.numel()
        m = p.numel() // max(n, 1)
        r = min(rank, n, m)
        total += 4 * ((n + m) * r if p.dim() > 1 and n * m >= min_rate * (n + m) * r else p.numel())
    return total


def bucket_options(model: torch.nn.Module, one_bucket: bool) -> dict:
    """DDP's keyword arguments for the buckets: none (DDP's defaults), or with ``one_bucket`` a cap above the
    model's gradient bytes, which makes every gradient (the first bucket's too) one bucket."""
    if not one_bucket:
        return {}
    return {"bucket_cap_mb": 1 + sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}


class DDPEngine:
    """``torch.distributed`` from torchrun's environment; NCCL on GPUs, Gloo on the CPU."""

    name = "ddp"

    def __init__(self, args: argparse.Namespace) -> None:
        if "RANK" not in os.environ:  # a single process without torchrun
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
        self.cuda = torch.cuda.is_available() and not args.no_cuda
        backend = getattr(args, "ddp_backend", "auto")
        backend = ("nccl" if self.cuda else "gloo") if backend == "auto" else backend
        dist.init_process_group(backend, timeout=timedelta(seconds=120))
        # PyTorch's powerSGD_hook starts a bucket's P and Q allreduces from future callbacks. On Gloo those run on
        # its worker threads when the previous collective has completed, so with several buckets the ranks can
        # start the next bucket's allreduce and this bucket's Q allreduce in different orders: a collective
        # mismatch that aborts the run, seen after about 470 steps of the GPT. One bucket leaves one chain.
        self.one_bucket = getattr(args, "compressor", None) == "powersgd" and backend == "gloo"
        atexit.register(_shutdown)  # an orderly end of the process group's threads before the interpreter's
        _note_failures()
        self.init_mode = "torchrun"

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def size(self) -> int:
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return DDP(model, device_ids=[model_device(model)] if self.cuda else None,
                   **bucket_options(model, self.one_bucket))

    def make_optimizer(self, model: DDP, args: argparse.Namespace, lr: float) -> torch.optim.Optimizer:
        """SGD (momentum correction as the Horovod engine) or AdamW, and the communication hook the flags name."""
        world = self.size
        compression = None if args.compressor == "powersgd" else make_compression(args)
        correct = args.momentum_correction and world > 1
        sparse = sparse_parameter_names(model.module, compression, world) if correct else set()
        local_steps = make_local_steps(args)
        if local_steps:  # each rank steps on its own batch; no gradient hook
            opt = base_optimizer(model.module, args, lr, sparse, sgd=HookedSGD, adamw=HookedAdamW)
            return hat.ddp.local_steps(opt, model, compression=compression, warmup_steps=args.dense_rounds or 0,
                                       **local_steps)
        opt = base_optimizer(model.module, args, lr, sparse, sgd=HookedSGD, adamw=HookedAdamW)
        opt.numel = sum(p.numel() for p in model.parameters())
        opt.step_bytes = 4 * opt.numel
        if args.compressor == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                       start_powerSGD_iter=max(2, args.dense_rounds or 0))
            model.register_comm_hook(state, psgd.powerSGD_hook)
            opt.step_bytes, opt.dense_steps = powersgd_step_bytes(model, args.powersgd_rank), state.start_powerSGD_iter
        elif not hat.Compression.is_dense_name(args.compressor) or args.compressor == "fp16":
            opt.hook_state = hat.ddp.register(model, compression, warmup_steps=args.dense_rounds or 0,
                                              exchange=getattr(args, "exchange", "allgather"))
        return opt

    def broadcast_initial_state(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        """DDP broadcast rank 0's parameters when it wrapped the model; buffers again here to be sure."""
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)

    def step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, clip_grad: float) -> None:
        """The gradients are averaged when backward() returns; clip (optionally) and step."""
        if clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
        opt.step()

    def checkpoint_state(self, opt: torch.optim.Optimizer) -> dict:
        """Collective: the optimizer state with every rank's hook state (for rank 0 to save)."""
        if hasattr(opt, "gather_state_dict"):  # local steps (hat.ddp.local_steps)
            return opt.gather_state_dict()
        sd = opt.base_state_dict()
        if opt.hook_state is not None:
            sd[HOOK_STATE_KEY] = opt.hook_state.gather_state_dict()
        return sd

    def _control(self, t: torch.Tensor) -> torch.Tensor:
        return t.cuda() if self.cuda else t

    def sum(self, values: torch.Tensor, name: str) -> torch.Tensor:  # noqa: ARG002 (names are Horovod's)
        out = self._control(values.clone())
        dist.all_reduce(out)
        return out.to(values.device)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:  # noqa: ARG002
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, name: str) -> Any:  # noqa: ARG002
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


_FAILED = []  # set when the process ends with an uncaught exception (see _note_failures)


def _note_failures() -> None:
    """Remember an uncaught exception (its traceback is printed first, then atexit runs ``_shutdown``)."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        _FAILED.append(kind.__name__)
        previous(kind, value, tb)

    if not getattr(sys.excepthook, "_hat_notes_failures", False):
        hook._hat_notes_failures = True
        sys.excepthook = hook


def _shutdown() -> None:
    """Wait for every rank (at most 30 s), destroy the group, then let Gloo's worker threads finish: one still
    dropping the last collective when the interpreter finalizes aborts a rank that finished ("terminate called
    without an active exception", see horovod_adtopk/ddp/teardown.py). After an uncaught exception (a peer
    lost) no barrier: the survivors exit at once, and under torchrun their agent restarts them sooner."""
    if dist.is_initialized() and _FAILED:
        dist.destroy_process_group()
        return
    hat.ddp.shutdown(timeout=30)


def model_device(model: torch.nn.Module) -> int:
    return next(model.parameters()).device.index or 0
