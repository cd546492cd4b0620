"""Horovod elastic training with hat.DistributedOptimizer (run by tests/test_elastic.py under horovodrun as
``python -m tests.elastic_worker MODE`` from the repository root), with a plain
``hvd.elastic.TorchState(model, optimizer)`` and no reset callback (horovod_adtopk.elastic does the rest).

MODE ``shrink``: 3 workers, rank 0 creates ``$HAT_ELASTIC_DIR/change`` at batch 15, which makes the host
discovery script drop one slot (Horovod then skips ``sync()``). MODE ``grow``: 2 workers, the file adds a slot
(a new worker joins with an empty AdamW state; ``sync()`` runs). Each rank appends one JSON line per committed
batch to ``$HAT_ELASTIC_DIR/log.jsonl`` (world size, round, a digest of its parameters); before every commit it
saves its residuals to ``commit_<pid>_<size>.pt`` and, on entering the training function after a membership change,
the residuals it holds then to ``after_<pid>_<size>.pt`` (for the test's check of the rescaling).
"""
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import horovod.torch as hvd

import horovod_adtopk as hat

OUT = Path(os.environ["HAT_ELASTIC_DIR"])
MODE = sys.argv[1]
TOTAL, CHANGE = 40, 15

hvd.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
if MODE == "grow":  # decoupled weight decay: a zero-gradient step() would move a new rank's parameters
    inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
else:
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
# hierarchical=True falls back to flat under elastic, without a collective at construction (a joining worker
# builds its optimizer alone)
opt = hat.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                               compression=hat.Compression.adtopk(ratio=0.05, min_numel=0), hierarchical=MODE == "grow")


def digest():
    h = hashlib.sha256()
    for _, p in sorted(model.state_dict().items()):
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def residuals():
    return {"size": hvd.size(), "residuals": opt.state_dict()["horovod_adtopk"]["ranks"][hvd.rank()]["memory"]["residuals"]}


SEEN = {"size": None}


@hvd.elastic.run
def train(state):
    if SEEN["size"] is not None or state.batch > 0:  # re-entered after a change, or a worker that joined late
        torch.save(residuals(), OUT / f"after_{os.getpid()}_{hvd.size()}.pt")
        (OUT / "changed").touch()
    SEEN["size"] = hvd.size()
    while state.batch < TOTAL:
        g = torch.Generator().manual_seed(1000 * hvd.rank() + state.batch)
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.batch += 1
        stats = opt.stats()
        with open(OUT / "log.jsonl", "a") as f:
            f.write(json.dumps({"batch": state.batch, "rank": hvd.rank(), "size": hvd.size(), "digest": digest(),
                                "round": stats["round"], "pid": os.getpid(), "elastic": stats["elastic"],
                                "residual_norm": stats["memory"]["residual_norm"],
                                "hierarchical": stats.get("hierarchical", {}).get("reason")}) + "\n")
        if state.batch == CHANGE and hvd.rank() == 0:
            (OUT / "change").touch()
        if state.batch >= CHANGE and not (OUT / "changed").exists():
            time.sleep(0.3)  # give the driver's host discovery (once a second) time to see the change
        torch.save(residuals(), OUT / f"commit_{os.getpid()}_{hvd.size()}.pt")
        state.commit()


state = hvd.elastic.TorchState(model, opt, batch=0)
train(state)
