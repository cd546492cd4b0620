#!/usr/bin/env python
"""End-to-end check of the Horovod engine (``hat.DistributedOptimizer``) on one device: the ``horovod`` stage of
``scripts/gpu_check.sh``, run as one process (``horovodrun -np 1``; on the GPU machine Horovod's operations are
NCCL's) with ``exchange_when_alone=True``, so that compression, error feedback and the collectives really run.

    horovodrun -np 1 python benchmarks/hvd_gpu_check.py --out gpu_check_out          # CUDA tensors
    horovodrun -np 1 python benchmarks/hvd_gpu_check.py --dry --out gpu_check_out    # CPU tensors (no GPU)

1. Every compressor family of ``hat.Compression.names()``: a small MLP trains a few steps on the device and,
   from the same seed and batches, on CPU tensors; every step's averaged gradient (what ``synchronize()`` leaves
   in ``p.grad``) is compared. Values: ``|d - c| <= 1e-5 (|c| + 0.01 max|c|)`` per tensor (relative, with a floor
   at a hundredth of the tensor's largest magnitude for entries that cancel). Selected positions (the nonzero
   entries of a sparse tensor's average, which at one rank is its own decompressed selection) must be equal,
   except at a near-tie: a position selected by one run only is a near-tie when its magnitude is within a
   relative 1e-6 of the smallest magnitude the other run selected in the same fiber (a row, or a column, when
   that run selected as many entries in every row, or column; else the whole tensor). That smallest selected
   magnitude is the other run's k-th, and the position, unselected there, was at most its (k+1)-th: the two are
   then equal to within float rounding of the gradient (1e-6 is about 8 float32 ulps), and either choice is
   right. After a step with an excused near-tie the two runs' residuals part, so later steps are not compared.
   The fp16 wire's values are compared within one float16 ulp (2^-10 relative) instead: float32 gradients
   that differ in their last bits may round to neighbouring float16 values.
2. The fixed-size rules (ADTopk and its variants, Top-k, Random-k, PowerSGD): one more step under
   ``torch.cuda.set_sync_debug_mode("error")``, first the backward pass (the gradient hooks: error feedback,
   selection, packing, the collectives' submission) and then ``synchronize()``; any device-to-host copy or
   synchronisation raises. A fixed-size rule that raises in its hooks fails the check; the threshold rules and
   fp16 are run the same way and recorded as reading a count or a flag where they raise. Skipped under --dry.
3. Local steps with 2-bit values (``sync_every=2``, ``hat.Outer.sgd(lr=1.0, value_bits=2)``, ADTopk): the
   parameters after every step, device against CPU (the same value tolerance).
4. ``hierarchical=True`` at one rank: it must fall back to the flat exchange and say why
   (``stats()["hierarchical"]``), and train as the flat ADTopk does.

Prints a table; writes ``OUT/hvd_gpu_check.json``. Exit status non-zero on any mismatch or failed check.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:
    import common  # run as a script: benchmarks/common.py, its folder is on the import path
except ImportError:  # imported by the tests
    from benchmarks import common

RTOL, FLOOR, TIE = 1e-5, 1e-2, 1e-6
# the fp16 wire rounds every value to 11 significant bits: gradients that differ in their last float32 bits may
# round to neighbouring float16 values, one float16 ulp (2^-10 relative) apart
FP16_RTOL = 2.0 ** -10
FIXED = ("adtopk", "adtopk_i", "adtopk_t", "topk", "randomk", "powersgd")
THRESHOLD = ("threshold", "dgc", "gaussiank", "redsync", "sidco")


def kind_of(name: str) -> str:
    return "fixed" if name in FIXED else "threshold" if name in THRESHOLD else "dense"


def compressor(hat, name: str, ratio: float):
    if name in ("none", "fp16"):
        return hat.Compression.get(name)
    if name == "powersgd":
        return hat.Compression.powersgd(rank=2, min_numel=0)
    if name == "threshold":
        return hat.Compression.threshold(threshold=1e-2, min_numel=0, hybrid=False)
    return hat.Compression.get(name, ratio=ratio, min_numel=0, hybrid=False)


def model_on(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10)).to(device)


def batch(step: int, device: str):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 32, generator=gen).to(device), torch.randint(0, 10, (16,), generator=gen).to(device)


def backward(model, step: int, device: str) -> None:
    x, y = batch(step, device)
    F.cross_entropy(model(x), y).backward()


def train(hat, device: str, compression, steps: int, **kwargs):
    """Per step, the averaged gradients (or with ``sync_every``, the parameters after the step), as float64 numpy."""
    model = model_on(device)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=compression, exchange_when_alone=True, **kwargs)
    local = "sync_every" in kwargs
    out = []
    for t in range(steps):
        opt.zero_grad()
        backward(model, t, device)
        if local:
            opt.step()
            out.append({n: p.detach().cpu().double().numpy() for n, p in model.named_parameters()})
            continue
        opt.synchronize()
        out.append({n: p.grad.detach().cpu().double().numpy() for n, p in model.named_parameters()})
        with opt.skip_synchronize():
            opt.step()
    return out, opt.stats(), (model, opt)


def fiber_mins(sel: np.ndarray, mag: np.ndarray) -> np.ndarray:
    """Per entry: the smallest selected magnitude of its fiber (rows, or columns, when every row, or column,
    holds as many selected entries; else the whole tensor)."""
    m = sel.reshape(sel.shape[0], -1) if sel.ndim > 1 else sel.reshape(1, -1)
    a = np.where(m, mag.reshape(m.shape), np.inf)
    rows, cols = m.sum(axis=1), m.sum(axis=0)
    if m.shape[0] > 1 and rows.min() == rows.max() > 0:
        mins = np.broadcast_to(a.min(axis=1, keepdims=True), m.shape)
    elif m.shape[1] > 1 and cols.min() == cols.max() > 0:
        mins = np.broadcast_to(a.min(axis=0, keepdims=True), m.shape)
    else:
        mins = np.full(m.shape, a.min())
    return mins.reshape(sel.shape)


def compare(dev: dict, cpu: dict, positional: set, rtol: float = RTOL) -> dict:
    """One step: the worst value error (in units of the tolerance), differing positions, near-ties."""
    worst, differ, ties = 0.0, 0, 0
    for n, c in cpu.items():
        d = dev[n]
        tol = rtol * (np.abs(c) + FLOOR * np.abs(c).max()) + 1e-30
        if n in positional:
            sd, sc = d != 0, c != 0
            flips = np.flatnonzero(sd != sc)
            differ += flips.size
            if flips.size:
                near_dev = np.abs(np.abs(d) - fiber_mins(sc, np.abs(c))) <= TIE * np.abs(d)  # dev only: vs cpu's k-th
                near_cpu = np.abs(np.abs(c) - fiber_mins(sd, np.abs(d))) <= TIE * np.abs(c)  # cpu only: vs dev's k-th
                near = np.where(sd, near_dev, near_cpu).reshape(-1)[flips]
                ties += int(near.sum())
            both = sd & sc
            worst = max(worst, float((np.abs(d - c)[both] / tol[both]).max(initial=0.0)))
        else:
            worst = max(worst, float((np.abs(d - c) / tol).max()))
    return {"worst": worst, "differ": differ, "ties": ties}


def check_run(dev_steps, cpu_steps, positional, rtol: float = RTOL) -> dict:
    compared, per_step, ok = 0, [], True
    for t, (d, c) in enumerate(zip(dev_steps, cpu_steps)):
        r = compare(d, c, positional, rtol)
        per_step.append(r)
        compared += 1
        if r["worst"] > 1.0 or r["differ"] > r["ties"]:
            ok = False
            break
        if r["ties"]:
            break  # the residuals part at the near-tie: later steps are not comparable
    return {"ok": ok, "steps_compared": compared, "steps": per_step,
            "worst": max(s["worst"] for s in per_step), "differ": sum(s["differ"] for s in per_step),
            "ties": sum(s["ties"] for s in per_step)}


def sync_probe(hat, device: str, name: str, ratio: float) -> dict:
    """Two steps; the second under ``set_sync_debug_mode("error")``: the hooks, then ``synchronize()``."""
    model = model_on(device)
    opt = hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=compressor(hat, name, ratio), exchange_when_alone=True)
    backward(model, 0, device)
    opt.step()
    opt.zero_grad()
    out = {"forward": None, "hook": None, "synchronize": None}
    x, y = batch(1, device)  # the batch's host-to-device copy comes before the mode is set
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = F.cross_entropy(model(x), y)
        except RuntimeError as exc:  # not the optimizer's: the model's forward synced (reported, not judged)
            out["forward"] = str(exc).splitlines()[0][:160]
            torch.cuda.set_sync_debug_mode(0)
            loss = F.cross_entropy(model(x), y)
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        except RuntimeError as exc:
            out["hook"] = str(exc).splitlines()[0][:160]
        if out["hook"] is None:
            try:
                opt.synchronize()
            except RuntimeError as exc:
                out["synchronize"] = str(exc).splitlines()[0][:160]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:  # finish whatever the raise left in flight, so that no Horovod operation is pending
        opt.synchronize()
    except Exception:  # noqa: BLE001  (reported above)
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU tensors instead of CUDA (no GPU); the sync checks skipped")
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ratio", type=float, default=0.05)
    args = ap.parse_args()
    try:
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001
        print(f"hvd_gpu_check: Horovod is not importable here ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    import horovod_adtopk as hat

    hvd.init()
    if hvd.size() != 1:
        print(f"hvd_gpu_check: run it as one process (horovodrun -np 1), got {hvd.size()}", file=sys.stderr)
        return 2
    device = "cpu" if args.dry else "cuda"
    if not args.dry:
        if not torch.cuda.is_available():
            print("hvd_gpu_check: CUDA is not available (use --dry for the CPU run)", file=sys.stderr)
            return 2
        if not hvd.nccl_built():
            print("hvd_gpu_check: this Horovod was built without NCCL operations "
                  "(HOROVOD_GPU_OPERATIONS=NCCL); its CUDA collectives would not go through NCCL", file=sys.stderr)
            return 2
        torch.cuda.set_device(hvd.local_rank())
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rows, failures = [], []

    def record(row):
        rows.append(row)
        if not row["ok"]:
            failures.append(row["name"])

    for name in hat.Compression.names():
        row = {"name": name, "kind": kind_of(name), "device": device}
        try:
            dev, stats, (model, _) = train(hat, device, compressor(hat, name, args.ratio), args.steps)
            cpu, _, _ = train(hat, "cpu", compressor(hat, name, args.ratio), args.steps)
            positional = {n for n, t in stats["tensors"].items() if t["path"] == "sparse" and name != "powersgd"}
            rtol = FP16_RTOL if name == "fp16" else RTOL
            row.update(check_run(dev, cpu, positional, rtol), rtol=rtol, density=stats["density"],
                       bytes_sent=stats["bytes_sent"], bytes_dense=stats["bytes_dense"])
            if stats["steps"] != args.steps:
                row.update(ok=False, error=f"{stats['steps']} exchange rounds, not {args.steps}")
            if name != "none" and not stats["bytes_sent"] < stats["bytes_dense"]:
                row.update(ok=False, error="nothing compressed")
            if args.dry:
                row["sync"] = "skipped (--dry: CPU tensors)"
            else:
                probe = sync_probe(hat, device, name, args.ratio)
                row["sync_probe"] = probe
                if probe["hook"] is None:
                    row["sync"] = "none in hooks" + ("" if probe["synchronize"] is None else "; synchronize() syncs")
                elif row["kind"] == "fixed":
                    row.update(sync="SYNC in hooks", ok=False, error=f"device sync in the hooks: {probe['hook']}")
                else:
                    row["sync"] = "reads a count/flag in hooks"
        except Exception:  # noqa: BLE001  (reported as this row's failure)
            row.update(ok=False, error=traceback.format_exc(limit=3).strip().splitlines()[-1])
            traceback.print_exc()
        record(row)

    for label, kwargs in (("local steps, 2-bit", {"sync_every": 2, "outer": hat.Outer.sgd(lr=1.0, value_bits=2)}),
                          ("hierarchical=True", {"hierarchical": True})):
        row = {"name": label, "kind": "local" if "sync_every" in kwargs else "fallback", "device": device,
               "sync": "-"}
        try:
            dev, stats, (_, opt) = train(hat, device, compressor(hat, "adtopk", args.ratio), args.steps, **kwargs)
            cpu, _, _ = train(hat, "cpu", compressor(hat, "adtopk", args.ratio), args.steps, **kwargs)
            positional = set() if "sync_every" in kwargs else {
                n for n, t in stats["tensors"].items() if t["path"] == "sparse"}
            row.update(check_run(dev, cpu, positional), density=stats["density"], bytes_sent=stats["bytes_sent"],
                       bytes_dense=stats["bytes_dense"])
            if "sync_every" in kwargs:
                row["local_steps"] = stats.get("local_steps")
                if not (0 < stats["density"] < 1 and stats["round"] == args.steps // 2):
                    row.update(ok=False, error=f"syncs {stats['round']}, density {stats['density']}")
            else:
                hier = stats.get("hierarchical")
                row["hierarchical"] = hier
                if not isinstance(hier, dict) or hier.get("active") is not False or not hier.get("reason"):
                    row.update(ok=False, error=f"no fallback with a reason: {str(hier)[:120]}")
                row["fallback_reason"] = hier.get("reason") if isinstance(hier, dict) else None
                flat, _, _ = train(hat, device, compressor(hat, "adtopk", args.ratio), args.steps)
                same = all(np.array_equal(a[n], b[n]) for a, b in zip(dev, flat) for n in a)
                row["same_as_flat"] = same
                if not same:
                    row.update(ok=False, error="differs from the flat exchange")
        except Exception:  # noqa: BLE001
            row.update(ok=False, error=traceback.format_exc(limit=3).strip().splitlines()[-1])
            traceback.print_exc()
        record(row)

    head = ["family", "kind", "steps", "worst/tol", "pos. differ", "near-ties", "density", "bytes sent", "sync", "ok"]
    table = [[r["name"], r["kind"], str(r.get("steps_compared", "-")), common.fmt(r.get("worst"), ".3f"),
              str(r.get("differ", "-")), str(r.get("ties", "-")), common.fmt(r.get("density"), ".4f"),
              str(r.get("bytes_sent", "-")), r.get("sync", "-"), "yes" if r["ok"] else "NO"] for r in rows]
    print(f"Horovod engine, one process, exchange_when_alone=True: {device} against CPU, {args.steps} steps, "
          f"ratio {args.ratio}; values within {RTOL} relative, near-ties within {TIE}")
    print(common.table(head, table))
    for r in rows:
        if r.get("error"):
            print(f"{r['name']}: {r['error']}")
    report = {"device": device, "dry": args.dry, "steps": args.steps, "ratio": args.ratio,
              "tolerance": {"relative": RTOL, "floor_of_max": FLOOR, "near_tie": TIE},
              "horovod": {"version": getattr(__import__("horovod"), "__version__", None),
                          "nccl_built": bool(hvd.nccl_built()), "gloo_built": bool(hvd.gloo_built()),
                          "mpi_built": bool(hvd.mpi_built())},
              "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
              "rows": rows, "failed": failures, "ok": not failures}
    path = common.write_record(Path(args.out, "hvd_gpu_check.json"), report)
    print("wrote", path)
    if failures:
        print("FAILED:", ", ".join(failures))
        return 1
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    rc = main()
    print(f"hvd_gpu_check: {time.perf_counter() - start:.1f} s")
    sys.exit(rc)
