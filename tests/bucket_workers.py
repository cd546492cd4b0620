"""Rank functions of tests/test_bucket_select.py's Horovod runs (``tests.harness.launch("bucket_workers:...")``).

The same job runs once per ``HOROVOD_ADTOPK_BUCKET_SELECT`` mode; the test compares the modes' files bit for bit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import horovod.torch as hvd

import horovod_adtopk as hat
from horovod_adtopk import bucket_select, exchange

from tests.cases import case_compression
from tests.workers import reference_cases


class Net(torch.nn.Module):
    """Several ADTopk layers (a conv, rows and columns of linears), 1-D biases (the dense path)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 6, 3)
        self.fc1 = torch.nn.Linear(6 * 4 * 4, 40)
        self.fc2 = torch.nn.Linear(40, 24)
        self.fc3 = torch.nn.Linear(24, 5)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def train(args, outdir):
    """Per spec: train Net with hat.DistributedOptimizer through its gradient hooks; every step's averaged
    gradients (``out/t/name``) and this rank's residuals after it (``res/t/name``) to ``spec<i>_rank<r>.npz``."""
    rank = hvd.rank()
    summary, groups = [], []  # groups: select_bucket calls per spec
    for si, spec in enumerate(args["specs"]):
        exchange.GROUP_CAP_BYTES = spec.get("cap", 25 * 1024 * 1024)  # small caps: groups fill in the hooks
        torch.manual_seed(0)
        model = Net()
        named = [(f"s{si}.{n}", p) for n, p in model.named_parameters()]
        opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=named,
                                       compression=case_compression(spec),
                                       backward_passes_per_step=spec.get("bpps", 1),
                                       warmup_steps=spec.get("warmup_steps", 0),
                                       exchange=spec.get("exchange", "allgather"))
        gen = torch.Generator().manual_seed(10 + rank)
        arrays = {}
        for t in range(spec["steps"]):
            for _ in range(spec.get("bpps", 1)):
                x = torch.randn(8, 2, 6, 6, generator=gen)
                y = torch.randint(0, 5, (8,), generator=gen)
                torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.synchronize()
            for n, p in model.named_parameters():
                arrays[f"out/{t}/{n}"] = p.grad.numpy().copy()
            mem = opt.state_dict()["horovod_adtopk"]["ranks"][rank]["memory"]
            for n, r in (mem.get("residuals") or {}).items():
                arrays[f"res/{t}/{n.split('.', 1)[1]}"] = r.numpy().copy()
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
        np.savez(Path(outdir, f"spec{si}_rank{rank}.npz"), **arrays)
        st = opt.stats()
        summary.append({"bytes_sent": st["bytes_sent"], "elements_sent": st["elements_sent"],
                        "paths": {n: v["path"] for n, v in st["tensors"].items()},
                        "sharded": sorted(opt._sender.shard_plans)})
        groups.append(opt._sender.group_selections)
    return {"train": summary, "cases": reference_cases({"cases": args["cases"]}, outdir) if args["cases"] else [],
            "groups": groups, "fused_launches": sum(p.launches for p in bucket_select._PLANS.values())}
