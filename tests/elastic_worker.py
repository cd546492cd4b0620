"""Horovod elastic training with hat.DistributedOptimizer (run by tests/test_elastic.py under horovodrun as
``python -m tests.elastic_worker MODE`` from the repository root), with a plain
``hvd.elastic.TorchState(model, optimizer)`` and no reset callback (horovod_adtopk.elastic does the rest).

MODE ``shrink``: 3 workers, rank 0 creates ``$HAT_ELASTIC_DIR/change`` at batch 15, which makes the host
discovery script drop one slot (Horovod then skips ``sync()``). MODE ``grow``: 2 workers, the file adds a slot
(a new worker joins with an empty AdamW state; ``sync()`` runs). MODE ``kill``: 3 workers on two "hosts"
(``localhost`` and ``127.0.0.1``), committing after odd steps only; the one on ``127.0.0.1`` SIGKILLs itself
after step 16, so the others fail in step 17's exchange, restore the commit of step 15 (residuals included)
and go on with 2. Each rank appends one JSON line per committed
batch to ``$HAT_ELASTIC_DIR/log.jsonl`` (world size, round, a digest of its parameters); before every commit it
saves its residuals to ``commit_<pid>_<size>.pt`` and, on entering the training function after a membership change,
the residuals it holds then to ``after_<pid>_<size>.pt`` (for the test's check of the rescaling).
"""
import hashlib
import json
import os
import signal
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

# grow: a second model with local steps (sync_every=3, AdamW inside, ADTopk on the pseudo-gradient) in the same
# TorchState; its parameters agree across ranks right after each sync
local_model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
local_opt = hat.DistributedOptimizer(torch.optim.AdamW(local_model.parameters(), lr=0.01, weight_decay=0.1),
                                     named_parameters=local_model.named_parameters(),
                                     compression=hat.Compression.adtopk(ratio=0.1, min_numel=0), sync_every=3,
                                     outer=hat.Outer.nesterov(0.7, 0.9)) if MODE == "grow" else None


def digest(m=None):
    h = hashlib.sha256()
    for _, p in sorted((m or model).state_dict().items()):
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
        local = None
        if local_opt is not None:
            local_opt.zero_grad()
            torch.nn.functional.cross_entropy(local_model(x), y).backward()
            local_opt.step()
            ls = local_opt.stats()
            local = {"step_in_interval": ls["local_steps"]["step_in_interval"], "syncs": ls["round"],
                     "digest": digest(local_model), "elastic": ls["elastic"]}
        state.batch += 1
        stats = opt.stats()
        with open(OUT / "log.jsonl", "a") as f:
            f.write(json.dumps({"batch": state.batch, "rank": hvd.rank(), "size": hvd.size(), "digest": digest(),
                                "round": stats["round"], "pid": os.getpid(), "elastic": stats["elastic"],
                                "residual_norm": stats["memory"]["residual_norm"],
                                "hierarchical": stats.get("hierarchical", {}).get("reason"),
                                "local": local}) + "\n")
        if state.batch == CHANGE and hvd.rank() == 0 and MODE != "kill":
            (OUT / "change").touch()
        if state.batch >= CHANGE and not (OUT / "changed").exists():
            time.sleep(0.3)  # give the driver's host discovery (once a second) time to see the change
        if MODE == "kill" and state.batch == CHANGE + 1 and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
            os.kill(os.getpid(), signal.SIGKILL)  # after a full step past the commit; the others fail in the next
        if MODE == "kill" and state.batch % 2 == 0:
            continue  # commit every second step: a failure then rolls back a step that changed the residuals
        torch.save(residuals(), OUT / f"commit_{os.getpid()}_{hvd.size()}.pt")
        state.commit()


state = (hvd.elastic.TorchState(model, opt, batch=0) if local_opt is None else
         hvd.elastic.TorchState(model, opt, local_model=local_model, local_opt=local_opt, batch=0))
train(state)
