#!/usr/bin/env python
"""Hierarchical vs flat ADTopk (and dense, fp16, PowerSGD) on the emulated cluster: time and inter-host bytes.

How to run (as root, from the repository root; it starts and stops its own emulated cluster, named
``hbench``, of ``tests/cluster.py``: network namespaces, veths capped with ``tc``)::

    PYTHONPATH=. python benchmarks/bench_hierarchical.py              # 2x2, 4x1, 2x1 at 1 and 10 Gbit/s
    PYTHONPATH=. python benchmarks/bench_hierarchical.py --links 1gbit --layouts 2x2 --steps 3

Communication only: every rank pre-generates its gradients of the ~25M-parameter MLP 2048-4096-4096-10
(``common.model_shapes("mlp")``) once; each timed step copies them into ``p.grad`` and runs
``opt.synchronize()`` (selection, error feedback, collectives, aggregation), with no forward or backward
pass: 4 ranks on 2 cores are compute-bound, and it is the exchange that scales with hosts. A "compute only"
column would be zero by construction in this mode, so there is none.

Per layout (hosts x ranks per host) and link, one horovodrun job runs every mode side by side: ``dense``
(Horovod allreduce, fp32), ``fp16`` (Horovod's fp16 compression), ``flat`` (ADTopk 0.01, flat allgather),
``hierarchical`` (ADTopk 0.01, ``hierarchical=True``), ``powersgd`` (our PowerSGD, rank 4). Inter-host
bytes are read from each host's veth (``eth1``'s tx bytes through netlink, ``ip -s -j link``, inside the host, so
Ethernet/IP/TCP headers and Gloo's own messages are included) around each mode's timed steps, besides
the package's own payload accounting. The 2x2 job also probes the links (allgathers of 8 KiB to 8 MiB
inside a host and between hosts) and fits alpha-beta per level, which the cost model
(``two_level_step`` below: alpha-beta per level, the package's own dense/sparse rule per tensor) uses to predict every cell: network time from the model plus the local
compression time each rank measured (``opt.stats()``). Then the same model projects to 8 hosts x 8 GPUs
(``--project``): inter-host 100 Gbit/s (alpha 10 us), intra-host NVLink-class 150 GB/s (alpha 5 us), one
link per host shared by its 8 GPUs, network time only (GPU selection time is not modelled).

Outputs: tables on stdout, ``--out`` JSON, ``--plot`` PNG of the projection.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import common

REPO = Path(__file__).resolve().parent.parent
MODES = ("dense", "fp16", "flat", "hierarchical", "powersgd")
RATIO = 0.01
PROBE_SIZES = (8 << 10, 1 << 20, 8 << 20)
PROJECTION = {"hosts": 8, "local": 8, "inter_alpha": 10e-6, "inter_beta": 12.5e9, "intra_alpha": 5e-6,
              "intra_beta": 150e9}


# --- the two-level alpha-beta model the cells are predicted with --------------------------------------------
# Ring collectives priced as T = (W-1) alpha + bytes / beta per step of the ring (allreduce: 2 (W-1) alpha +
# 2 (W-1)/W D / beta; allgather: (W-1) alpha + (W-1) P / beta), one collective per Horovod fusion buffer, the
# package's own dense/sparse rule per tensor (Compression.choose_path) and nominal payload (nominal_bytes).


@dataclass
class Tensor:
    name: str
    shape: Tuple[int, ...]
    numel: int
    dense_bytes: int  # fp32

    @property
    def info(self) -> Any:
        import torch
        from horovod_adtopk.compressors import TensorInfo

        return TensorInfo(self.name, self.shape, self.numel, torch.float32)


def model_tensors(name: str) -> List[Tensor]:
    return [Tensor(n, s, math.prod(s), 4 * math.prod(s)) for n, s in common.model_shapes(name)]


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



# --- rank side ---------------------------------------------------------------------------------------------------

def _veth_tx() -> Optional[int]:
    """This host's ``eth1`` tx bytes through netlink (``ip -s -j link``): ``/sys/class/net`` shows the counters
    of the namespace that mounted sysfs, not this host's."""
    import json
    import subprocess
    try:
        out = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", "eth1"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
    except (OSError, subprocess.SubprocessError, ValueError, LookupError):
        return None


def _compression(mode: str):
    import horovod_adtopk as hat
    if mode == "dense":
        return hat.Compression.none
    if mode == "fp16":
        return hat.Compression.fp16
    if mode == "powersgd":
        return hat.Compression.powersgd(rank=4)
    return hat.Compression.adtopk(ratio=RATIO)


def _host_counter(hvd, torch, name: str) -> int:
    """Sum over hosts of their veth's transmitted bytes (local rank 0 of each host reads its own)."""
    mine = _veth_tx() if hvd.local_rank() == 0 else 0
    return int(hvd.allreduce(torch.tensor([float(mine or 0)], dtype=torch.float64), op=hvd.Sum, name=name).item())


def _run_mode(hvd, torch, mode: str, shapes, grads, steps: int) -> Dict[str, Any]:
    import horovod_adtopk as hat
    params = [torch.nn.Parameter(torch.zeros(s)) for _, s in shapes]
    named = [(n, p) for (n, _), p in zip(shapes, params)]
    opt = hat.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                                   compression=_compression(mode), hierarchical=(mode == "hierarchical"))
    times = []
    for step in range(steps + 1):  # step 0 warms up (process sets, codecs, buffers)
        if step == 1:
            before = _host_counter(hvd, torch, f"veth.before.{mode}")
            first = _counters(opt.stats())
        for p, g in zip(params, grads):
            p.grad = g.clone()
        hvd.allreduce(torch.zeros(1), name=f"sync.{mode}.{step}")
        start = time.perf_counter()
        opt.synchronize()
        times.append(time.perf_counter() - start)
    after = _host_counter(hvd, torch, f"veth.after.{mode}")
    st = opt.stats()
    last = _counters(st)
    out = {"step_s": statistics.median(times[1:]), "step_times_s": times[1:],
           "inter_host_bytes_per_step": (after - before) / steps,
           "payload_bytes_per_step": (last[0] - first[0]) / steps,
           "compute_s_per_step": (last[1] - first[1]) / steps}
    if mode == "hierarchical":
        out["hierarchical"] = {k: st["hierarchical"][k] for k in ("active", "layout", "reason")}
    return out


def _counters(st: Dict[str, Any]) -> tuple:
    """(payload bytes this rank handed to collectives, local compression seconds), flat and hierarchical."""
    nbytes = st["bytes_sent"]
    seconds = st["compress_seconds"] + st["decompress_seconds"]
    h = st.get("hierarchical")
    if h is not None:
        nbytes += h["inter_host_payload_bytes"]
        seconds += sum(b["compress_seconds"] + b["decompress_seconds"] for b in h["blocks"].values())
    return nbytes, seconds


def _probe(hvd, torch, comm_ranks: List[List[int]], label: str) -> List[Dict[str, Any]]:
    """Allgathers of PROBE_SIZES bytes per rank over the first of ``comm_ranks`` (one link at work, the other
    ranks wait), five times each after a warm-up: the median seconds per size."""
    sets = [hvd.add_process_set(r) if len(r) < hvd.size() else hvd.global_process_set for r in comm_ranks]
    member = hvd.rank() in comm_ranks[0]
    out = []
    for size in PROBE_SIZES:
        t = torch.zeros(size // 4)
        runs = []
        for i in range(6):
            hvd.allreduce(torch.zeros(1), name=f"probe.sync.{label}.{size}.{i}")
            start = time.perf_counter()
            if member:
                hvd.allgather(t, name=f"probe.{label}.{size}.{i}", process_set=sets[0])
            runs.append(time.perf_counter() - start)
        out.append({"bytes": size, "members": len(comm_ranks[0]), "median_s": statistics.median(runs[1:])})
    return out


def worker(args: argparse.Namespace) -> int:
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    shapes = common.model_shapes("mlp")
    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    grads = [torch.randn(s, generator=gen) for _, s in shapes]
    result: Dict[str, Any] = {"layout": [hvd.cross_size(), hvd.local_size()], "modes": {}}
    if args.probe and hvd.local_size() > 1 and hvd.cross_size() > 1:
        hosts, local = hvd.cross_size(), hvd.local_size()
        by_host = [[h * local + j for j in range(local)] for h in range(hosts)]
        by_local = [[h * local + j for h in range(hosts)] for j in range(local)]
        result["probe_intra"] = _probe(hvd, torch, by_host, "intra")
        result["probe_inter"] = _probe(hvd, torch, by_local, "inter")
    for mode in args.modes:
        result["modes"][mode] = _run_mode(hvd, torch, mode, shapes, grads, args.steps)
        if hvd.rank() == 0:
            print(f"[bench_hierarchical] {result['layout']} {mode}: {result['modes'][mode]['step_s'] * 1e3:.1f} ms",
                  flush=True)
    if hvd.rank() == 0:
        Path(args.result).write_text(json.dumps(result))
    hvd.allreduce(torch.zeros(1), name="done")
    return 0


# --- driver ------------------------------------------------------------------------------------------------------

def parse_layout(text: str) -> List[int]:
    hosts, local = (int(x) for x in text.lower().split("x"))
    return [hosts, local]


def run_cell(cluster, layout: List[int], args: argparse.Namespace, workdir: Path) -> Dict[str, Any]:
    hosts, local = layout
    result = workdir / f"cell_{cluster.rate}_{hosts}x{local}.json"
    cmd = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(hosts * local), "--gloo",
           "-H", cluster.host_list(local, list(range(hosts))), "--network-interface", cluster.iface,
           "--ssh-identity-file", str(cluster.key), sys.executable, str(Path(__file__).resolve()), "--worker",
           "--result", str(result), "--steps", str(args.steps), "--modes", *args.modes]
    if layout == [2, 2]:
        cmd.append("--probe")
    env = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "HOROVOD_CYCLE_TIME": "1"}
    rc, output, seconds = cluster.run(0, cmd, timeout=args.timeout, env=env, cwd=str(REPO))
    if rc != 0 or not result.exists():
        raise RuntimeError(f"{hosts}x{local} at {cluster.rate}: exit {rc}\n{output[-6000:]}")
    cell = json.loads(result.read_text())
    cell["job_seconds"] = seconds
    return cell


def fit_alpha_beta(probes: List[Dict[str, Any]]) -> Dict[str, float]:
    """Least squares of ``t = (m - 1) * (alpha + bytes / beta)`` over the probes (ring allgather of m members)."""
    xs = [p["bytes"] for p in probes]
    ys = [p["median_s"] / max(1, p["members"] - 1) for p in probes]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(my - slope * mx, 1e-6)
    return {"alpha": alpha, "beta": 1.0 / slope if slope > 0 else float("inf")}


def predict(cell_layout: List[int], mode: str, links: Dict[str, Dict[str, float]], compute_s: float) -> Dict[str, float]:
    import horovod_adtopk as hat
    tensors = model_tensors("mlp")
    hosts, local = cell_layout
    topo = TwoLevel(hosts, local, Link(links["intra"]["alpha"], links["intra"]["beta"], 64 << 20),
                       Link(links["inter"]["alpha"], links["inter"]["beta"], 64 << 20))
    if mode == "powersgd":
        return {}
    comp = hat.Compression.adtopk(ratio=RATIO) if mode in ("flat", "hierarchical") else None
    cost = two_level_step(tensors, comp, mode, topo)
    return {"network_s": cost["seconds"], "step_s": cost["seconds"] + compute_s,
            "inter_host_bytes_per_step": cost["inter_host_bytes_per_host"] * hosts}


def projection(ratios: Sequence[float]) -> Dict[str, Any]:
    import horovod_adtopk as hat
    p = PROJECTION
    topo = TwoLevel(p["hosts"], p["local"], Link(p["intra_alpha"], p["intra_beta"], 64 << 20),
                       Link(p["inter_alpha"], p["inter_beta"], 64 << 20))
    tensors = model_tensors("mlp")
    rows = []
    for r in ratios:
        comp = hat.Compression.adtopk(ratio=r)
        row = {"ratio": r}
        for mode in ("dense", "fp16", "flat", "hierarchical"):
            row[mode] = two_level_step(tensors, comp, mode, topo)["seconds"]
        row["winner"] = min(("dense", "fp16", "flat", "hierarchical"), key=lambda m: row[m])
        rows.append(row)
    return {"topology": p, "model": "mlp", "rows": rows}


def write_plot(proj: Dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = proj["rows"]
    xs = [r["ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, style in (("dense", "k-"), ("fp16", "k--"), ("flat", "C0-o"), ("hierarchical", "C3-s")):
        ax.plot(xs, [r[mode] * 1e3 for r in rows], style, label=mode, markersize=3)
    p = proj["topology"]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ADTopk density (ratio)")
    ax.set_ylabel("predicted exchange time per step (ms)")
    ax.set_title(f"25M MLP, {p['hosts']} hosts x {p['local']} GPUs: {p['inter_beta'] * 8 / 1e9:.0f} Gbit/s between, "
                 f"{p['intra_beta'] / 1e9:.0f} GB/s inside", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def report(cells: Dict[str, Dict[str, Any]], links: Dict[str, Dict[str, Dict[str, float]]]) -> List[str]:
    lines = []
    head = ["link", "layout", "mode", "step ms", "predicted ms", "pred/meas", "inter-host MB/step", "predicted MB",
            "payload MB/rank", "compute ms"]
    rows = []
    for key, cell in cells.items():
        link, layout = key.split("/")
        for mode, m in cell["modes"].items():
            pred = predict(cell["layout"], mode, links[link], m["compute_s_per_step"]) if link in links else {}
            m["predicted"] = pred
            rows.append([link, layout, mode, f"{m['step_s'] * 1e3:.1f}",
                         f"{pred['step_s'] * 1e3:.1f}" if pred else "-",
                         f"{pred['step_s'] / m['step_s']:.2f}" if pred else "-",
                         f"{m['inter_host_bytes_per_step'] / 1e6:.2f}",
                         f"{pred['inter_host_bytes_per_step'] / 1e6:.2f}" if pred else "-",
                         f"{m['payload_bytes_per_step'] / 1e6:.2f}", f"{m['compute_s_per_step'] * 1e3:.1f}"])
    lines.append(common.table(head, rows))
    return lines


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--links", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("--layouts", nargs="+", default=["2x2", "4x1", "2x1"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per mode (after one warm-up step)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per horovodrun job")
    ap.add_argument("--out", default="bench_results/hierarchical.json")
    ap.add_argument("--plot", default="docs/hierarchical_projection.png")
    ap.add_argument("--from-json", help="re-report (and re-predict) a JSON written before, without running")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    try:
        from tests.cluster import Cluster
    except ImportError as exc:
        raise SystemExit("bench_hierarchical needs the repository's tests/cluster.py: run it from the repository "
                         "root as  PYTHONPATH=. python benchmarks/bench_hierarchical.py") from exc
    cells: Dict[str, Dict[str, Any]] = {}
    layouts = [parse_layout(x) for x in args.layouts]
    hosts = max(h for h, _ in layouts)
    with tempfile.TemporaryDirectory(prefix="hat-hbench-") as tmp:
        for link in args.links:
            with Cluster(hosts=hosts, name="hbench", link=link) as cluster:
                for layout in layouts:
                    key = f"{link}/{layout[0]}x{layout[1]}"
                    print(f"[bench_hierarchical] {key} ...", flush=True)
                    cells[key] = run_cell(cluster, layout, args, Path(tmp))
    return cells


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        cells = data["cells"]
    else:
        load_before = os.getloadavg()
        cells = measure(args)
        data = {"cells": cells, "load_before": load_before, "load_after": os.getloadavg()}
    links = {}
    for key, cell in cells.items():
        if "probe_intra" in cell:
            links[key.split("/")[0]] = {"intra": fit_alpha_beta(cell["probe_intra"]),
                                        "inter": fit_alpha_beta(cell["probe_inter"])}
    data["links"] = links
    for line in report(cells, links):
        print(line)
    for link, fit in links.items():
        print(f"fitted {link}: intra alpha {fit['intra']['alpha'] * 1e6:.0f} us, beta {fit['intra']['beta'] / 1e9:.2f} GB/s; "
              f"inter alpha {fit['inter']['alpha'] * 1e6:.0f} us, beta {fit['inter']['beta'] / 1e9:.3f} GB/s")
    proj = projection([0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2])
    data["projection"] = proj
    print(common.table(["ratio", "dense ms", "fp16 ms", "flat ms", "hierarchical ms", "fastest"],
                       [[f"{r['ratio']:g}", *(f"{r[m] * 1e3:.2f}" for m in ("dense", "fp16", "flat", "hierarchical")),
                         r["winner"]] for r in proj["rows"]]))
    if args.plot:
        write_plot(proj, Path(args.plot))
    common.write_record(args.out, data)  # adds the command, the commit, the date and the machine
    return 0


if __name__ == "__main__":
    sys.exit(main())
