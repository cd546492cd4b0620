"""Functions run on every rank by tests/test_dropin.py (``run_ranks("dropin_workers:<fn>", ...)``).

Each multi-case worker runs several scenarios in one Horovod job and returns every result; per-step
local and aggregated gradients go to ``outdir/<case>_rank<r>.npz`` for the test's numpy reference.
"""
from __future__ import annotations

import hashlib
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

import horovod_adtopk as hat


def case_where(arrays):
    """Which checkout the ranks import (the harness puts the test's repository first on PYTHONPATH)."""
    return {"file": hat.__file__}


def _compression(spec):
    if spec == "none":
        return hat.Compression.none
    kind, kwargs = spec
    kwargs = dict(kwargs)
    for key in ("value_dtype",):
        if key in kwargs:
            kwargs[key] = getattr(torch, kwargs[key])
    return hat.Compression.get(kind, **kwargs)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _same_everywhere(tensors, name) -> bool:
    return len(set(hvd.allgather_object(_digest(tensors), name=name))) == 1


def _residuals(opt):
    rank = hvd.rank()
    ranks = opt.state_dict()["horovod_adtopk"]["ranks"]
    mem = ranks[rank]["memory"] if rank in ranks else ranks[0]["memory"]
    return {k: v.clone() for k, v in (mem.get("residuals") or {}).items()}


def _as_np(t):
    return t.detach().to(torch.float64 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype).numpy().copy()


def _train_record(model, opt, forward, steps, arrays, prefix="", before_step=None):
    """Real backward passes through the hooks. Per step: local gradients (autograd.grad; absent when the
    parameter has none on this rank) and the aggregated ``p.grad`` after ``synchronize()``."""
    named = list(model.named_parameters())
    for t in range(steps):
        if before_step is not None:
            before_step(t)
        loss = forward(t)
        live = [(n, p) for n, p in named if p.requires_grad]
        grads = torch.autograd.grad(loss, [p for _, p in live], retain_graph=True, allow_unused=True)
        for (n, _), g in zip(live, grads):
            if g is not None:
                arrays[f"{prefix}g/{t}/{n}"] = _as_np(g.to_dense() if g.is_sparse else g)
        loss.backward()
        opt.synchronize()
        for n, p in named:
            arrays[f"{prefix}out/{t}/{n}"] = _as_np(p.grad.to_dense() if p.grad.is_sparse else p.grad)
            if p.grad.is_sparse:
                arrays[f"{prefix}sparse_grad/{t}/{n}"] = np.ones(1)
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
    return {n: list(p.shape) for n, p in named}


def _data(rank, t, *shape):
    g = torch.Generator().manual_seed(7919 * rank + t + 1)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def run_cases(args, outdir):
    """Run every case in ``args["cases"]`` (names of ``case_*`` functions with their arguments)."""
    rank = hvd.rank()
    out = {}
    for label, fn, kwargs in args["cases"]:
        arrays = {}
        start = time.time()
        try:
            res = globals()["case_" + fn](arrays=arrays, **kwargs)
        except Exception as exc:  # a case failing must not hide the others' results
            res = {"unexpected": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        res["seconds"] = time.time() - start
        out[label] = res
        if arrays:
            np.savez(Path(outdir, f"{label}_rank{rank}.npz"), **arrays)
    return out


def _error_of(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# --- 1: frozen layer, unused branch ------------------------------------------------------------------------

def _mlp(*sizes):
    torch.manual_seed(0)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).double()


def case_frozen(arrays, comp):
    rank = hvd.rank()
    model = _mlp(32, 16, 8)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))
    forward = lambda t: model(_data(rank, t, 4, 32)).pow(2).sum()  # noqa: E731
    _train_record(model, opt, forward, 3, arrays)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    res_before = _residuals(opt)
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    shapes = _train_record(model, opt, lambda t: forward(t + 3), 5, arrays, prefix="late/")
    res_after = _residuals(opt)
    change = {n: float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters()}
    return {"change": change, "shapes": shapes,
            "residual_kept": {n: bool(torch.equal(res_before[n], res_after[n])) for n in res_before
                              if n.startswith("0.")},
            "residual_names": sorted(res_before),
            "identical": _same_everywhere(list(model.parameters()), "frozen.digest")}


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = torch.nn.Linear(32, 8).double()
        self.b = torch.nn.Linear(32, 8).double()

    def forward(self, x, use_b):
        y = self.a(x).pow(2).sum()
        return y + self.b(x).pow(3).sum() if use_b else y


def case_unused_branch(arrays, comp, skip):
    """``skip``: {step: [ranks that do not use branch b]}."""
    rank = hvd.rank()
    model = _Branches()
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))
    forward = lambda t: model(_data(rank, t, 4, 32), rank not in skip.get(str(t), []))  # noqa: E731
    shapes = _train_record(model, opt, forward, 5, arrays)
    for n, r in _residuals(opt).items():
        arrays[f"res/{n}"] = r.numpy()
    return {"shapes": shapes, "identical": _same_everywhere(list(model.parameters()), "branch.digest")}


# --- 2: channels_last --------------------------------------------------------------------------------------

def case_channels_last(arrays, comp):
    rank = hvd.rank()
    results = {}
    for fmt in ("channels_last", "contiguous"):
        torch.manual_seed(2)
        model = torch.nn.Conv2d(32, 64, 3).double()
        if fmt == "channels_last":
            model = model.to(memory_format=torch.channels_last)
        w0 = model.weight.detach().clone()
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=_compression(comp))

        def forward(t, model=model, fmt=fmt):
            x = _data(rank, t, 2, 32, 5, 5)
            if fmt == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            return model(x).pow(2).sum()

        results[fmt] = {"shapes": _train_record(model, opt, forward, 3, arrays, prefix=fmt + "/"),
                        "moved": float((model.weight.detach() - w0).abs().max()),
                        "finite": bool(torch.isfinite(model.weight).all()),
                        "weight_channels_last": model.weight.is_contiguous(memory_format=torch.channels_last)}
    return results


# --- 3: Random-k non-finite, bf16 --------------------------------------------------------------------------

def case_randomk_nan(arrays):
    from horovod_adtopk.compressors import TensorInfo
    rank = hvd.rank()
    w = torch.nn.Parameter(torch.zeros(16, 64))
    comp = hat.Compression.randomk(ratio=0.05, min_numel=1)
    opt = hat.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)], compression=comp)
    drawn = set(comp._select(torch.zeros(16, 64), TensorInfo("w", (16, 64), 1024, torch.float32), 1).flat.tolist())
    pos = min(set(range(1024)) - drawn)
    finite = []
    for t in range(5):
        g = _data(rank, t, 16, 64).float()
        if t == 1 and rank == 1:
            g.view(-1)[pos] = float("nan")
        w.grad = g
        opt.synchronize()
        finite.append(bool(torch.isfinite(w.grad).all()))
    return {"finite": finite, "nan_drawn": pos in drawn,
            "residual_finite": bool(torch.isfinite(_residuals(opt)["w"]).all())}


def case_randomk_bf16(arrays):
    rank = hvd.rank()
    w = torch.nn.Parameter(torch.zeros(16, 64))
    opt = hat.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                   compression=hat.Compression.randomk(ratio=0.05, min_numel=1,
                                                                      value_dtype=torch.bfloat16))
    for t in range(3):
        g = _data(rank, t, 16, 64).float()
        arrays[f"g/{t}/w"] = g.numpy()
        w.grad = g.clone()
        opt.synchronize()
        arrays[f"out/{t}/w"] = w.grad.numpy().copy()
    arrays["res/w"] = _residuals(opt)["w"].numpy()
    return {}


def case_bf16_dense(arrays, comp):
    rank = hvd.rank()
    torch.manual_seed(3)
    model = torch.nn.Linear(64, 32).bfloat16()
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))
    for n, p in model.named_parameters():
        g = _data(rank, 0, *p.shape).bfloat16()
        arrays[f"g/0/{n}"] = _as_np(g)
        p.grad = g.clone()
    opt.synchronize()
    for n, p in model.named_parameters():
        arrays[f"out/0/{n}"] = _as_np(p.grad)
    return {"dtypes": [str(p.grad.dtype) for p in model.parameters()],
            "paths": {n: v["path"] for n, v in opt.stats()["tensors"].items()}}


# --- 10: float16 wire beyond 65504 --------------------------------------------------------------------------

def case_fp16_clamp(arrays):
    rank = hvd.rank()
    w = torch.nn.Parameter(torch.zeros(8, 64, dtype=torch.float64))
    opt = hat.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("w", w)],
                                   compression=hat.Compression.adtopk(ratio=0.05, min_numel=1,
                                                                      value_dtype=torch.float16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(4):
            g = _data(rank, t, 8, 64)
            if t == 0 and rank == 0:
                g[2, 5] = 1.0e5
            arrays[f"g/{t}/w"] = g.numpy()
            w.grad = g.clone()
            opt.synchronize()
            arrays[f"out/{t}/w"] = w.grad.numpy().copy()
    arrays["res/w"] = _residuals(opt)["w"].numpy()
    return {"warnings": [str(c.message) for c in caught]}


# --- 11, 12: checkpoint shapes, unconfigured class in stock Horovod -----------------------------------------

def case_load_mismatch(arrays):
    rank = hvd.rank()
    comp = lambda: hat.Compression.adtopk(ratio=0.1, min_numel=1)  # noqa: E731
    a = torch.nn.Linear(64, 32)
    opt_a = hat.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), named_parameters=a.named_parameters(),
                                     compression=comp())
    a(_data(rank, 0, 4, 64).float()).sum().backward()
    opt_a.step()
    sd = opt_a.state_dict()
    b = torch.nn.Linear(64, 16)
    opt_b = hat.DistributedOptimizer(torch.optim.SGD(b.parameters(), lr=0.1), named_parameters=b.named_parameters(),
                                     compression=comp())
    return {"residuals": sorted(sd["horovod_adtopk"]["ranks"][rank]["memory"]["residuals"]),
            "error": _error_of(lambda: opt_b.load_state_dict(sd))}


def case_stock_with_class(arrays):
    model = torch.nn.Linear(16, 8)

    def go():
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=hat.Compression.adtopk)
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
    return {"error": _error_of(go)}


# --- 6: Horovod's signature, positionally and by keyword -------------------------------------------------------

class _EmbedNet(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(4)
        self.embed = torch.nn.Embedding(50, 8, sparse=sparse).double()
        self.head = torch.nn.Linear(8, 3).double()

    def forward(self, x):
        return self.head(self.embed(x)).pow(2).sum()


def case_signature(arrays):
    """Every argument of hvd.DistributedOptimizer, positionally and by keyword: ours must train exactly as
    stock Horovod does with Compression.none. (Stock Horovod's grouped path does not densify sparse
    gradients, so groups are checked on the dense-embedding model.)"""
    rank = hvd.rank()
    finals = {}
    configs = {"sparse_as_dense": dict(sparse=True, num_groups=0, groups=None, sparse_as_dense=True),
               "groups": dict(sparse=False, num_groups=0, groups=2, sparse_as_dense=False),
               "num_groups": dict(sparse=False, num_groups=2, groups=None, sparse_as_dense=False)}
    for cfg, c in configs.items():
        for how in ("stock", "positional", "keyword"):
            model = _EmbedNet(sparse=c["sparse"])
            base = torch.optim.SGD(model.parameters(), lr=0.1)
            named = list(model.named_parameters())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                if how == "keyword":
                    opt = hat.DistributedOptimizer(optimizer=base, named_parameters=named,
                                                   compression=hat.Compression.none, backward_passes_per_step=2,
                                                   op=hvd.Average, gradient_predivide_factor=2.0,
                                                   num_groups=c["num_groups"], groups=c["groups"],
                                                   sparse_as_dense=c["sparse_as_dense"],
                                                   process_set=hvd.global_process_set)
                else:
                    make = hvd.DistributedOptimizer if how == "stock" else hat.DistributedOptimizer
                    opt = make(base, named, hvd.Compression.none, 2, hvd.Average, 2.0, c["num_groups"], c["groups"],
                               c["sparse_as_dense"], hvd.global_process_set)
            for t in range(3):
                for i in range(2):
                    x = torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(100 * rank + 10 * t + i))
                    model(x).backward()
                opt.step()
                opt.zero_grad()
            finals[f"{cfg}/{how}"] = _digest(list(model.parameters()))
            if how != "stock":
                finals[f"{cfg}/{how}/groups"] = len(set(opt._groups.values()))
    return {"finals": finals}


# --- 7 / Horovod's sparse-embedding scenario ----------------------------------------------------------------

def case_sparse_embedding(arrays, comp):
    rank = hvd.rank()
    out = {}
    for sparse in (True, False):
        model = _EmbedNet(sparse=sparse)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=_compression(comp),
                                       sparse_as_dense=True)
        forward = lambda t: model(torch.randint(0, 50, (6,), generator=torch.Generator().manual_seed(rank * 10 + t)))  # noqa
        out["shapes"] = _train_record(model, opt, forward, 3, arrays, prefix=f"sparse{int(sparse)}/")
        out[f"final{int(sparse)}"] = _digest(list(model.parameters()))
        for n, p in model.named_parameters():
            arrays[f"final{int(sparse)}/{n}"] = p.detach().numpy().copy()
    model = _EmbedNet(sparse=True)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))

    def without():
        model(torch.tensor([1, 2, 3])).backward()
        opt.step()
    out["error"] = _error_of(without)
    return out


# --- Horovod's optimizer scenarios ---------------------------------------------------------------------------

def case_broadcast_state(arrays, comp):
    rank = hvd.rank()
    torch.manual_seed(10 + rank)  # different initial parameters on every rank
    model = torch.nn.Linear(16, 8).double()
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * (rank + 1), momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))
    model(_data(rank, 0, 4, 16)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()
    root = [p.detach().clone() for p in model.parameters()]
    root_bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    root_digest = hvd.broadcast_object(_digest(root + root_bufs), root_rank=0, name="bcast.root")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = _digest(list(model.parameters()) + [opt.state[p]["momentum_buffer"] for p in model.parameters()])
    lr = opt.param_groups[0]["lr"]
    for t in range(1, 4):
        model(_data(rank, t, 4, 16)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    trained_identical = _same_everywhere(list(model.parameters()), "bcast.trained")
    # A fresh optimizer: Horovod initialises its state with a local step of the wrapped class (no collective).
    torch.manual_seed(20 + rank)
    fresh_model = torch.nn.Linear(16, 8).double()
    fresh = hat.DistributedOptimizer(torch.optim.Adam(fresh_model.parameters(), lr=1e-3 * (rank + 1)),
                                     named_parameters=fresh_model.named_parameters(), compression=_compression(comp))
    hvd.broadcast_parameters(fresh_model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    fresh_model(_data(rank, 9, 4, 16)).pow(2).sum().backward()
    fresh.step()
    return {"root_matches": after == root_digest, "lr": lr, "trained_identical": trained_identical,
            "fresh_lr": fresh.param_groups[0]["lr"],
            "fresh_identical": _same_everywhere(list(fresh_model.parameters()) +
                                                [fresh.state[p]["exp_avg"] for p in fresh_model.parameters()],
                                                "bcast.fresh")}


def case_clipping(arrays, comp):
    rank = hvd.rank()
    model = _mlp(16, 8)
    named = list(model.named_parameters())
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named,
                                   compression=_compression(comp))
    exact_update, norms = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(3):
            loss = model(_data(rank, t, 4, 16)).pow(2).sum()
            grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)
            for (n, _), g in zip(named, grads):
                arrays[f"g/{t}/{n}"] = g.numpy()
            loss.backward()
            opt.synchronize()
            for n, p in named:
                arrays[f"out/{t}/{n}"] = p.grad.numpy().copy()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            norms.append(float(torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
            before = [(p.detach().clone(), p.grad.clone()) for p in model.parameters()]
            with opt.skip_synchronize():
                opt.step()
            exact_update.append(all(torch.equal(p.detach(), b.add(g, alpha=-0.1))
                                    for p, (b, g) in zip(model.parameters(), before)))
            opt.zero_grad()
        quiet = [str(c.message) for c in caught]
        # Horovod's warning: step() right after synchronize() without skip_synchronize()
        model(_data(rank, 5, 4, 16)).pow(2).sum().backward()
        opt.synchronize()
        opt.step()
        opt.zero_grad()
        loud = [str(c.message) for c in caught][len(quiet):]
    return {"shapes": {n: list(p.shape) for n, p in named}, "norms": norms, "exact_update": exact_update,
            "quiet": quiet, "loud": loud, "identical": _same_everywhere(list(model.parameters()), "clip.digest")}


def case_dynamic_requires_grad(arrays, comp):
    rank = hvd.rank()
    model = _mlp(16, 8, 4)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))
    frozen_at = {1: 0, 2: 2, 4: 0}  # step -> layer index frozen during that step
    moved = {}
    snapshot = {}

    def before_step(t):
        for i in (0, 2):
            for p in model[i].parameters():
                p.requires_grad_(frozen_at.get(t) != i)
        if t > 0:
            moved[t - 1] = {n: float((p.detach() - snapshot[n]).abs().max()) for n, p in model.named_parameters()}
        snapshot.update({n: p.detach().clone() for n, p in model.named_parameters()})

    forward = lambda t: model(_data(rank, t, 4, 16)).pow(2).sum()  # noqa: E731
    shapes = _train_record(model, opt, forward, 5, arrays, before_step=before_step)
    moved[4] = {n: float((p.detach() - snapshot[n]).abs().max()) for n, p in model.named_parameters()}
    for n, r in _residuals(opt).items():
        arrays[f"res/{n}"] = r.numpy()
    return {"shapes": shapes, "moved": {str(k): v for k, v in moved.items()}, "frozen_at": frozen_at,
            "identical": _same_everywhere(list(model.parameters()), "dyn.digest")}


def case_names(arrays, comp):
    model = _mlp(8, 4, 2)
    named = list(model.named_parameters())
    dup = [(("same" if i < 2 else n), p) for i, (n, p) in enumerate(named)]
    return {"duplicate": _error_of(lambda: hat.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=dup, compression=_compression(comp))),
            "missing": _error_of(lambda: hat.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named[1:],
                compression=_compression(comp)))}


# --- 4: settings that differ between ranks (run together in one job, under a short timeout) ------------------

def mismatches(args, outdir):
    rank = hvd.rank()
    out = {}
    comp = lambda: hat.Compression.adtopk(ratio=0.1, min_numel=1)  # noqa: E731
    settings = {"groups": [{"groups": None}, {"groups": 1}],
                "partial_sparsification": [{"partial_sparsification": True}, {}],
                "profile_rounds": [{"partial_sparsification": True, "profile_rounds": 3},
                                   {"partial_sparsification": True, "profile_rounds": 4}],
                "all_frozen": [{}, {}]}
    for label, per_rank in settings.items():
        model = _mlp(16, 8, 4)
        if label == "all_frozen" and rank == 1:
            for p in model.parameters():
                p.requires_grad_(False)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=comp(),
                                       **per_rank[rank])

        def go():
            for t in range(2):
                loss = model(_data(rank, t, 4, 16)).pow(2).sum()
                if loss.requires_grad:
                    loss.backward()
                opt.step()
                opt.zero_grad()
        out[label] = _error_of(go)
    return out


# --- 5: hvd.join() -----------------------------------------------------------------------------------------

def join_case(args, outdir):
    """Rank 1 trains ``args["early"]`` steps then calls hvd.join(); rank 0 trains ``args["steps"]``, then joins."""
    rank = hvd.rank()
    out = {}
    for comp in args["compressors"]:
        label = comp if isinstance(comp, str) else comp[0]
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 16).double()
        named = list(model.named_parameters())
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=named,
                                       compression=_compression(comp))
        arrays, res = {}, {"steps": 0}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for t in range(args["steps"] if rank == 0 else args["early"]):
                    for n, r in _residuals(opt).items():
                        arrays[f"res/{t}/{n}"] = r.numpy()
                    loss = model(_data(rank, t, 4, 64)).pow(2).sum()
                    for (n, _), g in zip(named, torch.autograd.grad(loss, [p for _, p in named], retain_graph=True)):
                        arrays[f"g/{t}/{n}"] = g.numpy()
                    loss.backward()
                    opt.step()
                    for n, p in named:
                        arrays[f"out/{t}/{n}"] = p.grad.numpy().copy()
                    opt.zero_grad()
                    res["steps"] += 1
                res["last_joined"] = hvd.join()
            res["warnings"] = [str(c.message) for c in caught]
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
            out[label] = res
            break
        out[label] = res
        np.savez(Path(outdir, f"join_{label}_rank{rank}.npz"), **arrays)
    return out


# --- process sets --------------------------------------------------------------------------------------------

def process_set_cases(args, outdir):
    """Ranks {0, 1} of 3 train through the hooks in a process set; rank 2 builds the optimizer too."""
    ps = hvd.add_process_set([0, 1])
    rank = hvd.rank()
    out = {}
    for label, comp in args["compressors"].items():
        model = _mlp(32, 16, 8)
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), compression=_compression(comp),
                                       process_set=ps)
        arrays = {}
        shapes = _train_record(model, opt, lambda t: model(_data(rank, t, 4, 32)).pow(2).sum(), 3, arrays)
        np.savez(Path(outdir, f"ps_{label}_rank{rank}.npz"), **arrays)
        out[label] = {"shapes": shapes}
    hvd.remove_process_set(ps)
    return out


# --- issue 21: Horovod's sparse-embedding scenario without sparse_as_dense, the monkeypatch, channels_last ------

def _uneven_lookups(rank, t):
    """Horovod's test_sparse_embeddings inputs (a different number of indices per rank), varied per step."""
    base = torch.LongTensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if rank == 0 else torch.LongTensor([[1, 3, 4], [4, 7, 9]])
    return (base + t) % 10


def case_sparse_grad_like_stock(arrays, comp, sparse_as_dense):
    """nn.Embedding(sparse=True) + SparseAdam through stock hvd.DistributedOptimizer and through ours: per step
    the local sparse gradient, the aggregate (must stay sparse) and the parameters, for both."""
    rank = hvd.rank()
    out = {}
    for how in ("stock", "ours"):
        torch.manual_seed(11)
        model = torch.nn.Embedding(10, 3, sparse=True).double()
        base = torch.optim.SparseAdam(model.parameters(), lr=0.1)
        kwargs = dict(named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
        opt = (hvd.DistributedOptimizer(base, **kwargs) if how == "stock" else
               hat.DistributedOptimizer(base, compression=_compression(comp), **kwargs))
        sparse_after = []
        for t in range(3):
            opt.zero_grad()
            # The local gradient, taken where no hook fires (autograd.grad skips the accumulator): once
            # backward() has run, p.grad may already be the buffer the background allreduce writes into, and
            # a copy of it read there was half averaged on one CI run.
            loss = model(_uneven_lookups(rank, t)).pow(2).sum()
            (local,) = torch.autograd.grad(loss, model.weight, retain_graph=True)
            arrays[f"{how}/g/{t}"] = local.to_dense().numpy().copy()
            loss.backward()
            opt.synchronize()
            sparse_after.append(bool(model.weight.grad.is_sparse))
            arrays[f"{how}/out/{t}"] = model.weight.grad.to_dense().numpy().copy()
            with opt.skip_synchronize():
                opt.step()
        arrays[f"{how}/final"] = model.weight.detach().numpy().copy()
        out[how] = {"sparse_after": sparse_after, "final": _digest([model.weight])}
        if how == "ours":
            out["stats"] = {n: t["path"] for n, t in opt.stats()["tensors"].items()}
            out["bytes_sent"] = opt.stats()["bytes_sent"]
    return out


def case_monkeypatch_broadcast_state(arrays, comp):
    """``hvd.DistributedOptimizer = hat.DistributedOptimizer``; rank 0 alone loads a checkpoint (has optimizer
    state), the others start fresh; hvd.broadcast_optimizer_state must finish on every rank (it used to call our
    step() on the fresh ranks only: a collective the others never joined)."""
    rank = hvd.rank()
    original = hvd.DistributedOptimizer
    hvd.DistributedOptimizer = hat.DistributedOptimizer
    try:
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double()
        if rank == 0:  # a checkpoint of a previous (single-process) run: Adam state for every parameter
            warm = torch.optim.Adam(model.parameters(), lr=0.01)
            model(_data(0, 0, 8, 16)).pow(2).sum().backward()
            warm.step()
            checkpoint = warm.state_dict()
            model.zero_grad()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(), compression=_compression(comp))
        if rank == 0:
            opt.load_state_dict(checkpoint)
        start = time.time()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        seconds = time.time() - start
        state_digest = _digest([opt.state[p]["exp_avg"] for p in model.parameters()])
        for t in range(3):
            opt.zero_grad()
            model(_data(rank, t + 1, 8, 16)).pow(2).sum().backward()
            opt.step()
        return {"class_module": type(opt).__module__, "is_ours": isinstance(opt, torch.optim.Adam) and
                hasattr(opt, "stats"), "broadcast_seconds": seconds, "state": state_digest,
                "final": _digest(list(model.parameters()))}
    finally:
        hvd.DistributedOptimizer = original


def case_channels_last_broadcast(arrays, comp):
    """A channels_last ResNet-style model: stock hvd.broadcast_parameters refuses it; hat.broadcast_parameters
    makes every rank start from rank 0's weights and keeps the layout; then training stays bitwise identical."""
    from examples.models import ResNetCNN
    rank = hvd.rank()
    torch.manual_seed(100 + rank)  # different initial weights on every rank
    model = ResNetCNN(widths=(8, 16), blocks_per_stage=1).to(memory_format=torch.channels_last)
    conv = [n for n, p in model.named_parameters() if p.dim() == 4]
    mine = _digest([p for p in model.state_dict().values()])
    root = hvd.broadcast_object(mine, root_rank=0, name="cl.root")
    stock_error = _error_of(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0))
    hat.broadcast_parameters(model.state_dict(), root_rank=0)
    after = _digest([p for p in model.state_dict().values()])
    params = dict(model.named_parameters())
    layout_kept = (all(params[n].is_contiguous(memory_format=torch.channels_last) for n in conv)
                   and any(not params[n].is_contiguous() for n in conv))  # most 3x3 convs are not row-major
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=_compression(comp))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 1, 28, 28, generator=gen).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (4,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"mine": mine, "root": root, "after": after, "stock_error": stock_error, "layout_kept": layout_kept,
            "conv_params": len(conv), "final": _digest(list(model.parameters())),  # BN running stats stay local
            "sparse": sorted(n for n, t in opt.stats()["tensors"].items() if t["path"] == "sparse")}
