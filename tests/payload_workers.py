"""Rank workers of tests/test_payload.py: the payload layer (:mod:`horovod_adtopk.payload`) on real ranks, with
its built-in dense kinds and a throwaway int8 kind that lives only here (a new wire kind needs no engine file).

Every rank's inputs are drawn from a numpy generator seeded by (rank, tensor index), so the test recomputes
them; the worker returns what :func:`horovod_adtopk.payload.run` gave and what ``Stats`` counted."""
from __future__ import annotations

import numpy as np
import torch

from horovod_adtopk import payload
from horovod_adtopk.compressors import TensorInfo
from horovod_adtopk.stats import Stats

SHAPES = {"w": (7, 33), "b": (33,), "e": (50, 4)}


def inputs(rank: int) -> dict:
    """This rank's float32 tensors (the test draws the same)."""
    out = {}
    for i, (name, shape) in enumerate(sorted(SHAPES.items())):
        rng = np.random.default_rng(1000 * rank + i)
        out[name] = (rng.standard_normal(shape) * (1 + i)).astype(np.float32)
    return out


class Int8Gather(payload.Kind):
    """Throwaway kind: one float32 scale (max |x| / 127) and int8 codes per tensor, gathered, decoded and summed in
    rank order."""
    prefix = "test.int8"

    def encode(self, item):
        x = item.data.reshape(-1)
        scale = (x.abs().max() / 127).reshape(1)
        codes = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), codes.view(torch.uint8)])

    def finish(self, item, block, received):
        n = item.info.numel
        rows = received.view(self.world, 4 + n)
        total = torch.zeros(n, dtype=torch.float32)
        for r in range(self.world):
            scale = rows[r, :4].clone().view(torch.float32)  # its own storage: aligned for float32
            total += rows[r, 4:].view(torch.int8).to(torch.float32) * scale
        return total.mul_(1.0 / self.world).view(item.info.shape)


def _run(comm, args) -> dict:
    world, rank = comm.size(), comm.rank()
    xs = inputs(rank)
    kinds = {"dense": payload.DenseSum(world, world), "bf16": payload.Bfloat16Gather(world, None),
             "int8": Int8Gather(world)}
    groups = {k: (kind, []) for k, kind in kinds.items()}
    for name in sorted(SHAPES):
        for k in kinds:
            info = TensorInfo(f"{k}.{name}", SHAPES[name], int(np.prod(SHAPES[name])), torch.float32)
            t = torch.from_numpy(xs[name].copy())
            groups[k][1].append(payload.Item(info.name, info, t))
    stats = Stats()
    out = payload.run(comm, stats, list(groups.values()))
    tensors = stats.as_dict()["tensors"]
    return {"world": world, "rank": rank, "out": {n: v.reshape(-1).tolist() for n, v in out.items()},
            "traffic": {n: [t["bytes_sent"], t["wire_bytes_sent"], t["wire_bytes_received"]]
                        for n, t in tensors.items()}}


def ddp_kinds(args, outdir):
    from horovod_adtopk.ddp.communicator import ProcessGroupComm
    return _run(ProcessGroupComm(), args)


def horovod_kinds(args, outdir):
    from horovod_adtopk.communicator import Communicator
    return _run(Communicator(), args)
