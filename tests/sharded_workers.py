"""Rank workers of tests/test_sharded.py: the per-step owner-sharded exchange of ``hat.DistributedOptimizer``
(Horovod). The model and data are those of tests/local_steps_workers.py (float64 least squares), whose
gradients the numpy model in the test recomputes."""
from __future__ import annotations

import io

import torch

import horovod_adtopk as hat
from tests.local_steps_workers import batch, digest, least_squares, linear_model

LR = 0.1


def _opt(model, case):
    import horovod.torch as hvd
    c = hat.Compression.adtopk(ratio=case["ratio"], axis=case["axis"], min_numel=0, hybrid=False)
    return hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters(),
                                    compression=c, op=hvd.Average, exchange=case.get("exchange", "sharded"),
                                    warmup_steps=case.get("warmup", 0))


def _run(model, opt, rank, first, last, comm=None, log=None):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad()
        least_squares(model, x, y).backward()
        before = comm.collectives if comm is not None else 0
        opt.step()
        if log is not None:
            log.append(comm.collectives - before)


def steps(args, outdir):
    """Every case: train ``steps`` steps; the final parameters, residuals, owner residuals, wire bytes; then a
    gathered checkpoint written mid-run restores every rank bitwise."""
    import horovod.torch as hvd
    out = []
    for case in args["cases"]:
        model = linear_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = _opt(model, case)
        collectives = []
        _run(model, opt, hvd.rank(), 0, case["steps"], opt._comm, collectives)
        entry = next(iter(opt.state_dict()["horovod_adtopk"]["ranks"].values()))
        st = opt.stats()
        out.append({"initial_seed": 0, "final": {n: p.detach().numpy().tolist() for n, p in model.named_parameters()},
                    "residuals": {n: t.numpy().tolist() for n, t in entry["memory"].get("residuals", {}).items()},
                    "owner": {n: t.numpy().tolist() for n, t in entry.get("owner", {}).items()},
                    "paths": {n: t["path"] for n, t in st["tensors"].items()},
                    "wire": {n: [t["wire_bytes_sent"], t["wire_bytes_received"]] for n, t in st["tensors"].items()},
                    "digest": digest(model), "collectives": collectives})
    # resume: stop after 3 steps, one gathered checkpoint restores every rank, continue to 8: bitwise
    case = args["cases"][0]
    model = linear_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _opt(model, case)
    _run(model, opt, hvd.rank(), 0, 8)
    straight = digest(model)
    model = linear_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _opt(model, case)
    _run(model, opt, hvd.rank(), 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.gather_state_dict()}, buf)
    saved = hvd.broadcast_object(buf.getvalue() if hvd.rank() == 0 else None, root_rank=0, name="ckpt")
    ckpt = torch.load(io.BytesIO(saved), weights_only=True)
    model = linear_model()
    opt = _opt(model, case)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _run(model, opt, hvd.rank(), 3, 8)
    return {"cases": out, "straight": straight, "resumed": digest(model)}


def ddp_steps(args, outdir):
    """The same cases through the DDP hook (hat.ddp.register(..., exchange=...)), then a gathered state resumed
    at the same world size: bitwise."""
    import torch.distributed as dist
    rank = dist.get_rank()

    def build(case):
        model = linear_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        c = hat.Compression.adtopk(ratio=case["ratio"], axis=case["axis"], min_numel=0, hybrid=False)
        st = hat.ddp.register(ddp, compression=c, warmup_steps=case.get("warmup", 0),
                              exchange=case.get("exchange", "sharded"))
        return model, ddp, st, torch.optim.SGD(model.parameters(), lr=LR)

    def run(model, ddp, opt, first, last):
        for step in range(first, last):
            x, y = batch(rank, step)
            opt.zero_grad()
            least_squares(ddp, x, y).backward()
            opt.step()

    out = []
    for case in args["cases"]:
        model, ddp, st, opt = build(case)
        run(model, ddp, opt, 0, case["steps"])
        entry = next(iter(st.state_dict()["ranks"].values()))
        stats = st.stats()
        out.append({"final": {n: p.detach().numpy().tolist() for n, p in model.named_parameters()},
                    "residuals": {n: t.numpy().tolist() for n, t in entry["memory"].get("residuals", {}).items()},
                    "owner": {n: t.numpy().tolist() for n, t in entry.get("owner", {}).items()},
                    "paths": {n: t["path"] for n, t in stats["tensors"].items()},
                    "wire": {n: [t["wire_bytes_sent"], t["wire_bytes_received"]] for n, t in stats["tensors"].items()},
                    "digest": digest(model)})
    case = args["cases"][0]
    model, ddp, st, opt = build(case)
    run(model, ddp, opt, 0, 8)
    straight = digest(model)
    model, ddp, st, opt = build(case)
    run(model, ddp, opt, 0, 3)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
             "hat": st.gather_state_dict()}
    model, ddp, st, opt = build(case)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    st.load_state_dict(saved["hat"])
    run(model, ddp, opt, 3, 8)
    return {"cases": out, "straight": straight, "resumed": digest(model)}


def join_and_mismatch(args, outdir):
    """Rank 2 runs out of data after 2 steps and calls hvd.join(): the others' later rounds travel dense over
    the active members (per-step and local steps, both sharded), nothing hangs. Then ranks that disagree on
    the exchange all raise at the first step."""
    import horovod.torch as hvd
    rank, out = hvd.rank(), {}
    for kind in ("per_step", "local_steps"):
        model = linear_model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        c = hat.Compression.adtopk(ratio=0.25, axis=1, min_numel=0, hybrid=False)
        base = torch.optim.SGD(model.parameters(), lr=LR)
        opt = (hat.DistributedOptimizer(base, model.named_parameters(), compression=c, exchange="sharded")
               if kind == "per_step" else
               hat.DistributedOptimizer(base, model.named_parameters(), compression=c, sync_every=2,
                                        outer=hat.Outer.sgd(1.0, exchange="sharded")))
        steps = 2 if rank == 2 else 6
        for step in range(steps):
            x, y = batch(rank, step)
            opt.zero_grad()
            least_squares(model, x, y).backward()
            opt.step()
        hvd.join()
        st = opt.stats()
        out[kind] = {"paths": {n: t["path"] for n, t in st["tensors"].items()}, "digest": digest(model)}
    model = linear_model()
    c = hat.Compression.adtopk(ratio=0.25, axis=1, min_numel=0, hybrid=False)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(),
                                   compression=c, exchange="sharded" if rank == 0 else "allgather")
    try:
        x, y = batch(rank, 0)
        least_squares(model, x, y).backward()
        opt.step()
        out["mismatch"] = None
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out
