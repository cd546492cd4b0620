#!/usr/bin/env python
"""The convergence grid of per-step compressors against local steps (GPT, or the CNN), resumable, then a table.

Each run is ``examples/train.py --dataset shakespeare --model gpt`` (AdamW and every other setting at the
job's defaults, so each method has its recommended warm-up; ``--workload cnn``: ``--dataset fashion-mnist``,
the small CNN, SGD with momentum, an lr warm-up of 100 steps, scored by test accuracy) on 2 ranks for
``--steps`` optimizer steps,
one launch at a time, at the lowest priority (``nice`` 19 and its workers' sessions at autogroup nice 19, so
tests and other work on the machine come first; ``horovodrun --gloo``, or ``torchrun`` for the DDP engine's
methods).
A run writes a checkpoint every ``--checkpoint-every`` steps and is started with ``--resume``: stop the
grid at any time (or lose the machine) and the next invocation skips finished runs (their summary JSON
exists) and continues unfinished ones from their newest checkpoint. A finished run's summary (train.py's
``--summary-json``) is rewritten as a record (``common.write_record``: the launch as its command, the commit,
the date, the machine; ``launched_by``: this script's command line). Run it from a detached worktree of
committed code, so that edits to the checkout do not change a grid that is under way::

    git worktree add --detach ../grid HEAD && cd ../grid
    python benchmarks/gpt_grid.py --out ../grid-runs --group transformer --seeds 1,2      # the per-step compressors
    python benchmarks/gpt_grid.py --out ../grid-runs --group local --seeds 1,2            # the local-steps methods
    python benchmarks/gpt_grid.py --out ../grid-runs --analyse [--step-times step.json]   # the table
    python benchmarks/gpt_grid.py --workload cnn --out ../cnn-runs --group local --steps 1407  # Fashion-MNIST
    python benchmarks/gpt_grid.py --workload gpt-fp32 --out ../gpt32-runs --steps 400 --methods ...  # no bf16 CPU

``--analyse`` reads every summary in ``--out`` and writes ``table.md`` and ``table.json`` there: per method
the final test loss (mean +- sample std over the seeds present), its ratio to dense's, bytes sent against
a dense allreduce at every step, and the modelled time at 1 Gbit/s and 100 Mbit/s. The time model is a
lower bound: ``steps x t_compute + bytes sent per rank x 8 / rate``, where ``t_compute`` is the compute-only
step that ``benchmarks/bench_step.py --models gpt`` measured (``--step-times``; without it the column is
left out; ``--compute-step S`` gives it directly) and the bytes are what the optimizer counted (overlap of communication with compute, latency and
the collectives' algorithm factor are ignored).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import common  # benchmarks/common.py (this script's directory is on the path): the launch and the records

REPO = common.REPO_ROOT
RUN_FLAGS = ["--no-progress", "--log-every", "100", "--keep-checkpoints", "1", "--resume"]
# workload -> (job flags, optimizer steps per epoch on 2 ranks: --epochs covers --steps, --max-steps stops)
WORKLOADS = {"gpt": (["--dataset", "shakespeare", "--model", "gpt", "--bf16"], 500),
             # float32: for CPUs without native bfloat16, where bf16 autocast runs several times slower
             "gpt-fp32": (["--dataset", "shakespeare", "--model", "gpt"], 500),
             "cnn": (["--dataset", "fashion-mnist", "--model", "cnn", "--warmup-steps", "100"], 469),
             # at 8 ranks: SGD's peak rate lr * W of the 2-rank runs (0.1 x 2 = 0.2; the job's 0.1 x 8 diverges)
             "cnn-w8": (["--dataset", "fashion-mnist", "--model", "cnn", "--warmup-steps", "100", "--lr", "0.025"],
                        469)}
SPARSELOCO_OUTER = ["--outer-lr", "1", "--outer-momentum", "0"]


def sparseloco(h: int, rule: str, ratio: str, decay: bool = False, bits: Optional[int] = None,
               group: Optional[int] = None) -> List[str]:
    """The job flags of a SparseLoCo-style run: ``rule`` at ratio 0.<ratio> on the pseudo-gradient every ``h`` steps."""
    flags = ["--compressor", rule, "--ratio", f"0.{ratio}", "--sync-every", str(h), *SPARSELOCO_OUTER]
    flags += ["--outer-feedback-decay", "0.95"] if decay else []
    flags += ["--outer-value-bits", str(bits)] if bits else []
    return flags + (["--outer-value-group", str(group)] if group else [])


def sparseloco_name(h: int, rule: str, ratio: str, decay: bool = False, bits: Optional[int] = None,
                    group: Optional[int] = None) -> str:
    return (f"sparseloco{h}_{rule}{ratio}" + ("_decay95" if decay else "") + (f"_q{bits}" if bits else "")
            + (f"g{group}" if group else ""))


def low_bit_dense(h: int, bits: int, group: Optional[int] = None, outer: Optional[List[str]] = None) -> List[str]:
    """Every entry of the pseudo-gradient as a ``bits``-bit code with error feedback (``--compressor none
    --outer-value-bits``), every ``h`` steps; DiLoCo's outer Nesterov unless ``outer`` says otherwise."""
    flags = ["--compressor", "none", "--sync-every", str(h), "--outer-value-bits", str(bits), *(outer or [])]
    return flags + (["--outer-value-group", str(group)] if group else [])


# name -> (engine, flags); the DDP engine's methods run under torchrun
METHODS: Dict[str, tuple] = {
    "dense": ("horovod", ["--compressor", "none"]),
    # "--min-fiber-len 1": one row or column per fiber, as these ran before the job joined the GPT's short rows
    "adtopk01": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1"]),
    # per-step ADTopk 0.01 through the owner-sharded exchange (horovod_adtopk.sharded): bytes per rank bounded in W
    "adtopk01_sharded": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1",
                                     "--exchange", "sharded"]),
    # variants of per-step ADTopk 0.01 tried on the CNN at 8 ranks (--workload cnn-w8): SGD momentum on the average
    # instead of DGC's momentum correction, error feedback on each rank's update, ratio 0.05 through the shards
    "adtopk01_nomc": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1",
                                  "--no-momentum-correction"]),
    "adtopk01_efupdate": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1",
                                      "--error-feedback-on", "update", "--no-momentum-correction"]),
    "adtopk05_sharded": ("horovod", ["--compressor", "adtopk", "--ratio", "0.05", "--min-fiber-len", "1",
                                     "--exchange", "sharded"]),
    # DGC's longer density warm-up: 4 of the CNN's 12 epochs (470 steps) from density 0.25 down to 0.01
    "adtopk01_dwu470": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1",
                                    "--density-warmup", "470"]),
    "adtopk01_sharded_dwu470": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1",
                                            "--exchange", "sharded", "--density-warmup", "470"]),
    # half the workload's learning rate (argparse keeps the last --lr)
    "adtopk01_lr0125": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "1",
                                    "--lr", "0.0125"]),
    "topk01": ("horovod", ["--compressor", "topk", "--ratio", "0.01"]),
    "adtopk05": ("horovod", ["--compressor", "adtopk", "--ratio", "0.05", "--min-fiber-len", "1"]),
    # short rows joined: every fiber at least 2,048 entries (16 rows of the width-128 GPT, k = 20 at 0.01)
    "adtopk01_join2048": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "2048",
                                      "--fiber-join", "rows"]),
    "adtopk01_joincols2048": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--min-fiber-len", "2048",
                                          "--fiber-join", "columns"]),
    # the same at Top-k 0.01's bytes (ratio 0.013: 76,944 payload bytes per step on the matrices against 78,550)
    "adtopk013_join2048": ("horovod", ["--compressor", "adtopk", "--ratio", "0.013", "--min-fiber-len", "2048",
                                       "--fiber-join", "rows"]),
    # the paper's interleaving: fiber rounds alternate with global top-k rounds
    "adtopki01": ("horovod", ["--compressor", "adtopk_i", "--ratio", "0.01", "--min-fiber-len", "1"]),
    "psgd4": ("horovod", ["--compressor", "powersgd", "--powersgd-rank", "4"]),
    "ddp_psgd4": ("ddp", ["--compressor", "powersgd", "--powersgd-rank", "4"]),
    "diloco10": ("horovod", ["--compressor", "none", "--sync-every", "10"]),
    "diloco50": ("horovod", ["--compressor", "none", "--sync-every", "50"]),
    # dense DiLoCo at the intervals of the 1- and 2-bit rows below: what the local steps cost without the rounding
    "diloco16": ("horovod", ["--compressor", "none", "--sync-every", "16"]),
    "diloco32": ("horovod", ["--compressor", "none", "--sync-every", "32"]),
    # dense DiLoCo at the bytes of the SparseLoCo-style rows (0.8% and 0.2% of dense's): the equal-bytes check
    "diloco125": ("horovod", ["--compressor", "none", "--sync-every", "125"]),
    "diloco500": ("horovod", ["--compressor", "none", "--sync-every", "500"]),
    # dense local SGD (periodic averaging: outer SGD lr 1 without momentum), DiLoCo's outer step for an SGD inner
    # optimizer whose momentum the outer Nesterov would compound
    "localsgd10": ("horovod", ["--compressor", "none", "--sync-every", "10", *SPARSELOCO_OUTER]),
    "localsgd50": ("horovod", ["--compressor", "none", "--sync-every", "50", *SPARSELOCO_OUTER]),
    "localsgd125": ("horovod", ["--compressor", "none", "--sync-every", "125", *SPARSELOCO_OUTER]),
    "localsgd500": ("horovod", ["--compressor", "none", "--sync-every", "500", *SPARSELOCO_OUTER]),
    "diloco10_adtopk01": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--sync-every", "10"]),
    "diloco10_adtopk05": ("horovod", ["--compressor", "adtopk", "--ratio", "0.05", "--sync-every", "10"]),
    "diloco50_adtopk01": ("horovod", ["--compressor", "adtopk", "--ratio", "0.01", "--sync-every", "50"]),
    "diloco50_adtopk05": ("horovod", ["--compressor", "adtopk", "--ratio", "0.05", "--sync-every", "50"]),
    # SparseLoCo's recipe (sparseloco()): error feedback on the sparse pseudo-gradient in place of outer momentum,
    # outer SGD lr 1; "_decay95": the memory decayed by 0.95 at every sync (SparseLoCo's beta); "_qB": B-bit
    # values and bit-packed indices (H = 12 and 15: under 0.2% of dense's bytes); "_qBgN": levels shared by runs of
    # whole fibers, at least N entries. Since value_group existed, the 1-D tensors travel as bfloat16 with
    # value_bits (about 0.04% of dense's bytes at H = 10 on the GPT, 0.08% before); q1/q2 rows measured before
    # that sent them in float32
    **{sparseloco_name(*cfg): ("horovod", sparseloco(*cfg)) for cfg in [
        (10, "adtopk", "01"), (10, "adtopk", "05"), (50, "adtopk", "05"),
        (10, "adtopk", "01", True), (10, "adtopk", "05", True), (10, "topk", "05", True), (50, "adtopk", "05", True),
        (10, "adtopk", "05", True, 2), (10, "adtopk", "05", True, 1), (12, "adtopk", "05", True, 2),
        (12, "adtopk", "05", True, 1), (15, "adtopk", "05", True, 2), (10, "adtopk", "05", True, 2, 64),
        (4, "adtopk", "05", True, 2),
        (12, "adtopk", "05", True, 2, 64), (10, "adtopk", "05", True, 1, 64)]},
    # the same with whole columns joined into fibers of >= 2,048 entries (the per-step GPT default's layout) at
    # ratio 0.04: 12-bit indices instead of 7 but one set of levels per fiber, the bytes of 0.05 with the paper's
    # fibers (0.99x per sync)
    "sparseloco12_adtopk04_decay95_q2g64_joincols2048": ("horovod", sparseloco(12, "adtopk", "04", True, 2, 64) + [
        "--min-fiber-len", "2048", "--fiber-join", "columns"]),
    # dense low-bit outer exchange: no indices, every entry a 1- or 2-bit code (levels per >= N entries), its
    # rounding in the error-feedback memory; under 0.2% of dense's bytes on the GPT at these H
    "diloco16_q1g1024": ("horovod", low_bit_dense(16, 1, 1024)),
    "diloco18_q1": ("horovod", low_bit_dense(18, 1)),
    "diloco32_q2g1024": ("horovod", low_bit_dense(32, 2, 1024)),
    "localsgd16_q1g1024": ("horovod", low_bit_dense(16, 1, 1024, SPARSELOCO_OUTER)),
    # the same every step: each rank's AdamW update, error feedback, 1 bit an entry (about 3.2% of dense's bytes)
    "update_q1g1024": ("horovod", low_bit_dense(1, 1, 1024, SPARSELOCO_OUTER)),
    # ADTopk on each rank's AdamW update every step (error feedback on the update, DeMo's place for it), 2-bit values
    "update_adtopk10_q2": ("horovod", sparseloco(1, "adtopk", "10", bits=2)),
    # between the two: ADTopk 0.25 on the pseudo-gradient of 4 local steps, 2-bit values, SparseLoCo's outer step
    # (about 2% of dense's bytes: the target "ADTopk within 2% of dense at <= 5% of its bytes" by local steps)
    sparseloco_name(4, "adtopk", "25", True, 2, 64): ("horovod", sparseloco(4, "adtopk", "25", True, 2, 64)),
    # the recipe with every payload gathered (--outer-exchange allgather); the row above runs the default, auto,
    # which from 3 ranks on shards the payloads among owners (horovod_adtopk.sharded)
    sparseloco_name(4, "adtopk", "25", True, 2, 64) + "_allgather": (
        "horovod", sparseloco(4, "adtopk", "25", True, 2, 64) + ["--outer-exchange", "allgather"]),
    # the same with global Top-k (its bit-packed indices address the whole tensor: about 3.6% of dense's bytes)
    sparseloco_name(4, "topk", "25", True, 2, 64): ("horovod", sparseloco(4, "topk", "25", True, 2, 64)),
}
GROUPS = {"transformer": ["dense", "adtopk01", "topk01", "adtopk05", "psgd4", "ddp_psgd4"],
          "local": ["dense", "adtopk01", "diloco10", "diloco50", "diloco10_adtopk01", "diloco10_adtopk05",
                    "diloco50_adtopk01", "diloco50_adtopk05"]}
RATES = {"1gbit": 1e9, "100mbit": 1e8}


def command(name: str, seed: int, out: Path, steps: int, checkpoint_every: int, np_: int,
            workload: str = "gpt") -> List[str]:
    """The launch of one run (:func:`run_grid` runs it at the lowest priority)."""
    engine, flags = METHODS[name]
    run = f"{name}_s{seed}"
    job_flags, per_epoch = WORKLOADS[workload]
    epochs = max(1, math.ceil(steps / per_epoch))
    job = ["examples/train.py", *job_flags, *RUN_FLAGS, "--epochs", str(epochs), "--max-steps", str(steps),
           "--seed", str(seed), "--checkpoint-every", str(checkpoint_every), "--checkpoint-dir", str(out / "ckpt" / run),
           "--summary-json", str(out / f"{run}.json"), "--metrics-out", str(out / f"{run}.jsonl"), *flags]
    return common.launch_ranks(np_, job, engine)


def run_grid(args) -> int:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = args.methods or GROUPS[args.group]
    env = {"PYTHONPATH": str(REPO), "HOROVOD_CYCLE_TIME": "1"}
    failed = 0
    for seed in args.seeds:
        for name in names:
            run = f"{name}_s{seed}"
            summary = out / f"{run}.json"
            if summary.exists():
                continue
            cmd = command(name, seed, out, args.steps, args.checkpoint_every, args.np, args.workload)
            print(f"{time.strftime('%H:%M:%S')} {run}: start", flush=True)
            # at the lowest priority; a launch stopped by the timeout is killed, the next invocation resumes it
            rc, _, seconds = common.run_command(cmd, args.run_timeout, env=env, lowest_priority=True,
                                                log_path=out / f"{run}.log")
            if rc == 0 and summary.exists():
                # train.py's summary, with the launch, the commit, the date and the machine (report.py reads them)
                common.write_record(summary, dict(json.loads(summary.read_text()), launched_by=common.command_text(
                    [sys.executable, *sys.argv])), command=cmd)
            print(f"{time.strftime('%H:%M:%S')} {run}: "
                  f"{'timeout (the next invocation resumes it)' if rc is None else f'rc {rc}'} after {seconds:.0f} s",
                  flush=True)
            failed += rc != 0
    return 1 if failed else 0


def compute_step(path: Optional[str]) -> Optional[float]:
    """The compute-only step of the gpt model from a bench_step.py JSON (its first gpt cell with one)."""
    if not path:
        return None
    got = common.load_step_times([path]).get("gpt", {}).get("compute")
    if not got:
        raise SystemExit(f"{path}: no gpt cell with a compute mode; run benchmarks/bench_step.py --models gpt")
    return float(got[None][0])


def analyse(args) -> int:
    out = Path(args.out)
    runs: Dict[str, List[dict]] = {}
    for path in sorted(out.glob("*_s*.json")):
        name = path.stem.rsplit("_s", 1)[0]
        if name in METHODS:
            runs.setdefault(name, []).append(json.loads(path.read_text()))
    if "dense" not in runs:
        raise SystemExit(f"no finished dense run in {out}: nothing to compare with")
    t_compute = args.compute_step if args.compute_step is not None else compute_step(args.step_times)
    # a test loss of None: the run diverged (NaN in the mean and the std)
    dense_loss, _ = common.mean_std([r["test_loss"] for r in runs["dense"]], finite_only=False)
    rows = []
    for name in METHODS:
        if name not in runs:
            continue
        rs = runs[name]
        loss, std = common.mean_std([r["test_loss"] for r in rs], finite_only=False)
        row = {"method": name, "seeds": len(rs), "test_loss": loss, "std": std,
               "vs_dense": common.against_dense(loss, dense_loss, points=False) - 1,
               "bytes_vs_dense": statistics.mean(r["bytes_sent"] / r["bytes_dense"] for r in rs),
               "steps": statistics.mean(r["step"] for r in rs)}
        accs = [r.get("test_accuracy") for r in rs]
        if all(a is not None for a in accs):  # the CNN: accuracy, and its difference to dense's in points
            row["test_accuracy"], row["accuracy_std"] = common.mean_std(accs, finite_only=False)
            row["accuracy_vs_dense_pt"] = common.against_dense(row["test_accuracy"], common.mean_std(
                [r["test_accuracy"] for r in runs["dense"]], finite_only=False)[0], points=True)
        if t_compute is not None:
            per_rank = statistics.mean(r["bytes_sent"] / r["world_size"] for r in rs)
            for rate, bits in RATES.items():
                row[f"time_{rate}_s"] = row["steps"] * t_compute + per_rank * 8 / bits
        rows.append(row)
    with_acc = all("test_accuracy" in r for r in rows)
    lines = ["| method | seeds | test loss | vs dense |" + (" test accuracy | vs dense |" if with_acc else "")
             + " bytes vs dense |" + ("" if t_compute is None else " modelled 1 Gbit/s | modelled 100 Mbit/s |"),
             "|---|---|---|---|---|" + ("---|---|" if with_acc else "") + ("" if t_compute is None else "---|---|")]
    for r in rows:
        std = "" if r["std"] is None else f" +- {r['std']:.3f}"
        line = f"| {r['method']} | {r['seeds']} | {r['test_loss']:.3f}{std} | {100 * r['vs_dense']:+.1f}% |"
        if with_acc:
            astd = "" if r["accuracy_std"] is None else f" +- {100 * r['accuracy_std']:.2f}"
            line += f" {100 * r['test_accuracy']:.2f}%{astd} | {r['accuracy_vs_dense_pt']:+.2f} pt |"
        line += f" {100 * r['bytes_vs_dense']:.2f}% |"
        if t_compute is not None:
            line += f" {r['time_1gbit_s'] / 60:.1f} min | {r['time_100mbit_s'] / 60:.1f} min |"
        lines.append(line)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    # write_record adds the command, the commit, the date and the machine (report.py reads them)
    common.write_record(out / "table.json", {"compute_step_s": t_compute, "rows": rows})
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", required=True, help="folder of the runs (summaries, logs, checkpoints)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="gpt",
                    help="gpt: Shakespeare characters, AdamW (val loss); cnn: Fashion-MNIST, SGD (test accuracy)")
    ap.add_argument("--group", choices=sorted(GROUPS), default="transformer")
    ap.add_argument("--methods", type=common.csv_list, default=None,
                    help=f"comma-separated, instead of --group: {', '.join(METHODS)}")
    ap.add_argument("--seeds", type=common.csv_ints, default=[1, 2])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--checkpoint-every", type=int, default=200)
    ap.add_argument("--run-timeout", type=float, default=5400.0, help="seconds per launch (a resume continues)")
    ap.add_argument("--analyse", action="store_true", help="only aggregate what is in --out")
    ap.add_argument("--step-times", default=None, help="bench_step.py JSON with a gpt cell (for modelled time)")
    ap.add_argument("--compute-step", type=float, default=None,
                    help="the compute-only step in seconds, instead of --step-times (e.g. the wall time per step of a "
                         "local-steps run alone on the machine, whose loopback exchange every H steps is negligible)")
    args = ap.parse_args(argv)
    unknown = [m for m in args.methods or [] if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if shutil.which("nice") is None:
        ap.error("needs nice(1)")
    return analyse(args) if args.analyse else run_grid(args)


if __name__ == "__main__":
    sys.exit(main())
