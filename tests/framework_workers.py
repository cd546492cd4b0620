"""The reference the framework recipes are checked against: the same training as plain DDP + ``hat.ddp.register``.

Run by ``tests._ddp_launch`` (``framework_workers:plain_reference``). The framework examples
(``examples/frameworks/*.py``) train ``Sequential(Linear(32, 256), ReLU, Linear(256, 4))`` on 64 fixed
samples, batch 4 per rank, SGD(lr=0.1, momentum=0.9), accumulating ``accumulate`` micro-batches per step
with the loss divided by ``accumulate`` (exact for a power of two), the non-final micro-batches under
``no_sync()``. This worker does the same by hand, sharding the data the way the framework does:

- ``"sample"``: ``DistributedSampler(shuffle=False)`` (Ray Train's ``prepare_data_loader`` of an unshuffled
  loader): rank r gets samples r, r+W, ...;
- ``"shuffled"``: ``DistributedSampler(shuffle=True, seed=0)`` with ``set_epoch(epoch)`` (Lightning, which
  always shuffles the training data): rank r gets ``randperm(n, seed + epoch)[r::W]``;
- ``"batch"``: Accelerate's (and so the Trainer's) dataloader sharding: rank r gets batches r, r+W, ... of the
  unsharded loader.

Its digests (parameters, this rank's residuals) and round count are what a correct integration must end
with, bitwise: one round per optimizer step, error feedback fed the accumulated gradient.
"""
from __future__ import annotations

import hashlib
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_adtopk as hat


def toy_data(n: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))

    def forward(self, x):
        return self.net(x)


def shard(n: int, batch: int, rank: int, world: int, sharding: str, epoch: int) -> list:
    """The index lists of this rank's micro-batches for one epoch (``n`` a multiple of ``world``)."""
    if sharding in ("sample", "shuffled"):
        order = list(range(n))
        if sharding == "shuffled":
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        mine = order[rank::world]
        return [mine[i:i + batch] for i in range(0, len(mine), batch)]
    batches = [list(range(i, min(i + batch, n))) for i in range(0, n, batch)]
    return batches[rank::world]


def digests(params, state) -> dict:
    mem = state.state_dict()["ranks"][dist.get_rank()]["memory"].get("residuals", {})
    return {"params": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest(),
            "residuals": hashlib.sha256(b"".join(mem[n].numpy().tobytes() for n in sorted(mem))).hexdigest(),
            **{k: state.stats()[k] for k in ("round", "bytes_sent", "bytes_dense")}}


def plain_reference(args, outdir):
    """For each run in ``args["runs"]`` ({sharding, epochs, accumulate, ratio}): the digests after training."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = toy_data()
    out = {}
    for run in args["runs"]:
        torch.manual_seed(0)
        module = Net()
        model = DDP(module)
        state = hat.ddp.register(model, hat.Compression.adtopk(ratio=run["ratio"]))
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        acc = run["accumulate"]
        for epoch in range(run["epochs"]):
            micro = shard(len(x), 4, rank, world, run["sharding"], epoch)
            for start in range(0, len(micro), acc):
                group = micro[start:start + acc]
                for m, idx in enumerate(group):
                    with model.no_sync() if m + 1 < len(group) else nullcontext():
                        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx]) / acc
                        loss.backward()
                opt.step()
                opt.zero_grad()
        out[run["name"]] = digests(module.parameters(), state)
    return out


def horovod_reference(args, outdir):
    """Horovod side: the RayExecutor example's ``train`` run under ``horovodrun`` (tests.harness.run_ranks)."""
    from tests.harness import example_module

    train = example_module("frameworks/horovod_ray").train
    return train(args["ratio"], args["steps"], args["accumulate"])
