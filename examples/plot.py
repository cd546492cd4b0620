#!/usr/bin/env python
"""Plot and compare training runs from the JSONL metrics files of ``examples/train.py --metrics-out``.

    python examples/plot.py runs/adtopk.jsonl runs/none.jsonl --out runs/plots

Writes three PNGs into ``--out``: the test metric (accuracy for Fashion-MNIST, perplexity for
Shakespeare) against epochs, against wall time, and against bytes sent (summed over ranks, log scale).
Each run is labelled by its compressor and ratio (``adtopk r=0.01``, ``none``); runs of different datasets
get separate sets of plots. Prints the paths it wrote.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METRICS = (("test_accuracy", "test accuracy"), ("test_perplexity", "test perplexity"))
X_AXES = (
    ("epoch", "epochs", False),
    ("wall_time", "wall time (s)", False),
    ("bytes_sent", "bytes sent, all ranks (MB)", True),
)


def read_run(path: Path) -> List[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{n}: not a JSON line ({exc})")
    if not rows:
        raise SystemExit(f"{path}: no metrics lines")
    rows.sort(key=lambda r: r.get("step", 0))
    return rows


def label_of(rows: List[dict], path: Path) -> str:
    last = rows[-1]
    comp = last.get("compressor") or path.stem
    label = comp
    if last.get("ratio") is not None and comp not in ("none", "fp16"):
        label += f" r={last['ratio']:g}"
    if last.get("value_dtype"):
        label += f" {last['value_dtype']}"
    return label


def x_value(row: dict, key: str):
    if key == "epoch":
        return row.get("epoch_progress", row.get("epoch"))
    if key == "bytes_sent":
        v = row.get("bytes_sent")
        return None if v is None else v / 1e6
    return row.get(key)


def plot_dataset(dataset: str, runs: "OrderedDict[str, List[dict]]", out: Path) -> List[Path]:
    metric = next(((k, name) for k, name in METRICS if any(k in r for rows in runs.values() for r in rows)), None)
    if metric is None:
        print(f"warning: no test metric in the {dataset} runs; nothing to plot", file=sys.stderr)
        return []
    key, metric_name = metric
    written = []
    for x_key, x_name, logx in X_AXES:
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for label, rows in runs.items():
            pts = [(x_value(r, x_key), r.get(key)) for r in rows]
            pts = [(x, y) for x, y in pts if x is not None and y is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if logx:
            ax.set_xscale("log")
        if key == "test_perplexity":
            ax.set_yscale("log")
        ax.set_xlabel(x_name)
        ax.set_ylabel(metric_name)
        ax.set_title(f"{dataset}: {metric_name} vs {x_name.split(' (')[0]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{dataset}_{key}_vs_{x_key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Plot runs of examples/train.py (JSONL metrics files).")
    p.add_argument("runs", nargs="+", type=Path, help="metrics files written by train.py --metrics-out")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNG files")
    args = p.parse_args(argv)

    by_dataset: Dict[str, "OrderedDict[str, List[dict]]"] = {}
    for path in args.runs:
        if not path.is_file():
            raise SystemExit(f"{path}: no such file")
        rows = read_run(path)
        dataset = rows[-1].get("dataset", "run")
        group = by_dataset.setdefault(dataset, OrderedDict())
        label = base = label_of(rows, path)
        n = 2
        while label in group:  # two runs with the same settings: tell them apart
            label, n = f"{base} ({n})", n + 1
        group[label] = rows

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for dataset, runs in by_dataset.items():
        written += plot_dataset(dataset, runs, args.out)
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
