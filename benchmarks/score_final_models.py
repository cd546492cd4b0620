#!/usr/bin/env python
"""Score the candidate final models in a local-steps checkpoint written in the middle of an interval.

A run with ``--sync-every H`` that stops between syncs leaves every rank with its own parameters. Its
``gather_state_dict()`` checkpoint (what ``examples/train.py`` writes) holds them all, with the outer
parameters of the last sync. This scores, in one process on the whole held-out split of the job's dataset:
each rank's own model, the outer parameters, and the mean of the ranks' parameters (what
``opt.sync_now(average=True)`` gives with a dense exchange); its record is
``docs/convergence/gpt2000_fp32/last_sync/scores.json`` (docs/results.md, "How to regenerate")::

    python benchmarks/score_final_models.py --model gpt ckpt/diloco32_s1/ckpt-step2000.pt [...] --json out.json

The job's flags after ``--`` (default: the GPT on Shakespeare at the job's defaults) must describe the model
the checkpoints were written for.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

import torch

try:
    import common  # run as a script: its folder is on the import path
except ImportError:  # imported as benchmarks.score_final_models (the tests)
    from benchmarks import common

common.repo_package("examples")
from examples.job import options  # noqa: E402
from examples.job.data import DATASETS, compute_loss, make_model  # noqa: E402


def mean_loss(model: torch.nn.Module, state: Dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
              batch: int = 256) -> float:
    """Mean token (or example) cross-entropy of ``state`` on ``(x, y)``."""
    model.load_state_dict(state, strict=True)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(x), batch):
            total += float(compute_loss(model(x[b:b + batch]), y[b:b + batch], reduction="sum"))
            count += y[b:b + batch].numel()
    return total / count


def candidates(ckpt: dict) -> Dict[str, Dict[str, torch.Tensor]]:
    """The models a mid-interval checkpoint holds: each rank's, the last sync's outer parameters, their mean."""
    block = ckpt["optimizer"].get("horovod_adtopk", {})
    local = block.get("local_steps")
    if local is None:
        raise SystemExit("the checkpoint holds no local-steps state: it was not written with --sync-every")
    ranks = block["ranks"]
    if not all("local_params" in entry for entry in ranks.values()):
        raise SystemExit("the checkpoint was written at a sync (every rank holds the same model): nothing to compare")
    base = ckpt["model"]
    own = {r: dict(base, **ranks[r]["local_params"]) for r in sorted(ranks)}
    trained = set(local["outer_params"])
    mean = {k: (sum(m[k].double() for m in own.values()) / len(own)).to(v.dtype) if k in trained else v
            for k, v in base.items()}
    out = {f"rank {r}'s own": m for r, m in own.items()}
    out.update({"outer params of the last sync": dict(base, **local["outer_params"]), "mean of the ranks": mean})
    return out


def main(argv: List[str] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job_flags = argv[argv.index("--") + 1:] if "--" in argv else ["--dataset", "shakespeare", "--model", "gpt"]
    ours = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoints", nargs="+", type=Path)
    p.add_argument("--json", type=Path, help="write the scores here")
    args = p.parse_args(ours)
    job_args = options.parse_args(job_flags)
    _, test, vocab = DATASETS[job_args.dataset].load(job_args)
    x, y = test.tensors
    model = make_model(job_args, vocab)
    results = {}
    for path in args.checkpoints:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        step = ckpt["optimizer"]["horovod_adtopk"].get("local_steps", {}).get("step")
        scores = {name: mean_loss(model, state, x, y) for name, state in candidates(ckpt).items()}
        results[str(path)] = {"step": ckpt["step"], "step_in_interval": step, "test_loss": scores}
        print(f"{path} (step {ckpt['step']}, {step} steps into an interval):")
        for name, value in scores.items():
            print(f"  {name:32s} {value:.4f}")
    if args.json:
        # the scores by checkpoint, and (write_record) the command, the commit, the date and the machine
        common.write_record(args.json, results, ["python", "benchmarks/score_final_models.py", *argv])
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
