"""One rank of a ``benchmarks/bench_step.py`` cell: ``python benchmarks/_bench_step_worker.py CELL.json OUT.json``.

Not run by hand: ``bench_step.py`` writes CELL.json and launches this under ``horovodrun``.

Started by ``horovodrun`` (one job per (link rate, world size, model) cell). Every mode of the cell runs
here in turn, each on a freshly built model (so no hook of an earlier optimizer stays on its parameters)
whose parameter names carry the mode's index, so that no two modes ever share a Horovod tensor name:

- ``compute``: plain local optimizer, no communication at all (the lower bound of a step);
- ``hvd-dense`` / ``hvd-fp16``: ``hvd.DistributedOptimizer`` with ``Compression.none`` / ``Compression.fp16``;
- ``ddp-powersgd``: ``torch.nn.parallel.DistributedDataParallel`` with the PowerSGD (rank 1) comm hook, on a
  Gloo process group over a TCP store on 127.0.0.1 (port chosen by rank 0, broadcast through Horovod), with
  a single DDP bucket (several buckets make the hook's collectives mismatch between ranks on Gloo);
- ``ddp-powersgdR``: the same at rank ``R`` (``ddp-powersgd``: ``--powersgd-rank``);
- ``ddp-dense``: DDP without a hook (its own bucketed allreduce, default 25 MB buckets);
- ``ddp-NAME``: DDP with ``horovod_adtopk.ddp``'s hook and compressor NAME (``ddp-adtopk``), default buckets;
- any other name: a ``horovod_adtopk`` compressor, ``hat.DistributedOptimizer`` with ``ratio``.

A step is forward + backward + ``optimizer.step()`` on a pre-generated random batch (fixed size per rank).
Each rank times its own steps with ``perf_counter`` (no barrier inside the loop: the collectives keep the
ranks in step); rank 0 gathers every rank's times and reports, per step, the max over ranks. A mode stops
early (after at least ``min_steps`` timed steps) once it has used ``mode_budget_s`` seconds, so a very slow
link cannot make a cell run for hours; the decision is rank 0's, broadcast between (untimed) steps.
"""
from __future__ import annotations

import gc
import json
import os
import socket
import re
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
import horovod.torch as hvd

import horovod_adtopk as hat
import common  # benchmarks/common.py: this script's directory is on the path

build_model = common.load_example("models").build_model

LSTM_VOCAB = 84
DENSE_HVD = {"hvd-dense": hvd.Compression.none, "hvd-fp16": hvd.Compression.fp16}


# --- models and data -----------------------------------------------------------------------------------------

def make_model(name: str) -> torch.nn.Module:
    if name == "lstm":
        return build_model("lstm", vocab_size=LSTM_VOCAB)
    return build_model(name)


def make_batches(model_name: str, batch: int, seq_len: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        if model_name == "mlp":
            x = torch.randn(batch, 2048, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)
        elif model_name == "lstm":
            x = torch.randint(0, LSTM_VOCAB, (batch, seq_len), generator=g)
            y = torch.randint(0, LSTM_VOCAB, (batch, seq_len), generator=g)
        elif model_name == "cnn":  # examples/models.py SmallCNN on Fashion-MNIST-shaped 1x28x28 images
            x = torch.randn(batch, 1, 28, 28, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)
        else:  # resnet18 / cnn-like image models: 3x32x32
            x = torch.randn(batch, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (batch,), generator=g)
        out.append((x, y))
    return out


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # [B, T, V] language-model logits
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.cross_entropy(out, y)


def powersgd_bytes_estimate(model: torch.nn.Module, rank: int, min_rate: float = 2.0) -> int:
    """Bytes one rank hands to allreduce per step under the PowerSGD hook (an estimate from the shapes:
    a tensor viewed as [shape[0], -1] goes as P and Q factors when (n*m)/((n+m)*rank) >= min_rate, else dense)."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += 4 * p.numel()
            continue
        n = p.shape[0]
        m = p.numel() // n
        r = min(rank, n, m)
        if (n * m) / ((n + m) * r) >= min_rate:
            total += 4 * (n + m) * r
        else:
            total += 4 * p.numel()
    return total


# --- torch.distributed for DDP -----------------------------------------------------------------------------------

_TORCH_PG = {"ready": False}


def ensure_torch_dist() -> None:
    if _TORCH_PG["ready"]:
        return
    import torch.distributed as dist
    port = None
    if hvd.rank() == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="bench_step.tcp_port")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size(), timeout=timedelta(seconds=300))
    _TORCH_PG["ready"] = True


# --- one mode ------------------------------------------------------------------------------------------------------

def build_mode(mode: str, idx: int, model: torch.nn.Module, cfg: dict):
    """Return (model_to_run, optimizer, kind, ddp_state) for ``mode``."""
    named = [(f"m{idx}_{mode}.{n}", p) for n, p in model.named_parameters()]
    base = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    if mode == "compute":
        return model, base, "compute", None
    if mode in DENSE_HVD:
        return model, hvd.DistributedOptimizer(base, named_parameters=named, compression=DENSE_HVD[mode]), "hvd", None
    if mode == "ddp-dense" or (mode.startswith("ddp-") and not mode.startswith("ddp-powersgd")):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ensure_torch_dist()
        ddp = DDP(model)  # default buckets (25 MB): communication overlaps the backward pass
        state = None
        if mode != "ddp-dense":  # our hook: ddp-adtopk, ddp-topk, ...
            state = hat.ddp.register(ddp, hat.Compression.get(mode[4:], ratio=cfg["ratio"]))
        base = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
        return ddp, base, "ddp-hat" if state is not None else "ddp-dense", state
    psgd_rank = re.fullmatch(r"ddp-powersgd(\d*)", mode)
    if psgd_rank:
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
        ensure_torch_dist()
        rank = int(psgd_rank.group(1) or cfg["powersgd_rank"])
        # One bucket for the whole model: with several buckets the hook's chained collectives (allreduce of
        # the uncompressed part, then of P, then of Q) are issued from future callbacks in an order that can
        # differ between ranks, which Gloo reports as a size mismatch (pytorch/pytorch#58467 area). With one
        # bucket the communication starts only once the backward pass is over (no overlap).
        cap_mb = max(25, -(-4 * sum(p.numel() for p in model.parameters()) // (1 << 20)) + 1)
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                       start_powerSGD_iter=2, min_compression_rate=2)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
        base = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
        return ddp, base, f"ddp-powersgd{rank}", state
    partial = mode.endswith("-p")  # e.g. adtopk-p: partial sparsification decides per tensor after warm-up
    name = mode[:-2] if partial else mode
    psgd = re.fullmatch(r"powersgd(\d*)", name)  # our PowerSGD: powersgd (rank --powersgd-rank) or powersgdR
    if psgd:
        compression = hat.Compression.from_options("powersgd", rank=int(psgd.group(1) or cfg["powersgd_rank"]))
    else:
        compression = hat.Compression.get(name, ratio=cfg["ratio"])
    opt = hat.DistributedOptimizer(base, named_parameters=named, compression=compression,
                                   partial_sparsification=partial, profile_rounds=max(1, cfg["warmup"]))
    return model, opt, "hat", None


def run_mode(mode: str, idx: int, cfg: dict) -> dict:
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(1000 + idx)  # the same initial model on every rank
    model = make_model(cfg["model"])
    nparams = sum(p.numel() for p in model.parameters())
    batches = make_batches(cfg["model"], cfg["batch"], cfg["seq_len"], 4, seed=7919 * (rank + 1) + idx)
    net, opt, kind, _state = build_mode(mode, idx, model, cfg)
    warmup = max(cfg["warmup"], 3) if kind.startswith("ddp") else cfg["warmup"]

    def one_step(i: int) -> float:
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad()  # set_to_none by default (Horovod's override takes no argument)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    hvd.allreduce(torch.zeros(1), name=f"bench_step.align.{idx}.a")  # start together
    for i in range(warmup):
        one_step(i)
    stats_of = (lambda: opt.stats()) if kind == "hat" else (lambda: _state.stats()) if kind == "ddp-hat" else None
    stats0 = stats_of() if stats_of else None
    hvd.allreduce(torch.zeros(1), name=f"bench_step.align.{idx}.b")
    times = []
    start = time.perf_counter()
    i = 0
    while True:
        times.append(one_step(warmup + i))
        i += 1
        stop = 0
        if rank == 0:
            spent = time.perf_counter() - start
            stop = int(i >= cfg["steps"] or (i >= cfg["min_steps"] and spent >= cfg["mode_budget_s"]))
        # untimed: every rank must agree on the number of steps (collective counts must match)
        stop = int(hvd.broadcast(torch.tensor([stop]), root_rank=0, name=f"bench_step.stop.{idx}").item())
        if stop:
            break
    stats1 = stats_of() if stats_of else None
    all_times = hvd.allgather_object(times, name=f"bench_step.times.{idx}")
    per_step_max = [max(ts[j] for ts in all_times) for j in range(len(times))]
    res = {
        "mode": mode, "kind": kind, "params": nparams, "warmup": warmup, "steps_timed": len(times),
        "median_s": statistics.median(per_step_max),
        "mean_s": statistics.fmean(per_step_max),
        "min_s": min(per_step_max),
        "rank0_median_s": statistics.median(all_times[0]),
        "per_rank_median_s": [statistics.median(ts) for ts in all_times],
        "step_times_max_over_ranks_s": per_step_max,
    }
    n = len(times)
    if kind in ("hat", "ddp-hat"):
        d = {k: stats1[k] - stats0[k] for k in ("bytes_sent", "bytes_dense", "elements_sent", "elements_total",
                                               "compress_seconds", "decompress_seconds", "steps")}
        res.update({
            "bytes_sent_per_step": d["bytes_sent"] / n,
            "bytes_dense_per_step": d["bytes_dense"] / n,
            "density": d["elements_sent"] / d["elements_total"] if d["elements_total"] else 0.0,
            "compress_s_per_step": d["compress_seconds"] / n,
            "decompress_s_per_step": d["decompress_seconds"] / n,
            "bytes_source": "opt.stats() (rank 0)" if kind == "hat" else "hat.ddp state.stats() (rank 0)",
        })
        if kind == "ddp-hat":
            res["note"] = "DDP + horovod_adtopk.ddp hook, default 25 MB buckets"
    elif kind == "hvd":
        per = 2 if mode == "hvd-fp16" else 4
        res.update({"bytes_sent_per_step": per * nparams, "bytes_dense_per_step": 4 * nparams,
                    "bytes_source": "numel x element size (allreduce input)"})
    elif kind == "ddp-dense":
        res.update({"bytes_sent_per_step": 4 * nparams, "bytes_dense_per_step": 4 * nparams,
                    "bytes_source": "numel x element size (allreduce input)", "note": "DDP, default 25 MB buckets"})
    elif kind.startswith("ddp-powersgd"):
        res.update({"bytes_sent_per_step": powersgd_bytes_estimate(model, int(kind[len("ddp-powersgd"):])),
                    "bytes_dense_per_step": 4 * nparams, "bytes_source": "estimate from shapes (P+Q factors)",
                    "note": "DDP with a single bucket (comm after backward), PowerSGD from iteration 2"})
    else:
        res.update({"bytes_sent_per_step": 0, "bytes_dense_per_step": 4 * nparams, "bytes_source": "none"})
    del net, opt, model, batches
    gc.collect()
    return res


def allreduce_probe(size_bytes: int, reps: int) -> dict:
    """Median time of a dense fp32 ``hvd.allreduce`` of ``size_bytes`` bytes (max over ranks)."""
    t = torch.ones(size_bytes // 4)
    hvd.allreduce(t, name="bench_step.probe.warm")
    times = []
    for r in range(reps):
        hvd.allreduce(torch.zeros(1), name=f"bench_step.probe.align.{r}")
        t0 = time.perf_counter()
        hvd.allreduce(t, name=f"bench_step.probe.{r}")
        times.append(time.perf_counter() - t0)
    all_times = hvd.allgather_object(times, name="bench_step.probe.times")
    med = statistics.median([max(ts[j] for ts in all_times) for j in range(reps)])
    return {"bytes": size_bytes, "median_s": med, "algbw_bytes_per_s": size_bytes / med if med > 0 else None}


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    result = {"np": hvd.size(), "model": cfg["model"], "modes": {}, "errors": {}}
    if cfg.get("probe_bytes"):
        try:
            result["allreduce_probe"] = allreduce_probe(cfg["probe_bytes"], cfg.get("probe_reps", 2))
        except Exception as exc:  # a probe failure must not lose the cell
            result["errors"]["allreduce_probe"] = repr(exc)
    # Process-level warm-up (allocator, lazy initialisation, thread pools) so the first mode is not penalised.
    torch.manual_seed(0)
    warm_model = make_model(cfg["model"])
    for x, y in make_batches(cfg["model"], cfg["batch"], cfg["seq_len"], 2, seed=rank):
        loss_fn(warm_model(x), y).backward()
    del warm_model
    for idx, mode in enumerate(cfg["modes"]):
        t0 = time.perf_counter()
        try:
            res = run_mode(mode, idx, cfg)
        except Exception as exc:
            # A failure on one rank leaves the others inside a collective; report and abort the job.
            sys.stderr.write(f"[rank {rank}] mode {mode} failed:\n{traceback.format_exc()}")
            result["errors"][mode] = repr(exc)
            if rank == 0:
                out_path.write_text(json.dumps(result))
            sys.stderr.flush()
            os._exit(3)
        if rank == 0:
            result["modes"][mode] = res
            print(f"[bench_step] {cfg['model']} np={hvd.size()} {mode:<13} median {res['median_s'] * 1e3:9.1f} ms "
                  f"({res['steps_timed']} steps, {time.perf_counter() - t0:.1f}s)", flush=True)
            out_path.write_text(json.dumps(result))  # partial results survive a later timeout
    if _TORCH_PG["ready"]:
        import torch.distributed as dist
        dist.destroy_process_group()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
