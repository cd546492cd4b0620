#!/usr/bin/env python
"""Selection quality: how much of an update each rule sends, and why ADTopk trails global Top-k.

Two workloads answer it: the small CNN trained once per method (the default), and a snapshot of the job's
GPT's summed AdamW updates that every rule selects from (``gpt-updates``, the record
``docs/selection_quality/gpt_fiber_energy_r0.01.json`` that docs/results.md reads).

How to run (from the repository root; needs torch, numpy, matplotlib and the Fashion-MNIST files that
``examples/datasets.py`` reads, or the Shakespeare text for ``gpt-updates``; no Horovod)::

    nice -n 10 python benchmarks/bench_selection_quality.py                  # default: ~1 epoch, 1 seed
    python benchmarks/bench_selection_quality.py --quick                     # smoke test, ~10 s
    python benchmarks/bench_selection_quality.py --ratios 0.01,0.001 --seeds 3
    python benchmarks/bench_selection_quality.py --methods dense,topk,adtopk --steps 200
    python benchmarks/bench_selection_quality.py gpt-updates --time \\
        --out docs/selection_quality/gpt_fiber_energy_r0.01.json                 # the GPT, about a minute
    python benchmarks/bench_selection_quality.py gpt-updates --join 512,2048 --ratio 0.05 --out my.json

What it simulates. ``--world`` (W, default 2) data-parallel ranks in ONE process, training the small CNN
(``examples/models.py``, "cnn") on Fashion-MNIST. Every step draws a global batch of ``W * --batch-size``
examples (64 per rank) from one shuffled order of the training set; rank r computes the gradient of its
own slice. Per parameter the package's own rule decides the path (``compressor.choose_path(info, W)``):

- dense path (1-D tensors, tensors under ``min_numel``): the ranks' gradients are averaged;
- sparse path: every rank has its own :class:`horovod_adtopk.memory.ErrorFeedback`; it runs
  ``a = memory.compensate(name, g_r)`` -> ``s = compressor.select(a, info, step)`` ->
  ``memory.update(name, s.flat, 0)`` (an fp32 wire carries the values exactly), the same calls the
  optimizer's ``SparseSender`` makes, and the aggregate is ``sum_r index_add(s_r.flat, s_r.values) / W``
  (what ``aggregate_blocks`` computes after the allgather). ``step`` is the round counter, starting at 0,
  as the optimizer passes it (ADTopk-I uses ADTopk on even steps).

Optimizer: train.py's momentum-correction recipe for sparse compressors (not its compression warm-up): the sparse-path
tensors' memories are ``ErrorFeedback(momentum=0.9)`` and those tensors are stepped by SGD WITHOUT
momentum; dense-path tensors (and every tensor of the dense method) use SGD momentum 0.9. Learning rate:
linear warm-up from ``--lr`` to ``--lr * W`` over one epoch's steps, times cosine annealing to 0 at the
last step (train.py's defaults). ``--no-momentum-correction``: plain error feedback + SGD momentum 0.9
everywhere. Same seed -> same initial model, same data order and same schedule for every method.

Methods (``--methods``, at each ratio of ``--ratios``):

- ``dense``: no compression (once, not per ratio);
- ``topk``: exact global top-k per tensor, ``k = max(1, floor(ratio * numel))``;
- ``adtopk``: all-dimension top-k, ``axis="auto"`` (for this CNN every sparse tensor has ``cols >= rows``
  in the ``reshape(d0, -1)`` view, so auto = axis 1: one fiber per output unit);
- ``adtopk_eqbytes``: ADTopk at the largest ratio whose nominal payload (``compressor.nominal_bytes``
  summed over the sparse tensors) does not exceed Top-k's at the same ratio (found by bisection; ADTopk
  ships int16 fiber-local indices, 6 B/entry with fp32 values, Top-k int32 flat ones, 8 B/entry, on
  tensors of more than 32767 entries);
- ``adtopk_round``: ADTopk with one compressor per tensor whose ratio makes ``k = round(ratio *
  fiber_len)`` (>= 1) instead of ``floor``: the layer's achieved density back near ``ratio``;
- ``adtopk_i``: ADTopk-I (period 2: ADTopk on even steps, global top-k on odd steps);
- ``adtopk_axis0``: ADTopk with ``axis=0`` (one fiber per input column).

Measured every ``--every`` steps, per sparse layer and in total (per rank, then averaged over ranks):

- ``density``: entries one rank sends / numel (vs the ratio), and ``union_density``: distinct positions
  in the aggregated update / numel;
- ``energy``: captured energy ``||sent||^2 / ||a||^2`` of the error-compensated gradient ``a`` (with
  momentum correction ``a`` is the accumulated velocity); ``oracle``: what exact top-k with the SAME
  number of entries would capture from that same ``a``; ``efficiency = energy / oracle`` isolates the cost
  of the per-fiber constraint from the cost of sending fewer entries;
- ``coverage``: fraction of output units (rows of ``reshape(d0, -1)``) that receive at least one entry
  in the aggregated update;
- ``residual``: ``||r|| / ||g||``, the memory left after the send over this step's raw gradient;
- ``bytes``: one rank's payload bytes this step (``wire.block_bytes`` of the codec's index dtype, i.e.
  what ``pack`` builds), and the dense-path tensors' fp32 bytes separately.

At the end: accuracy on the full Fashion-MNIST test set (10000 images) and the mean training loss of the
last 50 steps. Outputs in ``--out-dir`` (default ``bench_results/selection_quality``, ``.../quick`` with
``--quick``): ``summary.json`` (settings, machine, layer layouts, every run's time series, the table
rows), ``table.txt`` and the plots ``energy.png`` (captured energy vs step), ``residual.png``
(``||r||/||g||`` vs step), ``density.png`` (per-layer achieved density and coverage bars), ``loss.png``.

``gpt-updates``: the rules on a transformer's AdamW updates. One process trains the job's GPT (``examples/models.py``, defaults: width 128, 5 blocks) on
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
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

import common  # benchmarks/common.py (sibling module)
from horovod_adtopk.compressors import Compression, TensorInfo
from horovod_adtopk.memory import ErrorFeedback
from horovod_adtopk.wire import block_bytes, dtype_bytes

ALL_METHODS = ("dense", "topk", "adtopk", "adtopk_eqbytes", "adtopk_round", "adtopk_i", "adtopk_axis0")
QUICK_METHODS = ("dense", "topk", "adtopk", "adtopk_eqbytes")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " See the module docstring.")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help=f"comma list of {', '.join(ALL_METHODS)}")
    p.add_argument("--ratios", default="0.01", help="comma list of ratios (e.g. 0.01,0.001)")
    p.add_argument("--world", type=int, default=2, help="simulated data-parallel ranks")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: one epoch, ceil(60000 / (world * batch)) = 469 at W=2)")
    p.add_argument("--lr", type=float, default=0.1, help="single-rank lr, warmed up to lr * world over one epoch")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=True,
                   help="DGC momentum correction in the sparse tensors' memories (default on, as train.py)")
    p.add_argument("--lr-schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--seeds", type=int, default=1, help="number of seeds (0, 1, ...) to average")
    p.add_argument("--seed-base", type=int, default=42)
    p.add_argument("--every", type=int, default=5, help="record the selection metrics every N steps")
    p.add_argument("--test-limit", type=int, default=None, help="score at most this many test images")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: 30 steps, {', '.join(QUICK_METHODS)}, 2000 test images")
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST folder (default: examples/datasets.py's)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--no-plots", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = args.steps or 30
        if args.methods == ",".join(ALL_METHODS):
            args.methods = ",".join(QUICK_METHODS)
        args.test_limit = args.test_limit or 2000
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in ALL_METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {', '.join(ALL_METHODS)}")
    args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    if args.world < 1 or args.batch_size < 1 or args.seeds < 1 or args.every < 1:
        p.error("--world, --batch-size, --seeds and --every must be >= 1")
    if args.out_dir is None:
        args.out_dir = common.REPO_ROOT / "bench_results" / "selection_quality" / ("quick" if args.quick else "")
    args.out_dir = Path(args.out_dir)
    return args


# --- methods: which package compressor each tensor uses ---------------------------------------------------


def tensor_infos(model: torch.nn.Module) -> Dict[str, TensorInfo]:
    return {n: TensorInfo(n, tuple(p.shape), p.numel(), p.dtype) for n, p in model.named_parameters()}


def sparse_payload_bytes(comp_for: Callable[[TensorInfo], object], infos: List[TensorInfo]) -> int:
    """Nominal bytes one rank sends per step for ``infos`` (the package's own ``nominal_bytes``)."""
    return sum(comp_for(i).nominal_bytes(i)[0] for i in infos)


def equal_bytes_ratio(ratio: float, infos: Dict[str, TensorInfo], world: int, momentum: Optional[float]) -> float:
    """Largest ADTopk ratio whose nominal payload over Top-k's sparse tensors stays <= Top-k's at ``ratio``."""
    topk = Compression.get("topk", ratio=ratio, momentum=momentum)
    sparse = [i for i in infos.values() if topk.choose_path(i, world)[0]]
    target = sparse_payload_bytes(lambda i: topk, sparse)

    def ad_bytes(r: float) -> int:
        c = Compression.get("adtopk", ratio=r, momentum=momentum)
        return sparse_payload_bytes(lambda i: c, sparse)

    lo, hi = ratio, 1.0
    if ad_bytes(lo) > target:  # ADTopk already sends more at the same ratio: shrink instead
        lo, hi = ratio * 1e-3, ratio
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ad_bytes(mid) <= target else (lo, mid)
    return lo


class Method:
    """A name plus the compressor each tensor uses (``None``: the dense method)."""

    def __init__(self, name: str, ratio: Optional[float], comp_for: Optional[Callable[[TensorInfo], object]],
                 note: str = "") -> None:
        self.name, self.ratio, self.comp_for, self.note = name, ratio, comp_for, note

    @property
    def label(self) -> str:
        return self.name if self.ratio is None else f"{self.name}@{self.ratio:g}"


def build_method(name: str, ratio: float, infos: Dict[str, TensorInfo], world: int,
                 momentum: Optional[float]) -> Method:
    if name == "dense":
        return Method("dense", None, None, "no compression")
    if name == "topk":
        c = Compression.get("topk", ratio=ratio, momentum=momentum)
        return Method(name, ratio, lambda i: c)
    if name == "adtopk":
        c = Compression.get("adtopk", ratio=ratio, momentum=momentum)
        return Method(name, ratio, lambda i: c, "axis auto")
    if name == "adtopk_axis0":
        c = Compression.get("adtopk", ratio=ratio, momentum=momentum, axis=0)
        return Method(name, ratio, lambda i: c, "axis 0")
    if name == "adtopk_i":
        c = Compression.get("adtopk_i", ratio=ratio, momentum=momentum)
        return Method(name, ratio, lambda i: c, "period 2")
    if name == "adtopk_eqbytes":
        r = equal_bytes_ratio(ratio, infos, world, momentum)
        c = Compression.get("adtopk", ratio=r, momentum=momentum)
        return Method(name, ratio, lambda i: c, f"adtopk ratio {r:.6g}")
    if name == "adtopk_round":
        base = Compression.get("adtopk", ratio=ratio, momentum=momentum)
        per: Dict[str, object] = {}
        for info in infos.values():
            if len(info.shape) < 2:
                per[info.name] = base
                continue
            lay = base.layout(info)
            k = max(1, int(round(ratio * lay.fiber_len)))
            r = min(1.0, (k + 0.5) / lay.fiber_len)  # floor(r * fiber_len) == k
            per[info.name] = Compression.get("adtopk", ratio=r, momentum=momentum)
        return Method(name, ratio, lambda i: per[i.name], "k = round(ratio * fiber_len)")
    raise ValueError(name)


def layer_rows(info: TensorInfo) -> int:
    return int(info.shape[0])


def describe_layers(method: Method, infos: Dict[str, TensorInfo], world: int) -> Dict[str, dict]:
    """Static facts: path, nominal count/bytes, and for fiber rules the layout."""
    out = {}
    for name, info in infos.items():
        if method.comp_for is None:
            out[name] = {"path": "dense", "reason": "dense method"}
            continue
        c = method.comp_for(info)
        sparse, reason = c.choose_path(info, world)
        d = {"path": "sparse" if sparse else "dense", "reason": reason, "numel": info.numel,
             "shape": list(info.shape)}
        if sparse:
            payload, dense_b = c.nominal_bytes(info)
            d.update(nominal_count=c.nominal_count(info), nominal_bytes=payload, dense_bytes=dense_b,
                     nominal_density=c.nominal_count(info) / info.numel,
                     index_dtype=str(c.nominal_index_dtype(info)).replace("torch.", ""))
            if hasattr(c, "layout"):
                lay = c.layout(info)
                d.update(axis=lay.axis, num_fibers=lay.num_fibers, fiber_len=lay.fiber_len, k=lay.k,
                         fiber_density=lay.count / info.numel, ratio=c.ratio)
        out[name] = d
    return out


# --- one training run ----------------------------------------------------------------------------------------


def lr_at(step: int, args, steps_per_epoch: int, total: int) -> float:
    target = args.lr * args.world
    lr = target if step >= steps_per_epoch else args.lr + (target - args.lr) * step / steps_per_epoch
    if args.lr_schedule == "cosine":
        lr *= 0.5 * (1.0 + math.cos(math.pi * min(step, total) / total))
    return lr


@torch.no_grad()
def evaluate(model, test_x, test_y, batch: int = 1000) -> float:
    model.eval()
    correct = 0
    for i in range(0, test_x.shape[0], batch):
        correct += int((model(test_x[i:i + batch]).argmax(1) == test_y[i:i + batch]).sum())
    model.train()
    return correct / test_x.shape[0]


def train_run(method: Method, seed: int, args, data, models) -> dict:
    train_x, train_y, test_x, test_y = data
    W, B = args.world, args.batch_size
    n_train = train_x.shape[0]
    steps_per_epoch = math.ceil(n_train / (W * B))
    total = args.steps or steps_per_epoch
    torch.manual_seed(seed)
    model = models.build_model("cnn")
    named = list(model.named_parameters())
    infos = tensor_infos(model)
    comp = {n: (method.comp_for(infos[n]) if method.comp_for else None) for n in infos}
    sparse = {n: bool(c is not None and c.choose_path(infos[n], W)[0]) for n, c in comp.items()}
    mc = args.momentum_correction and method.comp_for is not None
    momentum = args.momentum if mc else None
    groups = [{"params": [p for n, p in named if sparse[n]], "momentum": 0.0 if mc else args.momentum},
              {"params": [p for n, p in named if not sparse[n]], "momentum": args.momentum}]
    opt = torch.optim.SGD([g for g in groups if g["params"]], lr=args.lr, momentum=args.momentum)
    memories = [ErrorFeedback(momentum) for _ in range(W)] if method.comp_for else []
    sparse_names = [n for n in infos if sparse[n]]
    dense_bytes_step = sum(infos[n].numel * dtype_bytes(infos[n].dtype) for n in infos if not sparse[n])

    order_gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_train, generator=order_gen)
    epoch, pos = 0, 0
    records, losses = [], []
    bytes_total, entries_total = 0, 0
    t0 = time.perf_counter()
    for step in range(total):
        idx = order[pos:pos + W * B]
        pos += W * B
        if pos >= n_train:  # next epoch: a fresh order
            epoch += 1
            order = torch.randperm(n_train, generator=order_gen)
            pos = 0
        parts = idx.tensor_split(W)
        grads: List[Dict[str, torch.Tensor]] = []
        loss_sum = 0.0
        for r in range(W):
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(train_x[parts[r]]), train_y[parts[r]])
            loss.backward()
            loss_sum += loss.item()
            grads.append({n: p.grad.detach().clone() for n, p in named})
        losses.append(loss_sum / W)
        record = step % args.every == 0 or step == total - 1
        layer_stats = {}
        step_bytes = 0
        for n, p in named:
            info = infos[n]
            if not sparse[n]:
                p.grad = torch.stack([g[n] for g in grads]).mean(0)
                continue
            c = comp[n]
            agg = torch.zeros(info.numel, dtype=p.dtype)
            st = {"sent": 0, "sent_sq": 0.0, "a_sq": 0.0, "oracle_sq": 0.0, "r_sq": 0.0, "g_sq": 0.0, "bytes": 0}
            masks = torch.zeros(info.numel, dtype=torch.bool) if record else None
            for r in range(W):
                g = grads[r][n]
                a = memories[r].compensate(n, g)
                s = c.select(a, info, step)
                cnt = s.values.numel()
                nb = block_bytes(cnt, c.wire_value_dtype(info.dtype), s.codec.index_dtype)
                st["sent"] += cnt
                st["bytes"] += nb
                if record:
                    a_flat = a.reshape(-1)
                    st["a_sq"] += float(a_flat.pow(2).sum())
                    st["sent_sq"] += float(s.values.pow(2).sum())
                    st["oracle_sq"] += float(torch.topk(a_flat.abs(), cnt, sorted=False).values.pow(2).sum())
                    st["g_sq"] += float(g.pow(2).sum())
                    masks[s.flat] = True
                agg.index_add_(0, s.flat, s.values.to(agg.dtype))
                memories[r].update(n, s.flat, torch.zeros_like(s.values))
                if record:
                    st["r_sq"] += float(memories[r].residuals[n].pow(2).sum())
            agg.div_(W)
            p.grad = agg.view_as(p)
            step_bytes += st["bytes"] // W
            entries_total += st["sent"] // W
            if record:
                rows = layer_rows(info)
                covered = masks.view(rows, -1).any(dim=1).float().mean()
                layer_stats[n] = {
                    "density": st["sent"] / W / info.numel,
                    "union_density": float(masks.float().mean()),
                    "energy": st["sent_sq"] / st["a_sq"] if st["a_sq"] > 0 else float("nan"),
                    "oracle": st["oracle_sq"] / st["a_sq"] if st["a_sq"] > 0 else float("nan"),
                    "coverage": float(covered),
                    "residual": math.sqrt(st["r_sq"] / st["g_sq"]) if st["g_sq"] > 0 else float("nan"),
                    "bytes": st["bytes"] / W,
                    "_sums": (st["sent_sq"], st["a_sq"], st["oracle_sq"], st["r_sq"], st["g_sq"]),
                }
        bytes_total += step_bytes
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args, steps_per_epoch, total)
        opt.step()
        if record:
            tot = [sum(ls["_sums"][i] for ls in layer_stats.values()) for i in range(5)]
            rec = {"step": step, "loss": losses[-1], "bytes": step_bytes, "layers": {}}
            if layer_stats:
                rec.update(energy=tot[0] / tot[1] if tot[1] else float("nan"),
                           oracle=tot[2] / tot[1] if tot[1] else float("nan"),
                           residual=math.sqrt(tot[3] / tot[4]) if tot[4] else float("nan"))
            for n, ls in layer_stats.items():
                ls.pop("_sums")
                rec["layers"][n] = ls
            records.append(rec)
    train_seconds = time.perf_counter() - t0
    acc = evaluate(model, test_x, test_y)
    return {"method": method.name, "label": method.label, "ratio": method.ratio, "seed": seed,
            "steps": total, "test_accuracy": acc, "final_train_loss": statistics.fmean(losses[-50:]),
            "loss_curve": losses, "records": records, "sparse_tensors": sparse_names,
            "sparse_bytes_per_step": bytes_total / total, "entries_per_step": entries_total / total,
            "dense_path_bytes_per_step": dense_bytes_step, "train_seconds": train_seconds,
            "momentum_correction": mc, "note": method.note}


# --- summaries -----------------------------------------------------------------------------------------------


def mean_of(records: List[dict], key: str, layer: Optional[str] = None, second_half: bool = False) -> float:
    recs = records[len(records) // 2:] if second_half else records
    vals = [(r["layers"][layer][key] if layer else r.get(key)) for r in recs
            if (layer is None or layer in r["layers"])]
    vals = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else float("nan")


def summarize(runs: List[dict]) -> List[dict]:
    """One row per method label, averaged over seeds."""
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        rs = [r for r in runs if r["label"] == label]
        accs = [r["test_accuracy"] for r in rs]
        layers = rs[0]["sparse_tensors"]
        row = {"label": label, "method": rs[0]["method"], "ratio": rs[0]["ratio"], "note": rs[0]["note"],
               "seeds": len(rs), "accuracy_mean": statistics.fmean(accs),
               "accuracy_sd": statistics.stdev(accs) if len(accs) > 1 else 0.0, "accuracies": accs,
               "final_train_loss": statistics.fmean(r["final_train_loss"] for r in rs),
               "sparse_bytes_per_step": statistics.fmean(r["sparse_bytes_per_step"] for r in rs),
               "entries_per_step": statistics.fmean(r["entries_per_step"] for r in rs),
               "dense_path_bytes_per_step": rs[0]["dense_path_bytes_per_step"],
               "energy": statistics.fmean(mean_of(r["records"], "energy") for r in rs) if layers else 1.0,
               "oracle": statistics.fmean(mean_of(r["records"], "oracle") for r in rs) if layers else 1.0,
               "residual_2nd_half": statistics.fmean(mean_of(r["records"], "residual", second_half=True)
                                                     for r in rs) if layers else 0.0,
               "layers": {}}
        for n in layers:
            row["layers"][n] = {k: statistics.fmean(mean_of(r["records"], k, n, second_half=(k == "residual"))
                                                    for r in rs)
                                for k in ("density", "union_density", "energy", "oracle", "coverage", "residual",
                                          "bytes")}
        rows.append(row)
    return rows


def pct(x: float, d: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.{d}f}"


def render_tables(rows: List[dict]) -> str:
    head = ["method", "acc %", "sd", "loss(last50)", "energy %", "oracle %", "eff", "res ||r||/||g||",
            "entries/step", "bytes/step", "note"]
    body = []
    for r in rows:
        eff = r["energy"] / r["oracle"] if r["oracle"] else float("nan")
        body.append([r["label"], pct(r["accuracy_mean"]), pct(r["accuracy_sd"]), f"{r['final_train_loss']:.4f}",
                     pct(r["energy"], 1), pct(r["oracle"], 1), f"{eff:.3f}", f"{r['residual_2nd_half']:.2f}",
                     f"{r['entries_per_step']:.0f}", f"{r['sparse_bytes_per_step']:.0f}", r["note"]])
    out = ["Per method (energy/oracle: mean over recorded steps, total over sparse layers; residual: mean over "
           "the 2nd half; bytes: one rank's sparse payload)", common.table(head, body), ""]
    head2 = ["method", "layer", "density %", "union %", "energy %", "oracle %", "eff", "coverage %",
             "||r||/||g||", "bytes"]
    body2 = []
    for r in rows:
        for n, L in r["layers"].items():
            eff = L["energy"] / L["oracle"] if L["oracle"] else float("nan")
            body2.append([r["label"], n, pct(L["density"], 3), pct(L["union_density"], 3), pct(L["energy"], 1),
                          pct(L["oracle"], 1), f"{eff:.3f}", pct(L["coverage"], 1), f"{L['residual']:.2f}",
                          f"{L['bytes']:.0f}"])
    out += ["Per sparse layer", common.table(head2, body2)]
    return "\n".join(out)


def make_plots(runs: List[dict], rows: List[dict], out_dir: Path) -> List[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    sparse_runs = [r for r in runs if r["sparse_tensors"]]
    labels = list(dict.fromkeys(r["label"] for r in sparse_runs))
    layers = list(dict.fromkeys(n for r in sparse_runs for n in r["sparse_tensors"]))
    first_seed = {lab: next(r for r in sparse_runs if r["label"] == lab) for lab in labels}
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}

    def smooth(y, w=5):
        return [statistics.fmean(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]

    for key, fname, ylabel in (("energy", "energy.png", "captured energy ||sent||^2 / ||a||^2"),
                               ("residual", "residual.png", "||r|| / ||g||")):
        panels = ["total"] + layers
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
        for ax, panel in zip(axes[0], panels):
            for lab in labels:
                recs = first_seed[lab]["records"]
                xs = [r["step"] for r in recs if panel == "total" or panel in r["layers"]]
                ys = [r[key] if panel == "total" else r["layers"][panel][key] for r in recs
                      if panel == "total" or panel in r["layers"]]
                if xs:
                    ax.plot(xs, smooth(ys), label=lab, color=colors[lab], lw=1.2)
            ax.set_title(panel, fontsize=9)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            if key == "residual":
                ax.set_yscale("log")
        axes[0][0].set_ylabel(ylabel + " (5-point mean)")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        paths.append(out_dir / fname)

    srows = [r for r in rows if r["layers"]]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(1, len(srows))
    for j, (key, ax, title) in enumerate(((("density", axes[0], "achieved density per rank (%)")),
                                          ("coverage", axes[1], "output units covered per step (%)"))):
        for i, r in enumerate(srows):
            vals = [100 * r["layers"].get(n, {}).get(key, float("nan")) for n in layers]
            ax.bar([x + i * width for x in range(len(layers))], vals, width, label=r["label"],
                   color=plt.cm.tab10(i % 10))
        for rt in dict.fromkeys(r["ratio"] for r in srows):
            if key == "density":
                ax.axhline(100 * rt, color="k", ls="--", lw=0.8)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(layers))])
        ax.set_xticklabels(layers, fontsize=8)
        ax.set_title(title + (" (dashed: ratio)" if key == "density" else ""), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "density.png", dpi=110)
    plt.close(fig)
    paths.append(out_dir / "density.png")

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, lab in enumerate(dict.fromkeys(r["label"] for r in runs)):
        curve = next(r for r in runs if r["label"] == lab)["loss_curve"]
        ax.plot(smooth(curve, 25), label=lab, lw=1.1, color=plt.cm.tab10(i % 10))
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (25-step mean)")
    ax.set_ylim(top=1.2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "loss.png", dpi=110)
    plt.close(fig)
    paths.append(out_dir / "loss.png")
    return paths


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["gpt-updates"]:
        return gpt_updates_main(argv[1:])
    args = parse_args(argv)
    torch.set_num_threads(1)
    models = common.load_example("models")
    datasets = common.load_example("datasets")
    train, test = datasets.load_fashion_mnist(args.data_dir)
    train_x, train_y = train.tensors
    test_x, test_y = test.tensors
    if args.test_limit:
        test_x, test_y = test_x[:args.test_limit], test_y[:args.test_limit]
    data = (train_x, train_y, test_x, test_y)
    infos = tensor_infos(models.build_model("cnn"))
    mom = args.momentum if args.momentum_correction else None

    plan: List[Method] = []
    if "dense" in args.methods:
        plan.append(build_method("dense", 0.0, infos, args.world, mom))
    for ratio in args.ratios:
        plan += [build_method(m, ratio, infos, args.world, mom) for m in args.methods if m != "dense"]
    layouts = {m.label: describe_layers(m, infos, args.world) for m in plan}
    print(f"{len(plan)} methods x {args.seeds} seed(s), W={args.world}, batch {args.batch_size}/rank, "
          f"momentum correction {'on' if args.momentum_correction else 'off'}", flush=True)
    for m in plan:
        if m.comp_for is None:
            continue
        desc = ", ".join(f"{n}: {d['nominal_count']} ({100 * d['nominal_density']:.3f}%, {d['index_dtype']})"
                         for n, d in layouts[m.label].items() if d["path"] == "sparse")
        print(f"  {m.label:<22} {desc}  {m.note}", flush=True)

    runs = []
    t_start = time.perf_counter()
    for s in range(args.seeds):
        seed = args.seed_base + s
        for m in plan:
            run = train_run(m, seed, args, data, models)
            runs.append(run)
            print(f"seed {seed} {m.label:<22} acc {100 * run['test_accuracy']:.2f}%  "
                  f"loss {run['final_train_loss']:.4f}  {run['train_seconds']:.0f}s", flush=True)
    rows = summarize(runs)
    text = render_tables(rows)
    print()
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "table.txt").write_text(text + "\n")
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out_dir"}
    summary = {"settings": settings, "machine": common.machine_info(threads=1),
               "wall_seconds": time.perf_counter() - t_start, "layouts": layouts, "rows": rows, "runs": runs}
    common.write_record(args.out_dir / "summary.json", summary)  # + the command, the commit and the date
    if not args.no_plots:
        for path in make_plots(runs, rows, args.out_dir):
            print(f"wrote {path.relative_to(common.REPO_ROOT) if path.is_relative_to(common.REPO_ROOT) else path}")
    print(f"wrote {args.out_dir / 'summary.json'}")
    return 0


# --- gpt-updates: the rules on a transformer's summed AdamW updates -----------------------------------------


def parse_gpt_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_selection_quality.py gpt-updates",
                                description="The rules on the job's GPT's summed AdamW updates. See the module docstring.")
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
    train, _, vocab = common.load_example("datasets").load_shakespeare(seq_len=128)
    model = common.load_example("models").build_model("gpt", vocab_size=vocab)
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


def gpt_updates_main(argv=None) -> int:
    args = parse_gpt_args(argv)
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
