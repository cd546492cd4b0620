"""Rank-side scenarios of the hierarchical exchange (run by tests/test_hierarchical.py through the harness).

Run with two host names for this machine (``horovodrun -H localhost:2,127.0.0.1:2``): Horovod then sees
2 hosts x 2 ranks (``local_size`` 2, ``cross_size`` 2) and builds real process sets, while every process
runs here.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

import horovod_adtopk as hat
from tests.workers import SmallCNN, feed_case, params_digest


def _done() -> None:
    """A global collective before returning: no rank leaves while another host's ranks still exchange."""
    hvd.allreduce(torch.zeros(1), name="hier.done", op=hvd.Sum)


def _layout() -> dict:
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size()}


def hier_cases(args, outdir):
    """Known gradients through hierarchical=True; record outputs, block memory and stats per case."""
    rank = hvd.rank()
    summary = []
    for ci, case in enumerate(args["cases"]):
        opt, arrays = feed_case(ci, case, hierarchical=case.get("hierarchical", True))
        entry = opt.state_dict()["horovod_adtopk"]["ranks"][rank]
        blocks = entry["hierarchical"]["blocks"]
        for key, res in entry["hierarchical"]["memory"]["residuals"].items():
            name = key.split("@", 1)[0]
            arrays[f"res/{name.split('.', 1)[1]}"] = res.numpy()
            arrays[f"block/{name.split('.', 1)[1]}"] = np.array(blocks[name])
        for key, res in entry["memory"].get("residuals", {}).items():
            arrays[f"flatres/{key.split('.', 1)[1]}"] = res.numpy()
        np.savez(Path(outdir, f"case{ci}_rank{rank}.npz"), **arrays)
        st = opt.stats()
        summary.append({"paths": {n.split(".", 1)[1]: v["path"] for n, v in st["tensors"].items()},
                        "wire": {n.split(".", 1)[1]: [v["wire_bytes_sent"], v["wire_bytes_received"]]
                                 for n, v in st["tensors"].items()},
                        "hierarchical": {k: v for k, v in st["hierarchical"].items() if k != "blocks"}})
    _done()
    return {"layout": _layout(), "cases": summary}


class TwoLayer(torch.nn.Module):
    """Two weight matrices and two biases: few collectives per step, so the 60 steps on 4 ranks stay short."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _train(model, opt, steps, start=0):
    gen_base = 1000 * hvd.rank()
    image = isinstance(model, SmallCNN)
    for step in range(start, steps):
        g = torch.Generator().manual_seed(gen_base + step)
        x = torch.randn(16, 1, 28, 28, generator=g) if image else torch.randn(16, 64, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _make(compressor: str, ratio: float, hierarchical, small: bool = False):
    torch.manual_seed(0)
    model = TwoLayer() if small else SmallCNN()
    comp = hat.Compression.get(compressor, ratio=ratio, min_numel=0)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   hierarchical=hierarchical)
    return model, opt


def hier_consistency(args, outdir):
    """Train a two-layer MLP ``steps`` steps with hierarchical=True on rank-specific data: parameter digests (all
    ranks must agree); a gather_state_dict checkpoint at ``resume_at`` is reloaded into a fresh model and
    optimizer, which must continue bitwise identically."""
    steps, resume_at = args["steps"], args["resume_at"]
    model, opt = _make(args["compressor"], args["ratio"], True, small=True)
    _train(model, opt, resume_at)
    ckpt = {"model": model.state_dict(), "opt": opt.gather_state_dict()}
    if hvd.rank() == 0:
        torch.save(ckpt, Path(args["checkpoint"]))
    _train(model, opt, steps, resume_at)
    final = params_digest(model)
    model2, opt2 = _make(args["compressor"], args["ratio"], True, small=True)
    loaded = torch.load(Path(args["checkpoint"]), weights_only=True) if hvd.rank() == 0 else None
    loaded = hvd.broadcast_object(loaded, root_rank=0, name="hier.ckpt")
    model2.load_state_dict(loaded["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(loaded["opt"])
    _train(model2, opt2, steps, resume_at)
    st = opt.stats()
    _done()
    return {"layout": _layout(), "digest": final, "resumed_digest": params_digest(model2),
            "warnings": [str(w.message) for w in caught], "paths": {n: v["path"] for n, v in st["tensors"].items()},
            "hierarchical": {k: v for k, v in st["hierarchical"].items() if k != "blocks"}}


def hier_fallback(args, outdir):
    """hierarchical=True on a layout where it cannot apply: trains flat, says why; optionally loads a
    checkpoint written on the 2 x 2 layout (its block memory must be dropped with a warning)."""
    model, opt = _make("adtopk", 0.05, args.get("setting", True), small=True)
    caught = []
    if args.get("checkpoint"):
        loaded = torch.load(Path(args["checkpoint"]), weights_only=True)
        model.load_state_dict(loaded["model"])
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            opt.load_state_dict(loaded["opt"])
        caught = [str(w.message) for w in got]
    _train(model, opt, 5)
    st = opt.stats()
    _done()
    return {"layout": _layout(), "digest": params_digest(model), "warnings": caught,
            "paths": {n: v["path"] for n, v in st["tensors"].items()},
            "hierarchical": {k: v for k, v in st["hierarchical"].items() if k != "blocks"}}


def hier_no_process_sets(args, outdir):
    """hierarchical=True on 2 x 2 without dynamic process sets: the error every rank raises."""
    try:
        _make("adtopk", 0.05, True)
    except RuntimeError as exc:
        out = {"error": str(exc)}
    else:
        out = {"error": None}
    _done()
    return out
