#!/usr/bin/env python
"""Step-time benchmark: dense Horovod, fp16, PowerSGD (DDP) and horovod_adtopk compressors on capped links.

How to run (from the repository root, as root: it needs ``unshare -n`` and ``tc``; Horovod installed)::

    python benchmarks/bench_step.py --quick                       # < 3 minutes
    python benchmarks/bench_step.py --no-netns --rates uncapped --models mlp --modes compute,hvd-dense,adtopk
    python benchmarks/bench_step.py                               # every rate, N, model and mode

    python benchmarks/bench_step.py --quick            # mlp, 2 ranks, uncapped + 1gbit, 4 modes (< 3 min)
    python benchmarks/bench_step.py                    # the full matrix (long: hours on a small machine)
    python benchmarks/bench_step.py --rates uncapped,1gbit --np 2 --models mlp --compressors adtopk,topk

All ranks run on this machine. The script re-executes itself inside a private network namespace
(``unshare -n``, or ``unshare -r -n`` when not root) that has nothing but its own loopback, and caps that
loopback per link rate with a token bucket::

    tc qdisc add dev lo root tbf rate R burst 1mb latency 200ms       # R in {10gbit, 1gbit, 100mbit}

("uncapped" leaves lo without a qdisc). The cap applies to *all* loopback traffic of the namespace
together: with N ranks it behaves like one shared link of rate R (a bus), not like N full-duplex NICs.
No address other than 127.0.0.1 is ever used.

For each link rate the link is measured once between two processes with a raw TCP connection on
127.0.0.1 (ping-pong of 1 byte for the latency alpha; 8 MB and 64 MB transfers for the bandwidth beta,
from the slope so the 1 MB token-bucket burst cancels out) and stored under ``"link"`` in the JSON.

For each (rate, N, model) cell one ``horovodrun --gloo`` job is launched (HOROVOD_CYCLE_TIME=1 ms by
default, ``--threads`` torch threads per rank, 1 by default, the same for every mode) and every mode of the
cell runs inside it, in turn, on a fresh model, ``--rounds`` times (interleaved: the whole list, then the
whole list again; see ``benchmarks/_bench_step_worker.py``). A step is forward + backward + optimizer step
on a random batch of fixed size per rank (mlp: 32 x 2048, resnet18: 32 x 3x32x32, lstm: 16 x 64 tokens of
a vocabulary of 84, gpt: 32 x 128 tokens of 65); after ``--warmup`` steps, ``--steps`` steps are timed per round (fewer if a mode exceeds
``--mode-budget`` seconds, at least ``--min-steps``). Reported: the median over steps (pooled over rounds)
of the max over ranks of the step time, its ratio to the lower bound, the speed-up over ``hvd-dense`` and
``hvd-fp16``, and bytes each rank hands to the collectives per step (``opt.stats()`` for horovod_adtopk;
numel x element size for the dense modes; an estimate from the shapes for PowerSGD).

The lower bound is the same step with no communication, all ranks running concurrently as in training:
``compute`` (after ``hvd.init()``, so Horovod's background thread runs and costs CPU as it does in every
Horovod mode) and ``compute-noinit`` (before ``hvd.init()`` and after ``hvd.shutdown()``, no Horovod at
all). ``x compute`` is the ratio to the faster of the two (named in the table and in ``lower_bound`` of the
JSON); ``x_compute_hvd`` is the ratio to ``compute``. A mode that communicates cannot beat the lower bound:
if one is faster than it by more than the noise (``--lb-tolerance`` or the lower bound's own interquartile
range, whichever is larger) the script says so loudly and exits with status 2 (``--no-lb-check``: report
only).

Every launch runs in its own session under a timeout; on expiry the whole process tree is killed.
Outputs: a table on stdout, ``bench_results/step.json`` (``--out``) with machine info, configuration,
link measurements and every cell, and ``bench_results/step.png`` (step time per mode per link rate for
the mlp at N=2, or the first cell available).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import common
from common import HOROVODRUN, fmt

REPO = common.REPO_ROOT
WORKER = Path(__file__).resolve().parent / "_bench_step_worker.py"
NETNS_FLAG = "BENCH_STEP_IN_NETNS"
PARENT_NS = "BENCH_STEP_PARENT_NETNS"

ALL_RATES = ["uncapped", "10gbit", "1gbit", "100mbit"]
DEFAULT_COMPRESSORS = ["adtopk", "topk", "dgc", "randomk", "adtopk_i"]
DEFAULT_MODES = ["compute-noinit", "compute", "hvd-dense", "hvd-fp16", "ours", "ddp-powersgd"]
BATCH = {"mlp": 32, "resnet18": 32, "lstm": 16, "cnn": 64, "vgg": 64, "gpt": 32}
SEQ_LEN = 64
RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$")
UNITS = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


# --- arguments -------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=common.csv_list, default=None, help=f"link rates (default {','.join(ALL_RATES)})")
    ap.add_argument("--np", type=common.csv_ints, default=None, help="world sizes (default 2,4)")
    ap.add_argument("--models", type=common.csv_list, default=None, help="mlp,resnet18,lstm,cnn,vgg,gpt (default mlp,resnet18,lstm; cnn: the Fashion-MNIST SmallCNN of examples/models.py, batch 64 x 1x28x28; gpt: the transformer job's GPT, batch 32 x 128 tokens)")
    ap.add_argument("--modes", type=common.csv_list, default=None,
                    help="compute-noinit,compute,hvd-dense,hvd-fp16, DDP modes (ddp-dense, ddp-powersgd[R]: "
                         "PyTorch's PowerSGD hook at rank R, ddp-NAME: our DDP hook with compressor NAME; a -v "
                         "suffix on ddp-dense / ddp-NAME: gradient_as_bucket_view=True) and "
                         "compressor names; 'ours' expands to "
                         f"--compressors (default {','.join(DEFAULT_MODES)})")
    ap.add_argument("--compressors", type=common.csv_list, default=None,
                    help=f"horovod_adtopk compressors for 'ours' (default {','.join(DEFAULT_COMPRESSORS)})")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 10)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 3)")
    ap.add_argument("--min-steps", type=int, default=2, help="timed steps kept even past --mode-budget")
    ap.add_argument("--mode-budget", type=float, default=None,
                    help="seconds of timed steps per mode before stopping early (default 90)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="run the list of modes this many times in turn, pooling each mode's steps (default 2; "
                         "interleaving spreads a change of machine load over every mode)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (every mode alike)")
    ap.add_argument("--lb-tolerance", type=float, default=0.05,
                    help="the lower-bound check: fail when a mode's median is below the compute-only median by "
                         "more than max(this, the compute steps' noise) (relative; default 0.05)")
    ap.add_argument("--no-lb-check", action="store_true",
                    help="report a failed lower-bound check without failing the run")
    ap.add_argument("--ratio", type=float, default=0.01, help="density of the sparse compressors")
    ap.add_argument("--powersgd-rank", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=None, help="batch per rank for every model (default per model)")
    ap.add_argument("--cycle-time-ms", type=float, default=1.0, help="HOROVOD_CYCLE_TIME (ms)")
    ap.add_argument("--cell-timeout", type=float, default=None,
                    help="seconds before a cell's job is killed (default 3600; --quick 110)")
    ap.add_argument("--link-bytes", type=int, default=64 << 20, help="large transfer of the link measurement")
    ap.add_argument("--probe-bytes", type=int, default=8 << 20,
                    help="dense hvd.allreduce timed per cell (0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="mlp, N=2, uncapped+1gbit, compute/hvd-dense/hvd-fp16/adtopk, few steps (< 3 min)")
    ap.add_argument("--out", default=str(REPO / "bench_results" / "step.json"))
    ap.add_argument("--png", default=None, help="plot path (default: --out with .png)")
    ap.add_argument("--no-netns", action="store_true",
                    help="run without a network namespace (only the 'uncapped' rate then)")
    a = ap.parse_args(argv)
    q = a.quick
    a.rates = a.rates or (["uncapped", "1gbit"] if q else ALL_RATES)
    a.np = a.np or ([2] if q else [2, 4])
    a.models = a.models or (["mlp"] if q else ["mlp", "resnet18", "lstm"])
    a.compressors = a.compressors or (["adtopk"] if q else DEFAULT_COMPRESSORS)
    modes = a.modes or (["compute-noinit", "compute", "hvd-dense", "hvd-fp16", "ours"] if q else DEFAULT_MODES)
    expanded: List[str] = []
    for m in modes:
        for x in (a.compressors if m == "ours" else [m]):
            if x not in expanded:
                expanded.append(x)
    a.modes = expanded
    a.steps = a.steps if a.steps is not None else (5 if q else 10)
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 3)
    a.rounds = a.rounds if a.rounds is not None else (1 if q else 2)
    if a.rounds < 1 or a.threads < 1:
        ap.error("--rounds and --threads must be >= 1")
    a.mode_budget = a.mode_budget if a.mode_budget is not None else (10.0 if q else 90.0)
    a.cell_timeout = a.cell_timeout if a.cell_timeout is not None else (110.0 if q else 3600.0)
    a.link_bytes = min(a.link_bytes, 16 << 20) if q else a.link_bytes
    for r in a.rates:
        if r != "uncapped" and not RATE_RE.match(r):
            ap.error(f"bad rate {r!r}: use 'uncapped' or tc syntax like 10gbit, 1gbit, 100mbit")
    for m in a.models:
        if m not in BATCH:
            ap.error(f"unknown model {m!r}; choose from {', '.join(BATCH)}")
    known_dense = {"compute", "compute-noinit", "hvd-dense", "hvd-fp16", "ddp-powersgd"}
    from horovod_adtopk.compressors import _REGISTRY  # light import check of the names
    for m in a.modes:
        base_name = m[:-2] if m.endswith("-o") else m  # NAME-o: selection on the overlap worker thread
        base_name = base_name[:-2] if base_name.endswith("-p") else base_name  # NAME-p: partial sparsification
        if re.fullmatch(r"powersgd\d+", base_name):  # our PowerSGD at rank R (powersgd4)
            continue
        # DDP engine: dense, PyTorch PowerSGD[R], our hook; -v: gradient_as_bucket_view=True
        ddp = re.fullmatch(r"ddp-(dense|powersgd\d*|(.+?))(-v)?", m)
        if ddp and (ddp.group(2) is None or ddp.group(2).replace("-", "_") in _REGISTRY):
            continue
        if m not in known_dense and base_name.replace("-", "_") not in _REGISTRY:
            ap.error(f"unknown mode {m!r}; modes: {', '.join(sorted(known_dense))} or a compressor "
                     f"({', '.join(sorted(_REGISTRY))})")
    if any(n < 2 for n in a.np):
        ap.error("--np values must be >= 2")
    if a.no_netns and a.rates != ["uncapped"]:
        ap.error("--no-netns can only run --rates uncapped (capping the host loopback is not allowed)")
    return a


# --- network namespace and tc ---------------------------------------------------------------------------------

def netns_inode() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def reexec_in_netns() -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("bench_step: 'unshare' not found (util-linux); use --no-netns --rates uncapped")
    flags = ["-n"] if os.geteuid() == 0 else ["-r", "-n"]
    env = dict(os.environ)
    env[NETNS_FLAG] = "1"
    env[PARENT_NS] = str(netns_inode())
    sys.stdout.flush()
    os.execvpe(unshare, [unshare, *flags, "--", sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)


def check_private_netns() -> None:
    """Refuse to touch tc unless we are in a namespace of our own that holds nothing but lo."""
    if os.environ.get(PARENT_NS) and int(os.environ[PARENT_NS]) == netns_inode():
        sys.exit("bench_step: still in the parent network namespace; refusing to configure tc")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = [ln.split(":")[1].strip().split("@")[0] for ln in links.splitlines() if ln.strip()]
    if names != ["lo"]:
        sys.exit(f"bench_step: the namespace has interfaces {names}, expected only lo; refusing to configure tc")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def set_rate(rate: str) -> str:
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)  # absent: fine
    if rate != "uncapped":
        subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", "1mb",
                        "latency", "200ms"], check=True)
    return subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout.strip()


def nominal_bps(rate: str) -> Optional[float]:
    m = RATE_RE.match(rate)
    return float(m.group(1)) * UNITS[m.group(2)] if m else None


# --- link measurement (raw TCP between two processes on 127.0.0.1) -------------------------------------------------

def _recv_exact(sock: socket.socket, n: int, buf: Optional[bytearray] = None) -> None:
    view = memoryview(buf) if buf is not None else memoryview(bytearray(min(n, 1 << 20)))
    got = 0
    while got < n:
        k = sock.recv_into(view[: min(len(view), n - got)])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def _link_server(port_w: int) -> None:
    """Child process: accept one connection; 'p' = echo one byte; 'b' + 8-byte length = sink, ack one byte."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    os.write(port_w, struct.pack("!H", srv.getsockname()[1]))
    os.close(port_w)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(1 << 20)
    one = bytearray(1)
    while True:
        try:
            _recv_exact(conn, 1, one)
        except ConnectionError:
            break
        if one[0] == ord("p"):
            conn.sendall(b"p")
        elif one[0] == ord("b"):
            hdr = bytearray(8)
            _recv_exact(conn, 8, hdr)
            _recv_exact(conn, struct.unpack("!Q", hdr)[0], buf)
            conn.sendall(b"k")
        else:
            break
    conn.close()
    srv.close()


def measure_link(big: int, pings: int = 200) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: the receiving end
        os.close(r)
        try:
            _link_server(w)
        finally:
            os._exit(0)
    os.close(w)
    try:
        port = struct.unpack("!H", os.read(r, 2))[0]
        os.close(r)
        s = socket.create_connection(("127.0.0.1", port), timeout=120)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        one = bytearray(1)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            s.sendall(b"p")
            _recv_exact(s, 1, one)
            rtts.append(time.perf_counter() - t0)
        small = max(big // 8, 1 << 20)
        payload = bytes(big)

        def transfer(n: int) -> float:
            time.sleep(0.3)  # let the token bucket refill so every transfer starts alike
            t0 = time.perf_counter()
            s.sendall(b"b" + struct.pack("!Q", n))
            s.sendall(memoryview(payload)[:n])
            _recv_exact(s, 1, one)
            return time.perf_counter() - t0

        transfer(small)  # warm the connection (window growth)
        t_small = min(transfer(small) for _ in range(2))
        t_big = transfer(big)
        s.close()
    finally:
        os.waitpid(pid, 0)
    rtt = statistics.median(rtts)
    slope = (t_big - t_small) / (big - small) if t_big > t_small else None
    beta = 1.0 / slope if slope else big / t_big
    return {
        "method": "raw TCP on 127.0.0.1 between two processes: 1-byte ping-pong (alpha = median RTT / 2); "
                  "bulk transfers of small and big bytes (beta = slope)",
        "alpha_s": rtt / 2,
        "beta_bytes_per_s": beta,
        "beta_gbit_per_s": beta * 8 / 1e9,
        "rtt_median_s": rtt,
        "transfer_s": {str(small): t_small, str(big): t_big},
        "big_transfer_gbit_per_s": big * 8 / t_big / 1e9,
    }


# --- launching a cell ------------------------------------------------------------------------------------------

def launch_job(args, np_: int, cfg: dict, cfg_path: Path, out_path: Path):
    """One horovodrun job in its own session under --cell-timeout; returns (returncode|None, log lines, seconds)."""
    cfg_path.write_text(json.dumps(cfg))
    if out_path.exists():
        out_path.unlink()
    cmd = [HOROVODRUN, "-np", str(np_), "-H", f"localhost:{np_}", "--gloo", "--network-interface", "lo",
           sys.executable, str(WORKER), str(cfg_path), str(out_path)]
    env = {"MKL_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads), "HOROVOD_CYCLE_TIME": str(args.cycle_time_ms), "GLOO_SOCKET_IFNAME": "lo"}
    log_lines: List[str] = []

    def on_line(line: str) -> None:
        log_lines.append(line)
        if "[bench_step]" in line:
            print("   " + line.split("[bench_step]", 1)[1].strip(), flush=True)

    rc, _, seconds = common.run_command(cmd, timeout=args.cell_timeout, env=env, cwd=REPO, on_line=on_line)
    return rc, log_lines, seconds


def run_cell(args, rate: str, np_: int, model: str, workdir: Path) -> dict:
    """All modes of one (rate, N, model) cell in one job; if a mode fails (or hangs into the timeout), the
    job is relaunched with the modes after it, so one broken mode does not lose the rest."""
    tag = f"{rate}_np{np_}_{model}"
    base_cfg = {"model": model, "steps": args.steps, "warmup": args.warmup,
                "min_steps": args.min_steps, "mode_budget_s": args.mode_budget, "ratio": args.ratio,
                "batch": args.batch or BATCH[model], "seq_len": SEQ_LEN, "lr": args.lr,
                "powersgd_rank": args.powersgd_rank, "probe_bytes": args.probe_bytes, "probe_reps": 2,
                "rounds": args.rounds, "threads": args.threads}
    cell = {"rate": rate, "np": np_, "model": model, "batch": base_cfg["batch"], "modes": {}, "errors": {},
            "launches": []}
    remaining = list(args.modes)
    while remaining:
        n = len(cell["launches"])
        cfg = dict(base_cfg, modes=remaining, sync_dir=str(workdir / f"{tag}.{n}.sync"))
        if "allreduce_probe" in cell or len(cell["launches"]) > 0:
            cfg["probe_bytes"] = 0
        cfg_path, out_path = workdir / f"{tag}.{n}.cfg.json", workdir / f"{tag}.{n}.out.json"
        rc, log_lines, seconds = launch_job(args, np_, cfg, cfg_path, out_path)
        res = json.loads(out_path.read_text()) if out_path.exists() else {"modes": {}, "errors": {}}
        cell["modes"].update(res.get("modes", {}))
        cell["errors"].update(res.get("errors", {}))
        if "allreduce_probe" in res:
            cell["allreduce_probe"] = res["allreduce_probe"]
        launch = {"modes": remaining, "returncode": rc, "timed_out": rc is None, "wall_s": seconds}
        cell["launches"].append(launch)
        done = [m for m in remaining if m in res.get("modes", {})]
        if rc == 0 and len(done) == len(remaining):
            break
        failed = next((m for m in remaining if m not in done), None)
        why = (f"timed out after {args.cell_timeout:.0f}s (process tree killed)" if rc is None else f"exit {rc}")
        launch["log_tail"] = "".join(log_lines[-40:])[-6000:]
        if failed is not None and failed not in cell["errors"]:
            cell["errors"][failed] = why
        print(f"   cell {tag}: mode {failed} failed ({why}); last log lines:\n" +
              "".join("     | " + ln for ln in log_lines[-12:]), flush=True)
        if failed is None:
            break
        remaining = remaining[remaining.index(failed) + 1:]
        if remaining:
            print(f"   relaunching for {remaining}", flush=True)
    cell["wall_s"] = sum(x["wall_s"] for x in cell["launches"])
    cell["timed_out"] = any(x["timed_out"] for x in cell["launches"])
    cell["returncode"] = cell["launches"][-1]["returncode"]
    missing = [m for m in args.modes if m not in cell["modes"]]
    if missing:
        cell["missing_modes"] = missing
    # keep the modes in the requested order
    cell["modes"] = {m: cell["modes"][m] for m in args.modes if m in cell["modes"]}
    return cell


# --- report -------------------------------------------------------------------------------------------------------

COMPUTE_MODES = ("compute-noinit", "compute")


def add_ratios(cell: dict) -> None:
    """Ratios of every mode to the cell's lower bound (the faster of the two compute-only modes, named in
    ``cell["lower_bound"]``; ``x_compute_hvd`` is the ratio to ``compute`` with Horovod initialised) and
    speed-ups over Horovod dense / fp16."""
    modes = cell["modes"]
    ref = {k: modes[k]["median_s"] for k in ("compute", "hvd-dense", "hvd-fp16") if k in modes}
    present = [m for m in COMPUTE_MODES if m in modes]
    lb = min(present, key=lambda m: modes[m]["median_s"]) if present else None
    if lb is not None:
        cell["lower_bound"] = {"mode": lb, "median_s": modes[lb]["median_s"],
                               **{f"{m}_median_s": modes[m]["median_s"] for m in present}}
        if len(present) == 2:
            cell["lower_bound"]["horovod_thread_cost"] = modes["compute"]["median_s"] / modes["compute-noinit"]["median_s"]
    for m in modes.values():
        t = m["median_s"]
        m["x_compute"] = t / modes[lb]["median_s"] if lb else None
        m["x_compute_hvd"] = t / ref["compute"] if "compute" in ref else None
        m["speedup_vs_dense"] = ref["hvd-dense"] / t if "hvd-dense" in ref else None
        m["speedup_vs_fp16"] = ref["hvd-fp16"] / t if "hvd-fp16" in ref else None


def check_lower_bound(cell: dict, tolerance: float) -> List[str]:
    """Modes whose median is below the compute-only lower bound by more than the noise: ``max(tolerance,
    interquartile range / median of the lower bound's own steps)``. A mode that communicates cannot be
    faster than the same step without communication, so any such mode means the compute-only cell was
    inflated (load, a mode order effect) and the cell's ratios flatter; returns one message per mode."""
    lb = cell.get("lower_bound")
    if lb is None:
        return []
    steps = sorted(cell["modes"][lb["mode"]]["step_times_max_over_ranks_s"])
    q = statistics.quantiles(steps, n=4) if len(steps) >= 2 else [steps[0]] * 3
    noise = max(tolerance, (q[2] - q[0]) / lb["median_s"])
    lb["noise"] = noise
    bad = []
    for name, m in cell["modes"].items():
        if name in COMPUTE_MODES or m["median_s"] >= lb["median_s"] * (1.0 - noise):
            continue
        bad.append(f"{cell['rate']} N={cell['np']} {cell['model']}: mode {name} median {m['median_s'] * 1e3:.1f} ms is "
                   f"{(1 - m['median_s'] / lb['median_s']) * 100:.1f}% below the compute-only lower bound "
                   f"{lb['mode']} {lb['median_s'] * 1e3:.1f} ms (noise {noise * 100:.1f}%)")
    lb["violations"] = bad
    return bad


def print_table(cells: List[dict]) -> str:
    hdr = (f"{'rate':>9} {'N':>2} {'model':<8} {'mode':<13} {'median ms':>10} {'x compute':>9} "
           f"{'vs dense':>8} {'vs fp16':>8} {'MB/step':>9} {'density':>8} {'steps':>5}")
    lines = [hdr, "-" * len(hdr)]
    for c in cells:
        for name, m in c["modes"].items():
            dens = m.get("density") if m["kind"] in ("hat", "ddp-hat") else None
            lines.append(f"{c['rate']:>9} {c['np']:>2} {c['model']:<8} {name:<13} {m['median_s'] * 1e3:>10.1f} "
                         f"{fmt(m.get('x_compute'), '.2f'):>9} {fmt(m.get('speedup_vs_dense'), '.2f'):>8} "
                         f"{fmt(m.get('speedup_vs_fp16'), '.2f'):>8} "
                         f"{m.get('bytes_sent_per_step', 0) / 1e6:>9.3f} {fmt(dens, '.4f'):>8} "
                         f"{m['steps_timed']:>5}")
        for name in c.get("missing_modes", []):
            lines.append(f"{c['rate']:>9} {c['np']:>2} {c['model']:<8} {name:<13} {'FAILED/NOT RUN':>10}")
        lb = c.get("lower_bound")
        if lb:
            cost = lb.get("horovod_thread_cost")
            lines.append(f"{'':>9} x compute = vs {lb['mode']} ({lb['median_s'] * 1e3:.1f} ms)" +
                         (f"; compute with hvd.init() / without: {cost:.3f}" if cost else ""))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def plot(cells: List[dict], rates: List[str], modes: List[str], path: Path) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover - matplotlib missing
        return f"no plot: {exc!r}"
    pick = [c for c in cells if c["model"] == "mlp" and c["np"] == 2 and c["modes"]]
    if not pick:
        first = next((c for c in cells if c["modes"]), None)
        if first is None:
            return "no plot: no results"
        pick = [c for c in cells if c["model"] == first["model"] and c["np"] == first["np"]]
    model, np_ = pick[0]["model"], pick[0]["np"]
    by_rate = {c["rate"]: c for c in pick}
    rates = [r for r in rates if r in by_rate]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(modes) + 2), 4.5))
    width = 0.8 / max(1, len(rates))
    for i, r in enumerate(rates):
        ys = [by_rate[r]["modes"].get(m, {}).get("median_s", float("nan")) * 1e3 for m in modes]
        xs = [j + (i - (len(rates) - 1) / 2) * width for j in range(len(modes))]
        ax.bar(xs, ys, width, label=r)
    ax.set_xticks(range(len(modes)))
    ax.set_xticklabels(modes, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("median step time (ms, max over ranks)")
    ax.set_title(f"{model}, N={np_} ranks, loopback capped by tc tbf")
    ax.legend(title="link rate")
    ax.grid(axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --- main ---------------------------------------------------------------------------------------------------------

def main() -> int:
    args = parse_args()
    if not args.no_netns and os.environ.get(NETNS_FLAG) != "1":
        reexec_in_netns()  # does not return
    if not args.no_netns:
        check_private_netns()
    t_start = time.monotonic()
    print(f"bench_step: rates={args.rates} np={args.np} models={args.models} modes={args.modes} "
          f"steps={args.steps} warmup={args.warmup} ratio={args.ratio} HOROVOD_CYCLE_TIME={args.cycle_time_ms}ms",
          flush=True)
    out = Path(args.out)
    png = Path(args.png) if args.png else out.with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "step time (forward+backward+optimizer step), median over steps of max over ranks",
        "machine": common.machine_info(),
        "config": {"rates": args.rates, "np": args.np, "models": args.models, "modes": args.modes,
                   "steps": args.steps, "warmup": args.warmup, "min_steps": args.min_steps,
                   "mode_budget_s": args.mode_budget, "ratio": args.ratio, "powersgd_rank": args.powersgd_rank,
                   "batch_per_rank": {m: args.batch or BATCH[m] for m in args.models}, "lstm_seq_len": SEQ_LEN,
                   "lstm_vocab": 84, "optimizer": f"SGD lr={args.lr} momentum=0.9",
                   "HOROVOD_CYCLE_TIME_ms": args.cycle_time_ms, "torch_threads": args.threads, "rounds": args.rounds,
                   "lb_tolerance": args.lb_tolerance, "controller": "gloo",
                   "quick": args.quick,
                   "netns": None if args.no_netns else "private (unshare -n), loopback only",
                   "tc": "tc qdisc add dev lo root tbf rate R burst 1mb latency 200ms (shared by all ranks)"},
        "link_rates": {r: nominal_bps(r) for r in args.rates},
        "link": {},
        "cells": [],
        "failures": [],
        "lower_bound_violations": [],
    }
    workdir = Path(tempfile.mkdtemp(prefix="bench_step-"))
    try:
        for rate in args.rates:
            qdisc = set_rate(rate) if not args.no_netns else "(host loopback untouched)"
            print(f"\n== link {rate}: {qdisc}", flush=True)
            try:
                link = measure_link(args.link_bytes)
                link.update({"nominal_bit_per_s": nominal_bps(rate), "qdisc": qdisc})
                report["link"][rate] = link
                print(f"   measured: alpha {link['alpha_s'] * 1e6:.1f} us, beta {link['beta_gbit_per_s']:.3f} Gbit/s",
                      flush=True)
            except Exception as exc:
                report["failures"].append({"rate": rate, "what": "link measurement", "error": repr(exc)})
                print(f"   link measurement failed: {exc!r}", flush=True)
            for np_ in args.np:
                for model in args.models:
                    print(f"-- cell rate={rate} N={np_} model={model}", flush=True)
                    cell = run_cell(args, rate, np_, model, workdir)
                    add_ratios(cell)
                    for msg in check_lower_bound(cell, args.lb_tolerance):
                        print(f"   LOWER BOUND CHECK FAILED: {msg}", flush=True)
                        report["lower_bound_violations"].append(msg)
                    report["cells"].append(cell)
                    if cell.get("missing_modes") or cell.get("errors"):
                        report["failures"].append({"rate": rate, "np": np_, "model": model,
                                                   "missing_modes": cell.get("missing_modes", []),
                                                   "errors": cell.get("errors", {}),
                                                   "timed_out": cell["timed_out"], "returncode": cell["returncode"]})
                    common.write_record(out, report)  # partial results survive an interruption
    finally:
        if not args.no_netns:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    report["table"] = print_table(report["cells"])
    report["total_wall_s"] = time.monotonic() - t_start
    problem = plot(report["cells"], args.rates, args.modes, png)
    report["plot"] = problem or str(png)
    common.write_record(out, report)  # adds the command, the commit and the date (report.py reads them)
    print(f"\nwrote {out}" + (f" and {png}" if not problem else f" ({problem})") +
          f" in {report['total_wall_s']:.0f}s", flush=True)
    if report["failures"]:
        print(f"{len(report['failures'])} failure(s): see 'failures' in the JSON", flush=True)
    if report["lower_bound_violations"]:
        print("\nLOWER BOUND CHECK FAILED: a mode ran faster than the same step without communication, so the "
              "compute-only measurement of its cell is not the fastest this step can run and the cell's ratios "
              "are not honest (re-run on a quieter machine, with more --steps or --rounds):\n  " +
              "\n  ".join(report["lower_bound_violations"]), flush=True)
        if not args.no_lb_check:
            return 2
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
