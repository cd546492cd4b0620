#!/usr/bin/env python
"""What the axis rule, the AVX2 paths and threads buy, per layer shape, against the memory limit.

How to run (from the repository root, the native kernel built)::

    python benchmarks/bench_kernel_paths.py                 # about 2 minutes on one idle core
    python benchmarks/bench_kernel_paths.py --repeats 5 --dtypes float32 float16 bfloat16

For every shape (the 25M MLP's weight matrices, VGG-16 fc6/fc7, BERT-base embeddings and layer matrices,
a ResNet-50 3x3 conv, GPT-2 small's token embedding and fused qkv, the job's 1 M-parameter GPT's matrices) it times the fused error-feedback selection the optimizer runs on the CPU:
``kernels.adtopk_select(r, rows, cols, axis, k, grad=g, zero_sent=True)`` (``r += g``, per-fiber top-k,
sent entries zeroed), in seven configurations, interleaved repeat by repeat (so a change of machine load
hits all of them alike):

- ``before``: the old "auto" (fibers along the longer axis), the scalar first pass (``HOROVOD_ADTOPK_SIMD=0``),
  the legacy selection paths (``HOROVOD_ADTOPK_LEGACY_SELECT=1``: column tiles walked row by row, every entry
  a candidate where block maxima cannot bound the k-th key);
- ``simd``: the old "auto", the AVX2 first pass, the legacy paths;
- ``legacy``: the new "auto" (``selection.resolve_axis`` with ``ratio``: contiguous rows within 5% of ratio),
  the AVX2 first pass, the legacy paths;
- ``rule``: as ``legacy`` with today's paths (row-major slab passes for column fibers, thresholds from a sample
  of the keys where block maxima cannot bound the k-th key);
- ``rule+2t``: as ``rule`` with 2 torch threads (fibers split between threads);
- ``join``: as ``rule`` on the layout of ``min_fiber_len`` (``--min-fiber-len``, 2048 by default): rows shorter
  than that joined into fibers of whole adjacent rows (``selection.fiber_layout``), one thread;
- ``joincols``: the same with whole columns joined (``join="columns"``: the view ``[rows * g, cols / g]``, its
  columns the fibers), one thread;
- ``steady``: as ``rule``, on the error-feedback memory after 8 steps of the optimizer's use (``r += g_t``,
  per-fiber top-k, sent entries zeroed, ``g_t`` the gradient rolled a different way each step) instead of on
  ``r`` itself;
- ``hinted``: ``steady`` with the hint those 8 steps carried (``kernels.adtopk_select(..., hint=)``, what the
  optimizer passes on the CPU; rows and column slabs use it);
- ``join+hint``: the same on the ``join`` layout.

and two memory references on the same tensors: ``read`` (``g.sum()``, one read pass) and ``add``
(``r.add_(g)``: reads r and g, writes r, the bytes the fused selection must move at least, so its time is
the memory limit of the selection). Reported: the best of the repeats per configuration (preemption on a
shared machine only adds time; medians are in the JSON), ratios to
``read`` and ``add``, and the achieved bandwidth of ``add`` (bytes read + written / time).
Output: a table on stdout and ``bench_results/kernel_paths.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Callable, Dict, List

import torch

import common
from horovod_adtopk import kernels, selection

SHAPES = {"mlp.fc1 [4096,2048]": (4096, 2048), "mlp.fc2 [4096,4096]": (4096, 4096),
          "vgg16.fc6 [4096,25088]": (4096, 25088), "vgg16.fc7 [4096,4096]": (4096, 4096),
          "bert.word_emb [30522,768]": (30522, 768), "bert.ffn_in [3072,768]": (3072, 768),
          "bert.ffn_out [768,3072]": (768, 3072), "bert.attn [768,768]": (768, 768),
          "resnet50.conv3x3 [256,2304]": (256, 2304),
          # GPT-2 small (its attention, MLP and projection matrices share BERT-base's shapes above)
          "gpt2.wte [50257,768]": (50257, 768), "gpt2.c_attn [2304,768]": (2304, 768),
          # the job's GPT (width 128, examples/models.py): fused qkv, attention projection, MLP in and out
          "gpt1m.qkv [384,128]": (384, 128), "gpt1m.attn_proj [128,128]": (128, 128),
          "gpt1m.fc [512,128]": (512, 128), "gpt1m.proj [128,512]": (128, 512)}
CONFIGS = ("before", "simd", "legacy", "rule", "rule+2t", "join", "joincols", "steady", "hinted", "join+hint")
STEADY_STEPS = 8  # error-feedback steps before the steady-state configurations are timed


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layout_of(name: str, shape, ratio: float, min_fiber_len: int):
    """``(rows, cols, axis, k)`` of a configuration's fibers on a ``shape`` matrix."""
    rows, cols = shape
    if name in ("join", "joincols", "join+hint"):
        lay = selection.fiber_layout(tuple(shape), ratio, "auto", min_fiber_len,
                                     "columns" if name == "joincols" else "rows")
        return lay.rows, lay.cols, lay.axis, lay.k
    old_axis = 1 if cols >= rows else 0
    axis = old_axis if name in ("before", "simd") else selection.resolve_axis(rows, cols, "auto", ratio)
    return rows, cols, axis, selection.keep_count(ratio, cols if axis == 1 else rows)


def steady_state(name: str, r: torch.Tensor, g: torch.Tensor, ratio: float, min_fiber_len: int):
    """The error-feedback memory and hint after STEADY_STEPS steps of the optimizer's use (``r += g_t``, top-k
    per fiber, sent entries zeroed; ``g_t`` the gradient rolled by a different offset each step), from r."""
    rows, cols, axis, k = layout_of(name, r.shape, ratio, min_fiber_len)
    state, hint = r.clone(), kernels.new_hint(rows if axis == 1 else cols)
    for t in range(STEADY_STEPS):
        kernels.adtopk_select(state, rows, cols, axis, k, grad=g.view(-1).roll(7919 * (t + 1)).view(g.shape),
                              zero_sent=True, hint=hint)
    return state, hint


def one_config(name: str, r: torch.Tensor, g: torch.Tensor, ratio: float, min_fiber_len: int, steady=None) -> float:
    """Seconds of one fused selection of ``name`` on fresh copies of r (``steady``: of its steady state and
    hint, the hint used by ``hinted`` and ``join+hint`` only)."""
    rows, cols, axis, k = layout_of(name, r.shape, ratio, min_fiber_len)
    if name in ("steady", "hinted", "join+hint"):
        state, hint = steady
        x, h = state.clone(), hint.clone()
        h = None if name == "steady" else h
        return timed(lambda: kernels.adtopk_select(x, rows, cols, axis, k, grad=g, zero_sent=True, hint=h))
    os.environ["HOROVOD_ADTOPK_SIMD"] = "0" if name == "before" else "1"
    os.environ["HOROVOD_ADTOPK_LEGACY_SELECT"] = "1" if name in ("before", "simd", "legacy") else "0"
    torch.set_num_threads(2 if name.endswith("2t") else 1)
    x = r.clone()
    try:
        return timed(lambda: kernels.adtopk_select(x, rows, cols, axis, k, grad=g, zero_sent=True))
    finally:
        torch.set_num_threads(1)
        os.environ.pop("HOROVOD_ADTOPK_SIMD", None)
        os.environ.pop("HOROVOD_ADTOPK_LEGACY_SELECT", None)


def measure_shape(shape, dtype: torch.dtype, ratio: float, repeats: int, min_fiber_len: int) -> Dict[str, float]:
    gen = torch.Generator().manual_seed(shape[0] * 31 + shape[1])
    r = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    times: Dict[str, List[float]] = {c: [] for c in (*CONFIGS, "read", "add")}
    steady = {"rule": steady_state("rule", r, g, ratio, min_fiber_len),
              "join": steady_state("join", r, g, ratio, min_fiber_len)}
    for rep in range(repeats + 1):  # the first round is a warm-up
        for c in CONFIGS:
            t = one_config(c, r, g, ratio, min_fiber_len, steady["join" if c == "join+hint" else "rule"])
            if rep:
                times[c].append(t)
        x = r.clone()
        t_read, t_add = timed(lambda: g.sum()), timed(lambda: x.add_(g))
        if rep:
            times["read"].append(t_read)
            times["add"].append(t_add)
    # best of the repeats: on a shared machine preemptions only ever add time (medians are in the JSON)
    out = {c: min(v) for c, v in times.items()}
    out["median"] = {c: statistics.median(v) for c, v in times.items()}
    rows, cols = shape
    out["axis_before"] = 1 if cols >= rows else 0
    out["axis_rule"] = selection.resolve_axis(rows, cols, "auto", ratio)
    out["join_layout"] = list(dataclasses.astuple(selection.fiber_layout(shape, ratio, "auto", min_fiber_len))[1:])
    out["joincols_layout"] = list(dataclasses.astuple(
        selection.fiber_layout(shape, ratio, "auto", min_fiber_len, "columns"))[1:])
    out["add_gbytes_per_s"] = 3 * r.numel() * r.element_size() / out["add"] / 1e9
    return out


def ms(seconds: float) -> str:
    """Milliseconds with three significant digits (the job's GPT matrices take tens of microseconds)."""
    return f"{seconds * 1e3:.3g}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-fiber-len", type=int, default=2048, help="the join configuration's min_fiber_len")
    short = {n.split()[0]: n for n in SHAPES}  # "bert.attn" -> "bert.attn [768,768]"
    ap.add_argument("--shapes", nargs="+", choices=list(short), default=list(short), metavar="NAME",
                    help=f"a subset of the shapes (default: all): {', '.join(short)}")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--out", default=str(common.REPO_ROOT / "bench_results" / "kernel_paths.json"))
    a = ap.parse_args()
    if not kernels.native_available():
        raise SystemExit("bench_kernel_paths: the native kernel is not built (python setup.py build_ext --inplace)")
    torch.set_num_threads(1)
    report = {"machine": common.machine_info(threads=1), "ratio": a.ratio, "repeats": a.repeats,
              "min_fiber_len": a.min_fiber_len, "results": {}}
    head = ["shape", "dtype", "axis old->new", *[f"{c} ms" for c in CONFIGS], "read ms", "add ms",
            "legacy/rule", "before/add", "rule/add", "rule/read", "rule/join", "join/read", "joincols/read",
            "steady/read", "hinted/read", "join+hint/read", "hinted/add", "join+hint/add", "add GB/s"]
    rows = []
    for dt in a.dtypes:
        for name in (short[n] for n in a.shapes):
            shape = SHAPES[name]
            m = measure_shape(shape, getattr(torch, dt), a.ratio, a.repeats, a.min_fiber_len)
            report["results"][f"{name} {dt}"] = m
            rows.append([name, dt, f"{m['axis_before']}->{m['axis_rule']}", *[ms(m[c]) for c in CONFIGS],
                         ms(m['read']), ms(m['add']), f"{m['legacy'] / m['rule']:.2f}",
                         f"{m['before'] / m['add']:.1f}",
                         f"{m['rule'] / m['add']:.1f}", f"{m['rule'] / m['read']:.1f}", f"{m['rule'] / m['join']:.2f}",
                         f"{m['join'] / m['read']:.1f}", f"{m['joincols'] / m['read']:.1f}",
                         f"{m['steady'] / m['read']:.1f}", f"{m['hinted'] / m['read']:.1f}",
                         f"{m['join+hint'] / m['read']:.1f}", f"{m['hinted'] / m['add']:.2f}",
                         f"{m['join+hint'] / m['add']:.2f}", f"{m['add_gbytes_per_s']:.1f}"])
            print(rows[-1], flush=True)
    report["machine"]["loadavg_end"] = list(os.getloadavg())
    text = common.table(head, rows)
    print(text)
    report["table"] = text
    common.write_record(a.out, report)  # adds the command, the commit and the date (report.py reads them)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
