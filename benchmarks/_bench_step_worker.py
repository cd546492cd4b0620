"""One rank of a ``benchmarks/bench_step.py`` cell: ``python benchmarks/_bench_step_worker.py CELL.json OUT.json``.

Not run by hand: ``bench_step.py`` writes CELL.json and launches this under ``horovodrun``.

Started by ``horovodrun`` (one job per (link rate, world size, model) cell). Every mode of the cell runs
here in turn, each on a freshly built model (so no hook of an earlier optimizer stays on its parameters)
whose parameter names carry the mode's index, so that no two modes ever share a Horovod tensor name:

- ``compute``: plain local optimizer, no communication at all, after ``hvd.init()`` (Horovod's background
  thread running, as in every Horovod mode);
- ``compute-noinit``: the same step with Horovod not initialised at all: run before ``hvd.init()`` and, with
  ``rounds > 1``, again after ``hvd.shutdown()``, the ranks agreeing through files (``FileComm`` below).
  Both compute modes run every rank concurrently, with the same torch threads as the other modes;
- ``hvd-dense`` / ``hvd-fp16``: ``hvd.DistributedOptimizer`` with ``Compression.none`` / ``Compression.fp16``;
- ``ddp-powersgd``: ``torch.nn.parallel.DistributedDataParallel`` with the PowerSGD (rank 1) comm hook, on a
  Gloo process group over a TCP store on 127.0.0.1 (port chosen by rank 0, broadcast through Horovod), with
  a single DDP bucket (several buckets make the hook's collectives mismatch between ranks on Gloo);
- ``ddp-powersgdR``: the same at rank ``R`` (``ddp-powersgd``: ``--powersgd-rank``);
- ``ddp-dense``: DDP without a hook (its own bucketed allreduce, default 25 MB buckets);
- ``ddp-NAME``: DDP with ``horovod_adtopk.ddp``'s hook and compressor NAME (``ddp-adtopk``), default buckets;
- any other name: a ``horovod_adtopk`` compressor, ``hat.DistributedOptimizer`` with ``ratio``.

With ``rounds > 1`` the whole list of modes runs ``rounds`` times in turn (interleaved, so that a change
of machine load affects every mode alike); a mode's step times are pooled over its rounds, and the
per-round medians are kept.

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
from typing import Any, List

import torch
import torch.nn.functional as F
import horovod.torch as hvd

import horovod_adtopk as hat
import common  # benchmarks/common.py: this script's directory is on the path

build_model = common.load_example("models").build_model

LSTM_VOCAB = 84
GPT_VOCAB, GPT_CONTEXT = 65, 128  # the transformer job's: Shakespeare's 65 characters, 128-token windows
DENSE_HVD = {"hvd-dense": hvd.Compression.none, "hvd-fp16": hvd.Compression.fp16}


# --- models and data -----------------------------------------------------------------------------------------

# --- how the ranks of a cell agree and gather results, with or without Horovod ---------------------------------
# HvdComm goes through Horovod's collectives; FileComm through small JSON files in a directory shared by the
# ranks of one job (all ranks run on this machine), so that a mode can run before hvd.init() or after
# hvd.shutdown(), i.e. without Horovod's background thread (which wakes every HOROVOD_CYCLE_TIME to negotiate
# with the other ranks and so takes CPU from the step even when nothing is communicated).


class HvdComm:
    """Rank agreement through Horovod (after ``hvd.init()``)."""

    uses_horovod = True

    def __init__(self, hvd) -> None:
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()

    def barrier(self, name: str) -> None:
        """Every rank reaches this point before any leaves it."""
        import torch
        self.hvd.allreduce(torch.zeros(1), name=name)

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        return self.hvd.allgather_object(obj, name=name)

    def broadcast_int(self, value: int, name: str) -> int:
        """Rank 0's ``value`` on every rank."""
        import torch
        return int(self.hvd.broadcast(torch.tensor([value]), root_rank=0, name=name).item())


class FileComm:
    """Rank agreement through files in ``directory`` (no Horovod): each call writes ``name.rank.json`` and
    waits (polling every 2 ms, at most ``timeout`` seconds, then raises) until every rank's file is there."""

    uses_horovod = False

    def __init__(self, directory: str, rank: int, size: int, timeout: float = 600.0) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"FileComm: bad rank {rank} of size {size}")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.size, self.timeout = rank, size, timeout

    def allgather_object(self, obj: Any, name: str) -> List[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in rank order."""
        tmp = self.dir / f".{name}.{self.rank}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, self.dir / f"{name}.{self.rank}.json")  # atomic: readers never see a partial file
        paths = [self.dir / f"{name}.{r}.json" for r in range(self.size)]
        deadline = time.monotonic() + self.timeout
        while not all(p.exists() for p in paths):
            if time.monotonic() > deadline:
                missing = [r for r, p in enumerate(paths) if not p.exists()]
                raise RuntimeError(f"FileComm: ranks {missing} did not reach {name!r} within {self.timeout:.0f}s")
            time.sleep(0.002)
        return [json.loads(p.read_text()) for p in paths]

    def barrier(self, name: str) -> None:
        """Every rank reaches this point before any leaves it."""
        self.allgather_object(None, name)

    def broadcast_int(self, value: int, name: str) -> int:
        """Rank 0's ``value`` on every rank."""
        return int(self.allgather_object(value, name)[0])


def make_model(name: str) -> torch.nn.Module:
    if name == "lstm":
        return build_model("lstm", vocab_size=LSTM_VOCAB)
    if name == "gpt":  # examples/models.py GPT with the job's defaults (1.0M parameters, tied head)
        return build_model("gpt", vocab_size=GPT_VOCAB, context=GPT_CONTEXT)
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
        elif model_name == "gpt":
            x = torch.randint(0, GPT_VOCAB, (batch, GPT_CONTEXT), generator=g)
            y = torch.randint(0, GPT_VOCAB, (batch, GPT_CONTEXT), generator=g)
        elif model_name in ("cnn", "vgg"):  # examples/models.py SmallCNN / VGGStyle on 1x28x28 images
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
    if mode in ("compute", "compute-noinit"):
        return model, base, "compute", None
    if mode in DENSE_HVD:
        return model, hvd.DistributedOptimizer(base, named_parameters=named, compression=DENSE_HVD[mode]), "hvd", None
    if mode.startswith("ddp-") and not mode.startswith("ddp-powersgd"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ensure_torch_dist()
        view = mode.endswith("-v")  # ddp-NAME-v: gradient_as_bucket_view=True (no copy into the buckets)
        name = mode[4:-2] if view else mode[4:]
        # default buckets (25 MB): communication overlaps the backward pass
        ddp = DDP(model, gradient_as_bucket_view=view)
        state = None
        if name != "dense":  # our hook: ddp-adtopk, ddp-topk, ...
            state = hat.ddp.register(ddp, hat.Compression.get(name, ratio=cfg["ratio"]))
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
    overlap = mode.endswith("-o")  # e.g. adtopk-o: selection on the overlap worker thread (overlap=True)
    name = mode[:-2] if overlap else mode
    partial = name.endswith("-p")  # e.g. adtopk-p: partial sparsification decides per tensor after warm-up
    name = name[:-2] if partial else name
    psgd = re.fullmatch(r"powersgd(\d*)", name)  # our PowerSGD: powersgd (rank --powersgd-rank) or powersgdR
    if psgd:
        compression = hat.Compression.from_options("powersgd", rank=int(psgd.group(1) or cfg["powersgd_rank"]))
    else:
        compression = hat.Compression.get(name, ratio=cfg["ratio"])
    opt = hat.DistributedOptimizer(base, named_parameters=named, compression=compression,
                                   partial_sparsification=partial, profile_rounds=max(1, cfg["warmup"]),
                                   overlap=overlap)
    return model, opt, "hat", None


def time_steps(one_step, warmup: int, cfg: dict, comm, tag: str, after_warmup) -> tuple:
    """Warm-up, then timed steps until ``steps`` (or ``mode_budget_s`` spent, decided by rank 0).
    Returns ``(step times, what after_warmup() returned)``."""
    comm.barrier(f"bench_step.align.{tag}.a")  # start together
    for i in range(warmup):
        one_step(i)
    warm = after_warmup()
    comm.barrier(f"bench_step.align.{tag}.b")
    times = []
    start = time.perf_counter()
    i = 0
    while True:
        times.append(one_step(warmup + i))
        i += 1
        stop = 0
        if comm.rank == 0:
            spent = time.perf_counter() - start
            stop = int(i >= cfg["steps"] or (i >= cfg["min_steps"] and spent >= cfg["mode_budget_s"]))
        # untimed: every rank must agree on the number of steps (collective counts must match)
        if comm.broadcast_int(stop, f"bench_step.stop.{tag}.{i}"):
            return times, warm


def run_mode(mode: str, idx: int, cfg: dict, comm, tag: str, round_: int = 0) -> dict:
    """Time ``mode`` (the ``idx``-th of the cell) once, in round ``round_``; ``tag`` names this run's
    agreement points. Every round starts from the same model and batches."""
    rank = comm.rank
    torch.manual_seed(1000 + idx)  # the same initial model on every rank
    model = make_model(cfg["model"])
    nparams = sum(p.numel() for p in model.parameters())
    batches = make_batches(cfg["model"], cfg["batch"], cfg["seq_len"], 4, seed=7919 * (rank + 1) + idx)
    net, opt, kind, _state = build_mode(mode, idx + 1000 * round_, model, cfg)  # fresh tensor names
    warmup = max(cfg["warmup"], 3) if kind.startswith("ddp") else cfg["warmup"]

    def one_step(i: int) -> float:
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad()  # set_to_none by default (Horovod's override takes no argument)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    stats_of = (lambda: opt.stats()) if kind == "hat" else (lambda: _state.stats()) if kind == "ddp-hat" else None
    times, stats0 = time_steps(one_step, warmup, cfg, comm, tag, lambda: stats_of() if stats_of else None)
    stats1 = stats_of() if stats_of else None
    all_times = comm.allgather_object(times, f"bench_step.times.{tag}")
    per_step_max = [max(ts[j] for ts in all_times) for j in range(len(times))]
    res = {
        "mode": mode, "kind": kind, "params": nparams, "warmup": warmup, "steps_timed": len(times),
        "horovod_initialised": comm.uses_horovod, "torch_threads": torch.get_num_threads(),
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
        if stats1.get("overlap", {}).get("enabled"):  # main-thread wait for the worker in synchronize()
            res["overlap_wait_s_per_step"] = (stats1["overlap"]["wait_seconds"] - stats0["overlap"]["wait_seconds"]) / n
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


POOLED_MEANS = ("bytes_sent_per_step", "bytes_dense_per_step", "density", "compress_s_per_step",
                "decompress_s_per_step")


def pool_rounds(runs: list) -> dict:
    """One mode's result over its rounds: step times pooled (median / mean / min of all of them), the
    per-round medians kept, per-step counters averaged."""
    res = dict(runs[0])
    steps = [t for r in runs for t in r["step_times_max_over_ranks_s"]]
    res.update({"rounds": len(runs), "steps_timed": len(steps), "step_times_max_over_ranks_s": steps,
                "median_s": statistics.median(steps), "mean_s": statistics.fmean(steps), "min_s": min(steps),
                "round_medians_s": [r["median_s"] for r in runs],
                "rank0_median_s": statistics.median([r["rank0_median_s"] for r in runs])})
    for key in POOLED_MEANS:
        if key in res:
            res[key] = statistics.fmean(r[key] for r in runs)
    return res


def env_rank() -> tuple:
    """(rank, size) from horovodrun's environment, before ``hvd.init()``."""
    try:
        return int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    except (KeyError, ValueError):
        raise SystemExit("_bench_step_worker: HOROVOD_RANK / HOROVOD_SIZE not set: launch it through "
                         "bench_step.py (horovodrun --gloo)")


def process_warmup(cfg: dict, rank: int) -> None:
    """Allocator, lazy initialisation, thread pools: so that the first mode is not penalised."""
    torch.manual_seed(0)
    warm_model = make_model(cfg["model"])
    for x, y in make_batches(cfg["model"], cfg["batch"], cfg["seq_len"], 2, seed=rank):
        loss_fn(warm_model(x), y).backward()
    del warm_model


def run_or_abort(mode: str, idx: int, cfg: dict, comm, round_: int, result: dict, out_path: Path) -> dict:
    """``run_mode``; on failure report it (rank 0 writes what it has) and end the process: the other ranks
    would wait forever inside a collective."""
    t0 = time.perf_counter()
    try:
        res = run_mode(mode, idx, cfg, comm, f"{idx}.{round_}", round_)
    except Exception as exc:
        sys.stderr.write(f"[rank {comm.rank}] mode {mode} failed:\n{traceback.format_exc()}")
        result["errors"][mode] = repr(exc)
        if comm.rank == 0:
            out_path.write_text(json.dumps(result))
        sys.stderr.flush()
        os._exit(3)
    if comm.rank == 0:
        print(f"[bench_step] {cfg['model']} np={comm.size} {mode:<14} round {round_} median "
              f"{res['median_s'] * 1e3:9.1f} ms ({res['steps_timed']} steps, {time.perf_counter() - t0:.1f}s)",
              flush=True)
    return res


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    torch.set_num_threads(cfg.get("threads", 1))
    rank, size = env_rank()
    rounds = max(1, int(cfg.get("rounds", 1)))
    modes = list(cfg["modes"])
    result = {"np": size, "model": cfg["model"], "modes": {}, "errors": {}, "rounds": rounds,
              "torch_threads": torch.get_num_threads()}
    runs = {m: [] for m in modes}
    files = FileComm(cfg.get("sync_dir") or str(out_path) + ".sync", rank, size)
    noinit = "compute-noinit" in modes
    process_warmup(cfg, rank)
    if noinit:  # first, before Horovod exists in this process
        runs["compute-noinit"].append(run_or_abort("compute-noinit", modes.index("compute-noinit"), cfg, files, 0,
                                                   result, out_path))
    hvd.init()
    comm = HvdComm(hvd)
    if cfg.get("probe_bytes"):
        try:
            result["allreduce_probe"] = allreduce_probe(cfg["probe_bytes"], cfg.get("probe_reps", 2))
        except Exception as exc:  # a probe failure must not lose the cell
            result["errors"]["allreduce_probe"] = repr(exc)
    for r in range(rounds):
        for idx, mode in enumerate(modes):
            if mode == "compute-noinit":
                continue
            runs[mode].append(run_or_abort(mode, idx, cfg, comm, r, result, out_path))
            if rank == 0:
                result["modes"][mode] = pool_rounds(runs[mode])
                out_path.write_text(json.dumps(result))  # partial results survive a later timeout
    if _TORCH_PG["ready"]:
        import torch.distributed as dist
        dist.destroy_process_group()
    hvd.shutdown()
    if noinit and rounds > 1:  # and last, after Horovod's background thread has stopped
        runs["compute-noinit"].append(run_or_abort("compute-noinit", modes.index("compute-noinit"), cfg, files,
                                                   rounds - 1, result, out_path))
    if rank == 0:
        result["modes"] = {m: pool_rounds(runs[m]) for m in modes if runs[m]}
        out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
