"""Where the docs steer, the library steers: an Adam-family optimizer with per-step sparse compression and error
feedback on the gradient logs one SettingAdvice warning on rank 0 naming the decision table's setting for its
world size; SGD + ADTopk and AdamW + local steps do not.

Both engines, each in a fresh single process (world size 1: Horovod without horovodrun, DDP on a one-rank Gloo
group), under a timeout that kills the process group. About 10 s together.
"""
from __future__ import annotations

import json
import sys

import pytest

from tests.harness import REPO, run_command

pytestmark = pytest.mark.quick

COMMON = r"""
import json, sys, warnings
import torch
import horovod_adtopk as hat
from horovod_adtopk.advice import SettingAdvice

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

def train(opt, m, steps=3):
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(8, 64)).sum().backward()
        opt.step()

results = {}
"""

HOROVOD = COMMON + r"""
import horovod.torch as hvd
hvd.init()
cases = {
    "adamw_adtopk": lambda m: dict(optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                                   compression=hat.Compression.adtopk(ratio=0.01)),
    "adam_topk": lambda m: dict(optimizer=torch.optim.Adam(m.parameters(), lr=1e-3),
                                compression=hat.Compression.topk(ratio=0.01)),
    "sgd_adtopk": lambda m: dict(optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                 compression=hat.Compression.adtopk(ratio=0.01)),
    "adamw_local_steps": lambda m: dict(optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                                        compression=hat.Compression.adtopk(ratio=0.25), sync_every=4,
                                        outer=hat.Outer.sgd(lr=1.0, feedback_decay=0.95, value_bits=2, value_group=64)),
    "adamw_no_feedback": lambda m: dict(optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3),
                                        compression=hat.Compression.adtopk(ratio=0.01, error_feedback=False)),
    "adamw_dense": lambda m: dict(optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3)),
}
for name, make in cases.items():
    m = model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kw = make(m)
        opt = hat.DistributedOptimizer(kw.pop("optimizer"), named_parameters=m.named_parameters(), **kw)
        train(opt, m)
    results[name] = [str(w.message) for w in caught if issubclass(w.category, SettingAdvice)]
print("RESULT " + json.dumps(results), flush=True)
"""

DDP = COMMON + r"""
import os, tempfile
import torch.distributed as dist
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
cases = {
    "adamw_adtopk": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), hat.Compression.adtopk(ratio=0.01)),
    "sgd_adtopk": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), hat.Compression.adtopk(ratio=0.01)),
}
for name, (make, compression) in cases.items():
    m = model()
    ddp = torch.nn.parallel.DistributedDataParallel(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = hat.ddp.register(ddp, compression)
        opt = make(ddp)
        other = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # not the model's: never advised
        other.step()
        train(opt, ddp)
    results[name] = [str(w.message) for w in caught if issubclass(w.category, SettingAdvice)]
m = model()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    opt = hat.ddp.local_steps(torch.optim.AdamW(m.parameters(), lr=1e-3), m, sync_every=4,
                              outer=hat.Outer.sgd(lr=1.0, feedback_decay=0.95, value_bits=2, value_group=64),
                              compression=hat.Compression.adtopk(ratio=0.25))
    train(opt, m)
results["adamw_local_steps"] = [str(w.message) for w in caught if issubclass(w.category, SettingAdvice)]
print("RESULT " + json.dumps(results), flush=True)
hat.ddp.shutdown()
"""


def run(script: str) -> dict:
    rc, out, _ = run_command([sys.executable, "-c", script], timeout=120, cwd=str(REPO))
    assert rc is not None, f"timed out and was killed\n{out[-3000:]}"
    assert rc == 0, f"exit {rc}\n{out[-3000:]}"
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert len(line) == 1, out[-3000:]
    return json.loads(line[0][len("RESULT "):])


def check_recipe(messages):
    assert len(messages) == 1, messages
    text = messages[0]
    assert "At 1 ranks" in text
    for part in ("sync_every=4", "hat.Outer.sgd(lr=1.0, feedback_decay=0.95, value_bits=2, value_group=64)",
                 "hat.Compression.adtopk(ratio=0.25)"):
        assert part in text, text


def test_horovod_engine_advises_adam_family_once():
    got = run(HOROVOD)
    check_recipe(got["adamw_adtopk"])
    check_recipe(got["adam_topk"])
    for quiet in ("sgd_adtopk", "adamw_local_steps", "adamw_no_feedback", "adamw_dense"):
        assert got[quiet] == [], (quiet, got[quiet])


def test_ddp_engine_advises_adam_family_once():
    got = run(DDP)
    check_recipe(got["adamw_adtopk"])
    assert got["sgd_adtopk"] == [] and got["adamw_local_steps"] == [], got


def test_recommendation_follows_the_world_size():
    from horovod_adtopk import advice
    assert "adtopk(ratio=0.25)" in advice.recommendation(8)
    assert "adtopk(ratio=0.25)" in advice.recommendation(16)
    large = advice.recommendation(64)  # the sharded exchange keeps the recipe's bytes per rank bounded at any W
    assert "adtopk(ratio=0.25)" in large and "sharded" in large and "fp16" not in large
