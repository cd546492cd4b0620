"""Functions run on every rank by tests.harness (one per multi-rank scenario).

Each takes ``(args, outdir)``, runs after ``hvd.init()``, and returns JSON-able data; bulky arrays go to
``outdir`` as ``.npz`` for the test (numpy reference) to read.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

import horovod_adtopk as hat

from tests.cases import DTYPES, case_compression as _case_compression, case_params as _case_params  # noqa: F401
from tests.cases import local_gradient  # noqa: F401


def smoke_collectives(args, outdir):
    """Allgather with a different first dimension on every rank, and an allreduce."""
    r, w = hvd.rank(), hvd.size()
    rows = r + 1
    local = torch.full((rows, 3), float(r)) + torch.arange(3.0)
    gathered = hvd.allgather(local, name="smoke.gather")
    summed = hvd.allreduce(torch.tensor([float(r + 1), 2.0 * r]), name="smoke.sum", op=hvd.Sum)
    return {"rank": r, "size": w, "gathered": gathered.tolist(), "summed": summed.tolist()}


def feed_case(ci: int, case: dict, **opt_kwargs):
    """Case ``ci``: its parameters under hat.DistributedOptimizer (``opt_kwargs`` added), fed known per-rank
    gradients for ``case["steps"]`` rounds; returns ``(opt, arrays)`` with every step's local gradient
    (``g/t/name``) and aggregate (``out/t/name``)."""
    rank = hvd.rank()
    params = _case_params(case)
    named = [(f"case{ci}.{n}", p) for n, p in params.items()]
    opt = hat.DistributedOptimizer(torch.optim.SGD(list(params.values()), lr=0.0), named_parameters=named,
                                   compression=_case_compression(case),
                                   op=hvd.Sum if case.get("op") == "sum" else hvd.Average, **opt_kwargs)
    dtype = DTYPES[case.get("dtype", "float32")]
    arrays = {}
    for t in range(case.get("steps", 3)):
        for n, p in params.items():
            scale = case.get("scale", {}).get(n, 1.0) * case.get("rank_scale", [1.0] * 8)[rank]
            g = local_gradient(ci, rank, t, n, p.shape, dtype, scale)
            p.grad = g.clone()
            arrays[f"g/{t}/{n}"] = g.numpy()
        opt.synchronize()
        for n, p in params.items():
            arrays[f"out/{t}/{n}"] = p.grad.numpy().copy()
    return opt, arrays


def reference_cases(args, outdir):
    """For each case: feed known per-rank gradients, synchronize, record the aggregated gradients."""
    rank = hvd.rank()
    summary = []
    for ci, case in enumerate(args["cases"]):
        opt, arrays = feed_case(ci, case, gradient_predivide_factor=case.get("predivide", 1.0),
                                groups=case.get("groups"), warmup_steps=case.get("warmup_steps", 0))
        mem = opt.state_dict()["horovod_adtopk"]["ranks"][rank]["memory"]
        for n, res in (mem.get("residuals") or {}).items():
            arrays[f"res/{n.split('.', 1)[1]}"] = res.numpy()
        np.savez(Path(outdir, f"case{ci}_rank{rank}.npz"), **arrays)
        st = opt.stats()
        tensors = {n.split(".", 1)[1]: v for n, v in st["tensors"].items()}
        summary.append({"paths": {n: v["path"] for n, v in tensors.items()},
                        "bytes_sent": st["bytes_sent"], "elements_sent": st["elements_sent"], "tensors": tensors})
    return summary


class SmallCNN(torch.nn.Module):
    """A quarter-width examples/models.py SmallCNN (8/16 channels, 27.6k parameters): the many-step
    consistency and resume tests train one per compressor, and the full-width model is 8x larger."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 16, 3)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def params_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def train_consistency(args, outdir):
    """Train a small CNN on rank-specific random data with each compressor; return the parameter digests."""
    out = {}
    for si, spec in enumerate(args["compressors"]):
        label = f"{si}:{spec['compressor']}"
        torch.manual_seed(0)
        model = SmallCNN()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        comp = _case_compression(spec)
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hat.DistributedOptimizer(base, named_parameters=[(f"{si}.{n}", p)
                                                               for n, p in model.named_parameters()],
                                       compression=comp,
                                       backward_passes_per_step=spec.get("bpps", 1),
                                       overlap=spec.get("overlap", False))
        gen = torch.Generator().manual_seed(100 + hvd.rank())
        losses = []
        for step in range(args["steps"]):
            for _ in range(spec.get("bpps", 1)):
                x = torch.randn(16, 1, 28, 28, generator=gen)
                y = torch.randint(0, 10, (16,), generator=gen)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        digests = hvd.allgather_object(params_digest(model), name=f"digest.{si}")
        st = opt.stats()
        out[label] = {"digests": digests, "steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
                      "density": st["density"], "bytes_sent": st["bytes_sent"], "overlap": st["overlap"]}
    return out


def expect_errors(args, outdir):
    """Scenarios that must raise a clear error on every rank (never hang)."""
    rank = hvd.rank()
    results = {}
    scenario = args["scenario"]
    if scenario == "config_mismatch":
        ratio = 0.01 if rank == 0 else 0.02
        model = torch.nn.Linear(64, 64)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=ratio, min_numel=0))
    elif scenario == "compressor_mismatch":
        model = torch.nn.Linear(64, 64)
        comp = hat.Compression.adtopk(ratio=0.01) if rank == 0 else hat.Compression.topk(ratio=0.01)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=comp)
    elif scenario == "param_set_mismatch":
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(1 + rank)])
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=0.01))
    elif scenario == "param_mismatch":
        model = torch.nn.Linear(64, 64 if rank == 0 else 32)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=0.01))
    elif scenario == "stock_optimizer":
        model = torch.nn.Linear(64, 64)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=0.01))
    else:
        raise ValueError(scenario)
    try:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    except Exception as exc:  # the point: a clear error, on every rank
        results = {"error": type(exc).__name__, "message": str(exc)}
    else:
        results = {"error": None}
    return results


def process_set_case(args, outdir):
    """A process set of ranks {0, 1} out of 3: rank 2 takes no part; members average over 2."""
    ps = hvd.add_process_set([0, 1])
    rank = hvd.rank()
    params = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(8, 64, dtype=torch.float64))})
    opt = hat.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.0), named_parameters=params.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.25, min_numel=0, hybrid=False),
                                   process_set=ps)
    g = local_gradient(0, rank, 0, "w", (8, 64), torch.float64)
    params["w"].grad = g.clone()
    opt.synchronize()
    np.savez(Path(outdir, f"ps_rank{rank}.npz"), g=g.numpy(), out=params["w"].grad.numpy())
    hvd.remove_process_set(ps)
    return {"member": rank in (0, 1)}


def hang_forever(args, outdir):
    """Rank 0 waits in a collective that rank 1 never joins (a hung job, for the harness's timeout test)."""
    import time
    if hvd.rank() == 0:
        hvd.allreduce(torch.ones(1), name="never.matched")
    time.sleep(3600)


def hooks_reference(args, outdir):
    """Real backward passes through the gradient hooks (backward_passes_per_step 1 and 2), the
    synchronize() + skip_synchronize() pattern, and an Embedding/LSTM model; records local and aggregated
    gradients for the numpy reference."""
    rank = hvd.rank()
    bpps = args["bpps"]
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(40, 12)
            self.lstm = torch.nn.LSTM(12, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 40)

        def forward(self, x):
            h, _ = self.lstm(self.embed(x))
            return self.head(h)

    model = Net().double()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=hat.Compression.adtopk(ratio=args["ratio"], min_numel=0, hybrid=False),
                                   backward_passes_per_step=bpps, overlap=args.get("overlap", False))
    gen = torch.Generator().manual_seed(10 + rank)
    arrays = {}
    for step in range(args["steps"]):
        local = {n: torch.zeros_like(p) for n, p in named}
        for _ in range(bpps):
            x = torch.randint(0, 40, (4, 6), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 40), x.roll(1, dims=1).reshape(-1))
            grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
            for (n, _), g in zip(named, grads):
                local[n] += g
            loss.backward()
        opt.synchronize()
        for n, p in named:
            arrays[f"g/{step}/{n}"] = local[n].numpy()
            arrays[f"out/{step}/{n}"] = p.grad.numpy().copy()
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    np.savez(Path(outdir, f"hooks_rank{rank}.npz"), **arrays)
    return {"names": [n for n, _ in named], "shapes": {n: list(p.shape) for n, p in named},
            "overlap": opt.stats()["overlap"]}


def _batch(rank: int, step: int, n: int = 16):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _train_steps(model, opt, rank, first, last):
    for step in range(first, last):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _fresh(spec):
    torch.manual_seed(0)
    model = SmallCNN()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hat.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=_case_compression(spec),
                                   partial_sparsification=spec.get("partial", False), profile_rounds=3)
    return model, opt


def resume_run(args, outdir):
    """phase 'full': 2N steps; 'first': N steps then a checkpoint; 'second' (new processes): load it, N more.
    For each spec, saves the final parameters, optimizer state and every rank's residuals (rank 0 writes)."""
    rank, n = hvd.rank(), args["steps"]
    out = {}
    for si, spec in enumerate(args["specs"]):
        model, opt = _fresh(spec)
        ckpt = Path(outdir if args["phase"] != "second" else args["first_dir"], f"ckpt{si}.pt")
        if args["phase"] == "second":
            state = torch.load(ckpt, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            _train_steps(model, opt, rank, n, 2 * n)
        else:
            _train_steps(model, opt, rank, 0, n if args["phase"] == "first" else 2 * n)
        full_state = opt.gather_state_dict()  # collective: every rank
        if rank == 0:
            target = ckpt if args["phase"] == "first" else Path(outdir, f"final{si}.pt")
            tmp = target.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": full_state}, tmp)
            tmp.replace(target)
        st = opt.stats()
        out[str(si)] = {"round": st["round"], "paths": {k: v["path"] for k, v in st["tensors"].items()}}
    return out


def nonfinite_case(args, outdir):
    """Rank 1 produces a NaN (and an Inf) gradient at step 2: every rank must see a non-finite aggregated
    gradient for that tensor that step (as with dense allreduce), and finite ones afterwards."""
    rank = hvd.rank()
    params = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(16, 64))})
    opt = hat.DistributedOptimizer(torch.optim.SGD(params.parameters(), lr=0.0), named_parameters=params.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.05, min_numel=0, hybrid=False))
    finite = []
    for step in range(5):
        g = local_gradient(0, rank, step, "w", (16, 64), torch.float32)
        if step == 2 and rank == 1:
            g[3, 5] = float("nan")
            g[7, 9] = float("inf")
            g[7, 10:20] = float("nan")  # more non-finite entries than k in one fiber
        params["w"].grad = g
        opt.synchronize()
        finite.append(bool(torch.isfinite(params["w"].grad).all()))
    residual = opt.state_dict()["horovod_adtopk"]["ranks"][rank]["memory"]["residuals"]["w"]
    return {"finite": finite, "residual_finite": bool(torch.isfinite(residual).all()),
            "nonfinite_steps": opt.stats()["nonfinite_steps"]}


def die_midway(args, outdir):
    """Rank 1 kills itself with SIGKILL at step 5 of training; the others must exit, not hang."""
    import os
    import signal
    rank = hvd.rank()
    model, opt = _fresh({"compressor": "adtopk", "kwargs": {"ratio": 0.01}})
    for step in range(200):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        _train_steps(model, opt, rank, step, step + 1)
    return {"finished": True}


def transformer_reference(args, outdir):
    """A small GPT (tied embedding/head) in float64 through the real gradient hooks with ADTopk: every step's
    local gradient (also split into its two uses by an untied copy), the aggregate, and the per-tensor stats."""
    from examples.models import GPT
    rank = hvd.rank()
    torch.manual_seed(0)
    sizes = dict(vocab_size=11, dim=16, heads=2, layers=1, context=8)
    model = GPT(**sizes).double()
    untied = GPT(**sizes, tie_weights=False).double()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    named = list(model.named_parameters())
    opt = hat.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), named_parameters=named,
                                   compression=hat.Compression.adtopk(ratio=args["ratio"], min_numel=0, hybrid=False))
    gen = torch.Generator().manual_seed(10 + rank)
    arrays = {}
    for step in range(args["steps"]):
        x = torch.randint(0, 11, (3, 8), generator=gen)
        untied.load_state_dict({**model.state_dict(), "head.weight": model.tok_emb.weight.detach().clone()})
        loss_u = torch.nn.functional.cross_entropy(untied(x).reshape(-1, 11), x.roll(1, dims=1).reshape(-1))
        loss_u.backward()
        arrays[f"emb/{step}"] = untied.tok_emb.weight.grad.numpy().copy()
        arrays[f"head/{step}"] = untied.head.weight.grad.numpy().copy()
        untied.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 11), x.roll(1, dims=1).reshape(-1))
        local = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
        loss.backward()
        opt.synchronize()
        for (n, p), g in zip(named, local):
            arrays[f"g/{step}/{n}"] = g.numpy()
            arrays[f"out/{step}/{n}"] = p.grad.numpy().copy()
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    np.savez(Path(outdir, f"gpt_rank{rank}.npz"), **arrays)
    return {"names": [n for n, _ in named], "shapes": {n: list(p.shape) for n, p in named},
            "stats": opt.stats()["tensors"]}


def fold_resume(args, outdir):
    """For each spec: phase 'write' (3 ranks): N steps, then rank 0 writes the gathered state; phase 'read'
    (2 ranks, new processes): load it, dump this rank's residuals and velocities, take one more step."""
    rank, out = hvd.rank(), {}
    for si, spec in enumerate(args["specs"]):
        model, opt = _fresh(spec)
        ckpt = Path(args.get("first_dir", outdir), f"ckpt{si}.pt")
        if args["phase"] == "write":
            _train_steps(model, opt, rank, 0, args["steps"])
            full_state = opt.gather_state_dict()
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": full_state}, ckpt)
            out[str(si)] = {"round": opt.stats()["round"]}
            continue
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        mine = opt.state_dict()["horovod_adtopk"]["ranks"][rank]["memory"]
        np.savez(Path(outdir, f"fold{si}_rank{rank}.npz"),
                 **{f"residuals/{k}": v.numpy() for k, v in mine["residuals"].items()},
                 **{f"velocities/{k}": v.numpy() for k, v in mine["velocities"].items()})
        round_ = opt.stats()["round"]
        _train_steps(model, opt, rank, args["steps"], args["steps"] + 1)
        out[str(si)] = {"round": round_, "digest": params_digest(model)}
    return out


def alone_cases(args, outdir):
    """One rank, ``exchange_when_alone`` per case: the known gradients of :func:`feed_case` through the whole
    exchange (or passed through), with what the test needs to recompute it (aggregates, residuals, stats); then
    local steps with 2-bit values at this world of one."""
    summary = []
    for ci, case in enumerate(args["cases"]):
        opt, arrays = feed_case(ci, case, exchange_when_alone=case["alone"])
        mem = opt.state_dict()["horovod_adtopk"]["ranks"][hvd.rank()]["memory"]
        for n, res in (mem.get("residuals") or {}).items():
            arrays[f"res/{n.split('.', 1)[1]}"] = res.numpy()
        np.savez(Path(outdir, f"case{ci}_rank{hvd.rank()}.npz"), **arrays)
        st = opt.stats()
        summary.append({"tensors": {n.split(".", 1)[1]: v for n, v in st["tensors"].items()},
                        **{k: st[k] for k in ("steps", "density", "bytes_sent", "bytes_dense", "wire_bytes_sent",
                                              "wire_bytes_received", "world_size")}})
    local = {}
    for alone in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(48, 32)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hat.Compression.adtopk(ratio=0.1, min_numel=0), sync_every=2,
                                       outer=hat.Outer.sgd(lr=1.0, value_bits=2), exchange_when_alone=alone)
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(8, 48, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            opt.step()
        st = opt.stats()
        local[str(alone)] = {"density": st["density"], "bytes_sent": st["bytes_sent"], "round": st["round"],
                             "residual_tensors": st["memory"]["tensors"]}
    return {"cases": summary, "local": local}
