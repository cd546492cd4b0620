"""What the framework recipes beside this file share and is not part of any recipe: the toy data set they train
on and ``--report``, the digests of every rank's parameters and residuals that the tests compare with a plain
DDP reference. (Run as scripts, the recipes find this module beside them; ray_train.py keeps its own copy,
since Ray ships its training loop to workers that do not have this folder on their path.)"""
import hashlib
import json

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset


def toy_data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4)


def report(path: str, model: torch.nn.Module, state) -> None:
    """--report: every rank's parameter and residual digests and traffic (``state``: a hat.ddp.CompressionState),
    as JSON from rank 0."""
    mem = state.state_dict()["ranks"][dist.get_rank()]["memory"].get("residuals", {})
    mine = {"params": hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest(),
            "residuals": hashlib.sha256(b"".join(mem[n].numpy().tobytes() for n in sorted(mem))).hexdigest(),
            **{k: state.stats()[k] for k in ("round", "bytes_sent", "bytes_dense")}}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(every, f)
