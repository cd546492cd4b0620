#!/usr/bin/env python
"""End-to-end check of the DDP engine (``horovod_adtopk.ddp``) on a device: the stage ``scripts/gpu_check.sh``
runs on a GPU machine (no Horovod needed).

    python benchmarks/ddp_check.py --out gpu_check_out            # CUDA: needs one GPU
    python benchmarks/ddp_check.py --dry --out gpu_check_out      # the same on the CPU, small (no GPU)

1. Correctness. A small MLP trains 4 steps with ADTopk (ratio 0.05) through DDP + the hook, every rank on
   its own fixed batches, in three runs: (a) 2 processes over Gloo with CPU tensors (the reference), (b) 2
   processes over Gloo with CUDA tensors on the one GPU, (c) 1 process over NCCL with CUDA tensors
   (``exchange_when_alone=True``, so compression, error feedback and both collectives run), against (d) the
   same single process over Gloo on the CPU. Every step's averaged gradients must agree (CUDA vs CPU:
   ``rtol = atol = 1e-5``; the Triton and native kernels select the same entries, the sums differ only by
   rounding order) and be bitwise equal across ranks.
2. Step time of the 25M-parameter benchmark MLP (batch 32 x 2048), 1 process over NCCL with
   ``exchange_when_alone``: DDP dense, DDP + our ADTopk (ratio 0.01), DDP + PyTorch's PowerSGD hook (rank 1);
   median of CUDA-synchronised steps after warm-up. One process measures compute plus (de)compression,
   not a network. ``--dry`` uses CPU tensors, Gloo, a small MLP and 2 timed steps.

Prints a table; writes ``OUT/ddp_check.json``. Exit status non-zero if any check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_adtopk as hat
from horovod_adtopk import kernels
import common  # benchmarks/common.py (this script's directory is on the path)

STEPS = 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _small_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return common.load_example("models").build_model("mlp", sizes=(256, 192, 96, 10))


def _setup(rank: int, world: int, backend: str, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _ddp(model: torch.nn.Module, device: str) -> DDP:
    model = model.to(device)
    return DDP(model, device_ids=[0] if device == "cuda" else None, bucket_cap_mb=0.05)


def train_grads(device: str) -> dict:
    """4 ADTopk steps of the small MLP through DDP + the hook; every step's gradients (on the CPU)."""
    rank = dist.get_rank()
    model = _ddp(_small_mlp(), device)
    state = hat.ddp.CompressionState(compression=hat.Compression.adtopk(ratio=0.05),
                                     named_parameters=model.module.named_parameters(), exchange_when_alone=True)
    model.register_comm_hook(state, hat.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    grads = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 256, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        grads.append({n: p.grad.detach().cpu().clone() for n, p in model.module.named_parameters()})
        opt.step()
    return {"grads": grads, "density": state.stats()["density"], "kernels": kernels.describe()}


def pair_rank(rank: int, device: str, port: int, out: str) -> None:
    """One of 2 processes over Gloo: the CPU reference run, then the same on ``device``."""
    _setup(rank, 2, "gloo", port)
    if device == "cuda":
        torch.cuda.set_device(0)
    result = {"cpu": train_grads("cpu"), "device": train_grads(device)}
    torch.save(result, Path(out, f"pair{rank}.pt"))
    dist.destroy_process_group()


def single_rank(rank: int, device: str, backend: str, dry: bool, ports: tuple, out: str) -> None:
    """One process: Gloo on the CPU (reference), then ``backend`` on ``device``, then the step times."""
    _setup(rank, 1, "gloo", ports[0])
    result = {"cpu": train_grads("cpu")}
    dist.destroy_process_group()
    if device == "cuda":
        torch.cuda.set_device(0)
    _setup(rank, 1, backend, ports[1])
    result["device"] = train_grads(device)
    torch.save(result, Path(out, "single.pt"))
    Path(out, "timing.json").write_text(json.dumps(step_times(device, dry)))
    dist.destroy_process_group()


def compare(runs: list, ref: list, label: str) -> dict:
    """Ranks bitwise equal within ``runs``; rank 0's gradients close to ``ref``'s rank 0 every step."""
    worst, same_ranks = 0.0, True
    for t in range(STEPS):
        for n, g in runs[0]["grads"][t].items():
            same_ranks &= all(torch.equal(r["grads"][t][n], g) for r in runs[1:])
            want = ref[0]["grads"][t][n]
            err = float(((g - want).abs() / (want.abs() + 1e-5)).max())
            worst = max(worst, err)
            if not torch.allclose(g, want, rtol=1e-5, atol=1e-5):
                return {"check": label, "ok": False, "ranks_bitwise_equal": same_ranks,
                        "first_mismatch": f"step {t} {n}: max |diff| {float((g - want).abs().max()):.3e}"}
    return {"check": label, "ok": same_ranks, "ranks_bitwise_equal": same_ranks, "max_rel_diff": worst}


def step_times(device: str, dry: bool) -> dict:
    """Step times of dense / ADTopk / PowerSGD in this one-process group (``exchange_when_alone``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    models = common.load_example("models")
    batch, warmup, steps = (8, 1, 3) if dry else (32, 3, 10)
    results = {}
    for mode in ("dense", "adtopk", "powersgd1"):
        torch.manual_seed(0)
        module = (models.build_model("mlp", sizes=(512, 512, 512, 10)) if dry else models.build_model("mlp")).to(device)
        model = DDP(module, device_ids=[0] if device == "cuda" else None)
        if mode == "adtopk":
            model.register_comm_hook(hat.ddp.CompressionState(compression=hat.Compression.adtopk(ratio=0.01),
                                                              exchange_when_alone=True), hat.ddp.hook)
        elif mode == "powersgd1":
            model.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                        start_powerSGD_iter=2), psgd.powerSGD_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, module.sizes[0], device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        times = []
        for i in range(warmup + steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        results[mode] = {"median_ms": statistics.median(times) * 1e3, "steps": steps,
                         "params": sum(p.numel() for p in module.parameters())}
        del model, module, opt
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU tensors and Gloo only (no GPU), small sizes")
    ap.add_argument("--out", default="gpu_check_out")
    args = ap.parse_args()
    device = "cpu" if args.dry else "cuda"
    if not args.dry and not torch.cuda.is_available():
        sys.exit("ddp_check: CUDA is not available (use --dry for the CPU dry run)")
    single_backend = "gloo" if args.dry else "nccl"
    report = {"machine": common.machine_info(), "dry": args.dry, "checks": [], "timing": None}
    t0 = time.perf_counter()
    out = tempfile.mkdtemp(prefix="ddp_check-")
    try:
        mp.start_processes(pair_rank, args=(device, _port(), out), nprocs=2, join=True, start_method="spawn")
        pair = [torch.load(Path(out, f"pair{r}.pt"), weights_only=True) for r in range(2)]
        report["checks"].append(compare([p["device"] for p in pair], [p["cpu"] for p in pair],
                                        f"2 processes, Gloo, {device} tensors vs CPU"))
        report["density"], report["kernels"] = pair[0]["device"]["density"], pair[0]["device"]["kernels"]
    except Exception:
        report["checks"].append({"check": "2-process run", "ok": False, "error": traceback.format_exc()[-3000:]})
    try:
        mp.start_processes(single_rank, args=(device, single_backend, args.dry, (_port(), _port()), out), nprocs=1,
                           join=True, start_method="spawn")
        single = torch.load(Path(out, "single.pt"), weights_only=True)
        report["checks"].append(compare([single["device"]], [single["cpu"]],
                                        f"1 process, {single_backend.upper()}, {device} tensors vs CPU"))
        report["timing"] = json.loads(Path(out, "timing.json").read_text())
    except Exception:
        report["checks"].append({"check": "1-process run", "ok": False, "error": traceback.format_exc()[-3000:]})
    report["wall_s"] = time.perf_counter() - t0
    for c in report["checks"]:
        print(("ok   " if c["ok"] else "FAIL ") + json.dumps(c), flush=True)
    if report["timing"]:
        dense = report["timing"]["dense"]["median_ms"]
        rows = [[m, f"{r['median_ms']:.1f}", f"{r['median_ms'] / dense:.2f}", str(r["params"])]
                for m, r in report["timing"].items()]
        print(f"step time, 1 process over {single_backend.upper()} ({device}), median of "
              f"{report['timing']['dense']['steps']} steps")
        print(common.table(["mode", "median ms", "x dense", "params"], rows))
    path = common.write_record(Path(args.out, "ddp_check.json"), report)  # + the command, the commit and the date
    print(f"wrote {path} in {report['wall_s']:.0f}s")
    return 0 if report["checks"] and all(c["ok"] for c in report["checks"]) and report["timing"] else 1


if __name__ == "__main__":
    sys.exit(main())
