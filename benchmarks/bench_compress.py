#!/usr/bin/env python
"""Time gradient compression (select + cast + pack) and decompression (unpack + aggregate) per tensor.

How to run (from the repository root, with the package installed: ``pip install -e .``; BERT-base's
shapes need ``pip install transformers``)::

    python benchmarks/bench_compress.py --quick                      # < 1 minute on one core
    python benchmarks/bench_compress.py --models vgg16 --compressors adtopk topk --repeats 3
    python benchmarks/bench_compress.py                              # every model, compressor, ratio

What is measured
----------------
For each model (the real layer shapes of ResNet-50, VGG-16 and BERT-base from ``common.model_shapes``,
nothing allocated but one gradient at a time), each density ratio and each compressor, every tensor that
the compressor's ``choose_path(info, 2)`` sends *sparse* at world size 2 is timed on a fixed random
gradient (``torch.randn`` from a seeded generator; timing does not need real gradients):

(a) compress + pack: ``compressor.select`` of the package's compressor
    (``horovod_adtopk.compressors.Compression.get(name, ratio=...)``), the cast of the values to the wire
    dtype and ``horovod_adtopk.wire.pack`` into the one ``uint8`` payload the optimizer sends;
(b) unpack + aggregate for 2 ranks: the payload concatenated twice stands in for an allgather from two
    ranks; then ``horovod_adtopk.exchange.aggregate_blocks`` (the optimizer's own unpack, flat positions,
    ``index_add_`` and 1/W average; Random-k: the allreduced values scattered to their shared positions).

Beside each tensor, with the same gradient:

- floor: ``a.sum()``, one read pass over the tensor (the least any selection that looks at every entry
  must pay); ``a.abs().max()`` (a read, a write of a temporary and a second read) is recorded in the JSON;
- global top-k: ``torch.topk(a.abs().flatten(), k, sorted=False)`` with ``k = max(1, floor(ratio * numel))``.

Each number is the median of ``--repeats`` timed runs after ``--warmup`` untimed ones
(``time.perf_counter``; with ``--device cuda`` the device is synchronised before and after every run).
Tensors of the same shape get one measurement (the gradient is random, so only the shape matters).
Totals per model are sums over the compressor's sparse tensors, with the floor and global top-k summed
over the same tensors; the table shows method/floor and global_topk/method.

Rules with several kinds of steps report a per-step average: ADTopk-I alternates all-dimension top-k
(step 0) and global top-k (step 1) (weights 1/2, 1/2); ADTopk-T runs one exact step and ``tau - 1``
per-fiber threshold steps (``--tau``, default 16 = its ``tau_max``, the steady state when thresholds are
stable, as on a fixed gradient). The two ADTopk-T phases are timed on two package compressors whose tau
is pinned: ``tau_min = tau_max = 1`` (every step exact, with the tau update's statistic) and
``tau_min = tau_max = 2**30`` (after the first, exact, call every step is a threshold step). Each phase is
also reported on its own in the JSON. ``threshold`` (not in the default list) is the package's fixed
threshold rule, set per tensor to the exact k-th magnitude.

Wire-format check
-----------------
For ADTopk at ratio 0.01 on the biggest few sparse tensors (``--wire-tensors``) the script times the
selection, packing into one ``uint8`` block per rank (``wire.pack``: values, indices, 8-byte padding) and
two alternatives the package does not ship (one ``[value | index]`` row per entry; values and indices as
two tensors), and the matching unpack of a two-rank gather, so that the claim "packing costs a few % of
selection" can be checked.

Output: a fixed-width table on stdout and a JSON file (``--out``) with the machine (CPU model, threads,
torch version), the settings and every number.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import common
from horovod_adtopk import wire
from horovod_adtopk.compressors import Compression, Selection, SharedCodec, TensorInfo
from horovod_adtopk.exchange import aggregate_blocks

ALL_COMPRESSORS = ("adtopk+ef", "adtopk", "adtopk@torch", "adtopk_i", "adtopk_t", "topk+ef", "topk", "randomk", "dgc",
                   "gaussiank", "redsync", "sidco")
# threshold: fixed threshold, set to the exact k-th magnitude of each tensor
EXTRA_COMPRESSORS = ("threshold", "topk@torch", "adtopk_t+ef")
# Variants of a package compressor: "NAME+ef" times what the optimizer runs with error feedback (the
# residual r and the gradient g go to the kernel, which adds, selects and zeroes what it sends in its own
# passes: compress reads g and r and writes r); "NAME@torch" forces the pure-PyTorch kernels
# (HOROVOD_ADTOPK_NATIVE=0) to show what the native kernel buys.


def base_name(name: str) -> str:
    return name.split("+")[0].split("@")[0]
ALL_MODELS = ("resnet50", "vgg16", "bert-base")
QUICK_MAX_NUMEL = 1 << 22
WORLD = 2
PINNED_TAU = 1 << 30  # ADTopk-T with tau pinned this high: every step after the first is a threshold step
STEP = 2  # the step timed for ADTopk-T (>= its warmup of 2 exact steps); other rules use their phase's step


# --- the package's compressors, one per (ratio, name, phase) -------------------------------------------------------


@dataclass
class Phase:
    label: str
    step: int
    weight: float


def phases(name: str, tau: int) -> List[Phase]:
    name = base_name(name)
    if name == "adtopk_i":
        return [Phase("adtopk", 0, 0.5), Phase("topk", 1, 0.5)]
    if name == "adtopk_t":
        return [Phase("exact", STEP, 1.0 / tau), Phase("threshold", STEP, (tau - 1.0) / tau)]
    return [Phase("step", 0, 1.0)]


def make_compressor(name: str, ratio: float, vdt: torch.dtype, phase: str = "step", seed: int = 0,
                    threshold: float = 0.0):
    """``Compression.get`` with the benchmark's settings; ADTopk-T's tau pinned for the phase timed."""
    name = base_name(name)
    kwargs: Dict[str, Any] = {"ratio": ratio, "value_dtype": vdt}
    if name in ("randomk", "dgc"):
        kwargs["seed"] = seed
    if name == "adtopk_t":
        pin = 1 if phase == "exact" else PINNED_TAU
        kwargs.update(tau_min=pin, tau_max=pin)
    if name == "threshold":
        kwargs["threshold"] = threshold
    return Compression.get(name, **kwargs)


def kth_magnitude(a: torch.Tensor, ratio: float) -> float:
    k = max(1, int(math.floor(ratio * a.numel())))
    return float(torch.topk(a.reshape(-1).abs(), k, sorted=False).values.min())


# --- timing -----------------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, device: torch.device, repeats: int, warmup: int) -> None:
        self.cuda = device.type == "cuda"
        self.repeats, self.warmup = repeats, warmup

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, fn: Callable[[], Any]) -> Tuple[float, List[float], Any]:
        """(median seconds, every timed run, result of the last run)."""
        out = None
        for _ in range(self.warmup):
            out = fn()
        self.sync()
        runs: List[float] = []
        for _ in range(self.repeats):
            self.sync()
            t0 = time.perf_counter()
            out = fn()
            self.sync()
            runs.append(time.perf_counter() - t0)
        return statistics.median(runs), runs, out


def compress(comp, a: torch.Tensor, info: TensorInfo, step: int, vdt: torch.dtype,
             residual: Optional[torch.Tensor] = None) -> Tuple[Selection, torch.Tensor]:
    """select + cast + pack, as ``DistributedOptimizer`` does it; with ``residual``, error feedback fused
    as the optimizer runs it (``residual += a``, select, zero the sent entries of ``residual``)."""
    if residual is None:
        s = comp.select(a, info, step)
    else:
        s = comp.select(residual, info, step, grad=a, zero_sent=True)
    return s, wire.pack(s.values.to(vdt), s.wire_index, vdt, s.codec.index_dtype)


class torch_kernels:
    """Context: the package's pure-PyTorch kernels instead of the native ones."""

    def __enter__(self):
        self.old = os.environ.get("HOROVOD_ADTOPK_NATIVE")
        os.environ["HOROVOD_ADTOPK_NATIVE"] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("HOROVOD_ADTOPK_NATIVE", None)
        else:
            os.environ["HOROVOD_ADTOPK_NATIVE"] = self.old


def aggregate(s: Selection, gathered: torch.Tensor, counts: Sequence[int], numel: int, dtype: torch.dtype,
              vdt: torch.dtype) -> torch.Tensor:
    """unpack + positions + index_add_ (``exchange.aggregate_blocks``) + the 1/W average, as the optimizer does."""
    dense = torch.empty(numel, dtype=dtype, device=gathered.device)
    if isinstance(s.codec, SharedCodec):  # Random-k: the payload was summed (and averaged) by allreduce
        dense.zero_()
        dense[s.codec.flat] = gathered.to(dtype)
        return dense
    return aggregate_blocks(dense, gathered, counts, s.codec, vdt, 1.0 / len(counts))


def check_aggregate(s: Selection, dense: torch.Tensor, vdt: torch.dtype) -> bool:
    """Two identical ranks averaged must give back the (cast) values at their positions."""
    expect = s.values.to(vdt).to(dense.dtype)
    return bool(torch.allclose(dense[s.flat], expect, rtol=1e-6, atol=0.0, equal_nan=True))


# --- helpers ----------------------------------------------------------------------------------------------------


def gradient(shape: Tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device)


def shape_key(shape: Tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


@dataclass
class PhaseResult:
    compress_s: float
    aggregate_s: float
    compress_runs: List[float]
    aggregate_runs: List[float]
    count: int
    payload_bytes: int
    ok: bool


@dataclass
class ShapeMeasure:
    floor_s: float = 0.0
    floor_absmax_s: float = 0.0
    global_topk_s: Dict[float, float] = field(default_factory=dict)
    results: Dict[Tuple[float, str], Dict[str, PhaseResult]] = field(default_factory=dict)


# --- wire-format decision data (alternatives the package does not ship) ---------------------------------------------


def pack_rows(values: torch.Tensor, index: torch.Tensor, vdt: torch.dtype, idt: torch.dtype) -> torch.Tensor:
    """The alternative layout: one uint8 row [value bytes | index bytes] per entry (one collective)."""
    v = values.reshape(-1).to(vdt).contiguous()
    i = index.reshape(-1).to(idt).contiguous()
    n = v.numel()
    return torch.cat([v.view(torch.uint8).reshape(n, v.element_size()), i.view(torch.uint8).reshape(n, i.element_size())], 1)


def unpack_rows(rows: torch.Tensor, vdt: torch.dtype, idt: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    vb = torch.empty((), dtype=vdt).element_size()
    n = rows.shape[0]
    vcol = torch.empty((n, vb), dtype=torch.uint8).copy_(rows[:, :vb])
    icol = torch.empty((n, rows.shape[1] - vb), dtype=torch.uint8).copy_(rows[:, vb:])
    return vcol.view(vdt).reshape(-1), icol.view(idt).reshape(-1).to(torch.int64)


def wire_check(shapes: List[Tuple[str, Tuple[int, ...]]], args: argparse.Namespace,
               timer: Timer, device: torch.device, vdt: torch.dtype) -> List[Dict[str, Any]]:
    comp = make_compressor("adtopk", 0.01, vdt)
    rows = []
    for name, shape in shapes:
        a = gradient(shape, args.seed, device)
        info = TensorInfo(name, tuple(shape), a.numel(), a.dtype)
        sel_s, _, p = timer.run(lambda: comp.select(a, info, 0))
        idt = p.codec.index_dtype
        n = p.values.numel()
        block_s, _, payload = timer.run(lambda: wire.pack(p.values, p.wire_index, vdt, idt))
        rows_s, _, rows_payload = timer.run(lambda: pack_rows(p.values, p.wire_index, vdt, idt))
        sep_s, _, (vals, idx) = timer.run(
            lambda: (p.values.to(vdt).contiguous(), p.wire_index.reshape(-1).to(idt).contiguous()))
        gathered = torch.cat([payload, payload])
        gathered_rows = torch.cat([rows_payload, rows_payload])
        gv, gi = torch.cat([vals, vals]), torch.cat([idx, idx])
        unpack_block_s, _, _ = timer.run(lambda: wire.unpack(gathered, [n, n], vdt, idt))
        unpack_rows_s, _, _ = timer.run(lambda: unpack_rows(gathered_rows, vdt, idt))
        unpack_sep_s, _, _ = timer.run(lambda: (gv.to(a.dtype), gi.to(torch.int64)))
        rows.append({"name": name, "shape": list(shape), "numel": a.numel(), "entries": n,
                     "entry_bytes": wire.entry_bytes(vdt, idt), "index_dtype": str(idt).replace("torch.", ""),
                     "select_s": sel_s, "pack_block_s": block_s, "pack_rows_s": rows_s, "pack_separate_s": sep_s,
                     "unpack_block_s": unpack_block_s, "unpack_rows_s": unpack_rows_s, "unpack_separate_s": unpack_sep_s,
                     "pack_block_over_select": block_s / sel_s if sel_s else None,
                     "pack_rows_over_select": rows_s / sel_s if sel_s else None,
                     "pack_separate_over_select": sep_s / sel_s if sel_s else None,
                     "collectives_block": 1, "collectives_rows": 1, "collectives_separate": 2})
        del a, p, payload, gathered, gv, gi, rows_payload, gathered_rows
    return rows


# --- main ------------------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The docstring at the top of this file says what is measured and how.")
    ap.add_argument("--models", nargs="+", default=list(ALL_MODELS), choices=ALL_MODELS, metavar="MODEL",
                    help=f"layer-shape sets to run (default: all of {', '.join(ALL_MODELS)})")
    ap.add_argument("--compressors", nargs="+", default=None, metavar="NAME",
                    help=f"compressors, in order (default: {' '.join(ALL_COMPRESSORS)}; also: threshold, set to "
                         "each tensor's exact k-th magnitude)")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.01, 0.001], help="density ratios (default 0.01 0.001)")
    ap.add_argument("--max-numel", type=int, default=None,
                    help="skip tensors with more elements (default: none; --quick: %d)" % QUICK_MAX_NUMEL)
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per number; the median is kept (default 5; --quick: 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1, so runs are comparable)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--value-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="wire dtype of the values (default float32, the package's default for fp32 gradients)")
    ap.add_argument("--tau", type=int, default=16, help="ADTopk-T steps per exact step used for its average (default 16)")
    ap.add_argument("--wire-tensors", type=int, default=None,
                    help="biggest ADTopk tensors for the wire-format check (default 4; --quick: 2; 0: skip)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random gradients (default 0)")
    ap.add_argument("--quick", action="store_true",
                    help="3 repeats, adtopk and topk only, tensors up to %d elements (< 60 s on one core)" % QUICK_MAX_NUMEL)
    ap.add_argument("--per-tensor", action="store_true", help="also print one line per measured shape")
    ap.add_argument("--out", default="bench_results/compress.json", help="JSON output (default bench_results/compress.json)")
    args = ap.parse_args(argv)
    if args.compressors is None:
        args.compressors = ["adtopk", "topk"] if args.quick else list(ALL_COMPRESSORS)
    args.compressors = [c.lower().replace("-", "_") for c in args.compressors]
    bad = [c for c in args.compressors if c not in ALL_COMPRESSORS + EXTRA_COMPRESSORS]
    if bad:
        ap.error(f"unknown compressor(s) {bad}; choose from {', '.join(ALL_COMPRESSORS + EXTRA_COMPRESSORS)}")
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.max_numel is None and args.quick:
        args.max_numel = QUICK_MAX_NUMEL
    if args.wire_tensors is None:
        args.wire_tensors = 2 if args.quick else 4
    if args.repeats < 1 or args.warmup < 0 or args.tau < 2 or args.threads < 1:
        ap.error("need --repeats >= 1, --warmup >= 0, --tau >= 2, --threads >= 1")
    for r in args.ratios:
        if not 0.0 < r <= 1.0:
            ap.error(f"ratio {r} not in (0, 1]")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    vdt = getattr(torch, args.value_dtype)
    timer = Timer(device, args.repeats, args.warmup)
    machine = common.machine_info(device, args.threads)
    note = "compressors: horovod_adtopk.compressors.Compression.get; dense/sparse: compressor.choose_path(info, 2)"
    print(f"# bench_compress  cpu: {machine['cpu_model']}  threads: {args.threads}  torch {torch.__version__}  "
          f"device: {device}" + (f" ({machine['gpu']})" if "gpu" in machine else ""))
    print(f"# {note}")
    print(f"# median of {args.repeats} after {args.warmup} warmup; values on the wire: {args.value_dtype}; "
          f"world size {WORLD} (payload concatenated twice); floor = a.sum() (one read pass)")

    report: Dict[str, Any] = {"machine": machine, "settings": {k: v for k, v in vars(args).items()}, "note": note,
                              "floor": "a.sum() (one read pass); floor_absmax_s: a.abs().max()",
                              "global_topk": "torch.topk(a.abs().flatten(), k, sorted=False), k = max(1, floor(ratio*numel))",
                              "models": {}, "wire_format": []}
    rcs = [(r, c) for r in args.ratios for c in args.compressors]
    deciders = {(r, c): make_compressor(c, r, vdt, seed=args.seed) for r, c in rcs}
    all_checks_ok = True
    wire_candidates: List[Tuple[int, str, Tuple[int, ...]]] = []

    for model in args.models:
        layers = common.model_shapes(model)
        numels = {n: math.prod(s) for n, s in layers}
        skipped = [n for n, s in layers if args.max_numel is not None and numels[n] > args.max_numel]
        # Dense / sparse per (ratio, compressor, tensor): the package's rule.
        decisions = {rc: {n: deciders[rc].choose_path(TensorInfo(n, s, numels[n], torch.float32), WORLD)
                          for n, s in layers} for rc in rcs}
        needed: Dict[Tuple[int, ...], List[str]] = {}
        for n, s in layers:
            if n in skipped:
                continue
            if any(decisions[rc][n][0] for rc in rcs):
                needed.setdefault(s, []).append(n)

        measures: Dict[Tuple[int, ...], ShapeMeasure] = {}
        t_model = time.perf_counter()
        for s, names in needed.items():
            a = gradient(s, args.seed, device)
            numel = a.numel()
            info = TensorInfo(names[0], s, numel, a.dtype)
            m = ShapeMeasure()
            m.floor_s, _, _ = timer.run(lambda: a.sum())
            m.floor_absmax_s, _, _ = timer.run(lambda: a.abs().max())
            flat_abs_src = a.reshape(-1)
            for r in args.ratios:
                if not any(decisions[(r, c)][names[0]][0] for c in args.compressors):
                    continue
                k = max(1, int(math.floor(r * numel)))
                m.global_topk_s[r], _, _ = timer.run(lambda: torch.topk(flat_abs_src.abs().flatten(), k, sorted=False))
                for c in args.compressors:
                    if not decisions[(r, c)][names[0]][0]:
                        continue
                    per_phase: Dict[str, PhaseResult] = {}
                    for ph in phases(c, args.tau):
                        comp = make_compressor(c, r, vdt, ph.label, args.seed,
                                               kth_magnitude(a, r) if c == "threshold" else 0.0)
                        if base_name(c) == "adtopk_t":
                            comp.select(a, info, 0)  # untimed first (exact) step: sets the fiber thresholds
                        residual = torch.zeros_like(a) if c.endswith("+ef") else None
                        with (torch_kernels() if c.endswith("@torch") else contextlib.nullcontext()):
                            c_s, c_runs, (p, payload) = timer.run(
                                lambda: compress(comp, a, info, ph.step, vdt, residual))
                        gathered = torch.cat([payload] * WORLD) if p.wire_index is not None else payload
                        counts = [p.values.numel()] * WORLD
                        g_s, g_runs, dense = timer.run(lambda: aggregate(p, gathered, counts, numel, a.dtype, vdt))
                        ok = check_aggregate(p, dense, vdt)
                        all_checks_ok &= ok
                        per_phase[ph.label] = PhaseResult(c_s, g_s, c_runs, g_runs, p.values.numel(),
                                                          wire.payload_bytes(payload), ok)
                        del p, payload, gathered, dense, comp
                    m.results[(r, c)] = per_phase
                    if c == "adtopk" and r == 0.01:
                        wire_candidates.append((numel, names[0], s))
            measures[s] = m
            del a, flat_abs_src

        # Assemble per-tensor rows and totals.
        mrep: Dict[str, Any] = {"tensors": len(layers), "params": sum(numels.values()),
                                "skipped_over_max_numel": skipped, "seconds": time.perf_counter() - t_model,
                                "results": {}}
        print(f"\n== {model}: {len(layers)} tensors, {sum(numels.values()):,} params; "
              f"{len(needed)} distinct sparse shapes measured"
              + (f"; {len(skipped)} tensors over --max-numel skipped ({sum(numels[n] for n in skipped):,} params)"
                 if skipped else ""))
        hdr = (f"{'ratio':>6} {'compressor':<12} {'sparse':>6} {'dense':>5} {'payloadMB':>9} {'compress':>10} "
               f"{'aggregate':>10} {'floor':>9} {'glob_topk':>10} {'comp/floor':>10} {'topk/comp':>9} {'agg/floor':>9}")
        print(hdr + "\n" + "-" * len(hdr) + "   (times: ms, sums over the compressor's sparse tensors)")
        for r in args.ratios:
            for c in args.compressors:
                dec = decisions[(r, c)]
                weights = {ph.label: ph.weight for ph in phases(c, args.tau)}
                rows = []
                for n, s in layers:
                    if n in skipped or not dec[n][0]:
                        continue
                    m = measures[s]
                    per = m.results[(r, c)]
                    rows.append({
                        "name": n, "shape": list(s), "numel": numels[n],
                        "compress_s": sum(weights[l] * pr.compress_s for l, pr in per.items()),
                        "aggregate_s": sum(weights[l] * pr.aggregate_s for l, pr in per.items()),
                        "floor_s": m.floor_s, "floor_absmax_s": m.floor_absmax_s, "global_topk_s": m.global_topk_s[r],
                        "entries": sum(weights[l] * pr.count for l, pr in per.items()),
                        "payload_bytes": sum(weights[l] * pr.payload_bytes for l, pr in per.items()),
                        "phases": {l: vars(pr) for l, pr in per.items()} if len(per) > 1 else None,
                        "runs": None if len(per) > 1 else {"compress": per["step"].compress_runs,
                                                            "aggregate": per["step"].aggregate_runs},
                        "aggregate_ok": all(pr.ok for pr in per.values()),
                    })
                dense = {n: dec[n][1] for n, _ in layers if not dec[n][0]}
                tot = {key: sum(row[key] for row in rows) for key in
                       ("compress_s", "aggregate_s", "floor_s", "floor_absmax_s", "global_topk_s", "payload_bytes", "numel")}
                tot.update({"sparse_tensors": len(rows), "dense_tensors": len(dense),
                            "skipped_tensors": sum(1 for n in skipped if dec[n][0]),
                            "method_over_floor": tot["compress_s"] / tot["floor_s"] if tot["floor_s"] else None,
                            "global_topk_over_method": tot["global_topk_s"] / tot["compress_s"] if tot["compress_s"] else None,
                            "aggregate_over_floor": tot["aggregate_s"] / tot["floor_s"] if tot["floor_s"] else None})
                mrep["results"].setdefault(str(r), {})[c] = {"totals": tot, "tensors": rows, "dense": dense}
                print(f"{r:>6g} {c:<12} {len(rows):>6} {len(dense):>5} {tot['payload_bytes'] / 1e6:>9.3f} "
                      f"{common.ms(tot['compress_s']):>10} {common.ms(tot['aggregate_s']):>10} "
                      f"{common.ms(tot['floor_s']):>9} {common.ms(tot['global_topk_s']):>10} "
                      f"{common.ratio(tot['compress_s'], tot['floor_s']):>10} "
                      f"{common.ratio(tot['global_topk_s'], tot['compress_s']):>9} "
                      f"{common.ratio(tot['aggregate_s'], tot['floor_s']):>9}")
                if args.per_tensor:
                    seen = set()
                    for row in rows:
                        key = tuple(row["shape"])
                        if key in seen:
                            continue
                        seen.add(key)
                        mult = sum(1 for x in rows if tuple(x["shape"]) == key)
                        print(f"{'':>6} {'':<10}   {shape_key(key):<22} x{mult:<3} compress {common.ms(row['compress_s']):>9} "
                              f"aggregate {common.ms(row['aggregate_s']):>9} floor {common.ms(row['floor_s']):>8} "
                              f"glob_topk {common.ms(row['global_topk_s']):>9}")
        report["models"][model] = mrep

    if args.wire_tensors > 0 and wire_candidates and "adtopk" in args.compressors and 0.01 in args.ratios:
        seen_shapes, picks = set(), []
        for numel, n, s in sorted(wire_candidates, key=lambda x: -x[0]):
            if s not in seen_shapes:
                seen_shapes.add(s)
                picks.append((n, s))
            if len(picks) == args.wire_tensors:
                break
        rows = wire_check(picks, args, timer, device, vdt)
        report["wire_format"] = rows
        print(f"\n== wire format: adtopk @ 0.01, biggest {len(rows)} sparse shapes (ms; pack includes the value cast)")
        hdr = (f"{'tensor':<34} {'shape':<18} {'entries':>8} {'B/ent':>5} {'select':>9} {'pk_block':>8} {'pk_rows':>8} "
               f"{'pk_2t':>7} {'blk/sel':>7} {'rows/sel':>8} {'2t/sel':>6} {'up_block':>8} {'up_rows':>8} {'up_2t':>7}")
        print(hdr)
        print("-" * len(hdr))
        ms = common.ms
        for w in rows:
            print(f"{w['name']:<34} {'x'.join(map(str, w['shape'])):<18} {w['entries']:>8} {w['entry_bytes']:>5} "
                  f"{ms(w['select_s']):>9} {ms(w['pack_block_s']):>8} {ms(w['pack_rows_s']):>8} {ms(w['pack_separate_s']):>7} "
                  f"{100 * w['pack_block_over_select']:>6.1f}% {100 * w['pack_rows_over_select']:>7.1f}% "
                  f"{100 * w['pack_separate_over_select']:>5.1f}% "
                  f"{ms(w['unpack_block_s']):>8} {ms(w['unpack_rows_s']):>8} {ms(w['unpack_separate_s']):>7}")
        print("(block: the package's one uint8 block per rank [values | pad | indices | pad] = 1 collective; rows: one "
              "[value|index] row per entry = 1 collective; 2t: values + indices as two tensors = 2 collectives)")

    report["all_checks_ok"] = all_checks_ok
    report["seconds"] = time.perf_counter() - t_start
    out = common.write_record(args.out, report)  # adds the command, the commit, the date and the machine
    print(f"\n# checks (aggregation round trip): {'ok' if all_checks_ok else 'FAILED (see JSON)'}; wrote {out}; "
          f"{report['seconds']:.1f} s")
    return 0 if all_checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
