#!/usr/bin/env python
"""Model of every exchange at W = 8 .. 1024 ranks: bytes per rank and per host NIC, step time, break-even link.

How to run (from the repository root; the standard library and ``horovod_adtopk/netcost.py`` only)::

    python benchmarks/bench_world_model.py        # tables on stdout; docs/scale/world_model.json and .md
    python benchmarks/bench_world_model.py --overlap 0.5 --compute-ms gpt2-small=120 --out-dir bench_results/wm
    python benchmarks/bench_world_model.py --validate bench_results/wire_bytes.json   # model vs measured
    python benchmarks/bench_world_model.py --list  # the registered exchanges

Nothing is timed. Assumptions (printed, and recorded in the JSON):

- Topology: ``--ranks-per-host`` (8) GPUs share one host NIC (``--links``: 10, 25, 100 Gbit/s each way);
  inside a host NVLink-class ``--nvlink-gbs`` (300 GB/s per GPU). Bytes per collective are ``netcost``'s (ring
  allreduce ``2 (W-1)/W D``, allgather ``(W-1) P`` per rank). A flat ring over W ranks ordered by host crosses
  each NIC with one ring edge each way: a host's NIC carries what one rank sends. Up to 8 ranks (one host) no
  NIC is crossed and rings run at NVLink speed; "% of dense" then compares per-rank bytes.
- Paths per tensor are the library's: sparse rules need >= 2 dims and >= 1024 entries; a tensor is sparse iff
  ``netcost.choose_gather`` prefers its allgather to the fp32 allreduce (no latency: fused collectives).
  Payloads: ``wire.block_bytes`` (fp32 values, indices int16 up to 32767 else int32, fiber-local for ADTopk,
  flat for Top-k, each part padded to 8 bytes); low-bit blocks as ``quantize.QuantizedWire``. Steady state:
  no density or dense warm-up.
- Step time = compute + GPU work + exposed communication. Communication = NIC bytes / NIC speed + NVLink bytes /
  NVLink speed (+ ``--alpha-us`` per ring step; 0: bandwidth-bound). A per-step exchange hides behind
  ``--overlap`` x compute (default 0: nothing hidden); a sync of local steps hides nothing. GPU work:
  ``--select-ns`` per element compressed (0.19 ns: docs/results.md, GPU section, one H200, 25M MLP, DDP + ADTopk 7.0 ms
  against dense 2.1 ms) plus ``--decode-ns`` per entry received and scattered (0.1 ns: assumed, not measured).
- Compute per step (``--compute-ms``; A100, published): GPT-2-small 300 ms at 64 x 1024 tokens per GPU (llm.c,
  scripts/run_gpt2_124M.sh: 8x A100 80GB SXM, bf16, "~300ms/iter"); ResNet-50 103.6 ms at 256 images per GPU
  (NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5 README: 1x A100 80GB, mixed precision, 2,470 img/s);
  BERT-base 132 ms at 256 x 128 tokens, derived (6 x params x tokens at the flop rate of the GPT-2 figure; no
  published BERT-base A100 step time was at hand).
- Break-even: the NIC speed below which the exchange's step beats dense fp32's (scanned 0.01 .. 100,000
  Gbit/s; "tie": the same step at every speed, e.g. the hybrid rule sent every tensor dense). Stops paying: the first W (16, 32, ... 8192) where its step is not 1% faster than its baseline's
  (dense fp32; DiLoCo's for the exchanges every 4 steps).

``--validate RECORDS.json``: a JSON list (or ``{"records": [...]}``) of ``{"config": "adtopk", "world": 8,
"ranks_per_host": 4, "shapes": [["fc1", [4096, 2048]], ...], "wire_bytes_sent": 123456}``; ``config`` a registry
name, ``shapes`` or ``model`` (gpt2-small, bert-base, resnet50) or ``numel`` (+ ``shape``); ``wire_bytes_sent``
per rank per step as ``opt.stats()`` counts it (divided by ``steps`` where given); optional ``nic_bytes_sent``
per host per step (a NIC counter) and ``layout: [hosts, ranks_per_host]``. Exit 1 if one is off by more than
``--tolerance`` (5%).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import sys
from collections import namedtuple
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from horovod_adtopk import netcost

try:
    import common  # run as a script: its folder is on the import path (table, write_json)
except ImportError:  # loaded by path from the tests, which run from the repository root
    from benchmarks import common

REPO = common.REPO_ROOT

Shapes = List[Tuple[str, Tuple[int, ...]]]
WORLDS, LINKS_GBIT, MIN_NUMEL = (8, 16, 64, 256, 1024), (10.0, 25.0, 100.0), 1024
FUSED = netcost.Link(latency=0.0)  # the library's default decision link
COMPUTE_MS = {"gpt2-small": 300.0, "bert-base": 132.0, "resnet50": 103.6}


# --- real layer shapes ----------------------------------------------------------------------------------------

def gpt2_small() -> Shapes:
    """GPT-2 small (HF ``GPT2Model``: Conv1D weights [in, out]; the LM head is tied to wte)."""
    out: Shapes = [("wte", (50257, 768)), ("wpe", (1024, 768))]
    for i in range(12):
        out += [(f"h.{i}.{n}", s) for n, s in (
            ("ln_1.weight", (768,)), ("ln_1.bias", (768,)), ("attn.c_attn.weight", (768, 2304)), ("attn.c_attn.bias", (2304,)),
            ("attn.c_proj.weight", (768, 768)), ("attn.c_proj.bias", (768,)), ("ln_2.weight", (768,)), ("ln_2.bias", (768,)),
            ("mlp.c_fc.weight", (768, 3072)), ("mlp.c_fc.bias", (3072,)), ("mlp.c_proj.weight", (3072, 768)),
            ("mlp.c_proj.bias", (768,)))]
    return out + [("ln_f.weight", (768,)), ("ln_f.bias", (768,))]


def bert_base() -> Shapes:
    """BERT-base uncased (HF ``BertModel`` with its pooler: Linear weights [out, in])."""
    out: Shapes = [("emb.word", (30522, 768)), ("emb.position", (512, 768)), ("emb.token_type", (2, 768)),
                   ("emb.ln.weight", (768,)), ("emb.ln.bias", (768,))]
    for i in range(12):
        for lin in ("query", "key", "value", "attention.output"):
            out += [(f"layer.{i}.{lin}.weight", (768, 768)), (f"layer.{i}.{lin}.bias", (768,))]
        out += [(f"layer.{i}.{n}", s) for n, s in (
            ("attention.ln.weight", (768,)), ("attention.ln.bias", (768,)), ("intermediate.weight", (3072, 768)),
            ("intermediate.bias", (3072,)), ("output.weight", (768, 3072)), ("output.bias", (768,)),
            ("output.ln.weight", (768,)), ("output.ln.bias", (768,)))]
    return out + [("pooler.weight", (768, 768)), ("pooler.bias", (768,))]


def resnet50() -> Shapes:
    """ResNet-50 (torchvision: conv weights [out, in, kh, kw]; each BatchNorm a weight and a bias)."""
    out: Shapes = [("conv1", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for li, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), 1):
        for b in range(blocks):
            convs = [("conv1", (planes, inplanes, 1, 1)), ("conv2", (planes, planes, 3, 3)),
                     ("conv3", (4 * planes, planes, 1, 1))] + ([("downsample", (4 * planes, inplanes, 1, 1))] if b == 0 else [])
            for n, s in convs:
                out += [(f"layer{li}.{b}.{n}", s), (f"layer{li}.{b}.{n}.bn.weight", s[:1]), (f"layer{li}.{b}.{n}.bn.bias", s[:1])]
            inplanes = 4 * planes
    return out + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


MODELS = {"gpt2-small": (gpt2_small, 124_439_808), "bert-base": (bert_base, 109_482_240), "resnet50": (resnet50, 25_557_032)}


def model_shapes(name: str) -> Shapes:
    """A model's ``[(name, shape)]``, its parameter count checked."""
    build, total = MODELS[name]
    shapes = build()
    if sum(math.prod(s) for _, s in shapes) != total:
        raise RuntimeError(f"{name}: the shapes do not add up to {total:,} parameters")
    return shapes


# --- payloads (as selection.fiber_layout, wire.block_bytes and quantize.QuantizedWire size them) ---------------

def keep(ratio: float, n: int) -> int:
    return 0 if n <= 0 else max(1, int(math.floor(ratio * n)))


def fiber_layout(shape, ratio: float) -> Tuple[int, int, int]:
    """ADTopk's ``axis="auto"`` on the ``[d0, rest]`` view: ``(fibers, fiber_len, k)``; rows while their density is
    within 5% of ``ratio``, else the longer axis."""
    rows, cols = shape[0], math.prod(shape[1:])
    if abs(keep(ratio, cols) / cols - ratio) <= 0.05 * ratio or cols >= rows:
        return rows, cols, keep(ratio, cols)
    return cols, rows, keep(ratio, rows)


def index_bytes(max_index: int) -> int:
    return 2 if max_index <= 32767 else 4 if max_index <= 2 ** 31 - 1 else 8


def pad8(n: float) -> int:
    return -(-int(n) // 8) * 8


#: a tensor under a sparse rule: entries kept, nominal bytes (the library decides on them), block bytes
Sparse = namedtuple("Sparse", "count nominal wire fibers index")


def sparse_spec(shape, rule: str, ratio: float) -> Optional[Sparse]:
    """None where the rule keeps the tensor dense (1-D, under 1024 entries)."""
    numel = math.prod(shape)
    if len(shape) < 2 or numel < MIN_NUMEL:
        return None
    fibers, flen, k = fiber_layout(shape, ratio) if rule == "adtopk" else (1, numel, keep(ratio, numel))
    count, index = fibers * k, index_bytes(flen - 1)
    return Sparse(count, count * (4 + index), pad8(4 * count) + pad8(index * count), fibers, index)


def fibers_per_group(fibers: int, k: int, group: int) -> int:
    if fibers <= 1 or k >= group:
        return 1
    return next((d for d in range(1, fibers + 1) if fibers % d == 0 and d * k >= group), fibers)


def lowbit_bytes(count: int, bits: int, group: int, max_index: Optional[int]) -> int:
    """``QuantizedWire(bits, count, group, max_index).block_bytes``: bf16 levels, packed codes and indices."""
    width = 0 if max_index is None else max(1, int(max_index).bit_length())
    return pad8((count // group) * 2 ** (bits - 1) * 2 + -(-count * bits // 8) + -(-count * width // 8))


def lowbit_sparse(shape, ratio: float, bits: int, value_group: int) -> Optional[int]:
    """An ADTopk tensor's low-bit block (``LocalSteps.payload_bytes``); None where it stays dense."""
    if sparse_spec(shape, "adtopk", ratio) is None:
        return None
    fibers, flen, k = fiber_layout(shape, ratio)
    return lowbit_bytes(fibers * k, bits, k * fibers_per_group(fibers, k, value_group), flen - 1)


def lowbit_dense(shape, bits: int, value_group: int) -> int:
    """``QuantizedWire.dense(bits, shape, value_group).block_bytes``: every entry, levels per run of rows."""
    numel, rows = math.prod(shape), (shape[0] if len(shape) >= 2 else 1)
    return lowbit_bytes(numel, bits, numel // rows * fibers_per_group(rows, numel // rows, value_group), None)


# --- the registry of exchanges ------------------------------------------------------------------------------

@dataclass
class Cost:
    """One step of an exchange (a sync's cost over its interval). ``wire``: one rank's bytes as ``opt.stats()``
    counts them; ``nic``: a host NIC's bytes each way; ``intra``: NVLink bytes per rank besides flat rings;
    ``steps``: ring steps (latency); ``elements`` compressed and ``entries`` decoded per rank (GPU work)."""
    wire: netcost.Wire = netcost.NONE
    nic: float = 0.0
    intra: float = 0.0
    steps: int = 0
    elements: float = 0.0
    entries: float = 0.0
    per_step: bool = True
    notes: List[str] = field(default_factory=list)

    def ring(self, kind: str, nbytes: int, world: int, local: int) -> "Cost":
        """Add a flat ring collective over all ranks (one edge per host crosses its NIC)."""
        w = netcost.wire(kind, nbytes, world, FUSED)
        self.merge(Cost(w, max(w.sent, w.received) if world > local else 0, 0, netcost.messages(kind, world) if nbytes else 0))
        return self

    def merge(self, o: "Cost") -> "Cost":
        self.wire, self.nic, self.intra = self.wire + o.wire, self.nic + o.nic, self.intra + o.intra
        self.steps, self.elements, self.entries = self.steps + o.steps, self.elements + o.elements, self.entries + o.entries
        self.notes += [n for n in o.notes if n not in self.notes]
        return self

    def every(self, interval: int) -> "Cost":
        """A sync every ``interval`` steps, per step; nothing of it overlaps the backward pass."""
        w = netcost.Wire(self.wire.sent // interval, self.wire.received // interval)
        return replace(self, wire=w, nic=self.nic / interval, intra=self.intra / interval, steps=self.steps // interval,
                       elements=self.elements / interval, entries=self.entries / interval, per_step=False)


Exchange = Callable[[Shapes, int, int, netcost.Link], Cost]
REGISTRY: Dict[str, Tuple[Exchange, str, str]] = {}  # name: (bytes_per_step, label, baseline)


def exchange(name: str, label: str, baseline: str = "dense"):
    """Register ``bytes_per_step(shapes, world, ranks_per_host, link) -> Cost`` (``Cost.wire``: a ``netcost.Wire``)."""
    def deco(fn: Exchange) -> Exchange:
        REGISTRY[name] = (fn, label, baseline)
        return fn
    return deco


def numel_of(shapes: Shapes) -> int:
    return sum(math.prod(s) for _, s in shapes)


@exchange("dense", "dense fp32 ring allreduce")
def dense(shapes, world, local, link, nbytes=4):
    return Cost().ring(netcost.ALLREDUCE, nbytes * numel_of(shapes), world, local)


exchange("fp16", "fp16 ring allreduce")(lambda shapes, world, local, link: dense(shapes, world, local, link, 2))


def flat_sparse(shapes: Shapes, world: int, local: int, link, *, rule: str, ratio: float) -> Cost:
    """Per tensor the library's rule: its payload allgathered where that beats the fp32 allreduce, else that."""
    c, gathered, reduced = Cost(), 0, 0
    for _, shape in shapes:
        sp, numel = sparse_spec(shape, rule, ratio), math.prod(shape)
        if sp and sp.nominal < 4 * numel and netcost.choose_gather(sp.nominal, 4 * numel, world, link)[0]:
            gathered, c.elements, c.entries = gathered + sp.wire, c.elements + numel, c.entries + world * sp.count
        else:
            reduced += 4 * numel
    c.notes += [] if gathered else ["every tensor allreduced (hybrid rule)"]
    return c.ring(netcost.ALLGATHER, gathered, world, local).ring(netcost.ALLREDUCE, reduced, world, local)


adtopk = exchange("adtopk", "ADTopk 0.01, flat allgather")(functools.partial(flat_sparse, rule="adtopk", ratio=0.01))
exchange("topk", "Top-k 0.01, flat indices")(functools.partial(flat_sparse, rule="topk", ratio=0.01))


@exchange("powersgd", "PowerSGD rank 4")
def powersgd(shapes, world, local, link, rank=4):
    """``P`` (n x r) and ``Q`` (m x r) allreduced in fp32 for matrices compressed >= 2x; the rest dense."""
    c, low, reduced = Cost(), 0, 0
    for _, shape in shapes:
        numel = math.prod(shape)
        n, m = shape[0], numel // shape[0]
        r = min(rank, n, m)
        if len(shape) >= 2 and numel >= MIN_NUMEL and numel / ((n + m) * r) >= 2.0:
            low, c.elements = low + 4 * (n + m) * r, c.elements + numel
        else:
            reduced += 4 * numel
    return c.ring(netcost.ALLREDUCE, low, world, local).ring(netcost.ALLREDUCE, reduced, world, local)


@exchange("hierarchical", "hierarchical ADTopk 0.01")
def hierarchical(shapes, world, local, link, ratio=0.01):
    """``hierarchical.py``: reduce-scatter and allgather inside the host (NVLink); each local rank's block payload
    allgathered among the H hosts (only that crosses a NIC). Tensors it does not take (the flat rule at H, fewer
    fibers than local ranks) travel flat; one host or one rank per host: all flat."""
    hosts = world // local
    if hosts <= 1 or local <= 1:
        return adtopk(shapes, world, local, link, ratio=ratio).merge(Cost(notes=["flat: one host" if hosts <= 1 else "flat: L = 1"]))
    c, rest = Cost(), []
    for name, shape in shapes:
        sp, numel = sparse_spec(shape, "adtopk", ratio), math.prod(shape)
        if not (sp and sp.nominal < 4 * numel and sp.fibers >= local
                and netcost.choose_gather(sp.nominal, 4 * numel, hosts, link)[0]):
            rest.append((name, shape))
            continue
        base, extra = divmod(sp.fibers, local)
        k = sp.count // sp.fibers
        blocks = [pad8(4 * k * (base + (j < extra))) + pad8(sp.index * k * (base + (j < extra))) for j in range(local)]
        c.merge(Cost(netcost.allgather(blocks[0], hosts), (hosts - 1) * sum(blocks), 2 * (local - 1) / local * 4 * numel,
                     0, numel / local, hosts * sp.count / local))  # stats count local rank 0's block, the largest
    c.steps = (hosts - 1) + 2 * (local - 1) if c.elements else 0
    return c.merge(adtopk(rest, world, local, link, ratio=ratio))


def flat_sharded(payload: float, world: int, local: int) -> Cost:
    """``horovod_adtopk.sharded`` over all W ranks (no in-host stage): an all-to-all of the shards, then an
    allgather of the owners' blocks: ``2 (W-1)/W P`` per rank in ``2 (W-1)`` messages. A host's NIC carries the
    all-to-all traffic of its L ranks to the other hosts, ``L (W-L)/W P``, and one ring edge of the allgather."""
    share = round(2 * (world - 1) / world * payload)
    nic = (local * (world - local) / world * payload + (world - 1) / world * payload) if world > local else 0
    return Cost(netcost.Wire(share, share), nic, 0, 2 * (world - 1))


@exchange("adamw_recipe", "README AdamW recipe: ADTopk 0.25, 2-bit values, every 4 steps (auto: sharded from W = 3)",
          "diloco")
def adamw_recipe(shapes, world, local, link, ratio=0.25, bits=2, value_group=64, interval=4, shard=True):
    """``LocalSteps``: a sparse tensor's low-bit block by the cheapest of the owner-sharded exchange (from 3
    ranks on), an allgather (where that beats the fp32 allreduce) and the allreduce; the rest bf16-allgathered
    where that moves fewer bytes than the fp32 allreduce (W < 4), else allreduced in fp32."""
    c, gathered, reduced = Cost(), 0, 0
    for _, shape in shapes:
        numel, q = math.prod(shape), lowbit_sparse(shape, ratio, bits, value_group)
        if (shard and q is not None and world > 2 and len(shape) >= 2
                and 2 * (world - 1) / world * q < min(4 * numel * 2 * (world - 1) / world, (world - 1) * q)):
            c.merge(flat_sharded(q, world, local))
            gathered, c.elements = gathered + 0, c.elements + numel
            c.notes += [] if "sharded" in c.notes else ["sharded"]
            c.entries += (world + 1) * sparse_spec(shape, "adtopk", ratio).count
        elif q is not None and q < 4 * numel and netcost.choose_gather(q, 4 * numel, world, link)[0]:
            gathered, c.elements = gathered + q, c.elements + numel
            c.entries += world * sparse_spec(shape, "adtopk", ratio).count
        elif netcost.allgather(2 * numel, world).received < netcost.allreduce(4 * numel, world).received:
            gathered, c.entries = gathered + 2 * numel, c.entries + world * numel
        else:
            reduced += 4 * numel
    c.notes += [] if gathered or "sharded" in c.notes else ["every tensor allreduced: DiLoCo's exchange"]
    return c.ring(netcost.ALLGATHER, gathered, world, local).ring(netcost.ALLREDUCE, reduced, world, local).every(interval)


exchange("diloco", "dense DiLoCo every 4 steps")(lambda shapes, world, local, link: dense(shapes, world, local, link).every(4))


exchange("adamw_recipe_allgather", "the recipe with exchange=\"allgather\" (every payload gathered)", "diloco")(
    functools.partial(adamw_recipe, shard=False))


@exchange("lowbit_twostage", "2-bit codes of every entry, owner-sharded, every 4 steps (local steps, value_bits=2)",
          "diloco")
def lowbit_twostage(shapes, world, local, link, bits=2, value_group=64, interval=4):
    """Every pseudo-gradient entry as a b-bit code (``QuantizedWire.dense``); owners decode, sum and re-quantize
    their rows (``horovod_adtopk.sharded``, flat over all ranks): ``~2 D bits/32`` per rank, where an allgather
    of the codes moves ``(W-1) D bits/32``."""
    c = Cost()
    for _, shape in shapes:
        part = flat_sharded(lowbit_dense(shape, bits, value_group), world, local)
        c.merge(replace(part, steps=0, elements=2 * math.prod(shape), entries=math.prod(shape)))
        c.steps = max(c.steps, part.steps)
    return c.every(interval)


@exchange("sparse_rs", "ADTopk 0.01 every step, owner-sharded (exchange=\"sharded\", flat over all ranks)")
def sparse_rs(shapes, world, local, link, ratio=0.01):
    """Each rank's ADTopk payload split among owners by whole fibers (k per fiber: equal chunks); an owner sums
    its chunks, keeps k per fiber again and allgathers (``horovod_adtopk.sharded``): ``2 (W-1)/W P`` per rank
    instead of ``(W-1) P``."""
    c, reduced = Cost(), 0
    for _, shape in shapes:
        sp, numel = sparse_spec(shape, "adtopk", ratio), math.prod(shape)
        if sp is None or sp.wire >= 4 * numel:
            reduced += 4 * numel
            continue
        part = flat_sharded(sp.wire, world, local)
        c.merge(replace(part, steps=0, elements=numel * (1 + 1 / world), entries=2 * sp.count))
        c.steps = max(c.steps, part.steps)
    return c.ring(netcost.ALLREDUCE, reduced, world, local)


# --- time, break-even, crossover ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Hardware:
    nic: float  # bytes/s each way, one NIC per host
    nvlink: float  # bytes/s per GPU inside a host
    alpha: float  # seconds per ring step
    overlap: float  # fraction of compute that hides a per-step exchange
    select_ns: float
    decode_ns: float


def step_seconds(c: Cost, world: int, local: int, compute: float, hw: Hardware) -> Dict[str, float]:
    """Compute + the exchange's GPU work + the communication not hidden behind the backward pass."""
    flat = c.nic / hw.nic if world > local else max(c.wire.sent, c.wire.received) / hw.nvlink
    comm = flat + c.intra / hw.nvlink + c.steps * hw.alpha
    work = (c.elements * hw.select_ns + c.entries * hw.decode_ns) * 1e-9
    exposed = max(0.0, comm - hw.overlap * compute) if c.per_step else comm
    return {"step_s": compute + work + exposed, "comm_s": comm, "work_s": work, "exposed_s": exposed}


def at(hw: Hardware, gbit: float) -> Hardware:
    return replace(hw, nic=gbit * 1e9 / 8)


def break_even_gbit(name: str, shapes: Shapes, world: int, local: int, compute: float, hw: Hardware):
    """The NIC speed (Gbit/s) below which ``name``'s step beats dense's: a number, "always", "never" or "tie"."""
    x, d = REGISTRY[name][0](shapes, world, local, FUSED), dense(shapes, world, local, FUSED)
    gap = lambda g: (step_seconds(x, world, local, compute, at(hw, g))["step_s"]  # noqa: E731
                     - step_seconds(d, world, local, compute, at(hw, g))["step_s"])
    faster = lambda g: gap(g) < 0  # noqa: E731
    grid = [10 ** (e / 20) for e in range(-40, 101)]  # 0.01 .. 100,000 Gbit/s
    wins = [faster(g) for g in grid]
    if all(wins) or not any(wins):
        return "always" if wins[0] else "never" if any(gap(g) > 0 for g in grid) else "tie"
    lo = max(i for i, w in enumerate(wins) if w)
    if lo + 1 == len(grid):
        return "always"
    a, b = grid[lo], grid[lo + 1]
    for _ in range(40):
        a, b = (math.sqrt(a * b), b) if faster(math.sqrt(a * b)) else (a, math.sqrt(a * b))
    return round(a, 1)


def stops_paying(name: str, shapes: Shapes, local: int, compute: float, hw: Hardware) -> Optional[int]:
    """First W (16 .. 8192, powers of 2) where ``name``'s step is not >= 1% faster than its baseline's."""
    fn, _, base = REGISTRY[name]
    for w in (2 ** e for e in range(4, 14)):
        step = lambda f: step_seconds(f(shapes, w, local, FUSED), w, local, compute, hw)["step_s"]  # noqa: E731
        if step(fn) >= 0.99 * step(REGISTRY[base][0]):
            return w
    return None


# --- the report ---------------------------------------------------------------------------------------------

def evaluate(models, worlds, links, local: int, compute_ms: Dict[str, float], hw: Hardware) -> Dict[str, dict]:
    """Every model x W x exchange: bytes, % of dense, step times per link, break-even; stop-paying W per link."""
    out: Dict[str, dict] = {}
    for model in models:
        shapes, compute = model_shapes(model), compute_ms[model] / 1e3
        m = out[model] = {"params": numel_of(shapes), "tensors": len(shapes), "compute_ms": compute_ms[model],
                          "worlds": {}, "stops_paying_at_W": {}}
        for w in worlds:
            d, row = dense(shapes, w, local, FUSED), m["worlds"].setdefault(str(w), {})
            for name, (fn, label, base) in REGISTRY.items():
                c = fn(shapes, w, local, FUSED)
                share = c.nic / d.nic if w > local else c.wire.sent / d.wire.sent
                row[name] = {"label": label, "rank_bytes_sent": c.wire.sent, "rank_bytes_received": c.wire.received,
                             "nic_bytes": c.nic, "intra_bytes": c.intra, "pct_of_dense": 100 * share, "notes": c.notes,
                             "per_step": c.per_step, "baseline": base,
                             "time": {f"{g:g}": step_seconds(c, w, local, compute, at(hw, g)) for g in links},
                             "break_even_gbit": break_even_gbit(name, shapes, w, local, compute, hw)}
        m["stops_paying_at_W"] = {f"{g:g}": {n: stops_paying(n, shapes, local, compute, at(hw, g))
                                             for n in REGISTRY if n != "dense"} for g in links}
    return out


def tables(results: Dict[str, dict], worlds, link: float, local: int) -> List[Tuple[str, List[str], List[List[str]]]]:
    """Per model: cells "% of dense bytes | step ms at ``link`` | break-even Gbit/s"; then stop-paying W."""
    pct = lambda x: f"{x:.2g}%" if x < 10 else f"{x:.0f}%"  # noqa: E731
    out = []
    for model, m in results.items():
        dense_mb = {w: m["worlds"][str(w)]["dense"]["nic_bytes" if w > local else "rank_bytes_sent"] / 1e6 for w in worlds}
        head = ["exchange"] + [f"W={w} (dense {dense_mb[w]:.0f} MB)" for w in worlds]
        rows = [[label] + [f"{pct(r['pct_of_dense'])} | {r['time'][f'{link:g}']['step_s'] * 1e3:.0f} ms | "
                           f"{r['break_even_gbit']}" for r in (m["worlds"][str(w)][name] for w in worlds)]
                for name, (_, label, _) in REGISTRY.items()]
        out.append((f"{model} ({m['params']:,} params, compute {m['compute_ms']:g} ms): bytes as % of dense | step at "
                    f"{link:g} Gbit/s | break-even NIC Gbit/s", head, rows))
    names = [n for n in REGISTRY if n != "dense"]
    out.append((f"First W where the step is not 1% faster than its baseline's ({link:g} Gbit/s; baseline dense fp32, "
                "DiLoCo for adamw_recipe and lowbit_twostage)", ["model"] + names,
                [[model] + [str(m["stops_paying_at_W"][f"{link:g}"][n] or "> 8192") for n in names]
                 for model, m in results.items()]))
    return out


def markdown(title: str, head: List[str], rows: List[List[str]]) -> str:
    line = lambda cells: "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"  # noqa: E731
    return "\n".join([f"**{title}**", "", line(head), "|" + "---|" * len(head)] + [line(r) for r in rows])


ALIASES = {"none": "dense", "dense_fp32": "dense", "flat": "adtopk", "hier": "hierarchical", "recipe": "adamw_recipe"}
PARAMETER = {"adtopk": "ratio", "topk": "ratio", "hierarchical": "ratio", "sparse_rs": "ratio", "powersgd": "rank"}


def resolve(config: str) -> Exchange:
    """A registry name, optionally with its parameter as tests/wire_worker.py names phases (``adtopk:0.05``)."""
    name, _, arg = str(config).lower().replace("-", "_").partition(":")
    fn = REGISTRY[ALIASES.get(name, name)][0]
    if arg:
        key = PARAMETER[ALIASES.get(name, name)]
        return functools.partial(fn, **{key: int(arg) if key == "rank" else float(arg)})
    return fn


def validate(path: Path, local_default: int, tolerance: float) -> Tuple[List[dict], bool]:
    """The model's bytes against measured records (format: the module docstring)."""
    data = json.loads(path.read_text())
    out, ok = [], True
    for rec in data["records"] if isinstance(data, dict) else data:
        world = int(rec.get("world", rec.get("world_size", rec.get("np", 0))))
        local = min(world, int(rec["layout"][1]) if "layout" in rec else int(rec.get("ranks_per_host", local_default)))
        if "shapes" in rec:
            shapes = [(s[0], tuple(s[1])) if isinstance(s[0], str) else (f"t{i}", tuple(s)) for i, s in enumerate(rec["shapes"])]
        else:
            shapes = model_shapes(rec["model"]) if "model" in rec else [("t", tuple(rec.get("shape", [rec["numel"]])))]
        c = resolve(rec["config"])(shapes, world, local, FUSED)
        row = {"config": rec["config"], "world": world, "ranks_per_host": local}
        for key, model in (("wire_bytes_sent", c.wire.sent), ("nic_bytes_sent", c.nic)):
            if key in rec:
                measured = rec[key] / max(1, int(rec.get("steps", 1)))
                err = (model - measured) / measured if measured else (0.0 if not model else math.inf)
                row.update({key: measured, key + "_model": model, key + "_error": err})
                ok &= abs(err) <= tolerance
        out.append(row)
    return out, ok


def provenance(argv: Sequence[str]) -> Dict[str, object]:
    """The command, the commit (``common.git_commit``), the date and the machine of this run."""
    commit = common.git_commit() or ""
    return {"command": " ".join(["python benchmarks/bench_world_model.py", *common.portable_argv(argv)]),
            "git_commit": commit.split(" ")[0], "git_dirty": "uncommitted" in commit,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": common.machine_info()}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS))
    ap.add_argument("--links", nargs="+", type=float, default=list(LINKS_GBIT), help="host NIC Gbit/s (10 25 100)")
    ap.add_argument("--table-link", type=float, default=25.0, help="the tables' NIC Gbit/s (25)")
    ap.add_argument("--ranks-per-host", type=int, default=8)
    ap.add_argument("--nvlink-gbs", type=float, default=300.0, help="GB/s per GPU inside a host (300)")
    ap.add_argument("--alpha-us", type=float, default=0.0, help="latency per ring step, us (0: fused)")
    ap.add_argument("--overlap", type=float, default=0.0, help="fraction of compute hiding a per-step exchange (0)")
    ap.add_argument("--select-ns", type=float, default=0.19, help="GPU ns per element compressed (0.19)")
    ap.add_argument("--decode-ns", type=float, default=0.1, help="GPU ns per entry decoded (0.1)")
    ap.add_argument("--compute-ms", nargs="*", default=[], metavar="MODEL=MS", help=f"defaults {COMPUTE_MS}")
    ap.add_argument("--out-dir", default="docs/scale", help="relative to the repository root (docs/scale)")
    ap.add_argument("--validate", metavar="RECORDS.json")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--list", action="store_true", help="list the registered exchanges")
    return ap.parse_args(argv)


def run_validation(args: argparse.Namespace) -> int:
    rows, ok = validate(Path(args.validate), args.ranks_per_host, args.tolerance)
    keys = [k for k in ("wire_bytes_sent", "nic_bytes_sent") if any(k in r for r in rows)]
    print(common.table(["config", "W", "L"] + [f"{k} {s}" for k in keys for s in ("measured", "model", "error")],
                       [[r["config"], str(r["world"]), str(r["ranks_per_host"])]
                        + sum(([f"{r[k]:.0f}", f"{r[k + '_model']:.0f}", f"{100 * r[k + '_error']:+.2f}%"]
                               if k in r else ["-"] * 3 for k in keys), []) for r in rows]))
    print(f"every record within {100 * args.tolerance:g}%: {ok}")
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.list:
        print("\n".join(f"{n:16s} {label} (baseline {base})" for n, (_, label, base) in REGISTRY.items()))
        return 0
    if args.validate:
        return run_validation(args)
    compute = {**COMPUTE_MS, **{k: float(v) for k, v in (item.split("=") for item in args.compute_ms)}}
    hw = Hardware(args.table_link * 1e9 / 8, args.nvlink_gbs * 1e9, args.alpha_us * 1e-6, args.overlap,
                  args.select_ns, args.decode_ns)
    results = evaluate(args.models, args.worlds, args.links, args.ranks_per_host, compute, hw)
    text = __doc__.split("recorded in the JSON):")[1].split("``--validate")[0].strip()
    settings = {**{k: v for k, v in vars(args).items() if k not in ("validate", "list", "out_dir", "compute_ms")},
                "compute_ms": compute}
    this_run = "This run: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + "."
    prov = provenance(argv)
    md = ["# World-size model of the exchanges", "", f"`{prov['command']}` at git commit "
          f"{prov['git_commit']}" + (" (working tree modified)" if prov["git_dirty"] else "") + f", {prov['date'][:10]}.",
          "", text, "", this_run,
          "", "Bytes: a host NIC's per step as % of dense fp32's (W <= 8: one host, per-rank NVLink bytes).", ""]
    print(f"{text}\n\n{this_run}\n")
    for title, head, rows in tables(results, args.worlds, args.table_link, args.ranks_per_host):
        print(f"== {title}\n{common.table(head, rows)}\n")
        md += [markdown(title, head, rows), ""]
    out = REPO / args.out_dir
    common.write_json(out / "world_model.json", {"provenance": prov, "assumptions": {**settings, "text": text},
                                                 "exchanges": {n: v[1] for n, v in REGISTRY.items()}, "models": results})
    (out / "world_model.md").write_text("\n".join(md))
    print(f"wrote {args.out_dir}/world_model.json and world_model.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
