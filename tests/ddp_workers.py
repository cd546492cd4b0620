"""Functions run on every rank by ``tests._ddp_launch`` (the DDP engine's multi-rank scenarios).

Each takes ``(args, outdir)`` inside an initialised Gloo process group and returns JSON-able data; arrays go to
``outdir`` as ``.npz``. No Horovod here: the DDP engine must work without it.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_adtopk as hat
from tests.cases import DTYPES, case_compression, case_params, local_gradient


class GradModule(torch.nn.Module):
    """``forward(grads) = sum_n (p_n * grads[n]).sum()``: the gradient of ``p_n`` is exactly ``grads[n]``."""

    def __init__(self, params: dict) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterDict({n.replace(".", "__"): p for n, p in params.items()})

    def forward(self, grads: dict) -> torch.Tensor:
        return sum((self.ps[n.replace(".", "__")] * g).sum() for n, g in grads.items())


def _state_for(case, ci: int, module: GradModule, model: DDP, compression):
    """The hook's state: named like hat.DistributedOptimizer's parameters, or positional (hook-only API)."""
    names = [(f"case{ci}.{k.replace('__', '.')}", p) for k, p in module.ps.items()]  # (ParameterDict sorts keys)
    if case.get("naming") == "positional":
        state = hat.ddp.CompressionState(process_group=None, compression=compression,
                                         warmup_steps=case.get("warmup_steps", 0))
    else:
        state = hat.ddp.CompressionState(process_group=None, compression=compression,
                                         warmup_steps=case.get("warmup_steps", 0), named_parameters=names)
    model.register_comm_hook(state, hat.ddp.hook)
    return state


def reference_cases(args, outdir):
    """For each case: known per-rank gradients through DDP + the hook; record the averaged gradients.

    Case options beyond tests/workers.py's: ``ddp`` (DDP keyword arguments), ``no_sync`` (micro-batches per
    step, the first ones under ``no_sync()``), ``unused`` ({rank: {step: [names]}}: not used in that forward).
    """
    rank = dist.get_rank()
    summary = []
    for ci, case in enumerate(args["cases"]):
        params = case_params(case)
        module = GradModule(params)
        model = DDP(module, **{"bucket_cap_mb": 0.004, **case.get("ddp", {})})
        compression = case_compression(case)
        state = _state_for(case, ci, module, model, compression if compression is not hat.Compression.none else None)
        dtype = DTYPES[case.get("dtype", "float32")]
        micro = case.get("no_sync", 1)
        unused = case.get("unused", {}).get(str(rank), {})
        arrays = {}
        for t in range(case.get("steps", 3)):
            skip = set(unused.get(str(t), []))
            for p in params.values():
                p.grad = None
            total = {}
            for m in range(micro):
                grads = {}
                for n, p in params.items():
                    scale = case.get("scale", {}).get(n, 1.0) * case.get("rank_scale", [1.0] * 8)[rank]
                    g = local_gradient(ci + 1000 * m, rank, t, n, p.shape, dtype, scale)
                    if n not in skip:
                        grads[n] = g
                        total[n] = g if n not in total else total[n] + g
                with model.no_sync() if m + 1 < micro else nullcontext():
                    model(grads).backward()
            for n, p in params.items():
                arrays[f"g/{t}/{n}"] = total[n].numpy() if n in total else np.zeros(p.shape, dtype=total_dtype(dtype))
                arrays[f"present/{t}/{n}"] = np.array(n in total)
                arrays[f"out/{t}/{n}"] = p.grad.numpy().copy()
        sd = state.state_dict()
        mem = sd["ranks"][rank]["memory"]
        for n, res in (mem.get("residuals") or {}).items():
            arrays[f"res/{_short(case, n)}"] = res.numpy()
        np.savez(Path(outdir, f"case{ci}_rank{rank}.npz"), **arrays)
        st = state.stats()
        tensors = {_short(case, n): v for n, v in st["tensors"].items()}
        summary.append({"paths": {n: v["path"] for n, v in tensors.items()}, "round": st["round"],
                        "bytes_sent": st["bytes_sent"], "elements_sent": st["elements_sent"], "tensors": tensors,
                        "bucket_decodes": st["bucket_decodes"]})
    return summary


def total_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def _short(case, name: str) -> str:
    """``case3.linear.weight`` -> ``linear.weight``; positional ``param.<i>`` -> the case's i-th name in
    first-bucket order is not recoverable here, so it stays as it is."""
    return name.split(".", 1)[1] if name.startswith("case") else name


# --- training: consistency, resume ----------------------------------------------------------------------------

class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(196, 96)
        self.fc2 = torch.nn.Linear(96, 64)
        self.fc3 = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _batch(rank: int, step: int, n: int = 16):
    g = torch.Generator().manual_seed(7919 * (rank + 1) + step)
    return torch.randn(n, 196, generator=g), torch.randint(0, 10, (n,), generator=g)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _build(spec: dict):
    torch.manual_seed(0)
    module = MLP()
    model = DDP(module, bucket_cap_mb=spec.get("bucket_cap_mb", 0.03), **spec.get("ddp", {}))
    compression = case_compression(spec)
    if spec.get("naming") == "positional":
        state = hat.ddp.CompressionState(compression=compression, warmup_steps=spec.get("warmup_steps", 0))
        model.register_comm_hook(state, hat.ddp.hook)
    else:
        state = hat.ddp.register(model, compression, warmup_steps=spec.get("warmup_steps", 0))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return module, model, state, opt


def _steps(model, opt, first: int, last: int) -> float:
    rank = dist.get_rank()
    loss = torch.zeros(())
    for step in range(first, last):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return float(loss)


def train_consistency(args, outdir):
    """Train the MLP ``steps`` steps per compressor; every rank's parameter digest."""
    out = {}
    for si, spec in enumerate(args["compressors"]):
        module, model, state, opt = _build(spec)
        first = _steps(model, opt, 0, 1)
        last = _steps(model, opt, 1, args["steps"])
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest(module))
        out[f"{si}:{spec['compressor']}"] = {"digests": digests, "first_loss": first, "last_loss": last,
                                             "density": state.stats()["density"], "round": state.round}
    return out


def resume_run(args, outdir):
    """``phase="straight"``: train ``2k`` steps, and separately ``k`` steps saving a checkpoint per rank;
    ``phase="resume"``: new processes load it and train ``k`` more. Returns the digests."""
    rank, k = dist.get_rank(), args["k"]
    out = {}
    for si, spec in enumerate(args["compressors"]):
        path = Path(args["ckpt_dir"], f"{si}_rank{rank}.pt")
        module, model, state, opt = _build(spec)
        if args["phase"] == "straight":
            _steps(model, opt, 0, 2 * k)
            out[f"{si}:straight"] = digest(module)
            module, model, state, opt = _build(spec)
            _steps(model, opt, 0, k)
            torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, path)
            out[f"{si}:round_saved"] = state.round
        else:
            ckpt = torch.load(path, weights_only=True)
            module.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            state.load_state_dict(ckpt["hook"])
            copy = pickle.loads(pickle.dumps(state))  # the state pickles without its process group
            out[f"{si}:pickled"] = {"group_dropped": copy.process_group is None, "round": copy.round,
                                    "same_memory": _same_memory(copy, state)}
            _steps(model, opt, k, 2 * k)
            out[f"{si}:resumed"] = digest(module)
    return out


def fold_resume(args, outdir):
    """Per spec: ``phase="write"`` (W ranks): ``k`` steps, then rank 0 saves the gathered hook state
    (``gather_state_dict``); ``phase="read"`` (W' ranks, new processes): load it, dump this rank's residuals and
    velocities to ``fold<i>_rank<r>.npz``, note any warning, take one more step; the round and a digest."""
    import warnings

    rank, k = dist.get_rank(), args["k"]
    out = {}
    for si, spec in enumerate(args["compressors"]):
        path = Path(args["ckpt_dir"], f"fold{si}.pt")
        module, model, state, opt = _build(spec)
        if args["phase"] == "write":
            _steps(model, opt, 0, k)
            gathered = state.gather_state_dict()
            if rank == 0:
                torch.save({"model": module.state_dict(), "opt": opt.state_dict(), "hook": gathered}, path)
            dist.barrier()
            out[str(si)] = {"round": state.round}
            continue
        ckpt = torch.load(path, weights_only=True)
        module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state.load_state_dict(ckpt["hook"])
        mem = state.memory
        np.savez(Path(outdir, f"fold{si}_rank{rank}.npz"),
                 **{f"residuals/{n}": t.double().numpy() for n, t in mem.residuals.items()},
                 **{f"velocities/{n}": t.double().numpy() for n, t in mem.velocities.items()})
        _steps(model, opt, k, k + 1)
        out[str(si)] = {"round": state.round, "digest": digest(module), "warnings": [str(w.message) for w in caught]}
    return out


def _same_memory(a, b) -> bool:
    if a.memory is None or b.memory is None:
        return a.memory is None and b.memory is None
    ra, rb = a.memory.residuals, b.memory.residuals
    return sorted(ra) == sorted(rb) and all(torch.equal(ra[n], rb[n]) for n in ra)


# --- failures ---------------------------------------------------------------------------------------------------

def mismatch(args, outdir):
    """Rank 1 builds a different state (``args["rank1"]`` overrides); every rank must raise, none hang."""
    rank = dist.get_rank()
    spec = dict(args["spec"], **(args["rank1"] if rank == 1 else {}))
    _, model, _, opt = _build(spec)
    try:
        _steps(model, opt, 0, 2)
    except Exception as exc:  # the configuration check's error, raised out of backward()
        return {"raised": True, "message": str(exc)}
    return {"raised": False, "message": ""}


def die_midway(args, outdir):
    """Rank 1 SIGKILLs itself at step ``args["kill_step"]``; the others must fail (not hang) soon after."""
    rank = dist.get_rank()
    _, model, _, opt = _build(args["spec"])
    for step in range(args["steps"]):
        if rank == 1 and step == args["kill_step"]:
            Path(outdir, "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        _steps(model, opt, step, step + 1)
    return {"finished": True}


def no_horovod(args, outdir):
    """A few ADTopk steps with ``import horovod`` blocked; reports what was importable."""
    import importlib.util
    import sys

    _, model, state, opt = _build({"compressor": "adtopk", "kwargs": {"ratio": 0.05}})
    _steps(model, opt, 0, 3)
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest(model.module))
    horovod_blocked = sys.modules.get("horovod", "absent") is None
    try:
        importlib.import_module("horovod.torch")
        importable = True
    except ImportError:
        importable = False
    return {"digests": digests, "horovod_blocked": horovod_blocked, "horovod_importable": importable,
            "round": state.round, "density": state.stats()["density"]}


def pytorch_powersgd_buckets(args, outdir):
    """PyTorch's ``powerSGD_hook`` on a 2.1 MB MLP through the job's bucket rule (``job.ddp_engine.bucket_options``)
    for ``args["steps"]`` steps; returns DDP's bucket record and a hash of the final parameters."""
    from examples.job.ddp_engine import bucket_options
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    model = DDP(module, **bucket_options(module, args["one_bucket"]))
    model.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                                start_powerSGD_iter=2), psgd.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(args["steps"]):
        model(torch.randn(8, 256, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    data = model._get_ddp_logging_data()
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()
    return {"rebuilt_bucket_sizes": str(data.get("rebuilt_bucket_sizes")), "finite": bool(np.isfinite(flat).all()),
            "params_sha": hashlib.sha256(flat.tobytes()).hexdigest()}
