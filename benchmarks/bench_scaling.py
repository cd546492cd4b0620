#!/usr/bin/env python
"""Alpha-beta model of per-step gradient communication time as the world size W grows.

How to run (from the repository root, with the package installed: ``pip install -e .``; BERT-base's
shapes need ``pip install transformers``)::

    python benchmarks/bench_scaling.py                     # all models, a few seconds
    python benchmarks/bench_scaling.py --models vgg16 --ratios 0.01 --measured bench_results/step.json

Nothing is timed here: the script prices each model's gradient exchange with the alpha-beta model of
ring collectives (alpha = per-message latency in seconds, beta = link bandwidth in bytes/s), using the
real layer shapes of ResNet-50, VGG-16 and BERT-base and the ~25M-parameter MLP 2048-4096-4096-10
(``examples/models.py``'s ``MLP``), all from ``common.model_shapes`` (built on the meta device), for
W = 2, 4, ..., 64 and density ratios 0.01 and 0.001.

Formulas (per collective; D = dense bytes, P = one rank's sparse payload bytes):

- ring allreduce:  T = 2 (W-1) alpha + 2 (W-1)/W * D / beta
- ring allgather:  T =   (W-1) alpha +   (W-1)   * P / beta

Methods:

- ``dense_fp32``: every tensor allreduced in fp32 (D = 4 bytes/element);
- ``dense_fp16``: the same with D/2 (2 bytes/element);
- ``adtopk``: pure sparse: every tensor ADTopk may compress (>= 2 dims, >= min_numel elements, payload
  smaller than dense) is allgathered with P = fibers * k * (4 + index bytes), fiber-local indices
  (int16 when fibers are shorter than 32768); the rest (biases, norms, tiny tensors) are allreduced in
  fp32. This is ``choose_path`` with ``hybrid=False``, P from ``nominal_bytes``;
- ``topk``: the same with global top-k, P = k * (4 + flat index bytes), k = max(1, floor(ratio * numel));
  flat indices are int32 (int16 for tensors of <= 32768 elements: the package's ``index_dtype_for``);
- ``adtopk_hybrid`` / ``topk_hybrid``: the optimizer's rule, decided per tensor at each W: sparse iff
  P < D and W * P < 2 D (the bandwidth terms of the two formulas), else dense fp32 allreduce: the
  package's ``Compression.get(name, ratio=r).choose_path(info, W)``.

Collectives: Horovod fuses tensors into buffers of ``--fusion-mb`` MiB (64 by default, Horovod's
``HOROVOD_FUSION_THRESHOLD``). The model charges one latency term per buffer: ceil(dense bytes / F)
allreduces and ceil(W * payload bytes / F) allgathers (an allgather's buffer holds every rank's
payload). ``--fusion-mb 0`` charges one collective per tensor instead. The dense and sparse parts of a
step are added (no overlap with each other or with compute); the per-tensor count allgathers of
variable-size rules and the local compression time are not included (see bench_compress.py).

Outputs: a table per model and ratio, the crossover W where pure sparse allgather stops beating dense
allreduce (first integer W >= 2 with sparse time >= dense fp32 time, scanned up to ``--max-scan``; plus
the bandwidth-only value 2 D_s / P_s, where D_s and P_s are the dense and payload bytes of the sparse
tensors), a check that the hybrid is never slower than either pure method, a JSON file
(``--out``) and a PNG plot (``--plot``) of predicted time vs W for one model and ratio.

``--measured FILE`` reads alpha and beta from a JSON written by another benchmark when the file exists:
the first keys named alpha / alpha_s / latency_s and beta / beta_Bps / beta_bytes_per_s /
bandwidth_bytes_per_s found anywhere in it; failing a beta, allreduce probes (objects with ``bytes``
and ``median_s``, and an ``np`` / ``world_size`` beside them or in an enclosing object) are fitted to
the ring allreduce formula (alpha and beta by least squares when the probes span more than one
(W, size) shape, else beta alone with alpha from ``--alpha``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import common
from horovod_adtopk.compressors import Compression, TensorInfo

MODELS = ("resnet50", "vgg16", "bert-base", "mlp")
WORLDS = (2, 4, 8, 16, 32, 64)
METHODS = ("dense_fp32", "dense_fp16", "adtopk", "topk", "adtopk_hybrid", "topk_hybrid")
ALPHA_KEYS = ("alpha", "alpha_s", "latency_s")
BETA_KEYS = ("beta", "beta_Bps", "beta_bytes_per_s", "bandwidth_bytes_per_s", "bandwidth_Bps")
DECISION_SOURCE = ("horovod_adtopk.compressors.Compression.get(name, ratio=r): choose_path(info, W) and "
                   "nominal_bytes(info)")


# --- link parameters -------------------------------------------------------------------------------------------


def _walk(obj: Any, ctx: Dict[str, Any]):
    """Yield (dict, inherited context) for every dict in a JSON tree; ``np``/``world_size`` are inherited."""
    if isinstance(obj, dict):
        here = dict(ctx)
        for key in ("np", "world_size"):
            if isinstance(obj.get(key), (int, float)) and not isinstance(obj.get(key), bool):
                here["np"] = int(obj[key])
        yield obj, here
        for v in obj.values():
            yield from _walk(v, here)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v, ctx)


def _first_number(obj: Any, keys: Sequence[str]) -> Optional[float]:
    for d, _ in _walk(obj, {}):
        for k in keys:
            v = d.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return float(v)
    return None


def link_from_measured(path: Path, alpha_flag: float) -> Tuple[Optional[float], Optional[float], str]:
    """(alpha, beta, how) from a benchmark JSON; None where nothing usable was found."""
    data = json.loads(path.read_text())
    alpha, beta = _first_number(data, ALPHA_KEYS), _first_number(data, BETA_KEYS)
    if beta is not None:
        return alpha, beta, f"alpha/beta keys in {path}"
    points = []  # (W, bytes, seconds)
    for d, ctx in _walk(data, {}):
        if isinstance(d.get("bytes"), (int, float)) and isinstance(d.get("median_s"), (int, float)) and ctx.get("np", 0) >= 2:
            points.append((ctx["np"], float(d["bytes"]), float(d["median_s"])))
    if not points:
        return alpha, None, f"no alpha/beta or allreduce probes in {path}"
    xs = [(2.0 * (w - 1), 2.0 * (w - 1) / w * b) for w, b, _ in points]  # t = alpha * x0 + x1 / beta
    ts = [t for _, _, t in points]
    shapes = {(round(x0, 9), round(x1, 3)) for x0, x1 in xs}
    if len(shapes) >= 2:
        s00 = sum(x0 * x0 for x0, _ in xs); s01 = sum(x0 * x1 for x0, x1 in xs); s11 = sum(x1 * x1 for _, x1 in xs)
        b0 = sum(x0 * t for (x0, _), t in zip(xs, ts)); b1 = sum(x1 * t for (_, x1), t in zip(xs, ts))
        det = s00 * s11 - s01 * s01
        if det > 0:
            a_fit = (b0 * s11 - b1 * s01) / det
            inv_beta = (s00 * b1 - s01 * b0) / det
            if a_fit > 0 and inv_beta > 0:
                return a_fit, 1.0 / inv_beta, f"least-squares fit of {len(points)} allreduce probes in {path}"
    a = alpha if alpha is not None else alpha_flag
    inv = [(t - a * x0) / x1 for (x0, x1), t in zip(xs, ts) if x1 > 0 and t > a * x0]
    if not inv:
        return alpha, None, f"allreduce probes in {path} are all below the latency term; ignored"
    return alpha, len(inv) / sum(inv), f"beta from {len(points)} allreduce probe(s) in {path} (alpha fixed)"


# --- tensors and the package's dense/sparse rule ----------------------------------------------------------------


@dataclass
class Tensor:
    name: str
    shape: Tuple[int, ...]
    numel: int
    dense_bytes: int  # fp32

    @property
    def info(self) -> TensorInfo:
        return TensorInfo(self.name, self.shape, self.numel, torch.float32)


@dataclass
class SparseSpec:
    """One compressor's nominal payload and structural eligibility for one tensor."""

    payload: int  # bytes per rank (0 where the tensor cannot be sparse)
    eligible: bool  # sparse with hybrid=False
    reason: str


def model_tensors(name: str) -> List[Tensor]:
    return [Tensor(n, s, math.prod(s), 4 * math.prod(s)) for n, s in common.model_shapes(name)]


def pure_spec(compressor: Any, t: Tensor) -> SparseSpec:
    """Pure sparse (``hybrid=False``): the package's structural checks and nominal payload."""
    ok, reason = compressor.choose_path(t.info, 2)
    return SparseSpec(compressor.nominal_bytes(t.info)[0] if ok else 0, ok, reason)


def hybrid_mask(compressor: Any, tensors: List[Tensor], world: int) -> List[bool]:
    """Sparse per tensor at ``world`` by the optimizer's rule."""
    return [compressor.choose_path(t.info, world)[0] for t in tensors]


# --- the cost model -----------------------------------------------------------------------------------------------


@dataclass
class Link:
    alpha: float
    beta: float
    fusion_bytes: int  # 0: one collective per tensor


def n_collectives(total_bytes: float, n_tensors: int, fusion_bytes: int) -> int:
    if n_tensors == 0:
        return 0
    if fusion_bytes <= 0:
        return n_tensors
    return max(1, math.ceil(total_bytes / fusion_bytes))


def allreduce_time(dense_bytes: float, n_tensors: int, world: int, link: Link) -> Tuple[float, int, float]:
    """(seconds, collectives, bytes sent per rank) of ring allreduces of ``dense_bytes`` in total."""
    if n_tensors == 0:
        return 0.0, 0, 0.0
    n = n_collectives(dense_bytes, n_tensors, link.fusion_bytes)
    sent = 2.0 * (world - 1) / world * dense_bytes
    return n * 2 * (world - 1) * link.alpha + sent / link.beta, n, sent


def allgather_time(payload_bytes: float, n_tensors: int, world: int, link: Link) -> Tuple[float, int, float]:
    """(seconds, collectives, bytes sent per rank) of ring allgathers of ``payload_bytes`` per rank in total."""
    if n_tensors == 0:
        return 0.0, 0, 0.0
    n = n_collectives(world * payload_bytes, n_tensors, link.fusion_bytes)
    sent = (world - 1) * payload_bytes
    return n * (world - 1) * link.alpha + sent / link.beta, n, sent


@dataclass
class Split:
    """Which bytes of a step are allreduced and which allgathered."""

    dense_bytes: float
    dense_tensors: int
    payload_bytes: float
    sparse_tensors: int


def split(tensors: List[Tensor], sparse_mask: List[bool], payloads: List[int], dense_scale: float = 1.0) -> Split:
    """Tensors with mask True are allgathered (payload bytes), the rest allreduced (dense bytes x dense_scale)."""
    return Split(sum(t.dense_bytes for t, s in zip(tensors, sparse_mask) if not s) * dense_scale,
                 sum(1 for s in sparse_mask if not s),
                 float(sum(p for p, s in zip(payloads, sparse_mask) if s)),
                 sum(1 for s in sparse_mask if s))


def step_cost(sp: Split, world: int, link: Link) -> Dict[str, Any]:
    """Predicted communication of one step: the allreduce part plus the allgather part."""
    t_ar, n_ar, b_ar = allreduce_time(sp.dense_bytes, sp.dense_tensors, world, link)
    t_ag, n_ag, b_ag = allgather_time(sp.payload_bytes, sp.sparse_tensors, world, link)
    return {"seconds": t_ar + t_ag, "allreduce_s": t_ar, "allgather_s": t_ag, "sparse_tensors": sp.sparse_tensors,
            "dense_tensors": sp.dense_tensors, "allreduces": n_ar, "allgathers": n_ag, "bytes_sent_per_rank": b_ar + b_ag,
            "payload_bytes_per_rank": sp.payload_bytes, "dense_bytes_allreduced": sp.dense_bytes}


# --- two levels: hosts of ranks (the hierarchical exchange) -------------------------------------------------------


@dataclass
class TwoLevel:
    """``hosts`` x ``local`` ranks; ``intra``: a host's internal link, ``inter``: its one link to the others
    (shared by its ranks). Rings are ordered by host, so one ring edge leaves each host."""

    hosts: int
    local: int
    intra: Link
    inter: Link

    @property
    def world(self) -> int:
        return self.hosts * self.local

    def ring_link(self) -> Link:
        """The link a ring over every rank waits for: the inter-host one as soon as there are two hosts."""
        return self.inter if self.hosts > 1 else self.intra


def two_level_step(tensors: List[Tensor], compressor: Any, mode: str, topo: TwoLevel) -> Dict[str, Any]:
    """Predicted communication seconds of one step and bytes leaving each host (one direction), for ``mode``:
    "dense" (fp32 allreduce), "fp16", "flat" (the optimizer's hybrid rule at W: sparse tensors allgathered over
    all ranks, the rest allreduced) or "hierarchical" (tensors the hierarchical rule takes: reduce-scatter and
    allgather inside the host over ``intra``, then ``local`` cross-host allgathers of one block's payload
    each; the rest as "flat")."""
    from horovod_adtopk import hierarchical as hier
    world, ring = topo.world, topo.ring_link()
    scale = 0.5 if mode == "fp16" else 1.0
    sparse = ([False] * len(tensors) if mode in ("dense", "fp16")
              else hybrid_mask(compressor, tensors, world))
    hier_mask = [False] * len(tensors)
    if mode == "hierarchical" and topo.hosts > 1 and topo.local > 1:
        hier_mask = [compressor.choose_path(t.info, topo.hosts)[0] for t in tensors]
        sparse = [s and not h for s, h in zip(sparse, hier_mask)]
    payloads = [compressor.nominal_bytes(t.info)[0] if compressor is not None and len(t.shape) >= 2 else 0
                for t in tensors]
    rest = [i for i, h in enumerate(hier_mask) if not h]  # the tensors of the flat exchange
    flat_part = split([tensors[i] for i in rest], [sparse[i] for i in rest], [payloads[i] for i in rest], scale)
    cost = step_cost(flat_part, world, ring)
    crossing = 2.0 * (world - 1) / world * flat_part.dense_bytes + (world - 1) * flat_part.payload_bytes
    if topo.hosts <= 1:
        crossing = 0.0
    links = hier.LinkModel(topo.intra.alpha, topo.intra.beta, topo.inter.alpha, topo.inter.beta)
    hier_s, hier_cross = 0.0, 0.0
    for t, h, p in zip(tensors, hier_mask, payloads):
        if h:
            hier_s += hier.hierarchical_seconds(t.dense_bytes, p, topo.hosts, topo.local, links)
            hier_cross += (topo.hosts - 1) * p
    cost["seconds"] += hier_s
    cost.update({"hierarchical_s": hier_s, "hierarchical_tensors": sum(hier_mask),
                 "inter_host_bytes_per_host": crossing + hier_cross})
    return cost


def crossover(sparse: Split, dense: Split, link: Link, max_scan: int) -> Optional[int]:
    """First integer W >= 2 where the sparse step costs >= the dense step (None: not up to ``max_scan``)."""
    for w in range(2, max_scan + 1):
        if step_cost(sparse, w, link)["seconds"] >= step_cost(dense, w, link)["seconds"]:
            return w
    return None


# --- main -----------------------------------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="The docstring at the top of this file gives the formulas and assumptions.")
    ap.add_argument("--alpha", type=float, default=2e-5, help="latency per collective step, seconds (default 2e-5)")
    ap.add_argument("--beta", type=float, default=1.25e9, help="link bandwidth, bytes/s (default 1.25e9 = 10 Gbit/s)")
    ap.add_argument("--measured", default=None, metavar="FILE",
                    help="JSON from another benchmark to take alpha/beta from, if the file exists")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, metavar="MODEL",
                    help=f"models (default: {' '.join(MODELS)})")
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.01, 0.001], help="density ratios (default 0.01 0.001)")
    ap.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS), help="world sizes (default 2 4 8 16 32 64)")
    ap.add_argument("--fusion-mb", type=float, default=64.0,
                    help="Horovod fusion buffer, MiB; 0 = one collective per tensor (default 64)")
    ap.add_argument("--max-scan", type=int, default=1 << 16, help="largest W scanned for the crossover (default 65536)")
    ap.add_argument("--check-max-w", type=int, default=4096,
                    help="the hybrid check also runs at every power of 2 up to this W and at the crossovers (default 4096)")
    ap.add_argument("--quick", action="store_true", help="accepted for symmetry with bench_compress.py (this script is fast)")
    ap.add_argument("--plot-model", default="vgg16", choices=MODELS, help="model of the plot (default vgg16)")
    ap.add_argument("--plot-ratio", type=float, default=0.01, help="ratio of the plot (default 0.01)")
    ap.add_argument("--out", default="bench_results/scaling.json", help="JSON output (default bench_results/scaling.json)")
    ap.add_argument("--plot", default="bench_results/scaling.png", help="PNG output ('' to skip; default bench_results/scaling.png)")
    args = ap.parse_args(argv)
    if args.alpha < 0 or args.beta <= 0 or min(args.worlds) < 2 or args.max_scan < 2:
        ap.error("need --alpha >= 0, --beta > 0, world sizes >= 2, --max-scan >= 2")
    for r in args.ratios:
        if not 0.0 < r <= 1.0:
            ap.error(f"ratio {r} not in (0, 1]")
    return args


def ms(x: float) -> str:
    return common.ms(x, 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    alpha, beta, link_src = args.alpha, args.beta, "flags"
    if args.measured:
        path = Path(args.measured)
        if path.exists():
            m_alpha, m_beta, how = link_from_measured(path, args.alpha)
            if m_beta is not None:
                beta = m_beta
                alpha = m_alpha if m_alpha is not None else alpha
                link_src = how
            else:
                link_src = f"flags ({how})"
        else:
            link_src = f"flags ({path} not found)"
    link = Link(alpha, beta, int(args.fusion_mb * (1 << 20)))
    print(f"# alpha-beta model: alpha = {alpha:.3g} s, beta = {beta:.4g} B/s ({beta * 8 / 1e9:.3g} Gbit/s) from {link_src}; "
          + (f"fusion buffer {args.fusion_mb:g} MiB" if link.fusion_bytes else "one collective per tensor"))
    print(f"# dense/sparse rule and payloads: {DECISION_SOURCE}")
    print("# ring allreduce: 2(W-1) alpha + 2(W-1)/W D/beta; ring allgather: (W-1) alpha + (W-1) P/beta; times in ms")
    report: Dict[str, Any] = {
        "link": {"alpha_s": alpha, "beta_bytes_per_s": beta, "source": link_src, "fusion_bytes": link.fusion_bytes},
        "formulas": {"allreduce": "n_coll * 2(W-1) alpha + 2(W-1)/W * D / beta",
                     "allgather": "n_coll * (W-1) alpha + (W-1) * P / beta",
                     "n_coll": "ceil(bytes / fusion) (allgather: W * payload bytes), or one per tensor with --fusion-mb 0",
                     "hybrid": "per tensor sparse iff P < D and W * P < 2 D"},
        "decision_source": DECISION_SOURCE, "models": {}}
    grid_ok = True  # hybrid time <= min(dense fp32, pure sparse) at every W of --worlds
    bytes_ok = True  # hybrid bytes per rank <= both, at every W checked (must hold: the rule minimises them)
    worst_beyond: Optional[Dict[str, Any]] = None  # largest time excess of the hybrid at the extended W
    plot_data: Optional[Dict[str, Any]] = None

    for model in args.models:
        tensors = model_tensors(model)
        total = sum(t.numel for t in tensors)
        mrep: Dict[str, Any] = {"params": total, "tensors": len(tensors), "ratios": {}}
        print(f"\n== {model}: {len(tensors)} tensors, {total:,} params, dense fp32 {4 * total / 1e6:.1f} MB")
        for r in args.ratios:
            specs: Dict[str, List[SparseSpec]] = {}
            pkg_c: Dict[str, Any] = {}
            for cname in ("adtopk", "topk"):
                pure_c = Compression.get(cname, ratio=r, hybrid=False)
                specs[cname] = [pure_spec(pure_c, t) for t in tensors]
                pkg_c[cname] = Compression.get(cname, ratio=r)
            rrep: Dict[str, Any] = {"worlds": {}, "crossover": {}, "hybrid_ok": True}
            n = len(tensors)
            dense32 = split(tensors, [False] * n, [0] * n)
            dense16 = split(tensors, [False] * n, [0] * n, dense_scale=0.5)
            pure = {c: split(tensors, [sp.eligible for sp in specs[c]], [sp.payload for sp in specs[c]])
                    for c in ("adtopk", "topk")}
            print(f"-- ratio {r:g}")
            hdr = (f"{'W':>4} " + " ".join(f"{m:>13}" for m in METHODS) + f" {'hyb sparse':>11}  hybrid <= min(dense, sparse)")
            print(hdr + "\n" + "-" * len(hdr))
            for w in args.worlds:
                row: Dict[str, Any] = {"dense_fp32": step_cost(dense32, w, link), "dense_fp16": step_cost(dense16, w, link)}
                for cname in ("adtopk", "topk"):
                    row[cname] = step_cost(pure[cname], w, link)
                    hmask = hybrid_mask(pkg_c[cname], tensors, w)
                    row[f"{cname}_hybrid"] = step_cost(split(tensors, hmask, [sp.payload for sp in specs[cname]]), w, link)
                checks: Dict[str, Any] = {}
                bad = []
                for cname in ("adtopk", "topk"):
                    h = row[f"{cname}_hybrid"]
                    for other in ("dense_fp32", cname):
                        o = row[other]
                        key = f"{cname}_hybrid<={other}"
                        checks[key] = h["seconds"] <= o["seconds"] * (1 + 1e-12)
                        # Bandwidth terms alone: the rule minimises them tensor by tensor, so this must hold.
                        checks[key + "_bytes"] = h["bytes_sent_per_rank"] <= o["bytes_sent_per_rank"] * (1 + 1e-12)
                        if not checks[key]:
                            bad.append(f"{cname}_hyb>{'dense' if other == 'dense_fp32' else 'pure'} "
                                       f"+{100 * (h['seconds'] / o['seconds'] - 1):.1f}%")
                        if not checks[key + "_bytes"]:
                            bad.append(f"{key} bytes")
                ok = all(checks.values())
                rrep["hybrid_ok"] &= ok
                grid_ok &= all(v for k, v in checks.items() if not k.endswith("_bytes"))
                bytes_ok &= all(v for k, v in checks.items() if k.endswith("_bytes"))
                row["hybrid_checks"] = checks
                rrep["worlds"][str(w)] = row
                print(f"{w:>4} " + " ".join(f"{ms(row[m]['seconds']):>13}" for m in METHODS)
                      + f" {row['adtopk_hybrid']['sparse_tensors']:>5}/{row['topk_hybrid']['sparse_tensors']:<5}"
                      + f"  {'yes' if ok else 'NO: ' + '; '.join(bad)}")
            for cname in ("adtopk", "topk"):
                d_s = sum(t.dense_bytes for t, sp in zip(tensors, specs[cname]) if sp.eligible)
                p_s = pure[cname].payload_bytes
                co = rrep["crossover"][cname] = {
                    "vs_dense_fp32": crossover(pure[cname], dense32, link, args.max_scan),
                    "vs_dense_fp16": crossover(pure[cname], dense16, link, args.max_scan),
                    "bandwidth_only_vs_fp32": 2.0 * d_s / p_s if p_s else None,
                    "sparse_tensors": pure[cname].sparse_tensors, "sparse_part_dense_bytes": d_s, "payload_bytes": p_s,
                }
                fmt = lambda v: f"W={v}" if v is not None else f"none up to W={args.max_scan}"  # noqa: E731
                bw_only = f"{co['bandwidth_only_vs_fp32']:.1f}" if p_s else "-"
                print(f"   crossover {cname:<6}: pure sparse >= dense fp32 from {fmt(co['vs_dense_fp32'])}, "
                      f">= fp16 from {fmt(co['vs_dense_fp16'])}; bandwidth-only 2*D_s/P_s = {bw_only} "
                      f"({co['sparse_tensors']} sparse tensors, P_s = {p_s / 1e6:.3f} MB of D_s = {d_s / 1e6:.1f} MB)")
            # The grid rarely reaches the W where the hybrid starts sending tensors dense: check there too.
            ext = sorted({2 ** i for i in range(1, max(2, args.check_max_w).bit_length())}
                         | {v + d for co in rrep["crossover"].values() for v in (co["vs_dense_fp32"],) if v for d in (-1, 0, 1)}
                         - {1})
            worst: Dict[str, Any] = {}
            first_dense: Dict[str, Optional[int]] = {}
            for cname in ("adtopk", "topk"):
                worst[cname], first_dense[cname] = None, None
                for w in ext:
                    hmask = hybrid_mask(pkg_c[cname], tensors, w)
                    if first_dense[cname] is None and sum(hmask) < pure[cname].sparse_tensors:
                        first_dense[cname] = w
                    hc = step_cost(split(tensors, hmask, [sp.payload for sp in specs[cname]]), w, link)
                    dc, pc = step_cost(dense32, w, link), step_cost(pure[cname], w, link)
                    bytes_ok &= hc["bytes_sent_per_rank"] <= min(dc["bytes_sent_per_rank"], pc["bytes_sent_per_rank"]) * (1 + 1e-12)
                    better = "dense" if dc["seconds"] <= pc["seconds"] else "pure sparse"
                    excess = hc["seconds"] / min(dc["seconds"], pc["seconds"]) - 1.0
                    if worst[cname] is None or excess > worst[cname][1]:
                        worst[cname] = (w, excess, better)
                ok = worst[cname][1] <= 1e-12
                rrep["hybrid_ok"] &= ok
                if worst_beyond is None or worst[cname][1] > worst_beyond["excess_over_best"]:
                    worst_beyond = {"model": model, "ratio": r, "compressor": cname, "world": worst[cname][0],
                                    "excess_over_best": worst[cname][1], "better": worst[cname][2]}
                fd = first_dense[cname]
                print(f"   hybrid {cname:<6} W in {{2, 4, ..., {ext[-1]}}} + crossovers: first tensor sent dense at "
                      f"W={fd if fd is not None else '-'}; "
                      + ("never slower than min(dense fp32, pure sparse)" if ok else
                         f"up to {100 * worst[cname][1]:.2f}% slower than {worst[cname][2]} (W={worst[cname][0]})"))
            rrep["hybrid_extended_check"] = {"worlds": ext, "worst": {c: {"world": v[0], "excess_over_best": v[1], "better": v[2]}
                                                                     for c, v in worst.items()},
                                             "first_world_with_dense_tensor": first_dense}
            mrep["ratios"][str(r)] = rrep
            if model == args.plot_model and abs(r - args.plot_ratio) < 1e-12:
                plot_data = {"model": model, "ratio": r, "worlds": list(args.worlds),
                             "series": {m: [rrep["worlds"][str(w)][m]["seconds"] for w in args.worlds] for m in METHODS},
                             "crossover": rrep["crossover"]["adtopk"]["vs_dense_fp32"]}
        report["models"][model] = mrep

    report["hybrid_checks"] = {"grid_time_ok": grid_ok, "bytes_ok_everywhere": bytes_ok, "worst_beyond_grid": worst_beyond}
    out = common.write_json(args.out, report)
    print()
    print(f"# hybrid never slower than min(dense fp32, pure sparse) at W = {', '.join(map(str, args.worlds))}: "
          f"{'yes' if grid_ok else 'NO (see tables)'}")
    print(f"# hybrid never sends more bytes per rank than either, at every W checked: {'yes' if bytes_ok else 'NO (bug)'}")
    if worst_beyond is not None and worst_beyond["excess_over_best"] > 1e-12:
        wb = worst_beyond
        print(f"# beyond the grid the rule (bandwidth terms only; allreduce pays 2(W-1) latencies, allgather W-1) can lose: "
              f"worst {100 * wb['excess_over_best']:.2f}% slower than {wb['better']} ({wb['model']}, ratio {wb['ratio']:g}, "
              f"{wb['compressor']}, W={wb['world']})")
    print(f"# wrote {out}")
    if args.plot:
        if plot_data is None:
            print(f"# plot skipped: {args.plot_model} at ratio {args.plot_ratio:g} not in this run")
        else:
            write_plot(plot_data, link, Path(args.plot))
            print(f"# wrote {args.plot}")
    return 0 if bytes_ok else 1


def write_plot(data: Dict[str, Any], link: Link, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"dense_fp32": ("k", "-", "o"), "dense_fp16": ("0.5", "-", "s"), "adtopk": ("tab:blue", "-", "^"),
              "topk": ("tab:orange", "-", "v"), "adtopk_hybrid": ("tab:blue", "--", "D"), "topk_hybrid": ("tab:orange", "--", "d")}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, ys in data["series"].items():
        c, ls, mk = styles[m]
        hollow = {"markerfacecolor": "none", "markersize": 9} if m.endswith("_hybrid") else {}
        ax.plot(data["worlds"], [y * 1e3 for y in ys], color=c, linestyle=ls, marker=mk, label=m, **hollow)
    co = data["crossover"]
    if co is not None and min(data["worlds"]) <= co <= max(data["worlds"]):
        ax.axvline(co, color="tab:blue", alpha=0.4, linestyle=":")
    label = (f"pure ADTopk allgather >= dense fp32 allreduce from W={co}" if co is not None
             else "pure ADTopk allgather beats dense fp32 at every W scanned")
    if all(data["series"][f"{c}_hybrid"] == data["series"][c] for c in ("adtopk", "topk")):
        label += "\nhybrid = pure sparse here: every eligible tensor stays sparse at these W"
    ax.text(0.02, 0.02, label, transform=ax.transAxes, fontsize=8, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(data["worlds"])
    ax.set_xticklabels([str(w) for w in data["worlds"]])
    ax.set_xlabel("world size W")
    ax.set_ylabel("predicted communication time per step (ms)")
    ax.set_title(f"{data['model']}, ratio {data['ratio']:g}: alpha={link.alpha:.2g} s, "
                 f"beta={link.beta * 8 / 1e9:.3g} Gbit/s (alpha-beta model)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
