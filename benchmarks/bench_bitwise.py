"""Same parameters, same counters: a fixed set of short training runs, recorded at two commits and compared.

A refactor of the engines (the payload layer, the exchange kinds, the elastic bookkeeping) must not change
what training computes. This script runs the training job (``examples/train.py``) on a fixed set of
settings, each a few steps at 2 and 3 ranks on the CPU, and records per run the SHA-256 of the final
checkpoint's model parameters (every tensor's bytes in name order, hashed with the standard library) and the
summary's counters (payload and wire bytes, elements). Two records compare equal when every run's digest
and every counter are identical.

    python benchmarks/bench_bitwise.py --out after.json                 # record at this checkout
    python benchmarks/bench_bitwise.py --compare before.json after.json # exit 1 on any difference
    python benchmarks/bench_bitwise.py --against a43029d --out docs/bitwise/ab.json
        # record at that commit (a temporary git worktree, removed afterwards) and here, then compare

The set (``--runs`` picks some by name): the main job (Fashion-MNIST CNN, ADTopk 0.01), the GPT per step
(AdamW, ADTopk 0.01), the GPT with the AdamW transformer recipe (ADTopk 0.25 on the pseudo-gradient of 4
local steps, 2-bit values), local steps with 2-bit values on the CNN (Horovod and DDP engines), dense DiLoCo (outer Nesterov) with fp32, fp16
and 2-bit dense codes, PowerSGD, the per-step sharded exchange, the DDP engine, and a per-step float16 dense
allreduce on both engines; each at 2 and 3 ranks. Horovod's tensor fusion is off (``HOROVOD_FUSION_
THRESHOLD=0``): with fusion a dense allreduce's summation order depends on where a tensor lands in the
fusion buffer, which depends on timing, so fused runs need not repeat bitwise even at one commit. The
hierarchical exchange needs two emulated hosts and is checked bitwise by ``tests/test_hierarchical.py``.

With ``--against`` the older checkout imports its own ``horovod_adtopk`` (``PYTHONPATH``); the native
selection kernel is copied from this checkout when its source is the same at both commits, else the older
checkout runs on the PyTorch fallback (which selects identically; the record says which).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import common

REPO = common.REPO_ROOT
QUICK = ["--no-progress", "--log-every", "0", "--test-batches", "1", "--no-warmup"]
CNN = ["--dataset", "fashion-mnist", "--model", "cnn", "--train-samples", "2048"]
GPT = ["--dataset", "shakespeare", "--model", "gpt", "--train-samples", "4096", "--gpt-layers", "2"]
RECIPE = ["--compressor", "adtopk", "--ratio", "0.25", "--sync-every", "4", "--outer-lr", "1",
          "--outer-momentum", "0", "--outer-feedback-decay", "0.95", "--outer-value-bits", "2",
          "--outer-value-group", "64"]
# name -> (engine, job flags); every run stops after STEPS optimizer steps
RUNS: Dict[str, tuple] = {
    "cnn_adtopk01": ("horovod", CNN + ["--compressor", "adtopk", "--ratio", "0.01"]),
    "gpt_adtopk01": ("horovod", GPT + ["--compressor", "adtopk", "--ratio", "0.01"]),
    "gpt_recipe": ("horovod", GPT + RECIPE),
    "cnn_local_q2": ("horovod", CNN + ["--compressor", "adtopk", "--ratio", "0.05", "--sync-every", "3",
                                       "--outer-value-bits", "2"]),
    "cnn_diloco": ("horovod", CNN + ["--compressor", "none", "--sync-every", "3"]),
    "cnn_diloco_q2": ("horovod", CNN + ["--compressor", "none", "--sync-every", "3", "--outer-value-bits", "2"]),
    "cnn_diloco_fp16": ("horovod", CNN + ["--compressor", "fp16", "--sync-every", "3"]),
    "cnn_powersgd": ("horovod", CNN + ["--compressor", "powersgd", "--powersgd-rank", "2"]),
    "cnn_sharded": ("horovod", CNN + ["--compressor", "adtopk", "--ratio", "0.01", "--exchange", "sharded"]),
    "cnn_ddp_adtopk01": ("ddp", CNN + ["--compressor", "adtopk", "--ratio", "0.01"]),
    "cnn_ddp_local_q2": ("ddp", CNN + ["--compressor", "adtopk", "--ratio", "0.05", "--sync-every", "3",
                                       "--outer-value-bits", "2"]),
    "cnn_fp16": ("horovod", CNN + ["--compressor", "fp16"]),
    "cnn_ddp_fp16": ("ddp", CNN + ["--compressor", "fp16"]),
}
STEPS = 8
COUNTERS = ("step", "bytes_sent", "bytes_dense", "elements_sent", "elements_total", "wire_bytes_sent",
            "wire_bytes_received", "wire_bytes_dense", "replicas_identical")


def params_digest(ckpt_path: Path) -> str:
    """SHA-256 over the checkpoint's model tensors (name, dtype, shape, bytes), in name order."""
    import torch

    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    h = hashlib.sha256()
    for name in sorted(ckpt["model"]):
        t = ckpt["model"][name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def record(checkout: Path, names: List[str], worlds: List[int], timeout: float) -> Dict[str, dict]:
    """Run every setting at every world size from ``checkout``; name -> digest and counters."""
    out: Dict[str, dict] = {}
    env = {"PYTHONPATH": str(checkout), "HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "1"}
    for name in names:
        engine, flags = RUNS[name]
        for world in worlds:
            key = f"{name}@{world}"
            with tempfile.TemporaryDirectory(prefix="hat-bitwise-") as tmp:
                summary, ckpt_dir = Path(tmp) / "summary.json", Path(tmp) / "ckpt"
                job = [str(checkout / "examples" / "train.py"), *flags, *QUICK, "--max-steps", str(STEPS),
                       "--seed", "7", "--checkpoint-dir", str(ckpt_dir), "--summary-json", str(summary)]
                rc, log, seconds = common.run_command(common.launch_ranks(world, job, engine), timeout, env=env, cwd=checkout)
                if rc != 0 or not summary.exists():
                    out[key] = {"error": f"exit {rc}", "log_tail": log[-3000:]}
                    print(f"{key}: FAILED (exit {rc})\n{log[-3000:]}", flush=True)
                    continue
                res = json.loads(summary.read_text())
                last = max(ckpt_dir.glob("ckpt-step*.pt"), key=lambda p: int(p.stem[len("ckpt-step"):]))
                out[key] = {"digest": params_digest(last), **{k: res.get(k) for k in COUNTERS},
                            "seconds": round(seconds, 1)}
                print(f"{key}: {out[key]['digest'][:16]} step {res.get('step')} wire sent "
                      f"{res.get('wire_bytes_sent')} ({seconds:.0f} s)", flush=True)
    return out


def compare(a: Dict[str, dict], b: Dict[str, dict]) -> List[str]:
    """The differences between two records' runs (digests and counters; seconds ignored)."""
    diffs = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            diffs.append(f"{key}: only in {'the second' if x is None else 'the first'} record")
            continue
        for field in ("error", "digest", *COUNTERS):
            if x.get(field) != y.get(field):
                diffs.append(f"{key}: {field} {x.get(field)!r} != {y.get(field)!r}")
    return diffs


def worktree_at(commit: str, dest: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", str(dest), commit], cwd=str(REPO), check=True,
                   capture_output=True)
    same_kernel = subprocess.run(["git", "diff", "--quiet", commit, "--", "horovod_adtopk/csrc"],
                                 cwd=str(REPO)).returncode == 0
    if same_kernel:
        for so in (REPO / "horovod_adtopk").glob("_C*.so"):
            shutil.copy2(so, dest / "horovod_adtopk" / so.name)
    return dest


def print_table(runs: Dict[str, Dict[str, dict]]) -> None:
    labels = list(runs)
    keys = sorted(set().union(*[set(r) for r in runs.values()]))
    rows = [[k] + [(runs[l].get(k) or {}).get("digest", (runs[l].get(k) or {}).get("error", "-"))[:16]
                   for l in labels] for k in keys]
    print(common.table(["run@ranks", *labels], rows))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the record (JSON) here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two records; exit 1 if they differ")
    ap.add_argument("--against", default=None, metavar="COMMIT", help="also record at COMMIT and compare")
    ap.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=sorted(RUNS))
    ap.add_argument("--worlds", nargs="+", type=int, default=[2, 3])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(p).read_text())["runs"] for p in args.compare)
        diffs = compare(a, b)
        print_table({Path(args.compare[0]).stem: a, Path(args.compare[1]).stem: b})
        print("\n".join(diffs) if diffs else f"identical: {len(a)} runs")
        return 1 if diffs else 0
    payload: Dict[str, object] = {"steps": STEPS, "worlds": args.worlds, "settings": {n: RUNS[n] for n in args.runs}}
    if args.against:
        commit = subprocess.run(["git", "rev-parse", args.against], cwd=str(REPO), capture_output=True, text=True,
                                check=True).stdout.strip()
        tmp = Path(tempfile.mkdtemp(prefix="hat-bitwise-ref-"))
        try:
            old = worktree_at(commit, tmp / "ref")
            payload["reference_commit"] = commit
            payload["reference_native_kernel"] = any((old / "horovod_adtopk").glob("_C*.so"))
            payload["reference"] = record(old, args.runs, args.worlds, args.timeout)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "ref")], cwd=str(REPO),
                           capture_output=True)
            shutil.rmtree(tmp, ignore_errors=True)
    payload["runs"] = record(REPO, args.runs, args.worlds, args.timeout)
    code = 0 if all("digest" in r for r in payload["runs"].values()) else 1
    if args.against:
        diffs = compare(payload["reference"], payload["runs"])
        payload["differences"] = diffs
        print_table({"reference": payload["reference"], "this checkout": payload["runs"]})
        print("\n".join(diffs) if diffs else f"identical: {len(payload['runs'])} runs")
        code = code or (1 if diffs else 0)
    if args.out:
        common.write_record(args.out, payload)
    return code


if __name__ == "__main__":
    sys.exit(main())
