#!/usr/bin/env python
"""Convergence benchmark: dense training vs gradient compressors, several seeds, with and without warm-up.

How to run (from the repository root, with the package and Horovod installed: ``scripts/setup.sh``)::

    python benchmarks/bench_convergence.py --quick                  # smoke test, a few minutes
    python benchmarks/bench_convergence.py                          # the full design (hundreds of CPU hours)
    python benchmarks/bench_convergence.py --datasets fashion-mnist --epochs 1 --seeds 1,2,3 \\
        --methods dense,adtopk,topk,adtopk_i,dgc,powersgd1,powersgd4 --ratios 0.01 --warmup on \\
        --step-times bench_results/step_cnn.json
    python benchmarks/bench_convergence.py --analyse-only --step-times ...   # re-aggregate what is in --out-dir

Design (the defaults): 3 seeds; Fashion-MNIST with the small CNN for 10 epochs, Fashion-MNIST with the
ResNet-style model (``--resnet-epochs`` 3, only with ``--datasets fashion-mnist-resnet``), Shakespeare with
the char LSTM for 2,000 steps; methods dense, ADTopk, ADTopk-I, Top-k, DGC, PowerSGD rank 1 and rank 4;
ratios 0.01 and 0.001 (sparse methods; PowerSGD has a rank instead, dense neither); with and without
compression warm-up.

Methods. ``dense`` (= train.py ``--compressor none``), any train.py compressor name, and ``powersgdR``
(``--compressor powersgd --powersgd-rank R``, our PowerSGD in the same engine: the same optimizer, error
feedback and byte counters as the sparse compressors). Warm-up (``--warmup on|off|both``): a run "with
warm-up" (suffix ``_wu`` in its name, ``+wu`` in tables) passes ``--dense-rounds D`` (the first D steps all
dense) and, for the sparse compressors, ``--density-warmup W --density-start S`` (DGC's exponential density
warm-up from S down to the ratio over W steps; PowerSGD gets the dense rounds only). Dense runs are the same
with or without warm-up and run once per seed. Every run of a seed uses the same ``--seed``: the same
initialisation, data order and learning-rate schedule, so only the gradient exchange differs.

Every run is one launch of ``horovodrun -np N --gloo python examples/train.py`` (sequential, each under
``--run-timeout``). train.py evaluates at epoch ends and at the end only, so each run also writes a
checkpoint every ceil(total_steps / ``--eval-points``) steps (``--keep-checkpoints 0``: train.py keeps only
the newest 2 by default); after the run every checkpoint's model is scored here on the same test examples
train.py uses (each rank's ``rank::world`` share, at most ``--test-batches`` batches of
``--test-batch-size``), at the step, wall time and byte counters stored in the checkpoint. The checkpoint
at an epoch end is compared once per dataset with train.py's own test loss there (``eval_check_abs_diff``).
Checkpoints are deleted afterwards unless ``--keep-checkpoints``. ``--log-every`` is passed in seconds.

Aggregation. All run records in ``--out-dir/runs`` (so several invocations into one folder, e.g. one per
ratio, are analysed together; runs are grouped by dataset, method, ratio and warm-up, and all runs of a
group must have the same settings) give per group the mean and sample standard deviation over seeds of:
the final test accuracy (Fashion-MNIST) or perplexity (Shakespeare); bytes sent / bytes a dense fp32
allreduce would send (both counted by the optimizer, summed over ranks); the achieved density
(elements sent / elements); the steps to the target (first evaluation point with accuracy >=
``--target-accuracy``, default 0.85; for Shakespeare perplexity <= (1 + ``--ppl-tolerance``) x dense's
mean final perplexity), only as fine as the evaluation points; and the modelled time to the target on the
link of ``--step-rate`` (default 1gbit): steps_to_target x the step time that ``benchmarks/bench_step.py``
measured for that method (``--step-times FILE``: its JSON; cell with ``--step-np`` ranks, model
``--step-model``, default cnn for Fashion-MNIST and lstm for Shakespeare; dense = ``hvd-dense``; PowerSGD
rank R = mode ``powersgdR``; a sparse method's step time at the run's ratio when the JSON has it, else at
the JSON's ratio, noted). With warm-up, the first D dense rounds are charged at the dense step time and the
rest at the method's step time (the density warm-up steps, which send more than the final ratio, are
charged at the final ratio's step time: an underestimate there). Measured wall times on this CPU machine
are reported too, but they measure oversubscribed compute, not a network.

Outputs in ``--out-dir`` (default ``bench_results/convergence``): ``<run>.jsonl`` (train.py's own),
``logs/``, ``runs/<run>.json`` (one record per run, with its evaluation points; ``common.write_record``
adds the launch as its command, the commit, the date and the machine, ``launched_by`` is this script's command
line), ``curves/<run>.jsonl``, ``summary.json`` (a record too: machine, settings, groups, verdicts),
``table.md`` (the markdown table and verdicts) and
per (dataset, ratio, warm-up) setting one PNG with three panels, test metric vs epoch, vs bytes sent and vs
modelled wall time, mean over seeds with a +-1 std band (dense and PowerSGD appear in every setting of
their dataset). Finally the verdict lines of the targets, met / missed with the numbers (reported, not
asserted):

1. Fashion-MNIST, 0.01 with warm-up, mean of the seeds: ADTopk within 0.5 points of dense (not more than
   0.5 below), and not worse than Top-k by more than one standard deviation (the larger of the two
   groups' stds);
2. Shakespeare, 0.01 with warm-up: ADTopk's perplexity within ``--ppl-tolerance`` (default 5%) of dense's;
3. 0.001 with warm-up: no method diverges (non-finite final test loss, or final accuracy below
   ``--diverge-accuracy``, default 0.2 = twice chance) and ADTopk's mean >= Top-k's;
4. on the ``--step-rate`` link ADTopk reaches ``--target-accuracy`` on Fashion-MNIST first (smallest mean
   modelled time) among all methods of the 0.01 with-warm-up setting, dense and PowerSGD included.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import common
from common import csv_floats, csv_ints, csv_list

REPO = common.REPO_ROOT
TRAIN = common.EXAMPLES_DIR / "train.py"
DATASETS = ("fashion-mnist", "fashion-mnist-resnet", "fashion-mnist-vgg", "shakespeare")
DEEP_MODELS = {"fashion-mnist-resnet": "resnet", "fashion-mnist-vgg": "vgg"}  # trained for --resnet-epochs
DEFAULT_METHODS = ("dense", "adtopk", "adtopk_i", "topk", "dgc", "powersgd1", "powersgd4")
DEFAULT_RATIOS = (0.01, 0.001)
DEFAULT_SEEDS = (1, 2, 3)
QUICK = {"np": 2, "datasets": ["fashion-mnist"], "methods": ["dense", "adtopk", "topk", "powersgd1"],
         "ratios": [0.01], "seeds": [1, 2], "max_steps_fashion": 40, "eval_points": 2, "run_timeout": 120.0,
         "test_batches": 2, "dense_rounds": 5, "density_warmup": 10}


def canonical_method(name: str) -> str:
    m = name.strip().lower().replace("-", "_")
    return "dense" if m in ("none", "dense") else m


def is_powersgd(method: str) -> bool:
    return re.fullmatch(r"powersgd\d*", method) is not None


def uses_ratio(method: str) -> bool:
    return method not in ("dense", "fp16") and not is_powersgd(method)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " See the module docstring for details.")
    p.add_argument("--np", type=int, default=None, help="ranks per run (default 2)")
    p.add_argument("--datasets", type=csv_list, default=None,
                   help="comma list of fashion-mnist (small CNN), fashion-mnist-resnet (ResNet-style CNN), "
                        "fashion-mnist-vgg (VGG-style, 2.1 M parameters), shakespeare (default "
                        "fashion-mnist,shakespeare)")
    p.add_argument("--methods", type=csv_list, default=None,
                   help=f"comma list: dense, train.py compressors, powersgdR (default {','.join(DEFAULT_METHODS)}); "
                        "dense is always added as the baseline")
    p.add_argument("--ratios", type=csv_floats, default=None, help="densities of the sparse methods (default 0.01,0.001)")
    p.add_argument("--seeds", type=csv_ints, default=None, help="comma list of seeds (default 1,2,3)")
    p.add_argument("--warmup", choices=("on", "off", "both"), default="on",
                   help="compression warm-up variants of the non-dense methods (default on)")
    p.add_argument("--dense-rounds", type=int, default=None, help="warm-up: train.py --dense-rounds (default 100)")
    p.add_argument("--density-warmup", type=int, default=None,
                   help="warm-up, sparse methods: train.py --density-warmup steps (default: one epoch, 469 at 2 ranks)")
    p.add_argument("--density-start", type=float, default=0.25, help="warm-up: train.py --density-start (default 0.25)")
    p.add_argument("--epochs", type=int, default=10, help="Fashion-MNIST small-CNN epochs (default 10)")
    p.add_argument("--resnet-epochs", type=int, default=3,
                   help="epochs of the deeper Fashion-MNIST models, fashion-mnist-resnet / -vgg (default 3)")
    p.add_argument("--max-steps-fashion", type=int, default=None, help="train.py --max-steps for fashion-mnist runs")
    p.add_argument("--max-steps-shakespeare", type=int, default=None,
                   help="train.py --max-steps for shakespeare (default 2000)")
    p.add_argument("--lr-warmup-steps", type=int, default=None,
                   help="train.py --warmup-steps (linear lr warm-up; default train.py's: one epoch)")
    p.add_argument("--eval-points", type=int, default=None,
                   help="evaluation points per run through checkpoints (default 10; 0: only train.py's records)")
    p.add_argument("--test-batches", type=int, default=None, help="train.py --test-batches per rank (default 5)")
    p.add_argument("--test-batch-size", type=int, default=500, help="train.py --test-batch-size (default 500)")
    p.add_argument("--curve-test-batches", type=int, default=None,
                   help="test batches per rank for scoring the intermediate checkpoints (default: --test-batches); "
                        "fewer makes the curves cheaper but noisier; the final point is always train.py's own "
                        "evaluation on --test-batches")
    p.add_argument("--train-args", default="",
                   help='extra train.py arguments for every run, one shell-quoted string: --train-args="--lr 0.05"')
    p.add_argument("--run-timeout", type=float, default=None, help="seconds per train.py launch (default 7200)")
    p.add_argument("--target-accuracy", type=float, default=0.85, help="accuracy target (default 0.85)")
    p.add_argument("--ppl-tolerance", type=float, default=0.05,
                   help="Shakespeare: perplexity <= (1 + this) x dense's mean final perplexity, for the steps to the "
                        "target and the verdict on ADTopk (default 0.05)")
    p.add_argument("--diverge-accuracy", type=float, default=0.2,
                   help="a Fashion-MNIST run below this final accuracy counts as diverged (default 0.2)")
    p.add_argument("--step-times", type=Path, default=None, help="benchmarks/bench_step.py JSON with the step times")
    p.add_argument("--step-rate", default="1gbit", help="link rate cell of --step-times (default 1gbit)")
    p.add_argument("--step-np", type=int, default=None, help="ranks of the --step-times cell (default --np)")
    p.add_argument("--step-model", default=None,
                   help="model of the --step-times cell (default: cnn / resnet18 / lstm per dataset)")
    p.add_argument("--out-dir", type=Path, default=None, help="results folder (default bench_results/convergence)")
    p.add_argument("--plot-dir", type=Path, default=None, help="where the PNGs go (default --out-dir)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep the evaluation checkpoints")
    p.add_argument("--channel-stats", action="store_true",
                   help="pass train.py --channel-stats: per-layer update density and share of output channels "
                        "updated per step (out-dir/channels/<run>.json, a table per dataset in table.md)")
    p.add_argument("--reuse", action="store_true",
                   help="skip a run whose record in --out-dir finished with exactly the same command")
    p.add_argument("--analyse-only", action="store_true", help="launch nothing; aggregate the records in --out-dir")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 ranks, fashion-mnist, dense/adtopk/topk/powersgd1 at 0.01 with warm-up, "
                        "2 seeds, 40 steps")
    args = p.parse_args(argv)

    q = QUICK if args.quick else {}
    args.np = args.np or q.get("np", 2)
    args.datasets = args.datasets or list(q.get("datasets", ["fashion-mnist", "shakespeare"]))
    args.methods = args.methods or list(q.get("methods", DEFAULT_METHODS))
    args.ratios = args.ratios or list(q.get("ratios", DEFAULT_RATIOS))
    args.seeds = args.seeds or list(q.get("seeds", DEFAULT_SEEDS))
    if args.dense_rounds is None:
        args.dense_rounds = q.get("dense_rounds", 100)
    if args.density_warmup is None:
        args.density_warmup = q.get("density_warmup")  # None: one epoch, resolved per dataset
    if args.max_steps_fashion is None:
        args.max_steps_fashion = q.get("max_steps_fashion")
    if args.max_steps_shakespeare is None:
        args.max_steps_shakespeare = q.get("max_steps_shakespeare", 2000)
    if args.test_batches is None:
        args.test_batches = q.get("test_batches", 5)
    if args.curve_test_batches is None:
        args.curve_test_batches = args.test_batches
    if args.eval_points is None:
        args.eval_points = q.get("eval_points", 10)
    if args.run_timeout is None:
        args.run_timeout = q.get("run_timeout", 7200.0)
    if args.out_dir is None:
        args.out_dir = REPO / "bench_results" / "convergence" / ("quick" if args.quick else "")
    args.step_np = args.step_np or args.np
    for d in args.datasets:
        if d not in DATASETS:
            p.error(f"unknown dataset {d!r}; choose from {', '.join(DATASETS)}")
    args.methods = list(dict.fromkeys(["dense"] + [canonical_method(m) for m in args.methods]))
    for m in args.methods:
        if is_powersgd(m) and m == "powersgd":
            p.error("write PowerSGD as powersgdR with its rank, e.g. powersgd1")
    if any(not 0.0 < r <= 1.0 for r in args.ratios):
        p.error("--ratios must be in (0, 1]")
    if args.np < 1 or args.epochs < 1 or args.eval_points < 0 or not args.seeds:
        p.error("--np and --epochs must be >= 1, --eval-points >= 0, --seeds not empty")
    return args


# ---------------------------------------------------------------------------------------------------------
# train.py (imported only for its argument parser, so the commands are validated and resolved here)
# ---------------------------------------------------------------------------------------------------------

_RESOLVE = """
import json, sys
import train
out = []
for argv in json.loads(sys.argv[1]):
    try:
        out.append(vars(train.parse_args(argv)))
    except SystemExit as exc:
        out.append({"__exit__": exc.code})
print(json.dumps(out, default=str))
"""


def resolve_train_args(argvs: Sequence[List[str]]) -> List[object]:
    """``train.parse_args(argv)`` for every argv (a namespace, or the exit code when train.py rejects it)."""
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(list(argvs))], cwd=str(TRAIN.parent),
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"could not run train.py's argument parser:\n{proc.stderr.strip()[-3000:]}")
    return [d["__exit__"] if "__exit__" in d else SimpleNamespace(**d)
            for d in json.loads(proc.stdout.strip().splitlines()[-1])]


# ---------------------------------------------------------------------------------------------------------
# Offline evaluation of checkpoints
# ---------------------------------------------------------------------------------------------------------

_DATA_CACHE: Dict[tuple, tuple] = {}
_CHECKED: set = set()  # datasets whose offline scoring was compared with train.py's own final record


def test_data(dataset: str, seq_len: int):
    """(train length, test set, vocab size or None), cached."""
    key = (dataset, seq_len if dataset == "shakespeare" else None)
    if key not in _DATA_CACHE:
        datasets = common.load_example("datasets")
        if dataset == "fashion-mnist":
            train, test = datasets.load_fashion_mnist(None)
            _DATA_CACHE[key] = (len(train), test, None)
        else:
            train, test, vocab = datasets.load_shakespeare(None, seq_len=seq_len)
            _DATA_CACHE[key] = (len(train), test, vocab)
    return _DATA_CACHE[key]


def evaluate_checkpoint(path: Path, test_set, vocab: Optional[int], world: int, test_batch_size: int,
                        test_batches: Optional[int]) -> dict:
    """Score a checkpoint's model on the test examples train.py's evaluate() would use with ``world`` ranks."""
    import torch
    import torch.nn.functional as F
    build_model = common.load_example("models").build_model

    torch.set_num_threads(1)  # the scoring shares the CPUs with the next runs and other work
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    cfg = ckpt["config"]
    if cfg["model"] == "lstm":
        model = build_model("lstm", vocab_size=vocab, hidden=cfg["lstm_hidden"], layers=cfg["lstm_layers"])
    else:
        model = build_model(cfg["model"])
    model.load_state_dict(ckpt["model"])
    model.eval()
    x_all, y_all = test_set.tensors
    n = len(test_set)
    loss_sum = correct = count = 0.0
    with torch.no_grad():
        for r in range(world):
            mine = torch.arange(r, n, world)
            n_batches = math.ceil(mine.numel() / test_batch_size)
            if test_batches is not None:
                n_batches = min(n_batches, test_batches)
            for b in range(n_batches):
                idx = mine[b * test_batch_size:(b + 1) * test_batch_size]
                logits, y = model(x_all[idx]), y_all[idx]
                if logits.dim() == 3:
                    logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += float((logits.argmax(dim=-1) == y).sum())
                count += y.numel()
    test_loss = loss_sum / count if count else float("nan")
    counters = ckpt["counters"]
    out = {"epoch": int(ckpt["epoch"]) + (1 if ckpt["batch_in_epoch"] else 0), "step": int(ckpt["step"]),
           "test_loss": test_loss, "wall_time": float(ckpt["wall_time"])}
    if cfg["dataset"] == "shakespeare":
        out["test_perplexity"] = math.exp(min(test_loss, 700.0))
        out["test_char_accuracy"] = correct / count if count else None
    else:
        out["test_accuracy"] = correct / count if count else None
    out.update({k: float(v) for k, v in counters.items()})
    out["density"] = counters["elements_sent"] / counters["elements_total"] if counters["elements_total"] else 0.0
    out.update({"compressor": cfg["compressor"], "ratio": cfg["ratio"], "value_dtype": cfg["value_dtype"],
                "world_size": cfg["world_size"], "dataset": cfg["dataset"], "model": cfg["model"], "final": False,
                "source": "checkpoint"})
    return out


# ---------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------

def train_dataset(dataset: str) -> str:
    return "fashion-mnist" if dataset.startswith("fashion-mnist") else dataset


def metric_key(dataset: str) -> str:
    return "test_perplexity" if dataset == "shakespeare" else "test_accuracy"


def run_name(dataset: str, method: str, ratio: Optional[float], warmup: bool, seed: int) -> str:
    return (f"{dataset}_{method}" + ("" if ratio is None else f"_r{ratio:g}") + ("_wu" if warmup else "")
            + f"_s{seed}")


def read_jsonl(path: Path) -> List[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def steps_per_epoch(args, dataset: str, batch_size: int, seq_len: int) -> int:
    n_train, _, _ = test_data(train_dataset(dataset), seq_len)
    return math.ceil(math.ceil(n_train / args.np) / batch_size)  # DistributedSampler, no drop_last


def grid(args) -> List[dict]:
    """Every planned run (seed-major, so an interrupted grid has whole seeds)."""
    variants = {"on": [True], "off": [False], "both": [True, False]}[args.warmup]
    runs = []
    for seed in args.seeds:
        for ds in args.datasets:
            for m in args.methods:
                for wu in ([False] if m == "dense" else variants):
                    for ratio in (args.ratios if uses_ratio(m) else [None]):
                        runs.append({"dataset": ds, "method": m, "ratio": ratio, "warmup": wu, "seed": seed})
    return runs


def train_argv_for(args, run: dict, spe: Optional[int]) -> List[str]:
    ds, m = run["dataset"], run["method"]
    name = run_name(ds, m, run["ratio"], run["warmup"], run["seed"])
    compressor = "none" if m == "dense" else ("powersgd" if is_powersgd(m) else m)
    argv = ["--dataset", train_dataset(ds), "--compressor", compressor, "--seed", str(run["seed"]),
            "--metrics-out", str(args.out_dir / f"{name}.jsonl"), "--no-progress", "--log-every", "30",
            "--test-batch-size", str(args.test_batch_size)]
    if ds in DEEP_MODELS:
        argv += ["--model", DEEP_MODELS[ds], "--epochs", str(args.resnet_epochs)]
    elif ds == "fashion-mnist":
        argv += ["--epochs", str(args.epochs)]
    if run["ratio"] is not None:
        argv += ["--ratio", repr(run["ratio"])]
    if is_powersgd(m):
        argv += ["--powersgd-rank", m[len("powersgd"):]]
    if run["warmup"]:
        argv += ["--dense-rounds", str(args.dense_rounds)]
        if uses_ratio(m):
            w = args.density_warmup if args.density_warmup is not None else spe
            argv += ["--density-warmup", str(w), "--density-start", repr(args.density_start)]
    else:  # train.py's defaults include the recommended warm-up for sparse compressors: turn it off
        argv += ["--dense-rounds", "0", "--density-warmup", "0"]
    max_steps = args.max_steps_shakespeare if ds == "shakespeare" else args.max_steps_fashion
    if max_steps is not None:
        argv += ["--max-steps", str(max_steps)]
    if args.test_batches is not None:
        argv += ["--test-batches", str(args.test_batches)]
    if args.lr_warmup_steps is not None:
        argv += ["--warmup-steps", str(args.lr_warmup_steps)]
    return argv + shlex.split(args.train_args)


def plan_runs(args) -> List[dict]:
    runs = grid(args)
    # steps per epoch (for the default density warm-up of one epoch): resolve a dense argv per dataset first
    spe = {}
    for ds in args.datasets:
        probe = train_argv_for(args, {"dataset": ds, "method": "dense", "ratio": None, "warmup": False, "seed": 0},
                               None)
        res = resolve_train_args([probe])[0]
        if not isinstance(res, SimpleNamespace):
            raise SystemExit(f"train.py rejects {' '.join(probe)} (exit {res})")
        spe[ds] = steps_per_epoch(args, ds, res.batch_size, res.seq_len)
    argvs = [train_argv_for(args, r, spe[r["dataset"]]) for r in runs]
    plans = []
    for run, argv, resolved in zip(runs, argvs, resolve_train_args(argvs)):
        name = run_name(run["dataset"], run["method"], run["ratio"], run["warmup"], run["seed"])
        if not isinstance(resolved, SimpleNamespace):
            raise SystemExit(f"train.py rejects the arguments of run {name}: {' '.join(argv)} (exit {resolved})")
        total = resolved.epochs * spe[run["dataset"]]
        if resolved.max_steps is not None:
            total = min(total, resolved.max_steps)
        ckpt_dir = args.out_dir / "checkpoints" / name
        every = 0
        argv = list(argv)
        if args.eval_points > 0 and total > 1:
            every = max(1, math.ceil(total / args.eval_points))
            argv += ["--checkpoint-dir", str(ckpt_dir), "--checkpoint-every", str(every), "--keep-checkpoints", "0"]
        if args.channel_stats:
            argv += ["--channel-stats", str(args.out_dir / "channels" / f"{name}.json")]
        cmd = common.launch_ranks(args.np, [TRAIN, *argv])
        plans.append(dict(run, name=name, cmd=cmd, total_steps=total, steps_per_epoch=spe[run["dataset"]],
                          checkpoint_every=every, ckpt_dir=ckpt_dir if every else None,
                          dense_rounds=args.dense_rounds if run["warmup"] else 0,
                          density_warmup=(resolved.density_warmup if run["warmup"] else 0),
                          seq_len=resolved.seq_len, test_batch_size=resolved.test_batch_size,
                          test_batches=resolved.test_batches,
                          settings={"epochs": resolved.epochs, "max_steps": resolved.max_steps,
                                    "batch_size": resolved.batch_size, "lr": resolved.lr,
                                    "lr_warmup_steps": args.lr_warmup_steps, "np": args.np,
                                    "test_batches": resolved.test_batches,
                                    "test_batch_size": resolved.test_batch_size,
                                    "curve_test_batches": args.curve_test_batches,
                                    "eval_points": args.eval_points,
                                    "density_start": args.density_start if run["warmup"] and uses_ratio(run["method"])
                                    else None}))
    return plans


def execute_run(args, plan: dict) -> dict:
    out = args.out_dir
    name = plan["name"]
    metrics_path = out / f"{name}.jsonl"
    log_path = out / "logs" / f"{name}.log"
    curve_path = out / "curves" / f"{name}.jsonl"
    record_path = out / "runs" / f"{name}.json"

    if args.reuse and record_path.is_file():
        try:
            old = json.loads(record_path.read_text())
        except json.JSONDecodeError:
            old = None
        if old and old.get("command") == common.command_text(plan["cmd"]) and old.get("status") == "ok" \
                and old.get("settings") == json.loads(json.dumps(plan["settings"])):
            old["reused"] = True
            return old

    for path in (metrics_path, curve_path, log_path):
        if path.exists():
            path.unlink()
    if plan["ckpt_dir"] is not None and plan["ckpt_dir"].exists():
        shutil.rmtree(plan["ckpt_dir"])
    rc, output, seconds = common.run_command(plan["cmd"], timeout=args.run_timeout, log_path=log_path)
    status = "ok" if rc == 0 else ("timeout" if rc is None else f"failed (rc {rc})")
    records = read_jsonl(metrics_path)
    for r in records:
        r.setdefault("source", "train.py")
    final = next((r for r in reversed(records) if r.get("final")), records[-1] if records else None)
    if status == "ok" and final is None:
        status = "no metrics"

    points = {r["step"]: r for r in records}
    eval_check = eval_error = None
    eval_seconds = 0.0
    if plan["ckpt_dir"] is not None and plan["ckpt_dir"].is_dir():
        t0 = time.monotonic()
        _, test_set, vocab = test_data(train_dataset(plan["dataset"]), plan["seq_len"])
        try:
            for ck in sorted(plan["ckpt_dir"].glob("ckpt-step*.pt"), key=lambda p: int(p.stem[len("ckpt-step"):])):
                step = int(ck.stem[len("ckpt-step"):])
                if step in points and plan["dataset"] in _CHECKED:
                    continue  # train.py scored it; the offline scoring is checked once per dataset
                check = step in points  # the consistency check scores exactly what train.py scored
                res = evaluate_checkpoint(ck, test_set, vocab, args.np, plan["test_batch_size"],
                                          plan["test_batches"] if check else args.curve_test_batches)
                if res["step"] in points:
                    mine, theirs = res.get("test_loss"), points[res["step"]].get("test_loss")
                    if mine is not None and theirs is not None:
                        eval_check = max(eval_check or 0.0, abs(mine - theirs))
                        _CHECKED.add(plan["dataset"])
                else:
                    res["epoch_progress"] = res["step"] / plan["steps_per_epoch"]
                    res["test_batches"] = args.curve_test_batches
                    points[res["step"]] = res
        except Exception as exc:  # a damaged checkpoint must not lose the run's own metrics
            eval_error = f"{type(exc).__name__}: {exc}"
        eval_seconds = time.monotonic() - t0
        if not args.keep_checkpoints:
            shutil.rmtree(plan["ckpt_dir"], ignore_errors=True)
    curve = [points[s] for s in sorted(points)]
    channels_path = out / "channels" / f"{name}.json"
    channels = json.loads(channels_path.read_text()) if args.channel_stats and channels_path.is_file() else None
    if curve:
        curve_path.parent.mkdir(parents=True, exist_ok=True)
        curve_path.write_text("".join(json.dumps(r) + "\n" for r in curve))
    keys = ("step", "wall_time", "test_accuracy", "test_perplexity", "test_char_accuracy", "test_loss",
            "bytes_sent", "bytes_dense", "density", "source")
    row = {k: plan[k] for k in ("name", "dataset", "method", "ratio", "warmup", "seed", "total_steps",
                                "steps_per_epoch", "checkpoint_every", "dense_rounds", "density_warmup", "settings")}
    row.update({"status": status, "returncode": rc, "launch_seconds": seconds, "eval_seconds": eval_seconds,
                "launched_by": common.command_text([sys.executable, *sys.argv]), "final": final,
                "points": [{k: r.get(k) for k in keys} for r in curve], "eval_check_abs_diff": eval_check,
                "eval_error": eval_error,
                "log_tail": None if status == "ok" else "\n".join(output.strip().splitlines()[-15:]),
                "reused": False, "channels": channels})
    common.write_record(record_path, row, command=plan["cmd"])  # + the launch, the commit, the date, the machine
    return row

# ---------------------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------------------

def step_mode(method: str) -> str:
    return "hvd-dense" if method == "dense" else method


def load_step_times(args) -> dict:
    """{model: {mode: {ratio or None: (seconds, file, commit)}}} from the --step-times JSON files (comma list
    allowed), the cells of --step-rate and --step-np; the first file that has a mode at a ratio wins (dense and
    PowerSGD do not depend on the ratio)."""
    if args.step_times is None:
        return {}
    return common.load_step_times(str(args.step_times).split(","), rate=args.step_rate, np_=args.step_np,
                                  by_ratio=lambda m: uses_ratio(m) and m not in ("hvd-dense", "hvd-fp16", "compute"))


def step_model_for(args, dataset: str) -> str:
    return args.step_model or {"fashion-mnist": "cnn", "fashion-mnist-resnet": "resnet18", "fashion-mnist-vgg": "vgg",
                               "shakespeare": "lstm"}[dataset]


def step_time(args, steps_table: dict, dataset: str, method: str, ratio: Optional[float]):
    """(seconds, note) of one step of ``method`` on the --step-rate link, or (None, why)."""
    modes = steps_table.get(step_model_for(args, dataset), {})
    by_ratio = modes.get(step_mode(method))
    if not by_ratio:
        return None, f"no {step_mode(method)} step time for model {step_model_for(args, dataset)}"
    if ratio is None or not uses_ratio(method):
        got = by_ratio.get(None) or next(iter(by_ratio.values()))
        return got[0], ""
    if ratio in by_ratio:
        return by_ratio[ratio][0], ""
    other = sorted(by_ratio, key=lambda r: abs(math.log(r / ratio)) if r else 1e9)[0]
    return by_ratio[other][0], f"step time measured at ratio {other:g}"


def modelled_seconds(steps: Optional[int], dense_rounds: int, t_method: Optional[float], t_dense: Optional[float]):
    if steps is None or t_method is None or (dense_rounds and t_dense is None):
        return None
    d = min(steps, dense_rounds)
    return d * (t_dense or 0.0) + (steps - d) * t_method


def load_records(out_dir: Path) -> List[dict]:
    rows = []
    for path in sorted((out_dir / "runs").glob("*.json")):
        try:
            rows.append(json.loads(path.read_text()))
        except json.JSONDecodeError:
            print(f"warning: unreadable run record {path.name}", file=sys.stderr)
    return [r for r in rows if r.get("status") == "ok" and r.get("final")]


def group_key(r: dict) -> tuple:
    return (r["dataset"], r["method"], r["ratio"], bool(r["warmup"]))


def group_label(method: str, ratio: Optional[float], warmup: bool) -> str:
    return method + ("" if ratio is None else f" r={ratio:g}") + (" +wu" if warmup else "")


def reached(dataset: str, value: Optional[float], target: float) -> bool:
    if value is None or not math.isfinite(value):
        return False
    return value <= target if dataset == "shakespeare" else value >= target


def analyse(args, records: List[dict]) -> Tuple[List[dict], dict]:
    steps_table = load_step_times(args)
    groups: Dict[tuple, List[dict]] = {}
    for r in records:
        groups.setdefault(group_key(r), []).append(r)
    dense_final = {}
    for (ds, m, ratio, wu), runs in groups.items():
        if m == "dense":
            dense_final[ds] = common.mean_std([(x["final"] or {}).get(metric_key(ds)) for x in runs])[0]
    targets = {ds: (args.target_accuracy if ds != "shakespeare" else
                    (None if dense_final.get(ds) is None else (1 + args.ppl_tolerance) * dense_final[ds]))
               for ds in dict.fromkeys(r["dataset"] for r in records)}
    out = []
    def order(kv):  # dense first, then with warm-up before without, ratios descending (PowerSGD between)
        ds, m, ratio, wu = kv[0]
        return (ds, m != "dense", not wu, -(ratio if ratio is not None else 0.005),
                list(DEFAULT_METHODS).index(m) if m in DEFAULT_METHODS else 99, m)

    for (ds, m, ratio, wu), runs in sorted(groups.items(), key=order):
        runs = sorted(runs, key=lambda x: x["seed"])
        key, target = metric_key(ds), targets.get(ds)
        t_m, note = step_time(args, steps_table, ds, m, ratio)
        t_d, _ = step_time(args, steps_table, ds, "dense", None)
        settings = {json.dumps(x.get("settings"), sort_keys=True) for x in runs}
        per_run = []
        for x in runs:
            f = x["final"]
            sts = next((p["step"] for p in x["points"] if target is not None and reached(ds, p.get(key), target)), None)
            wall = next((p["wall_time"] for p in x["points"] if target is not None and reached(ds, p.get(key), target)),
                        None)
            loss = f.get("test_loss")
            acc = f.get("test_accuracy")
            diverged = (loss is None or not math.isfinite(loss)) or (ds != "shakespeare" and acc is not None
                                                                    and acc < args.diverge_accuracy)
            per_run.append({"seed": x["seed"], "final": f.get(key), "test_loss": loss,
                            "bytes_vs_dense": f["bytes_sent"] / f["bytes_dense"] if f.get("bytes_dense") else None,
                            "bytes_sent": f.get("bytes_sent"), "density": f.get("density"), "steps": f.get("step"),
                            "wall_time": f.get("wall_time"), "steps_to_target": sts, "wall_to_target": wall,
                            "modelled_to_target": modelled_seconds(sts, x["dense_rounds"], t_m, t_d),
                            "modelled_total": modelled_seconds(f.get("step"), x["dense_rounds"], t_m, t_d),
                            "diverged": diverged})
        g = {"dataset": ds, "method": m, "ratio": ratio, "warmup": wu, "label": group_label(m, ratio, wu),
             "metric": key, "target": target, "n": len(runs), "seeds": [x["seed"] for x in runs],
             "settings_consistent": len(settings) == 1, "settings": runs[0].get("settings"),
             "dense_rounds": runs[0]["dense_rounds"], "density_warmup": runs[0]["density_warmup"],
             "step_time_s": t_m, "step_time_note": note, "step_time_dense_s": t_d, "runs": per_run,
             "n_reached": sum(p["steps_to_target"] is not None for p in per_run),
             "n_diverged": sum(p["diverged"] for p in per_run),
             "channels": channel_means([x.get("channels") for x in runs])}
        for field in ("final", "bytes_vs_dense", "bytes_sent", "density", "steps", "wall_time", "steps_to_target",
                      "wall_to_target", "modelled_to_target", "modelled_total"):
            g[field + "_mean"], g[field + "_std"] = common.mean_std([p[field] for p in per_run])
        # mean curve over the steps every seed has
        common_steps = set.intersection(*[{p["step"] for p in x["points"] if p.get(key) is not None} for x in runs])
        curve = []
        for s in sorted(common_steps):
            vals = [next(p for p in x["points"] if p["step"] == s) for x in runs]
            mv, sv = common.mean_std([v.get(key) for v in vals])
            bm, _ = common.mean_std([v.get("bytes_sent") for v in vals])
            curve.append({"step": s, "epoch": s / runs[0]["steps_per_epoch"], "mean": mv, "std": sv,
                          "bytes_sent": bm, "modelled_s": modelled_seconds(s, runs[0]["dense_rounds"], t_m, t_d)})
        g["curve"] = curve
        out.append(g)
    dense_groups = {g["dataset"]: g for g in out if g["method"] == "dense"}
    for g in out:
        d = dense_groups.get(g["dataset"])
        g["delta_vs_dense"] = None
        if d and g["final_mean"] is not None and d["final_mean"] is not None:
            g["delta_vs_dense"] = common.against_dense(g["final_mean"], d["final_mean"],
                                                       points=g["metric"] == "test_accuracy")
    return out, {"targets": targets, "step_times": steps_table}


def find(groups, ds, method, ratio, warmup):
    for g in groups:
        if g["dataset"] == ds and g["method"] == method and g["ratio"] == ratio and (g["warmup"] == warmup or method == "dense"):
            return g
    return None


def verdicts(args, groups: List[dict]) -> List[dict]:
    out = []

    def add(target, holds, detail):
        out.append({"target": target, "holds": holds, "detail": detail})

    fm = "fashion-mnist"
    d, a, t = find(groups, fm, "dense", None, False), find(groups, fm, "adtopk", 0.01, True), find(groups, fm, "topk", 0.01, True)
    ep = lambda g: (g["settings"] or {}).get("epochs")  # noqa: E731
    if d and a:
        diff = 100 * (a["final_mean"] - d["final_mean"])
        add(f"Fashion-MNIST 0.01 +wu: ADTopk within 0.5 pt of dense (mean of {a['n']} seeds, {ep(a)} epoch(s))",
            diff >= -0.5, f"ADTopk {100 * a['final_mean']:.2f} ± {100 * (a['final_std'] or 0):.2f} % vs dense "
                          f"{100 * d['final_mean']:.2f} ± {100 * (d['final_std'] or 0):.2f} % ({diff:+.2f} pt)")
    else:
        add("Fashion-MNIST 0.01 +wu: ADTopk within 0.5 pt of dense", None, "n/a (runs missing)")
    if a and t:
        sd = max(a["final_std"] or 0.0, t["final_std"] or 0.0)
        diff = 100 * (a["final_mean"] - t["final_mean"])
        add("Fashion-MNIST 0.01 +wu: ADTopk not worse than Top-k by more than one std (the larger of the two)",
            diff >= -100 * sd, f"ADTopk {100 * a['final_mean']:.2f} vs Top-k {100 * t['final_mean']:.2f} % "
                               f"({diff:+.2f} pt; one std = {100 * sd:.2f} pt)")
    else:
        add("Fashion-MNIST 0.01 +wu: ADTopk not worse than Top-k by more than one std", None, "n/a (runs missing)")
    sd_, sa = find(groups, "shakespeare", "dense", None, False), find(groups, "shakespeare", "adtopk", 0.01, True)
    if sd_ and sa:
        ratio = sa["final_mean"] / sd_["final_mean"]
        add(f"Shakespeare 0.01 +wu: ADTopk perplexity within {100 * args.ppl_tolerance:g}% of dense ({sa['n']} "
            f"seed(s), {sa['runs'][0]['steps']} steps)", ratio <= 1 + args.ppl_tolerance,
            f"ADTopk {sa['final_mean']:.3f} vs dense {sd_['final_mean']:.3f} (x{ratio:.3f})")
    else:
        add(f"Shakespeare 0.01 +wu: ADTopk perplexity within {100 * args.ppl_tolerance:g}% of dense", None,
            "n/a (runs missing)")
    for ds in dict.fromkeys(g["dataset"] for g in groups):
        at3 = [g for g in groups if g["dataset"] == ds and g["ratio"] == 0.001 and g["warmup"]]
        if not at3:
            add(f"{ds} 0.001 +wu: no method diverges, ADTopk >= Top-k", None, "n/a (runs missing)")
            continue
        div = [f"{g['label']} ({g['n_diverged']}/{g['n']})" for g in at3 if g["n_diverged"]]
        add(f"{ds} 0.001 +wu: no method diverges ({', '.join(g['method'] for g in at3)})", not div,
            "diverged: " + ", ".join(div) if div else
            "none diverged; finals " + ", ".join(f"{g['method']} {fmt_metric(g, g['final_mean'])}" for g in at3))
        a3, t3 = find(groups, ds, "adtopk", 0.001, True), find(groups, ds, "topk", 0.001, True)
        if a3 and t3:
            better = a3["final_mean"] >= t3["final_mean"] if a3["metric"] == "test_accuracy" else \
                a3["final_mean"] <= t3["final_mean"]
            add(f"{ds} 0.001 +wu: ADTopk >= Top-k (mean of {a3['n']} / {t3['n']} seeds)", better,
                f"ADTopk {fmt_metric(a3, a3['final_mean'], a3['final_std'])} vs Top-k "
                f"{fmt_metric(t3, t3['final_mean'], t3['final_std'])}")
    div_all = [f"{g['label']} seed {p['seed']}" for g in groups for p in g["runs"] if p["diverged"]]
    add("(information) runs that diverged anywhere in the grid", None if not div_all else False,
        ", ".join(div_all) if div_all else "none")
    cands = [g for g in groups if g["dataset"] == fm and (g["method"] == "dense" or
                                                          (g["warmup"] and g["ratio"] in (0.01, None)))]
    timed = [g for g in cands if g["modelled_to_target_mean"] is not None]
    if a and timed:
        order = sorted(timed, key=lambda g: g["modelled_to_target_mean"])
        first = order[0]
        missing = [g["label"] for g in cands if g["modelled_to_target_mean"] is None]
        add(f"Fashion-MNIST, {args.step_rate} link: ADTopk (0.01 +wu) reaches {100 * args.target_accuracy:.0f}% first "
            "among dense and the 0.01 +wu methods (PowerSGD included)", first is a,
            "order by mean modelled seconds: " + ", ".join(
                f"{g['label']} {g['modelled_to_target_mean']:.1f} s ({g['n_reached']}/{g['n']})" for g in order)
            + (f"; never reached / no step time: {', '.join(missing)}" if missing else ""))
    else:
        add(f"Fashion-MNIST, {args.step_rate} link: ADTopk reaches the target first", None,
            "n/a (runs or step times missing)")
    return out


def fmt_metric(g: dict, v: Optional[float], sd: Optional[float] = None) -> str:
    if v is None:
        return "n/a"
    if g["metric"] == "test_accuracy":
        return f"{100 * v:.2f}" + ("" if sd is None else f" ± {100 * sd:.2f}") + " %"
    return f"{v:.3f}" + ("" if sd is None else f" ± {sd:.3f}") + " ppl"


def pm(m: Optional[float], s: Optional[float], spec: str, scale: float = 1.0) -> str:
    if m is None:
        return "n/a"
    return format(scale * m, spec) + ("" if s is None else " ± " + format(scale * s, spec))


def channel_means(per_run: List[Optional[dict]]) -> Optional[dict]:
    """Per layer, over the seeds with train.py --channel-stats: mean steady-state update density and share of
    output channels updated per step, and the smallest share any seed saw after the warm-up."""
    runs = [c for c in per_run if c]
    if not runs:
        return None
    out = {}
    for layer, first in runs[0]["layers"].items():
        rows = [c["layers"][layer] for c in runs if layer in c["layers"] and c["layers"][layer]["steady_steps"]]
        if rows:
            out[layer] = {"shape": first["shape"], "path": first["path"], "seeds": len(rows),
                          "density": statistics.fmean(r["steady_density"] for r in rows),
                          "channel_share": statistics.fmean(r["steady_channel_share"] for r in rows),
                          "min_channel_share": min(r["steady_min_channel_share"] for r in rows)}
    return out


def channel_table(groups: List[dict]) -> str:
    """Markdown: per dataset and layer, each group's steady-state density / share of channels updated."""
    lines = []
    for ds in dict.fromkeys(g["dataset"] for g in groups):
        gs = [g for g in groups if g["dataset"] == ds and g.get("channels")]
        if not gs:
            continue
        layers = list(dict.fromkeys(layer for g in gs for layer in g["channels"]))
        lines += [f"\n{ds}: per layer after the compression warm-up, mean over seeds: density of the applied update "
                  "/ share of output channels updated per step (smallest share seen)\n",
                  "| layer | shape | " + " | ".join(g["label"] for g in gs) + " |",
                  "|---|---|" + "---|" * len(gs)]
        for layer in layers:
            cells = []
            for g in gs:
                c = g["channels"].get(layer)
                cells.append("-" if c is None else
                             f"{c['density']:.4f} / {100 * c['channel_share']:.1f}% ({100 * c['min_channel_share']:.0f}%)")
            shape = next(g["channels"][layer]["shape"] for g in gs if layer in g["channels"])
            lines.append(f"| {layer} | {'x'.join(map(str, shape))} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n" if lines else "")


def markdown_table(args, groups: List[dict]) -> str:
    lines = []
    for ds in dict.fromkeys(g["dataset"] for g in groups):
        gs = [g for g in groups if g["dataset"] == ds]
        acc = gs[0]["metric"] == "test_accuracy"
        tname = (f"{100 * args.target_accuracy:.0f}%" if acc else
                 f"ppl <= {1 + args.ppl_tolerance:g} x dense")
        lines += [f"**{ds}** ({'test accuracy' if acc else 'test perplexity'}; mean ± sample std over seeds; "
                  f"target {tname}; modelled time = steps x bench_step.py step time on the {args.step_rate} link)", "",
                  f"| method | seeds | final {'accuracy %' if acc else 'perplexity'} | vs dense | bytes / dense | "
                  f"density | steps to {tname} (reached) | modelled s to target | step ms ({args.step_rate}) | "
                  "measured wall s (this CPU) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for g in gs:
            delta = "(base)" if g["method"] == "dense" else (
                "n/a" if g["delta_vs_dense"] is None else
                (f"{g['delta_vs_dense']:+.2f} pt" if acc else f"x{g['delta_vs_dense']:.3f}"))
            st = "n/a" if g["step_time_s"] is None else f"{1e3 * g['step_time_s']:.1f}" + (
                "*" if g["step_time_note"] else "")
            lines.append(
                f"| {g['label']} | {g['n']} | {pm(g['final_mean'], g['final_std'], '.2f', 100 if acc else 1)} | "
                f"{delta} | {pm(g['bytes_vs_dense_mean'], g['bytes_vs_dense_std'], '.4f')} | "
                f"{pm(g['density_mean'], g['density_std'], '.4f')} | "
                f"{pm(g['steps_to_target_mean'], g['steps_to_target_std'], '.0f')} ({g['n_reached']}/{g['n']}) | "
                f"{pm(g['modelled_to_target_mean'], g['modelled_to_target_std'], '.1f')} | {st} | "
                f"{pm(g['wall_time_mean'], g['wall_time_std'], '.1f')} |")
        notes = sorted({g["step_time_note"] for g in gs if g["step_time_note"]})
        if notes:
            lines.append("")
            lines.append("\\* " + "; ".join(notes))
        lines.append("")
    return "\n".join(lines)


def make_plots(args, groups: List[dict], plot_dir: Path) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for ds in dict.fromkeys(g["dataset"] for g in groups):
        gs = [g for g in groups if g["dataset"] == ds]
        settings = sorted({(g["ratio"], g["warmup"]) for g in gs if g["ratio"] is not None},
                          key=lambda s: (-s[0], not s[1]))
        if not settings:
            settings = sorted({(None, g["warmup"]) for g in gs}, key=lambda s: not s[1])
        for ratio, wu in settings:
            sel = [g for g in gs if g["method"] == "dense" or
                   ((g["ratio"] == ratio or g["ratio"] is None) and g["warmup"] == wu)]
            if len(sel) < 2 and ratio is not None:
                continue
            fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
            for gi, g in enumerate(sel):  # one colour per method in all three panels (a panel may skip one)
                c = [p for p in g["curve"] if p["mean"] is not None]
                if not c:
                    continue
                y = [p["mean"] * (100 if g["metric"] == "test_accuracy" else 1) for p in c]
                s = [(p["std"] or 0.0) * (100 if g["metric"] == "test_accuracy" else 1) for p in c]
                xs = [("epoch", [p["epoch"] for p in c]), ("bytes", [p["bytes_sent"] / 1e6 for p in c]),
                      ("time", [p["modelled_s"] for p in c])]
                style = "--" if g["method"] == "dense" else ("-." if is_powersgd(g["method"]) else "-")
                for ax, (name, x) in zip(axes, xs):
                    if any(v is None for v in x):
                        continue
                    color = f"C{gi % 10}"
                    ax.plot(x, y, style, marker=".", color=color, label=f"{g['label']} (n={g['n']})")
                    ax.fill_between(x, [a - b for a, b in zip(y, s)], [a + b for a, b in zip(y, s)],
                                    color=color, alpha=0.15)
            ylabel = "test accuracy (%)" if gs[0]["metric"] == "test_accuracy" else "test perplexity"
            for ax, xl in zip(axes, ("epochs", "bytes sent, all ranks (MB, log)",
                                     f"modelled wall time on {args.step_rate} (s)")):
                ax.set_xlabel(xl)
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                if gs[0]["metric"] == "test_accuracy":
                    ax.axhline(100 * args.target_accuracy, color="grey", lw=0.8, ls=":")
                    lo = min((p["mean"] for g in sel for p in g["curve"] if p["mean"] is not None), default=0.5)
                    ax.set_ylim(max(100 * lo - 2, 40.0), None)
                else:
                    ax.set_yscale("log")
            axes[1].set_xscale("log")
            axes[0].legend(fontsize=7)
            title = f"{ds}: " + ("" if ratio is None else f"ratio {ratio:g}, ") + \
                ("with warm-up" if wu else "no warm-up") + " — mean over seeds, band ±1 std"
            fig.suptitle(title)
            fig.tight_layout()
            path = plot_dir / (f"{ds}" + ("" if ratio is None else f"_r{ratio:g}") + ("_wu" if wu else "_nowu") + ".png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(str(path))
    return files


def report(args, start) -> None:
    records = load_records(args.out_dir)
    if not records:
        print("no finished runs in", args.out_dir)
        return
    groups, extra = analyse(args, records)
    text = markdown_table(args, groups) + channel_table(groups)
    checks = verdicts(args, groups)
    vtext = "\n".join(f"- [{'INFO' if c['target'].startswith('(information)') else 'n/a' if c['holds'] is None else ('MET' if c['holds'] else 'MISSED')}] {c['target']}: "
                      f"{c['detail']}" for c in checks)
    print()
    print(text)
    print("Targets (reported, not asserted):")
    print(vtext)
    inconsistent = [g["label"] for g in groups if not g["settings_consistent"]]
    if inconsistent:
        print("warning: runs with different settings grouped together: " + ", ".join(inconsistent), file=sys.stderr)
    bad = [r["name"] for r in records if (r.get("eval_check_abs_diff") or 0) > 1e-3]
    if bad:
        print("warning: checkpoint scoring disagrees with train.py's own test loss: " + ", ".join(bad), file=sys.stderr)
    plot_dir = (args.plot_dir or args.out_dir).resolve()
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = [] if args.no_plots else make_plots(args, groups, plot_dir)
    for p_ in plots:
        print("plot:", p_)
    info = common.machine_info()
    summary = {"benchmark": "convergence", "machine": info, "analysed_seconds": time.time() - start,
               "analysis_settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                                     if k in ("target_accuracy", "ppl_tolerance", "diverge_accuracy", "step_rate",
                                              "step_np", "step_model")},
               "step_times_files": None if args.step_times is None else [Path(p).name for p in str(args.step_times).split(",")],
               "targets_by_dataset": extra["targets"],
               "groups": groups, "verdicts": checks, "plots": [Path(p_).name for p_ in plots],
               "runs": [{k: r.get(k) for k in ("name", "command", "status", "launch_seconds", "eval_seconds",
                                                "eval_check_abs_diff", "eval_error")} for r in records]}
    common.write_record(args.out_dir / "summary.json", summary)  # + the command, the commit and the date
    (args.out_dir / "table.md").write_text(text + "\nTargets (reported, not asserted):\n\n" + vtext + "\n")
    if args.plot_dir:
        common.write_record(plot_dir / "summary.json", summary)
        (plot_dir / "table.md").write_text(text + "\nTargets (reported, not asserted):\n\n" + vtext + "\n")
    print(f"wrote {args.out_dir / 'summary.json'} and table.md")


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    ok = True
    if not args.analyse_only:
        plans = plan_runs(args)
        print(f"bench_convergence: {len(plans)} runs, {args.np} ranks, seeds {args.seeds}, warm-up {args.warmup}, "
              f"eval points {args.eval_points}; out {args.out_dir}", flush=True)
        for i, plan in enumerate(plans, 1):
            print(f"[{i}/{len(plans)}] {plan['name']}: {plan['total_steps']} steps ...", end=" ", flush=True)
            row = execute_run(args, plan)
            f = row["final"] or {}
            key = metric_key(plan["dataset"])
            v = f.get(key)
            print(f"{row['status']}{' (reused)' if row.get('reused') else ''}, {row['launch_seconds']:.1f} s, "
                  f"{key} {'n/a' if v is None else format(v, '.4f')}", flush=True)
            if row["status"] != "ok" and row.get("log_tail"):
                print("    " + row["log_tail"].replace("\n", "\n    "), flush=True)
            ok = ok and row["status"] == "ok"
    report(args, start)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
