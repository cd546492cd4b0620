#!/usr/bin/env python
"""Time gradient compression (select + cast + pack) and decompression (unpack + aggregate) per tensor.

What is measured
----------------
For each model (the real layer shapes of ResNet-50, VGG-16 and BERT-base from
``examples.models.layer_shapes``, nothing allocated but one gradient at a time), each density
ratio and each compressor, every tensor that the optimizer's dense/sparse rule sends *sparse* at world
size 2 is timed on a fixed random gradient (``torch.randn`` from a seeded generator; timing does not need
real gradients):

(a) compress + pack: the compressor's selection, the cast of the values to the wire dtype and
    ``horovod_adtopk.wire.pack`` into the one ``uint8`` payload the optimizer sends;
(b) unpack + aggregate for 2 ranks: the payload concatenated twice stands in for an allgather from two
    ranks; then ``wire.unpack``, flat positions from the codec, ``zeros`` + ``index_add_`` and the 1/W
    average, as ``horovod_adtopk.optimizer`` does it (Random-k: the allreduced values are scattered to
    their shared positions).

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
and global top-k (weights 1/2, 1/2); ADTopk-T runs one exact step and ``tau - 1`` per-fiber threshold
steps (``--tau``, default 16 = its ``tau_max``, the steady state when thresholds are stable, as on a
fixed gradient). Each phase is also reported on its own in the JSON.

How the compressors are called
------------------------------
``horovod_adtopk/compressors.py`` imports Horovod, and so does the package's ``__init__``. To run on a
machine without Horovod (e.g. a CUDA box) this script loads ``horovod_adtopk.selection``, ``.wire`` and
``.models`` without the package ``__init__`` when ``import horovod`` fails, and always times a local
re-expression of each compressor's ``select`` built from the ``horovod_adtopk.selection`` functions
(same functions, same order, same seeds). When Horovod is importable the script also (i) takes the
dense/sparse decision from ``Compression.get(name, ratio=r).choose_path(info, 2)`` and checks the local
rule agrees, and (ii) checks on one tensor per model that each local rule selects exactly the entries
the package compressor selects. ``--no-horovod`` forces the Horovod-free path.

Wire-format check
-----------------
For ADTopk at ratio 0.01 on the biggest few sparse tensors (``--wire-tensors``) the script times the
selection, packing into one ``uint8`` block per rank (``wire.pack``: values, indices, 8-byte padding) and the
alternative of two separate tensors (values cast, indices cast), and the matching unpack of a two-rank
gather, so that the claim "packing costs a few % of selection" can be checked.

Output: a fixed-width table on stdout and a JSON file (``--out``) with the machine (CPU model, threads,
torch version), the settings and every number.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import types
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
ALL_COMPRESSORS = ("adtopk", "adtopk_i", "adtopk_t", "topk", "randomk", "dgc", "gaussiank", "redsync", "sidco")
EXTRA_COMPRESSORS = ("threshold",)  # fixed threshold, set to the exact k-th magnitude of each tensor
ALL_MODELS = ("resnet50", "vgg16", "bert-base")
QUICK_MAX_NUMEL = 1 << 22
WORLD = 2
MIN_NUMEL = 1024  # horovod_adtopk.compressors.DEFAULT_MIN_NUMEL (used only when Horovod is missing)


# --- loading the package with or without Horovod ----------------------------------------------------------


@dataclass
class Package:
    sel: types.ModuleType
    wire: types.ModuleType
    models: types.ModuleType
    compressors: Optional[types.ModuleType]  # None when Horovod cannot be imported
    note: str


def load_package(no_horovod: bool) -> Package:
    """Import the selection / wire / models modules; the compressor classes only if Horovod imports."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    if no_horovod:
        sys.modules["horovod"] = None  # type: ignore[assignment]  # makes `import horovod` fail
    try:
        comp = importlib.import_module("horovod_adtopk.compressors")
        note = "horovod importable: dense/sparse rule from Compression.choose_path, selections cross-checked"
    except ImportError as exc:
        if (getattr(exc, "name", "") or "").startswith("horovod_adtopk"):
            raise
        # horovod_adtopk's selection, wire and models modules need no Horovod (the package imports
        # Horovod only for Compression / DistributedOptimizer, lazily).
        comp = None
        note = (f"horovod not importable ({exc.__class__.__name__}: {exc}); dense/sparse rule re-implemented "
                "locally, no cross-check")
    return Package(importlib.import_module("horovod_adtopk.selection"), importlib.import_module("horovod_adtopk.wire"),
                   importlib.import_module("examples.models"), comp, note)


# --- local re-expression of each compressor's select ---------------------------------------------------------


def stable_seed(*parts: Any) -> int:
    """Same as horovod_adtopk.compressors.stable_seed (crc32 of the parts), so seeds match the package."""
    return zlib.crc32("\x1f".join(str(p) for p in parts).encode()) & 0x7FFFFFFF


@dataclass
class Picked:
    """One rank's selection: what the optimizer gets from ``compressor.select``."""

    values: torch.Tensor  # 1-D signed, gradient dtype
    flat: torch.Tensor  # 1-D int64 flat positions
    wire_index: Optional[torch.Tensor]  # None: positions shared by every rank (values allreduced)
    index_dtype: Optional[torch.dtype]
    count: Optional[int]  # fixed entries per rank, None = variable
    to_flat: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Phase:
    label: str
    step: int
    weight: float


def _identity_flat(idx: torch.Tensor) -> torch.Tensor:
    return idx.to(torch.int64)


class Rule:
    """A compressor's selection built from ``horovod_adtopk.selection`` (``select`` is what gets timed)."""

    def __init__(self, pkg: Package, name: str, ratio: float, tau: int = 16, seed: int = 0, axis: Any = "auto") -> None:
        self.pkg, self.sel, self.name, self.ratio, self.tau, self.seed, self.axis = pkg, pkg.sel, name, ratio, tau, seed, axis

    # -- static facts --------------------------------------------------------------------------------------
    def phases(self) -> List[Phase]:
        if self.name == "adtopk_i":
            return [Phase("adtopk", 0, 0.5), Phase("topk", 1, 0.5)]
        if self.name == "adtopk_t":
            return [Phase("exact", 0, 1.0 / self.tau), Phase("threshold", 1, (self.tau - 1.0) / self.tau)]
        return [Phase("step", 0, 1.0)]

    def nominal(self, shape: Tuple[int, ...], numel: int) -> Tuple[int, Optional[torch.dtype]]:
        """(entries per rank, index dtype) that the package's ``choose_path`` prices."""
        idt_flat = self.pkg.wire.index_dtype_for(numel - 1)
        k = self.sel.keep_count(self.ratio, numel)
        if self.name in ("adtopk", "adtopk_i", "adtopk_t"):
            lay = self.sel.fiber_layout(shape, self.ratio, self.axis)
            if self.name == "adtopk":
                return lay.count, self.pkg.wire.index_dtype_for(lay.fiber_len - 1)
            if self.name == "adtopk_i":
                return max(lay.count, k), idt_flat
            return lay.count, idt_flat
        if self.name == "randomk":
            return k, None
        return k, idt_flat

    def choose_path(self, shape: Tuple[int, ...], numel: int, world: int, value_bytes: int) -> Tuple[bool, str]:
        """Re-implementation of ``SparseCompressor.choose_path`` (fp32 gradients)."""
        if len(shape) < 2:
            return False, f"{len(shape)}-D tensor"
        if numel < MIN_NUMEL:
            return False, f"numel {numel} < min_numel {MIN_NUMEL}"
        count, idt = self.nominal(shape, numel)
        ib = 0 if idt is None else self.pkg.wire.dtype_bytes(idt)
        payload, dense = count * (value_bytes + ib), numel * 4
        if payload >= dense:
            return False, f"sparse payload {payload} B >= dense {dense} B"
        hybrid = self.name != "randomk"  # Random-k allreduces its values: no allgather term
        if hybrid and world * payload >= 2 * dense:
            return False, f"allgather of {world} x {payload} B >= ring allreduce of {dense} B"
        return True, "sparse"

    # -- per tensor, untimed ---------------------------------------------------------------------------------
    def prepare(self, a: torch.Tensor, shape: Tuple[int, ...], name: str) -> Dict[str, Any]:
        """State the package keeps per tensor between steps (codec, bases, ADTopk-T thresholds)."""
        prep: Dict[str, Any] = {"name": name, "numel": a.numel(), "shape": shape}
        if self.name in ("adtopk", "adtopk_i", "adtopk_t"):
            lay = self.sel.fiber_layout(shape, self.ratio, self.axis)
            prep["layout"] = lay
            prep["bases"] = self.sel.fiber_bases(lay, a.device)
            prep["scratch"] = torch.empty(a.numel(), dtype=a.dtype, device=a.device)  # as the package reuses one
        if self.name == "adtopk_t":
            values, _ = self.sel.all_dimension_topk(a, prep["layout"])
            theta = torch.nan_to_num(values.abs().amin(dim=1).detach().to(torch.float64), nan=0.0, posinf=0.0)
            prep["theta"] = theta
        if self.name == "threshold":
            k = self.sel.keep_count(self.ratio, a.numel())
            prep["threshold"] = float(torch.topk(a.reshape(-1).abs(), k, sorted=False).values.min())
        return prep

    # -- the timed part ------------------------------------------------------------------------------------------
    def _adtopk(self, a: torch.Tensor, prep: Dict[str, Any]) -> Picked:
        lay, bases = prep["layout"], prep["bases"]
        values, local = self.sel.all_dimension_topk(a, lay, prep["scratch"])
        flat = self.sel.local_to_flat(local, lay, bases)

        def to_flat(idx: torch.Tensor) -> torch.Tensor:  # what FiberCodec.to_flat does
            return self.sel.local_to_flat(idx, lay, bases)

        return Picked(values.reshape(-1), flat, local.reshape(-1), self.pkg.wire.index_dtype_for(lay.fiber_len - 1),
                      lay.count, to_flat)

    def _flat(self, values: torch.Tensor, flat: torch.Tensor, numel: int, count: Optional[int]) -> Picked:
        return Picked(values, flat, flat, self.pkg.wire.index_dtype_for(numel - 1), count, _identity_flat)

    def _topk(self, a: torch.Tensor, numel: int) -> Picked:
        k = self.sel.keep_count(self.ratio, numel)
        values, flat = self.sel.global_topk(a, k)
        return self._flat(values, flat, numel, k)

    def select(self, a: torch.Tensor, prep: Dict[str, Any], step: int) -> Picked:
        sel, numel, name = self.sel, prep["numel"], self.name
        k = sel.keep_count(self.ratio, numel)
        if name == "adtopk" or (name == "adtopk_i" and step % 2 == 0):
            return self._adtopk(a, prep)
        if name in ("topk", "adtopk_i"):
            return self._topk(a, numel)
        if name == "adtopk_t":
            lay = prep["layout"]
            if step % self.tau != 0:  # between exact steps: one comparison pass per fiber threshold
                values, flat = sel.fiber_threshold_select(a, lay, prep["theta"])
                return self._flat(values, flat, numel, None)
            values, local = sel.all_dimension_topk(a, lay, prep["scratch"])
            theta = torch.nan_to_num(values.abs().amin(dim=1).detach().to(torch.float64), nan=0.0, posinf=0.0)
            old = prep["theta"]
            float(((theta - old).abs() / old.clamp_min(1e-30)).median())  # the tau update's statistic
            flat = sel.local_to_flat(local, lay, prep["bases"])
            return self._flat(values.reshape(-1), flat, numel, None)
        if name == "randomk":
            gen = torch.Generator(device="cpu")
            gen.manual_seed(stable_seed(self.seed, prep["name"], step))
            flat = sel.random_positions(numel, k, gen, a.device)
            return Picked(a.reshape(-1)[flat], flat, None, None, k, _identity_flat)
        mag = a.reshape(-1).abs()
        if name == "dgc":
            gen = torch.Generator(device="cpu")
            gen.manual_seed(stable_seed("dgc", self.seed, prep["name"], step))
            t = sel.refine_threshold(mag, sel.dgc_threshold(mag, self.ratio, gen, 0.01), k, max_iters=3)
            values, flat = sel.threshold_select(a, t)
            if flat.numel() > 1.25 * k:  # DGC's hierarchical step: exact top-k of the candidates
                finite = torch.isfinite(values)
                keep = torch.topk(torch.where(finite, values.abs(), torch.full_like(values, float("inf"))), k,
                                  sorted=False).indices
                values, flat = values[keep], flat[keep]
            return self._flat(values, flat, numel, None)
        if name == "gaussiank":
            t = sel.refine_threshold(mag, sel.gaussian_threshold(a, self.ratio), k, max_iters=5)
        elif name == "redsync":
            t = sel.redsync_threshold(mag, k)
        elif name == "sidco":
            t = sel.refine_threshold(mag, sel.sidco_threshold(mag, self.ratio, 2, "exponential"), k, max_iters=4)
        elif name == "threshold":
            t = prep["threshold"]
        else:
            raise ValueError(f"unknown compressor {name!r}")
        values, flat = sel.threshold_select(a, t)
        return self._flat(values, flat, numel, None)

    def package_compressor(self, threshold: float = 0.0):
        """The package's compressor with the same settings (needs Horovod)."""
        comp = self.pkg.compressors
        assert comp is not None
        kwargs: Dict[str, Any] = {"ratio": self.ratio}
        if self.name == "adtopk_t":
            kwargs["tau_max"] = self.tau
        if self.name == "threshold":
            kwargs["threshold"] = threshold
        return comp.Compression.get(self.name, **kwargs)


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


def compress(rule: Rule, a: torch.Tensor, prep: Dict[str, Any], step: int, vdt: torch.dtype,
             wire: types.ModuleType) -> Tuple[Picked, torch.Tensor]:
    """select + cast + pack, as ``DistributedOptimizer._submit_sparse`` does (no error feedback)."""
    p = rule.select(a, prep, step)
    values = p.values.to(vdt)
    return p, wire.pack(values, p.wire_index, vdt, p.index_dtype)


def aggregate(p: Picked, gathered: torch.Tensor, counts: Sequence[int], numel: int, dtype: torch.dtype,
              vdt: torch.dtype, wire: types.ModuleType) -> torch.Tensor:
    """unpack + positions + index_add_ + average, as ``DistributedOptimizer._finish`` does."""
    dense = torch.zeros(numel, dtype=dtype, device=gathered.device)
    if p.wire_index is None:  # Random-k: the payload was summed (and averaged) by allreduce
        dense[p.flat] = gathered.to(dtype)
        return dense
    values, index = wire.unpack(gathered, counts, vdt, p.index_dtype)
    values = values.to(dtype)
    flat = p.to_flat(index) if index.numel() else index
    if dense.device.type == "cpu":
        dense.index_add_(0, flat, values)
    else:
        off = 0
        for c in counts:
            dense.index_add_(0, flat[off:off + c], values[off:off + c])
            off += c
    dense.mul_(1.0 / len(counts))
    return dense


def check_aggregate(p: Picked, dense: torch.Tensor, vdt: torch.dtype) -> bool:
    """Two identical ranks averaged must give back the (cast) values at their positions."""
    expect = p.values.to(vdt).to(dense.dtype)
    return bool(torch.allclose(dense[p.flat], expect, rtol=1e-6, atol=0.0, equal_nan=True))


# --- helpers ----------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, threads: int) -> Dict[str, Any]:
    info: Dict[str, Any] = {"cpu": cpu_model(), "logical_cpus": os.cpu_count(), "torch_threads": threads,
                            "torch": torch.__version__, "python": platform.python_version(),
                            "platform": platform.platform(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def gradient(shape: Tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(device)


def shape_key(shape: Tuple[int, ...]) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


def ms(x: float) -> str:
    return f"{x * 1e3:.3f}" if x < 10 else f"{x * 1e3:.0f}"


def ratio_str(num: float, den: float) -> str:
    return f"{num / den:.2f}" if den > 0 else "-"


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


# --- cross-check against the package compressors (Horovod only) --------------------------------------------------


def cross_check(rule: Rule, a: torch.Tensor, shape: Tuple[int, ...], name: str) -> str:
    """Compare the local rule's selection with ``Compression.get(...).select`` on one tensor, every phase."""
    comp = rule.pkg.compressors
    info = comp.TensorInfo(name, tuple(shape), a.numel(), a.dtype)
    prep = rule.prepare(a, shape, name)
    c = rule.package_compressor(prep.get("threshold", 0.0))
    if rule.name == "adtopk_t":
        # Package: steps 0 and 1 are exact (warmup); the thresholds did not move, so tau becomes 2 and
        # step 2 is a threshold step. Local: step 0 exact, step 1 threshold.
        exact = c.select(a, info, 0)
        c.select(a, info, 1)
        pairs = [(0, exact), (1, c.select(a, info, 2))]
    else:
        pairs = [(ph.step, c.select(a, info, ph.step)) for ph in rule.phases()]
    for step, ref in pairs:
        mine = rule.select(a, prep, step)
        o1, o2 = torch.sort(mine.flat).indices, torch.sort(ref.flat).indices
        if mine.flat.numel() != ref.flat.numel() or not torch.equal(mine.flat[o1], ref.flat[o2]) \
                or not torch.equal(mine.values[o1], ref.values[o2]):
            return f"MISMATCH step {step}"
        if (ref.wire_index is None) != (mine.wire_index is None) or ref.codec.index_dtype != mine.index_dtype:
            return f"MISMATCH wire step {step}"
    return "ok"


# --- wire-format decision data -------------------------------------------------------------------------------------


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


def wire_check(pkg: Package, shapes: List[Tuple[str, Tuple[int, ...]]], args: argparse.Namespace,
               timer: Timer, device: torch.device, vdt: torch.dtype) -> List[Dict[str, Any]]:
    wire = pkg.wire
    rule = Rule(pkg, "adtopk", 0.01, args.tau, args.seed)
    rows = []
    for name, shape in shapes:
        a = gradient(shape, args.seed, device)
        prep = rule.prepare(a, shape, name)
        sel_s, _, p = timer.run(lambda: rule.select(a, prep, 0))
        idt = p.index_dtype
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
        del a, prep, p, payload, gathered, gv, gi, rows_payload, gathered_rows
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
    ap.add_argument("--no-horovod", action="store_true",
                    help="behave as if Horovod were not installed (local dense/sparse rule, no cross-check)")
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
    pkg = load_package(args.no_horovod)
    wire = pkg.wire
    vdt = getattr(torch, args.value_dtype)
    vbytes = wire.dtype_bytes(vdt)
    timer = Timer(device, args.repeats, args.warmup)
    machine = machine_info(device, args.threads)
    print(f"# bench_compress  cpu: {machine['cpu']}  threads: {args.threads}  torch {torch.__version__}  device: {device}"
          + (f" ({machine['gpu']})" if "gpu" in machine else ""))
    print(f"# {pkg.note}")
    print(f"# median of {args.repeats} after {args.warmup} warmup; values on the wire: {args.value_dtype}; "
          f"world size {WORLD} (payload concatenated twice); floor = a.sum() (one read pass)")

    report: Dict[str, Any] = {"machine": machine, "settings": {k: v for k, v in vars(args).items()},
                              "horovod": pkg.compressors is not None, "note": pkg.note,
                              "floor": "a.sum() (one read pass); floor_absmax_s: a.abs().max()",
                              "global_topk": "torch.topk(a.abs().flatten(), k, sorted=False), k = max(1, floor(ratio*numel))",
                              "models": {}, "wire_format": []}
    rules = {(r, c): Rule(pkg, c, r, args.tau, args.seed) for r in args.ratios for c in args.compressors}
    all_checks_ok = True
    wire_candidates: List[Tuple[int, str, Tuple[int, ...]]] = []

    for model in args.models:
        layers = [(n, tuple(int(s) for s in shp)) for n, shp in pkg.models.layer_shapes(model)]
        numels = {n: math.prod(s) for n, s in layers}
        skipped = [n for n, s in layers if args.max_numel is not None and numels[n] > args.max_numel]
        # Decide dense / sparse per (ratio, compressor, tensor).
        decisions: Dict[Tuple[float, str], Dict[str, Tuple[bool, str]]] = {}
        rule_mismatch: List[str] = []
        for (r, c), rule in rules.items():
            dec = {}
            pc = rule.package_compressor() if pkg.compressors is not None else None
            if pc is not None and args.value_dtype != "float32":
                pc.value_dtype = vdt
            for n, s in layers:
                local = rule.choose_path(s, numels[n], WORLD, vbytes)
                if pc is not None:
                    info = pkg.compressors.TensorInfo(n, s, numels[n], torch.float32)
                    ref = pc.choose_path(info, WORLD)
                    if ref[0] != local[0]:
                        rule_mismatch.append(f"{c}@{r}:{n}")
                    local = ref
                dec[n] = local
            decisions[(r, c)] = dec
        if rule_mismatch:
            all_checks_ok = False
            print(f"# WARNING {model}: local dense/sparse rule disagrees with choose_path on {rule_mismatch[:5]}")
        needed: Dict[Tuple[int, ...], List[str]] = {}
        for n, s in layers:
            if n in skipped:
                continue
            if any(decisions[rc][n][0] for rc in rules):
                needed.setdefault(s, []).append(n)

        measures: Dict[Tuple[int, ...], ShapeMeasure] = {}
        checks: Dict[str, str] = {}
        check_shape = None
        if pkg.compressors is not None and needed:
            big = [s for s in needed if math.prod(s) >= 4096]
            check_shape = min(big or list(needed), key=math.prod)
        t_model = time.perf_counter()
        for s, names in needed.items():
            a = gradient(s, args.seed, device)
            numel = a.numel()
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
                    rule = rules[(r, c)]
                    if s == check_shape:
                        checks[f"{c}@{r}"] = cross_check(rule, a, s, names[0])
                        all_checks_ok &= checks[f"{c}@{r}"] == "ok"
                    prep = rule.prepare(a, s, names[0])
                    per_phase: Dict[str, PhaseResult] = {}
                    for ph in rule.phases():
                        c_s, c_runs, (p, payload) = timer.run(lambda: compress(rule, a, prep, ph.step, vdt, wire))
                        gathered = torch.cat([payload] * WORLD) if p.wire_index is not None else payload
                        counts = [p.values.numel()] * WORLD
                        g_s, g_runs, dense = timer.run(
                            lambda: aggregate(p, gathered, counts, numel, a.dtype, vdt, wire))
                        ok = check_aggregate(p, dense, vdt)
                        all_checks_ok &= ok
                        per_phase[ph.label] = PhaseResult(c_s, g_s, c_runs, g_runs, p.values.numel(),
                                                          wire.payload_bytes(payload), ok)
                        del p, payload, gathered, dense
                    m.results[(r, c)] = per_phase
                    if c == "adtopk" and r == 0.01:
                        wire_candidates.append((numel, names[0], s))
            measures[s] = m
            del a, flat_abs_src

        # Assemble per-tensor rows and totals.
        mrep: Dict[str, Any] = {"tensors": len(layers), "params": sum(numels.values()),
                                "skipped_over_max_numel": skipped, "cross_check": checks,
                                "rule_mismatches": rule_mismatch, "seconds": time.perf_counter() - t_model,
                                "results": {}}
        print(f"\n== {model}: {len(layers)} tensors, {sum(numels.values()):,} params; "
              f"{len(needed)} distinct sparse shapes measured"
              + (f"; {len(skipped)} tensors over --max-numel skipped ({sum(numels[n] for n in skipped):,} params)"
                 if skipped else "")
              + (f"; cross-check vs package: {'ok' if all(v == 'ok' for v in checks.values()) else checks}" if checks else ""))
        hdr = (f"{'ratio':>6} {'compressor':<10} {'sparse':>6} {'dense':>5} {'payloadMB':>9} {'compress':>10} "
               f"{'aggregate':>10} {'floor':>9} {'glob_topk':>10} {'comp/floor':>10} {'topk/comp':>9} {'agg/floor':>9}")
        print(hdr + "\n" + "-" * len(hdr) + "   (times: ms, sums over the compressor's sparse tensors)")
        for r in args.ratios:
            for c in args.compressors:
                rule = rules[(r, c)]
                dec = decisions[(r, c)]
                rows = []
                for n, s in layers:
                    if n in skipped or not dec[n][0]:
                        continue
                    m = measures[s]
                    phases = m.results[(r, c)]
                    weights = {ph.label: ph.weight for ph in rule.phases()}
                    rows.append({
                        "name": n, "shape": list(s), "numel": numels[n],
                        "compress_s": sum(weights[l] * pr.compress_s for l, pr in phases.items()),
                        "aggregate_s": sum(weights[l] * pr.aggregate_s for l, pr in phases.items()),
                        "floor_s": m.floor_s, "floor_absmax_s": m.floor_absmax_s, "global_topk_s": m.global_topk_s[r],
                        "entries": sum(weights[l] * pr.count for l, pr in phases.items()),
                        "payload_bytes": sum(weights[l] * pr.payload_bytes for l, pr in phases.items()),
                        "phases": {l: vars(pr) for l, pr in phases.items()} if len(phases) > 1 else None,
                        "runs": None if len(phases) > 1 else {"compress": phases["step"].compress_runs,
                                                               "aggregate": phases["step"].aggregate_runs},
                        "aggregate_ok": all(pr.ok for pr in phases.values()),
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
                print(f"{r:>6g} {c:<10} {len(rows):>6} {len(dense):>5} {tot['payload_bytes'] / 1e6:>9.3f} "
                      f"{ms(tot['compress_s']):>10} {ms(tot['aggregate_s']):>10} {ms(tot['floor_s']):>9} "
                      f"{ms(tot['global_topk_s']):>10} {ratio_str(tot['compress_s'], tot['floor_s']):>10} "
                      f"{ratio_str(tot['global_topk_s'], tot['compress_s']):>9} "
                      f"{ratio_str(tot['aggregate_s'], tot['floor_s']):>9}")
                if args.per_tensor:
                    seen = set()
                    for row in rows:
                        key = tuple(row["shape"])
                        if key in seen:
                            continue
                        seen.add(key)
                        mult = sum(1 for x in rows if tuple(x["shape"]) == key)
                        print(f"{'':>6} {'':<10}   {shape_key(key):<22} x{mult:<3} compress {ms(row['compress_s']):>9} "
                              f"aggregate {ms(row['aggregate_s']):>9} floor {ms(row['floor_s']):>8} "
                              f"glob_topk {ms(row['global_topk_s']):>9}")
        report["models"][model] = mrep

    if args.wire_tensors > 0 and wire_candidates and "adtopk" in args.compressors and 0.01 in args.ratios:
        seen_shapes, picks = set(), []
        for numel, n, s in sorted(wire_candidates, key=lambda x: -x[0]):
            if s not in seen_shapes:
                seen_shapes.add(s)
                picks.append((n, s))
            if len(picks) == args.wire_tensors:
                break
        rows = wire_check(pkg, picks, args, timer, device, vdt)
        report["wire_format"] = rows
        print(f"\n== wire format: adtopk @ 0.01, biggest {len(rows)} sparse shapes (ms; pack includes the value cast)")
        hdr = (f"{'tensor':<34} {'shape':<18} {'entries':>8} {'B/ent':>5} {'select':>9} {'pk_block':>8} {'pk_rows':>8} "
               f"{'pk_2t':>7} {'blk/sel':>7} {'rows/sel':>8} {'2t/sel':>6} {'up_block':>8} {'up_rows':>8} {'up_2t':>7}")
        print(hdr)
        print("-" * len(hdr))
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\n# checks (aggregation round trip{', choose_path and selection cross-check' if pkg.compressors else ''}): "
          f"{'ok' if all_checks_ok else 'FAILED (see JSON)'}; wrote {out}; {report['seconds']:.1f} s")
    return 0 if all_checks_ok else 1


if __name__ == "__main__":
    sys.exit(main())
