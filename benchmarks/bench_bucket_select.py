#!/usr/bin/env python
"""Whole-bucket ADTopk selection on a GPU against the memory limit and against today's per-layer path, and the
step time of a GPT-2-small-sized model on the DDP engine (the stages ``bucket`` and ``step`` of
``scripts/gpu_check.sh``).

    python benchmarks/bench_bucket_select.py --stage bucket --out gpu_check_out     # CUDA
    python benchmarks/bench_bucket_select.py --stage step --out gpu_check_out       # CUDA, 1 process over NCCL
    python benchmarks/bench_bucket_select.py --stage all --dry --out dry_out          # CPU, interpreter, tiny

``bucket``: for the ADTopk tensors (2 or more dims, at least 1,024 entries) of GPT-2 small, BERT-base and
ResNet-50 (their parameter shapes written out below: no downloads), float32 gradients in DDP-style buckets of
25 MB (parameters in reverse order), ADTopk ratio 0.01 (``--ratio``), side by side with CUDA events (median of
``--repeats`` after warm-up), for the whole model:

- ``copy``: one kernel moving the bytes such a pass must move at least: read the gradient, read and write the
  residual, write the payload (values and int64 fiber-local positions), write the averaged gradient;
- ``bucket``: ``horovod_adtopk.bucket_select.select`` per bucket (error-feedback add, per-fiber top-k, sent
  entries zeroed, every tensor's wire block written into one ``uint8`` buffer), then
  ``bucket_select.decode`` of 8 ranks' buffers (8 simulated ranks: a ``[8, wire bytes]`` buffer as an
  allgather delivers it; one launch for the zeroing and one per rank over the whole bucket) into the averaged
  gradient: what the DDP engine runs per bucket on CUDA;
- ``per_layer``: the per-tensor path, tensor by tensor: ``kernels.adtopk_select``, ``wire.pack``, the
  concatenation of the 8 ranks' blocks and ``sparsify.aggregate_blocks`` (one ``index_add_`` per rank).

Checks: the bucket path's wire blocks, residual and averaged gradient are bit for bit the per-layer path's;
the bucket path runs under ``torch.cuda.set_sync_debug_mode("error")`` (no host synchronisation).
Ratios: ``bucket / copy`` (target <= 2) and ``per_layer / bucket`` (target >= 5).

``step``: one process (NCCL on CUDA, Gloo with ``--dry``), the GPT model of ``examples/models.py`` at
GPT-2-small size (12 layers, width 768, vocabulary 50,257, context 1,024; ``--layers --dim --vocab``),
AdamW, bf16 autocast, ``--seqs`` sequences of ``--seq-len`` tokens per step, through DDP: dense; the DDP
engine with ADTopk 0.01 (``exchange_when_alone=True``: compression and both collectives run) with the
bucket selection and with the per-tensor one (``horovod_adtopk.ddp.bucket.BUCKET_SELECT``); PyTorch's
PowerSGD hook (rank 4) and ``fp16_compress_hook``. Median step time of ``--steps`` synchronised steps after
``--warmup``; overhead against dense (target: ADTopk within 1.10x). Check: every loss finite, and (dry) the
bucket and per-tensor ADTopk runs end with bitwise equal parameters.

Writes ``OUT/bench_bucket_select.json`` (``{"bucket": ..., "step": ..., "ok": ...}``); exit status 1 if a
check failed (targets missed are reported, not failures).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from horovod_adtopk import bucket_select as bs  # noqa: E402
from horovod_adtopk import kernels  # noqa: E402
from horovod_adtopk.compressors import ADTopkCompressor, TensorInfo  # noqa: E402
from horovod_adtopk.compressors.base import FiberCodec  # noqa: E402
from horovod_adtopk import wire  # noqa: E402
from horovod_adtopk.sparsify import aggregate_blocks  # noqa: E402

import common  # noqa: E402  (benchmarks/common.py: the script's directory is on the path)

RANKS = 8
BUCKET_BYTES = 25 * 2 ** 20
MIN_NUMEL = 1024


# --- parameter shapes ------------------------------------------------------------------------------------------


def gpt2_shapes(dim=768, layers=12, vocab=50257, context=1024):
    """GPT-2 small (Hugging Face names; Conv1D weights are [in, out])."""
    s = [("wte", (vocab, dim)), ("wpe", (context, dim))]
    for i in range(layers):
        p = f"h.{i}."
        s += [(p + "ln_1.weight", (dim,)), (p + "ln_1.bias", (dim,)),
              (p + "attn.c_attn.weight", (dim, 3 * dim)), (p + "attn.c_attn.bias", (3 * dim,)),
              (p + "attn.c_proj.weight", (dim, dim)), (p + "attn.c_proj.bias", (dim,)),
              (p + "ln_2.weight", (dim,)), (p + "ln_2.bias", (dim,)),
              (p + "mlp.c_fc.weight", (dim, 4 * dim)), (p + "mlp.c_fc.bias", (4 * dim,)),
              (p + "mlp.c_proj.weight", (4 * dim, dim)), (p + "mlp.c_proj.bias", (dim,))]
    return s + [("ln_f.weight", (dim,)), ("ln_f.bias", (dim,))]


def bert_shapes(dim=768, layers=12, vocab=30522, positions=512):
    """BERT-base (bert-base-uncased sizes, with the pooler)."""
    s = [("embeddings.word", (vocab, dim)), ("embeddings.position", (positions, dim)), ("embeddings.type", (2, dim)),
         ("embeddings.ln.weight", (dim,)), ("embeddings.ln.bias", (dim,))]
    for i in range(layers):
        p = f"layer.{i}."
        for m in ("query", "key", "value", "attn_out"):
            s += [(p + m + ".weight", (dim, dim)), (p + m + ".bias", (dim,))]
        s += [(p + "attn_ln.weight", (dim,)), (p + "attn_ln.bias", (dim,)),
              (p + "intermediate.weight", (4 * dim, dim)), (p + "intermediate.bias", (4 * dim,)),
              (p + "output.weight", (dim, 4 * dim)), (p + "output.bias", (dim,)),
              (p + "out_ln.weight", (dim,)), (p + "out_ln.bias", (dim,))]
    return s + [("pooler.weight", (dim, dim)), ("pooler.bias", (dim,))]


def resnet50_shapes(width=64, classes=1000):
    """torchvision's ResNet-50 (``width`` 64; smaller for a dry run)."""
    s = [("conv1", (width, 3, 7, 7)), ("bn1.weight", (width,)), ("bn1.bias", (width,))]
    cin = width
    for li, (blocks, w) in enumerate([(3, width), (4, 2 * width), (6, 4 * width), (3, 8 * width)]):
        out = 4 * w
        for b in range(blocks):
            p = f"layer{li + 1}.{b}."
            s += [(p + "conv1", (w, cin, 1, 1)), (p + "bn1.weight", (w,)), (p + "bn1.bias", (w,)),
                  (p + "conv2", (w, w, 3, 3)), (p + "bn2.weight", (w,)), (p + "bn2.bias", (w,)),
                  (p + "conv3", (out, w, 1, 1)), (p + "bn3.weight", (out,)), (p + "bn3.bias", (out,))]
            if b == 0:
                s += [(p + "downsample", (out, cin, 1, 1)), (p + "downsample.bn.weight", (out,)),
                      (p + "downsample.bn.bias", (out,))]
            cin = out
    return s + [("fc.weight", (classes, cin)), ("fc.bias", (classes,))]


def model_sets(dry: bool):
    if dry:  # tiny, and ResNet-50's first tensors only: the interpreter runs every program on the CPU
        return {"GPT-2 small (dry: width 16, 1 layer)": gpt2_shapes(16, 1, 97, 64),
                "BERT-base (dry: width 16, 1 layer)": bert_shapes(16, 1, 101, 64),
                "ResNet-50 (dry: width 4, first block)": resnet50_shapes(4, 10)[:15]}
    return {"GPT-2 small": gpt2_shapes(), "BERT-base": bert_shapes(), "ResNet-50": resnet50_shapes()}


# --- the bucket stage ------------------------------------------------------------------------------------------


def buckets_of(shapes, ratio, bucket_bytes, min_numel=MIN_NUMEL, elem=4):
    """The ADTopk tensors in DDP-style buckets: ``[[(name, shape, layout), ...], ...]``."""
    c = ADTopkCompressor(ratio=ratio)
    sparse = [(n, s) for n, s in reversed(shapes) if len(s) >= 2 and math.prod(s) >= min_numel]
    out, cur, size = [], [], 0
    for n, s in sparse:
        cur.append((n, s, c.layout(TensorInfo(n, tuple(s), math.prod(s), torch.float32))))
        size += math.prod(s) * elem
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


class Bucket:
    """One bucket's buffers (gradient, residual, averaged gradient, 8 ranks' gathered payloads) and both paths
    over them."""

    def __init__(self, tensors, device, impl, gen):
        self.layouts = [lay for _, _, lay in tensors]
        self.offsets, n = [], 0
        for lay in self.layouts:
            self.offsets.append(n)
            n += lay.rows * lay.cols
        self.n = n
        self.grad = torch.randn(n, generator=gen).to(device)
        self.res = (0.1 * torch.randn(n, generator=gen)).to(device)
        self.avg = torch.empty(n, device=device)
        specs = [bs.FiberSpec(lay.rows, lay.cols, lay.axis, lay.k) for lay in self.layouts]
        self.plan = bs.plan(specs, self.offsets, dtype=torch.float32, device=device, impl=impl,
                            wire_dtype=torch.float32)
        # what an allgather of 8 ranks' wire buffers delivers (filled with this rank's for the checks)
        self.rows = torch.zeros(RANKS, self.plan.wire_bytes, dtype=torch.uint8, device=device)
        self.codecs = [FiberCodec(lay) for lay in self.layouts]
        self.count = self.plan.total

    def bucket_path(self, fill=False):
        """Selection and packing of the whole bucket, then the decode of 8 ranks' payloads into the average."""
        r = bs.select(self.res, self.plan, self.grad, zero_sent=True)
        if fill:
            self.rows.copy_(r.wire.expand(RANKS, -1))
        bs.decode(self.plan, self.rows, self.avg, 1.0 / RANKS)
        return r

    def per_layer_path(self):
        """Today's per-tensor path (the engines without the bucket selection): select, pack, and per tensor the
        concatenation of the ranks' blocks and their rank-by-rank sum (``sparsify.aggregate_blocks``)."""
        out = []
        for lay, off, codec in zip(self.layouts, self.offsets, self.codecs):
            n = lay.rows * lay.cols
            v, loc = kernels.adtopk_select(self.res[off:off + n], lay.rows, lay.cols, lay.axis, lay.k,
                                           self.grad[off:off + n], True)
            block = wire.pack(v.reshape(-1), loc.reshape(-1), torch.float32, codec.index_dtype)
            gathered = torch.cat([block] * RANKS)
            aggregate_blocks(self.avg[off:off + n], gathered, [lay.count] * RANKS, codec, torch.float32,
                             1.0 / RANKS)
            out.append(block)
        return out


def _traffic_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(g_ptr, r_ptr, avg_ptr, pv_ptr, pi_ptr, n, count, BLOCK: tl.constexpr):
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        g = tl.load(g_ptr + off, mask=m, other=0.0)
        s = g + tl.load(r_ptr + off, mask=m, other=0.0)
        tl.store(r_ptr + off, s, mask=m)
        tl.store(avg_ptr + off, g, mask=m)
        pm = off < count
        tl.store(pv_ptr + off, s, mask=pm)
        tl.store(pi_ptr + off, off, mask=pm)

    return kernel, triton.cdiv


def timed(fn, device, warmup, repeats):
    """Median milliseconds of ``repeats`` runs after ``warmup`` (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _bits(t):
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def bucket_stage(args, device):
    impl = "triton" if args.dry else "auto"  # dry: the fused launches under the interpreter
    gen = torch.Generator().manual_seed(0)
    kernel, cdiv = _traffic_kernel()
    results, ok = {}, True
    for name, shapes in model_sets(args.dry).items():
        groups = buckets_of(shapes, args.ratio, args.bucket_bytes, 64 if args.dry else MIN_NUMEL)
        if not groups:
            raise ValueError(f"{name}: no ADTopk tensor")
        buckets = [Bucket(t, device, impl, gen) for t in groups]
        # correctness: both paths from the same state, bit for bit
        saved = [(b.res.clone(), b.grad.clone()) for b in buckets]
        got = [(b.bucket_path(fill=True), b.res.clone(), b.avg.clone()) for b in buckets]
        for b, (r, g) in zip(buckets, saved):
            b.res.copy_(r)
        equal = True
        for b, (r, res, avg) in zip(buckets, got):
            per = b.per_layer_path()
            for block, mine in zip(per, bs.split_wire(b.plan, r)):
                equal &= torch.equal(block, mine[4])  # the packed blocks (fp32 wire), byte for byte
            equal &= torch.equal(_bits(res), _bits(b.res)) and torch.equal(_bits(avg), _bits(b.avg))
        ok &= equal
        # the minimum-traffic pass over the same buffers
        scratch = [(torch.empty(b.count, device=device), torch.empty(b.count, dtype=torch.int64, device=device))
                   for b in buckets]

        def copy_all():
            for b, (pv, pi) in zip(buckets, scratch):
                kernel[(cdiv(b.n, 1024),)](b.grad, b.res, b.avg, pv, pi, b.n, b.count, BLOCK=1024)

        def bucket_all():
            for b in buckets:
                b.bucket_path()

        def per_layer_all():
            for b in buckets:
                b.per_layer_path()

        t_copy = timed(copy_all, device, args.warmup, args.repeats)
        t_bucket = timed(bucket_all, device, args.warmup, args.repeats)
        t_layer = timed(per_layer_all, device, args.warmup, args.repeats)
        sync = "skipped (CPU tensors)"
        if device == "cuda":
            torch.cuda.synchronize()
            try:
                torch.cuda.set_sync_debug_mode("error")
                bucket_all()
                sync = "passed"
            except RuntimeError as exc:
                sync = f"FAILED: {str(exc).splitlines()[0]}"
                ok = False
            finally:
                torch.cuda.set_sync_debug_mode("default")
        numel = sum(b.n for b in buckets)
        moved = sum(4 * 4 * b.n + 12 * b.count for b in buckets)  # the copy kernel writes int64 positions
        results[name] = {
            "tensors": sum(len(g) for g in groups), "numel": numel, "buckets": len(buckets),
            "payload_entries": sum(b.count for b in buckets),
            "fused_launches": sum(b.plan.launches for b in buckets),
            "per_tensor_calls_in_bucket_path": sum(len(b.plan.single) for b in buckets),
            "copy_ms": t_copy, "bucket_ms": t_bucket, "per_layer_ms": t_layer,
            "copy_GBps": moved / t_copy / 1e6 if t_copy > 0 else None,
            "bucket_over_copy": t_bucket / t_copy if t_copy > 0 else None,
            "per_layer_over_bucket": t_layer / t_bucket if t_bucket > 0 else None,
            "bitwise_equal": bool(equal), "host_sync_check": sync,
        }
    print(f"\nbucket stage ({device}, ratio {args.ratio}, {RANKS} simulated ranks, median of {args.repeats})")
    print(f"{'model':38s} {'tensors':>7s} {'buckets':>7s} {'launch':>6s} {'copy ms':>9s} {'bucket ms':>9s} "
          f"{'layer ms':>9s} {'bkt/copy':>8s} {'layer/bkt':>9s}  bitwise  sync")
    for name, r in results.items():
        print(f"{name:38s} {r['tensors']:7d} {r['buckets']:7d} {r['fused_launches']:6d} {r['copy_ms']:9.3f} "
              f"{r['bucket_ms']:9.3f} {r['per_layer_ms']:9.3f} {r['bucket_over_copy']:8.2f} "
              f"{r['per_layer_over_bucket']:9.2f}  {'yes' if r['bitwise_equal'] else 'NO':7s}  {r['host_sync_check']}")
    targets = {"bucket_over_copy_max": 2.0, "per_layer_over_bucket_min": 5.0}
    print(f"targets: bucket/copy <= {targets['bucket_over_copy_max']}, per-layer/bucket >= "
          f"{targets['per_layer_over_bucket_min']}" + (" (timings of a dry run mean nothing)" if args.dry else ""))
    return {"device": device, "ratio": args.ratio, "ranks": RANKS, "targets": targets, "models": results, "ok": bool(ok)}


# --- the step stage --------------------------------------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sync_probe(device, forward, y, vocab, opt):
    """One more training step (no loss read back) under ``torch.cuda.set_sync_debug_mode("warn")``: the host
    synchronisations it makes (forward, backward with the comm hook, the optimizer), as ``{"count", "first"}``;
    a record for the issue's no-host-sync target, not a check (DDP and AdamW may synchronise on their own)."""
    if device != "cuda":
        return "skipped (CPU tensors)"
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                logits = forward()
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return {"count": len(syncs), "first": syncs[:5]}


def step_stage(args, device):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import horovod_adtopk as hat
    from horovod_adtopk.ddp import bucket as ddp_bucket

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_port()}",
                            rank=0, world_size=1, timeout=timedelta(seconds=120))
    models = common.load_example("models")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.seqs, args.seq_len + 1), generator=gen).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    bucket_mode = "triton" if args.dry else "auto"

    def run(variant):
        torch.manual_seed(0)
        model = models.GPT(args.vocab, dim=args.dim, heads=args.heads, layers=args.layers,
                           context=args.seq_len).to(device)
        ddp = DDP(model, device_ids=[0] if device == "cuda" else None)
        previous = ddp_bucket.BUCKET_SELECT
        if variant.startswith("adtopk"):
            state = hat.ddp.CompressionState(compression=hat.Compression.adtopk(ratio=args.ratio),
                                             named_parameters=model.named_parameters(), exchange_when_alone=True)
            ddp.register_comm_hook(state, hat.ddp.hook)
            ddp_bucket.BUCKET_SELECT = bucket_mode if variant == "adtopk" else "off"
        elif variant == "powersgd":
            ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                                               start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook)
        elif variant == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        losses, times = [], []
        try:
            for i in range(args.warmup + args.steps):
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                with torch.autocast(device_type=device, dtype=torch.bfloat16):
                    logits = ddp(x)
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), y.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= args.warmup:
                    times.append((time.perf_counter() - t) * 1e3)
                losses.append(float(loss.detach()))
            if variant == "adtopk":
                probe["syncs"] = _sync_probe(device, lambda: ddp(x), y, args.vocab, opt)
                probe["bucket_decodes"] = state.stats()["bucket_decodes"]
        finally:
            ddp_bucket.BUCKET_SELECT = previous
        params = torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])
        del ddp, model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
        return statistics.median(times), losses, params

    variants = ["dense", "adtopk", "adtopk_per_tensor", "powersgd", "fp16"]
    res, params, probe = {}, {}, {}
    for v in variants:
        ms, losses, params[v] = run(v)
        res[v] = {"step_ms": ms, "losses": losses, "finite": all(math.isfinite(v_) for v_ in losses)}
    res["adtopk"].update(probe)
    dist.destroy_process_group()
    dense = res["dense"]["step_ms"]
    for v in variants:
        res[v]["over_dense"] = res[v]["step_ms"] / dense
        res[v]["overhead_ms"] = res[v]["step_ms"] - dense
    same = bool(torch.equal(params["adtopk"], params["adtopk_per_tensor"]))
    ok = all(r["finite"] for r in res.values()) and (same or not args.dry)
    print(f"\nstep stage ({device}, 1 process, GPT {args.layers} layers x {args.dim}, vocab {args.vocab}, "
          f"{args.seqs} x {args.seq_len} tokens, bf16 autocast, median of {args.steps} steps)")
    print(f"{'variant':20s} {'step ms':>9s} {'vs dense':>8s} {'overhead ms':>11s}")
    for v in variants:
        print(f"{v:20s} {res[v]['step_ms']:9.2f} {res[v]['over_dense']:8.3f} {res[v]['overhead_ms']:11.2f}")
    print(f"ADTopk target: within 1.10x of dense; bucket and per-tensor ADTopk parameters bitwise equal: {same}")
    print(f"ADTopk (bucket path): buckets decoded whole {probe.get('bucket_decodes')}; host synchronisations in one "
          f"training step (forward, backward with the hook, AdamW), torch's sync debug mode: {probe.get('syncs')}")
    return {"device": device, "model": {"layers": args.layers, "dim": args.dim, "heads": args.heads,
                                        "vocab": args.vocab, "seqs": args.seqs, "seq_len": args.seq_len},
            "ratio": args.ratio, "variants": res, "adtopk_bucket_equals_per_tensor": same,
            "target_over_dense_max": 1.10, "ok": bool(ok)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=["bucket", "step", "all"], default="all")
    ap.add_argument("--dry", action="store_true", help="CPU tensors, the Triton interpreter, tiny shapes")
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seqs", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    args = ap.parse_args(argv)
    small = dict(warmup=0, repeats=1, steps=1, seqs=2, seq_len=16, layers=1, dim=32, heads=2, vocab=97)
    full = dict(warmup=3, repeats=10, steps=10, seqs=16, seq_len=1024, layers=12, dim=768, heads=12, vocab=50257)
    for k, v in (small if args.dry else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.dry:
        args.bucket_bytes = min(args.bucket_bytes, 16384)  # a few buckets of several tensors each
        device = "cpu"
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_bucket_select: CUDA is not available (use --dry for the CPU check)")
        device = "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench_bucket_select.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    report["dry"] = args.dry
    ok = True
    for stage, fn in (("bucket", bucket_stage), ("step", step_stage)):
        if args.stage not in (stage, "all"):
            continue
        try:
            report[stage] = fn(args, device)
        except Exception:  # noqa: BLE001 (reported in the JSON, the stage fails)
            traceback.print_exc()
            report[stage] = {"ok": False, "error": traceback.format_exc(limit=3)}
        ok &= report[stage]["ok"]
    report["ok"] = all(report[s]["ok"] for s in ("bucket", "step") if s in report)
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
