"""Rank workers of tests/test_local_steps.py (issue 29: local steps with an outer exchange), both engines.

Horovod workers run under ``tests.harness.run_ranks("local_steps_workers:<name>")``; DDP workers under
``tests._ddp_launch`` (``local_steps_workers:ddp_<name>``). The model is a float64 least-squares linear
layer whose gradients the numpy reference (in the test module) recomputes from the same data.
"""
from __future__ import annotations

import functools
import hashlib
import io

import numpy as np
import torch
import torch.nn.functional as F

import horovod_adtopk as hat

IN, OUT, BATCH = 24, 16, 8


def batch(rank: int, step: int):
    """Rank ``rank``'s data of global step ``step`` (the numpy reference draws the same)."""
    rs = np.random.RandomState(1000 * rank + step + 1)
    return torch.from_numpy(rs.standard_normal((BATCH, IN))), torch.from_numpy(rs.standard_normal((BATCH, OUT)))


def least_squares(model, x, y):
    """``0.5 * mean_i ||W x_i + b - y_i||^2``."""
    return 0.5 * ((model(x) - y) ** 2).sum(1).mean()


def linear_model():
    torch.manual_seed(0)
    return torch.nn.Linear(IN, OUT).double()


def digest(model) -> str:
    h = hashlib.sha256()
    for _, t in sorted(model.state_dict().items()):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def compression_of(case):
    kind = case.get("compressor", "none")
    if kind == "none":
        return None
    return hat.Compression.get(kind, **case.get("kwargs", {}))


def outer_of(case):
    o = case["outer"]
    low_bit = {"feedback_decay": o.get("feedback_decay", 1.0), "value_bits": o.get("value_bits"),
               "value_group": o.get("value_group")}
    low_bit["exchange"] = o.get("exchange", "auto")
    if o.get("optimizer") == "adam":  # Outer.custom: any torch.optim optimizer as the outer step
        return hat.Outer.custom(functools.partial(torch.optim.Adam, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"]),
                                **low_bit)
    return (hat.Outer.nesterov(o["lr"], o["momentum"], **low_bit) if o.get("nesterov")
            else hat.Outer.sgd(o["lr"], **low_bit))


def _params(model) -> dict:
    return {n: p.detach().cpu().numpy().tolist() for n, p in model.named_parameters()}


def train_case(case, rank, model, opt, comm):
    """Run ``case["steps"]`` inner steps; record what the test checks."""
    lr = case["inner_lr"]
    out = {"initial": _params(model), "digests": [], "collectives": [], "delta_sum": None}
    delta_sum = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    H = case["sync_every"]
    for step in range(case["steps"]):
        x, y = batch(rank, step)
        opt.zero_grad()
        least_squares(model, x, y).backward()
        before = comm.collectives
        if (step + 1) % H == 0:  # the pseudo-gradient of this sync, recomputed as SGD would step (same ops)
            for n, p in model.named_parameters():
                delta_sum[n] += theta[n] - p.detach().add(p.grad, alpha=-lr)
        opt.step()
        out["collectives"].append(comm.collectives - before)
        if (step + 1) % H == 0:
            out["digests"].append(digest(model))
            theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    if case.get("final_sync"):  # a last, shorter interval: sync_now() exchanges it (once: a second call is a no-op)
        for n, p in model.named_parameters():
            delta_sum[n] += theta[n] - p.detach()
        before = comm.collectives
        average = case["final_sync"] == "average"
        out["final_sync"] = [opt.sync_now(average=average), comm.collectives - before]
        out["digests"].append(digest(model))
        before = comm.collectives
        out["final_sync"] += [opt.sync_now(average=average), comm.collectives - before]
    sd = opt.state_dict()["horovod_adtopk"]
    entry = next(iter(sd["ranks"].values()))
    out["residuals"] = {n: t.numpy().tolist() for n, t in entry["memory"].get("residuals", {}).items()}
    out["owner"] = {n: t.numpy().tolist() for n, t in entry.get("owner", {}).items()}
    out["final"] = _params(model)
    out["delta_sum"] = {n: t.numpy().tolist() for n, t in delta_sum.items()}
    out["stats"] = {k: v for k, v in opt.stats().items() if k in ("bytes_sent", "bytes_dense", "steps", "round", "wire_bytes_sent",
                                                         "wire_bytes_received", "wire_bytes_dense")}
    out["memory_bytes"] = opt.stats()["local_steps"]["memory_bytes"]
    return out


# --- Horovod ---------------------------------------------------------------------------------------------------

def _hvd_opt(model, case, **extra):
    import horovod.torch as hvd
    base = torch.optim.SGD(model.parameters(), lr=case["inner_lr"])
    compression = compression_of(case) or hat.Compression.none
    return hat.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=compression,
                                    sync_every=case["sync_every"], outer=outer_of(case),
                                    warmup_steps=case.get("warmup", 0), op=hvd.Average, **extra)


def reference_cases(args, outdir):
    """Every case of ``args["cases"]`` on a fresh model; the numpy reference checks the results."""
    import horovod.torch as hvd
    results = []
    for case in args["cases"]:
        model = linear_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = _hvd_opt(model, case)
        results.append(train_case(case, hvd.rank(), model, opt, opt._local.comm))
    return results


def mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.Tanh(), torch.nn.Linear(32, OUT))


def _mlp_run(model, opt, rank, first, last):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad()
        F.mse_loss(model(x.float()), y.float()).backward()
        opt.step()


def equivalence(args, outdir):
    """sync_every=1 + Outer.sgd(1) + dense against plain hat.DistributedOptimizer with Compression.none."""
    import horovod.torch as hvd
    finals = []
    for local in (False, True):
        model = mlp()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        kw = {"sync_every": 1, "outer": hat.Outer.sgd(1.0)} if local else {}
        opt = hat.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=hat.Compression.none, **kw)
        _mlp_run(model, opt, hvd.rank(), 0, args["steps"])
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"max_abs_diff": float((finals[0] - finals[1]).abs().max()), "scale": float(finals[0].abs().max())}


def _resumable(spec):
    model = mlp()
    base = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, base


def resume(args, outdir):
    """Stop in the middle of an interval, restore from one gather_state_dict file, continue: bitwise the same."""
    import horovod.torch as hvd
    H, total, stop = args["sync_every"], args["steps"], args["stop"]
    outer = hat.Outer.nesterov(0.7, 0.9, exchange=args.get("exchange", "auto"))
    if args.get("outer") == "adam":  # Outer.custom: Adam's moments and step count, and a changed learning rate
        outer = hat.Outer.custom(functools.partial(torch.optim.Adam, lr=0.01), exchange=args.get("exchange", "auto"))
    kw = dict(sync_every=H, outer=outer, warmup_steps=1,
              compression=hat.Compression.adtopk(ratio=0.1, min_numel=0, hybrid=False))

    def build():
        model, base = _resumable(args)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hat.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kw)
        if args.get("outer") == "adam":  # as a schedule would; the resumed run gets it from the checkpoint
            opt.outer_optimizer().param_groups[0]["lr"] = 0.02
        return model, opt

    model, opt = build()
    _mlp_run(model, opt, hvd.rank(), 0, total)
    straight = digest(model)

    model, opt = build()
    _mlp_run(model, opt, hvd.rank(), 0, stop)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.gather_state_dict()}, buf)  # every rank, one file each
    saved = buf.getvalue() if hvd.rank() == 0 else None
    saved = hvd.broadcast_object(saved, root_rank=0, name="ckpt")  # rank 0's file restores every rank
    ckpt = torch.load(io.BytesIO(saved), weights_only=True)
    model, base = _resumable(args)
    opt = hat.DistributedOptimizer(base, named_parameters=model.named_parameters(), **kw)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    step_in_interval = opt._local.step
    _mlp_run(model, opt, hvd.rank(), stop, total)
    return {"straight": straight, "resumed": digest(model), "step_in_interval": step_in_interval,
            "owner_tensors": len(opt._local.owner), "paths": sorted({t["path"] for t in opt.stats()["tensors"].values()})}


def errors(args, outdir):
    """Bad settings raise clear errors; ranks that disagree on sync_every all raise at the first step."""
    import horovod.torch as hvd
    out = {}
    model = linear_model()
    base = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    named = lambda: model.named_parameters()  # noqa: E731
    bad = {
        "sync_every_0": lambda: hat.DistributedOptimizer(base(), named(), sync_every=0),
        "sync_every_float": lambda: hat.DistributedOptimizer(base(), named(), sync_every=2.0),
        "outer_lr_0": lambda: hat.Outer.sgd(0.0),
        "custom_not_callable": lambda: hat.Outer.custom(0.7),
        "custom_not_optimizer": lambda: hat.Outer.custom(lambda params: params),
        "outer_lr_neg": lambda: hat.Outer.nesterov(lr=-1.0),
        "momentum_1": lambda: hat.Outer.nesterov(0.7, 1.0),
        "momentum_neg": lambda: hat.Outer.momentum_sgd(0.7, -0.1),
        "outer_not_outer": lambda: hat.DistributedOptimizer(base(), named(), sync_every=2, outer=0.7),
        "outer_without_sync": lambda: hat.DistributedOptimizer(base(), named(), outer=hat.Outer.sgd(1.0)),
        "backward_passes": lambda: hat.DistributedOptimizer(base(), named(), backward_passes_per_step=2, sync_every=2),
        "hierarchical": lambda: hat.DistributedOptimizer(base(), named(), sync_every=2, hierarchical=True),
        "overlap": lambda: hat.DistributedOptimizer(base(), named(), sync_every=2, overlap=True),
        "op_sum": lambda: hat.DistributedOptimizer(base(), named(), op=hvd.Sum, sync_every=2),
        "variable_count": lambda: hat.DistributedOptimizer(base(), named(), sync_every=2,
                                                           compression=hat.Compression.dgc(ratio=0.01)),
        "powersgd": lambda: hat.DistributedOptimizer(base(), named(), sync_every=2,
                                                     compression=hat.Compression.powersgd(rank=1)),
    }
    for key, make in bad.items():
        try:
            make()
            out[key] = None
        except (ValueError, TypeError) as exc:
            out[key] = str(exc)
    # a checkpoint of other settings is refused
    opt = hat.DistributedOptimizer(base(), named(), sync_every=2, outer=hat.Outer.sgd(1.0))
    other = hat.DistributedOptimizer(base(), named(), sync_every=3, outer=hat.Outer.sgd(1.0))
    try:
        other.load_state_dict(opt.state_dict())
        out["resume_other_settings"] = None
    except ValueError as exc:
        out["resume_other_settings"] = str(exc)
    # ranks that disagree
    opt = hat.DistributedOptimizer(base(), named(), sync_every=2 + hvd.rank(), outer=hat.Outer.sgd(1.0))
    x, y = batch(0, 0)
    least_squares(model, x, y).backward()
    try:
        opt.step()
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def reset_interval(args, outdir):
    """reset_compression_state() mid-interval (an elastic reset): residuals, momentum and the interval are
    dropped; after the re-broadcast the next interval starts from rank 0's parameters, ranks identical."""
    import horovod.torch as hvd
    model = linear_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.1, **{"min_numel": 0, "hybrid": False}),
                                   sync_every=2, outer=hat.Outer.nesterov(0.7, 0.9))
    run = lambda first, last: [(opt.zero_grad(), least_squares(model, *batch(hvd.rank(), s)).backward(), opt.step())
                               for s in range(first, last)]  # noqa: E731
    run(0, 5)
    held = opt.stats()["local_steps"]["memory_bytes"]
    opt.reset_compression_state()
    after = opt.stats()["local_steps"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # what Horovod elastic's sync does
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    run(5, 6)
    theta_is_start = all(torch.equal(opt._local.theta[n], start[n]) for n in start)
    run(6, 7)
    return {"held_before": held, "after": after, "theta_is_start": theta_is_start, "digest": digest(model)}


def other_world(args, outdir):
    """A gather_state_dict file written mid-interval at one world size (``args["write"]``), loaded at another
    (``args["read"]``): the outer state carries over, the residuals fold into the new world size, the interval
    restarts from the outer parameters, with a warning."""
    import warnings
    import horovod.torch as hvd
    model = linear_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.1, **{"min_numel": 0, "hybrid": False}),
                                   sync_every=3, outer=hat.Outer.nesterov(0.7, 0.9, exchange="sharded"))
    if args.get("write"):
        for s in range(4):  # one sync, then one step into the next interval
            opt.zero_grad()
            least_squares(model, *batch(hvd.rank(), s)).backward()
            opt.step()
        sd = opt.gather_state_dict()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "opt": sd}, args["write"])
        return {"written": True}
    ckpt = torch.load(args["read"], weights_only=True)
    model.load_state_dict(ckpt["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(ckpt["opt"])
    block = ckpt["opt"]["horovod_adtopk"]["local_steps"]
    local = opt._local
    return {"warnings": [str(w.message) for w in caught], "step": local.step, "syncs": local.syncs,
            "params_are_outer": all(torch.equal(p.detach(), block["outer_params"][n]) for n, p in model.named_parameters()),
            "momentum_kept": all(torch.equal(local.momentum[n], t) for n, t in block["momentum"].items()),
            "residuals": len(local.memory.residuals),
            # the owners' residuals of the sharded exchange: written by 2 owners, re-cut among 3
            "owner_written": [ckpt["opt"]["horovod_adtopk"]["ranks"][i]["owner"]["weight"].tolist() for i in range(2)],
            "owner_now": local.owner["weight"].tolist()}


def join_uneven(args, outdir):
    """Rank 1 runs out of data after one interval and calls hvd.join(); rank 0's later syncs average over the
    active members only (Outer.sgd(1): its parameters become its own local ones)."""
    import horovod.torch as hvd
    H, lr = 2, 0.1
    model = linear_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model.named_parameters(),
                                   sync_every=H, outer=hat.Outer.sgd(1.0))
    steps = 2 * H if hvd.rank() == 0 else H
    errors = []
    for step in range(steps):
        x, y = batch(hvd.rank(), step)
        opt.zero_grad()
        least_squares(model, x, y).backward()
        expected = [p.detach().add(p.grad, alpha=-lr) for p in model.parameters()]
        opt.step()
        if step >= H and (step + 1) % H == 0:
            errors.append(max(float((p.detach() - e).abs().max()) for p, e in zip(model.parameters(), expected)))
    last = hvd.join()
    return {"errors_after_join": errors, "last_joined": int(last)}


# --- DDP -------------------------------------------------------------------------------------------------------

def ddp_reference_cases(args, outdir):
    """The reference cases through hat.ddp.local_steps: a DDP-wrapped model (no-communication hook) or the
    plain module (parameters broadcast by local_steps)."""
    import torch.distributed as dist
    results = []
    for case in args["cases"]:
        model = linear_model()
        if dist.get_rank() != 0:  # local_steps (plain) or DDP (wrapped) must broadcast rank 0's parameters
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
        wrapped = torch.nn.parallel.DistributedDataParallel(model) if args["wrap"] else model
        base = torch.optim.SGD(model.parameters(), lr=case["inner_lr"])
        opt = hat.ddp.local_steps(base, wrapped, sync_every=case["sync_every"], outer=outer_of(case),
                                  compression=compression_of(case), warmup_steps=case.get("warmup", 0))
        results.append(train_case(case, dist.get_rank(), wrapped, opt, opt._local.comm))
        if args["wrap"]:  # names without DDP's "module." prefix, as the reference uses
            for key in ("initial", "final", "delta_sum"):
                results[-1][key] = {n.replace("module.", "", 1): v for n, v in results[-1][key].items()}
    return results


def ddp_equivalence(args, outdir):
    """sync_every=1 + Outer.sgd(1) + dense under DDP against plain DDP (its own gradient allreduce)."""
    import torch.distributed as dist
    finals = []
    for local in (False, True):
        model = mlp()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if local:
            opt = hat.ddp.local_steps(opt, ddp, sync_every=1, outer=hat.Outer.sgd(1.0))
        _mlp_run(ddp, opt, dist.get_rank(), 0, args["steps"])
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return {"max_abs_diff": float((finals[0] - finals[1]).abs().max()), "scale": float(finals[0].abs().max())}


def ddp_resume(args, outdir):
    """Mid-interval resume on the DDP engine (plain module), bitwise."""
    import torch.distributed as dist
    H, total, stop = args["sync_every"], args["steps"], args["stop"]
    kw = dict(sync_every=H, outer=hat.Outer.nesterov(0.7, 0.9),
              compression=hat.Compression.topk(ratio=0.05, min_numel=0, hybrid=False))
    rank = dist.get_rank()
    model, base = _resumable(args)
    opt = hat.ddp.local_steps(base, model, **kw)
    _mlp_run(model, opt, rank, 0, total)
    straight = digest(model)
    model, base = _resumable(args)
    opt = hat.ddp.local_steps(base, model, **kw)
    _mlp_run(model, opt, rank, 0, stop)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.gather_state_dict()}, buf)
    box = [buf.getvalue() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt = torch.load(io.BytesIO(box[0]), weights_only=True)
    model, base = _resumable(args)
    opt = hat.ddp.local_steps(base, model, **kw)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _mlp_run(model, opt, rank, stop, total)
    return {"straight": straight, "resumed": digest(model)}


# --- one job per engine and world size (each launch costs seconds on a loaded machine) ----------------------------

def hvd_job(args, outdir):
    """The reference cases; at 2 ranks also the equivalence, the resume, the errors and (last) hvd.join()."""
    out = {"reference": reference_cases(args, outdir)}
    if args.get("other_world"):
        out["other_world"] = other_world(args["other_world"], outdir)
    if args.get("sharded_resume"):  # the owners' residuals in one gathered checkpoint: bitwise as not stopping
        out["resume_sharded"] = resume({"sync_every": 4, "steps": 16, "stop": 6, "exchange": "sharded"}, outdir)
    if args.get("all"):
        out["equivalence"] = equivalence({"steps": 8}, outdir)
        out["resume"] = resume({"sync_every": 4, "steps": 16, "stop": 6}, outdir)
        out["resume_custom"] = resume({"sync_every": 4, "steps": 16, "stop": 6, "outer": "adam"}, outdir)
        out["errors"] = errors({}, outdir)
        out["reset"] = reset_interval({}, outdir)
        out["join"] = join_uneven({}, outdir)
    return out


def ddp_job(args, outdir):
    """The reference cases on a DDP-wrapped model and on the plain module; the equivalence; the resume."""
    out = {"reference": ddp_reference_cases(dict(args, wrap=True), outdir),
           "reference_plain": ddp_reference_cases(dict(args, wrap=False), outdir)}
    if args.get("all"):
        out["equivalence"] = ddp_equivalence({"steps": 8}, outdir)
        out["resume"] = ddp_resume({"sync_every": 4, "steps": 16, "stop": 6}, outdir)
    return out
