#!/usr/bin/env python
"""Fiber rules on a transformer's AdamW updates: how much of each tensor's energy a budget per fiber keeps.

How to run (from the repository root; torch and the Shakespeare text, no Horovod; about a minute)::

    python benchmarks/bench_fiber_energy.py                        # the job's GPT, ratio 0.01
    python benchmarks/bench_fiber_energy.py --join 512,2048 --ratio 0.05 --out my.json

What it measures. One process trains the job's GPT (``examples/models.py``, defaults: width 128, 5 blocks) on
Shakespeare characters with AdamW (lr 2e-3, betas 0.9/0.95, batch 32 x 128) for ``--steps`` steps, and sums
the parameter updates of the last ``--window`` of them: the quantity that error feedback on the update
accumulates between sends. For every matrix it then runs each rule's selection on that sum, as the package
does (``compressor.select``), and reports

- ``energy``: ``||sent||^2 / ||a||^2``, the share of the tensor's squared norm the rule sends;
- ``efficiency``: energy / what exact top-k with the same number of entries keeps (1 = no loss from the
  per-fiber budget, whatever the count).

Rules: ADTopk with ``axis="auto"`` (the default), ``axis=0``, ``axis=1``, ADTopk with short rows joined into
fibers of at least ``L`` entries (``joinL``: ``min_fiber_len=L`` for every ``L`` of ``--join``), the same with
whole columns joined (``joincolsL``: ``min_fiber_len=L, join="columns"``) and global Top-k.
It is a snapshot of one sum, not a training run: error feedback changes what accumulates under each rule.

``--time``: also the selection time of each rule over all of the model's matrices (``compressor.select`` on
that sum, one thread, best of 5 rounds of 20 calls each), side by side in one run.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import common  # benchmarks/common.py (sibling module): repo_package, write_record

common.repo_package("examples")
from examples.datasets import load_shakespeare  # noqa: E402
from examples.models import build_model  # noqa: E402
from horovod_adtopk.compressors import Compression, TensorInfo  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " See the module docstring.")
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--join", default="512,1024,2048,4096", help="comma list of min_fiber_len values")
    p.add_argument("--steps", type=int, default=80, help="AdamW steps of dense training")
    p.add_argument("--window", type=int, default=20, help="sum the updates of this many last steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    p.add_argument("--time", action="store_true", help="also time each rule's selection over all the matrices")
    args = p.parse_args(argv)
    if not 1 <= args.window <= args.steps:
        p.error("need 1 <= --window <= --steps")
    args.join = [int(x) for x in args.join.split(",") if x.strip()]
    return args


def summed_updates(args) -> dict:
    torch.manual_seed(args.seed)
    train, _, vocab = load_shakespeare(seq_len=128)
    model = build_model("gpt", vocab_size=vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    x_all, y_all = train.tensors
    gen = torch.Generator().manual_seed(args.seed)
    acc = {}
    for step in range(args.steps):
        idx = torch.randint(0, x_all.shape[0], (32,), generator=gen)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() > 1}
        loss = torch.nn.functional.cross_entropy(model(x_all[idx]).flatten(0, 1), y_all[idx].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= args.steps - args.window:
            for n, p in model.named_parameters():
                if n in before:
                    acc[n] = acc.get(n, 0) + (before[n] - p.detach())
    return acc


def selection_seconds(comp, tensors: dict, rounds: int = 5, calls: int = 20) -> float:
    """Best of ``rounds`` of the mean time of ``comp.select`` over every tensor of ``tensors`` (one pass)."""
    infos = {n: TensorInfo(n, tuple(a.shape), a.numel(), a.dtype) for n, a in tensors.items()}
    for n, a in tensors.items():  # warm-up: layouts, codecs, the native kernel's first call
        comp.select(a, infos[n], 0)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            for n, a in tensors.items():
                comp.select(a, infos[n], 0)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rules = {"adtopk": Compression.adtopk(ratio=args.ratio), "axis0": Compression.adtopk(ratio=args.ratio, axis=0),
             "axis1": Compression.adtopk(ratio=args.ratio, axis=1)}
    rules.update({f"join{L}": Compression.adtopk(ratio=args.ratio, min_fiber_len=L) for L in args.join})
    rules.update({f"joincols{L}": Compression.adtopk(ratio=args.ratio, min_fiber_len=L, join="columns")
                  for L in args.join})
    rules["topk"] = Compression.topk(ratio=args.ratio)
    acc = summed_updates(args)
    per_tensor, totals = {}, {r: {"sent": 0.0, "all": 0.0, "oracle": 0.0, "count": 0} for r in rules}
    for name, a in acc.items():
        info = TensorInfo(name, tuple(a.shape), a.numel(), a.dtype)
        total = float(a.pow(2).sum())
        row = {"shape": list(a.shape)}
        for r, comp in rules.items():
            s = comp.select(a, info, 0)
            count = s.values.numel()
            sent = float(s.values.pow(2).sum())
            oracle = float(torch.topk(a.reshape(-1).abs(), count).values.pow(2).sum())
            row[r] = {"energy": sent / total, "efficiency": sent / oracle, "count": count}
            for key, v in (("sent", sent), ("all", total), ("oracle", oracle), ("count", count)):
                totals[r][key] += v
        per_tensor[name] = row
    summary = {r: {"energy": t["sent"] / t["all"], "efficiency": t["sent"] / t["oracle"], "count": t["count"]}
               for r, t in totals.items()}
    print(f"energy sent (efficiency against top-k of the same count), ratio {args.ratio}, the sum of the last "
          f"{args.window} of {args.steps} AdamW updates")
    print("| tensor | shape | " + " | ".join(rules) + " |")
    print("|---|---|" + "---|" * len(rules))
    for name, row in per_tensor.items():
        cells = " | ".join(f"{row[r]['energy']:.3f} ({row[r]['efficiency']:.2f})" for r in rules)
        print(f"| {name} | {row['shape']} | {cells} |")
    cells = " | ".join(f"{summary[r]['energy']:.3f} ({summary[r]['efficiency']:.2f})" for r in rules)
    print(f"| all matrices | | {cells} |")
    print("| entries sent | | " + " | ".join(str(summary[r]["count"]) for r in rules) + " |")
    if args.time:
        for r, comp in rules.items():
            summary[r]["select_ms"] = 1e3 * selection_seconds(comp, acc)
        print("| selection, ms per step (all matrices) | | " +
              " | ".join(f"{summary[r]['select_ms']:.2f}" for r in rules) + " |")
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k != "out"}  # no machine paths in the record
        # write_record adds the command, the commit, the date and the machine (report.py reads them)
        common.write_record(args.out, {"args": settings, "tensors": per_tensor, "all": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
