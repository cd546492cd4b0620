"""Horovod elastic training with hat.DistributedOptimizer (run by tests/test_elastic.py under horovodrun as
``python -m tests.elastic_worker`` from the repository root).

Trains a small model; rank 0 creates ``$HAT_ELASTIC_DIR/shrink`` at batch 15, which makes the host discovery
script drop one slot. Each rank appends one JSON line per committed batch to ``$HAT_ELASTIC_DIR/log.jsonl``
with its world size and a digest of its parameters.
"""
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import horovod.torch as hvd

import horovod_adtopk as hat

OUT = Path(os.environ["HAT_ELASTIC_DIR"])
TOTAL = 40

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
                               compression=hat.Compression.adtopk(ratio=0.05, min_numel=0))


def digest():
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        g = torch.Generator().manual_seed(1000 * hvd.rank() + state.batch)
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.batch += 1
        with open(OUT / "log.jsonl", "a") as f:
            f.write(json.dumps({"batch": state.batch, "rank": hvd.rank(), "size": hvd.size(), "digest": digest(),
                                "resets": RESETS}) + "\n")
        if state.batch == 15 and hvd.rank() == 0:
            (OUT / "shrink").touch()
        if state.batch >= 15 and hvd.size() > 2:
            time.sleep(0.3)  # give the driver's host discovery (once a second) time to see the change
        state.commit()


RESETS = []


def on_reset():
    opt.reset_compression_state()
    RESETS.append(len(opt.state_dict()["horovod_adtopk"]["ranks"][hvd.rank()]["memory"]["residuals"]))


state = hvd.elastic.TorchState(model, opt, batch=0)
state.register_reset_callbacks([on_reset])
train(state)
