"""One rank that counts its own host's link around a window of training steps (tests/test_wire_bytes.py,
benchmarks/bench_wire_bytes.py). Run under horovodrun with one rank per emulated host (tests/cluster.py), so
the host's ``eth1`` carries exactly this rank's traffic::

    python -m tests.wire_worker model OUTDIR [--phases none adtopk:0.01] [--dims 1024 2048 1024 16] ...
    python -m tests.wire_worker job OUTDIR [--warm 2 --steps 8 --idle 3] -- [examples/train.py arguments]

``model``: a small dedicated model (``--dims``: a stack of ``nn.Linear`` layers, two large 2-D ones with the
defaults) wrapped in ``hat.DistributedOptimizer``, one *phase* per compression (``none``, ``fp16``,
``adtopk:RATIO``, ``topk:RATIO``, ``powersgd:RANK``), each phase a fresh model whose parameter names carry the
phase (so Horovod's negotiation never meets a name of an earlier phase). ``job``: examples/train.py's own job
(``train.setup``, ``resume``, ``train`` as tests/multihost_worker.py runs it; needs ``examples/`` on
PYTHONPATH), the window marked from ``job.engine.step``, which the loop calls once per optimizer step.

A phase: ``--warm`` steps (the first negotiates every tensor with Horovod's coordinator and fills its
response cache), mark ``start``, ``--steps`` steps, mark ``end``, then ``--idle`` seconds with no collective at
all, mark ``idle``, and with ``--busy`` that many seconds of matrix products with no collective, mark ``busy``.
A *mark* is a barrier (``hvd.barrier()``: every rank has finished the previous step, so every
byte of it has left its sender and reached its receiver), ``--drain`` seconds of sleep (trailing TCP
acknowledgements), then one sample of

* the link: ``ip -s -j link show eth1`` (netlink; this process is inside the host's network namespace, so
  that is the host's ``eth1``; ``/sys/class/net`` would show the sysfs of the namespace that mounted it),
  tx/rx bytes and packets;
* TCP's own counters of this namespace (``/proc/net/snmp`` is per network namespace): segments out, in and
  retransmitted; and per socket (``ss -tin``) the bytes acknowledged, received and retransmitted: a second
  reading of the payload at the TCP layer, without headers and without retransmitted copies;
* ``opt.stats()`` (the package's cumulative per-rank counters; the whole dict);
* ``time.monotonic()``.

The ``idle`` window runs Horovod's background loop as during training (its coordinator's per-cycle cache and
state allreduce, ``HOROVOD_CYCLE_TIME``) plus ssh keepalives, and nothing else: :func:`counted` turns it into a
background rate per second and subtracts it from the step window (the ``busy`` window gives a second rate:
ranks that compute cycle less often than sleeping ones). Each rank writes
``OUTDIR/rank<r>.json``. Nothing is printed during a window (remote ranks' output travels over ssh on eth1).
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

IFACE = "eth1"
#: bytes of headers one counted packet carries besides its TCP payload: Ethernet 14 + IPv4 20 + TCP 20 + the
#: timestamp option 12 (Linux sends timestamps by default, also inside a new network namespace). A GSO/GRO
#: frame of many segments is counted as one packet with one set of headers on a veth, so
#: ``bytes - HEADER_BYTES * packets`` is the TCP payload either way; a pure ACK is exactly 66 bytes.
HEADER_BYTES = 66
#: keys of ``opt.stats()`` copied into a mark besides the whole dict
WIRE_KEYS = ("wire_bytes_sent", "wire_bytes_received", "wire_bytes_dense", "bytes_sent", "bytes_dense",
             "elements_sent", "elements_total")


def link_counters(iface: str = IFACE) -> Dict[str, int]:
    """tx/rx bytes and packets of ``iface`` in this process's network namespace, through netlink."""
    out = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", iface], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    st = json.loads(out)[0]["stats64"]
    return {"tx_bytes": st["tx"]["bytes"], "tx_packets": st["tx"]["packets"],
            "rx_bytes": st["rx"]["bytes"], "rx_packets": st["rx"]["packets"]}


def tcp_counters() -> Dict[str, int]:
    """OutSegs, InSegs and RetransSegs of this network namespace's TCP (``/proc/net/snmp``)."""
    lines = [ln.split() for ln in Path("/proc/net/snmp").read_text().splitlines() if ln.startswith("Tcp:")]
    table = dict(zip(lines[0][1:], (int(v) for v in lines[1][1:])))
    return {"tcp_out_segs": table["OutSegs"], "tcp_in_segs": table["InSegs"],
            "tcp_retrans_segs": table["RetransSegs"]}


_SS_FIELDS = ("bytes_sent", "bytes_acked", "bytes_received", "bytes_retrans")


def _host_of(addr: str) -> str:
    host = addr.rsplit(":", 1)[0].strip("[]")
    return host[7:] if host.startswith("::ffff:") else host


def _crosses_link(local: str, peer: str) -> bool:
    """A socket to another host (not loopback, not this host's own address: those never reach eth1)."""
    a, b = _host_of(local), _host_of(peer)
    return a != b and not any(h.startswith(("127.", "::1")) for h in (a, b))


def tcp_sockets() -> Dict[str, Dict[str, int]]:
    """Per TCP socket of this network namespace to another host (``ss -tin``, netlink): bytes sent
    (retransmissions included), acknowledged and received (in order, each byte once) and retransmitted, keyed
    by ``local peer``."""
    out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, check=True, timeout=30).stdout
    socks: Dict[str, Dict[str, int]] = {}
    key = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            parts = line.split()
            key = None
            if len(parts) >= 5 and _crosses_link(parts[3], parts[4]):
                key = f"{parts[3]} {parts[4]}"
            continue
        if key is None:
            continue
        fields = dict(t.split(":", 1) for t in line.split() if t.split(":", 1)[0] in _SS_FIELDS)
        socks[key] = {f: int(fields.get(f, 0)) for f in _SS_FIELDS}
    return socks


class Meter:
    """Marks: barrier, drain, then the link's and TCP's counters, the optimizer's stats and the clock."""

    def __init__(self, drain: float) -> None:
        self.drain = drain
        self.marks: Dict[str, Dict[str, Any]] = {}

    def mark(self, label: str, opt=None) -> Dict[str, Any]:
        import horovod.torch as hvd
        hvd.barrier()
        time.sleep(self.drain)
        sample: Dict[str, Any] = {"t": time.monotonic(), **link_counters(), **tcp_counters(),
                                  "sockets": tcp_sockets()}
        if opt is not None and hasattr(opt, "stats"):
            stats = opt.stats()
            sample.update({k: stats.get(k) for k in WIRE_KEYS})
            sample["stats"] = _jsonable(stats)
        self.marks[label] = sample
        return sample


def burn(seconds: float) -> None:
    """Keep this rank's main thread busy with matrix products for ``seconds`` (no collective): the CPU load of
    training, under which Horovod's background thread cycles less often than when every rank sleeps."""
    import torch
    a = torch.randn(256, 256)
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        a = torch.tanh(a @ a)


def _jsonable(obj: Any) -> Any:
    """``obj`` with anything JSON cannot hold turned into a string (stats hold only plain values today)."""
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return str(obj)


# ------------------------------------------------------------------------------------------------------------
# reading a record: the window's counted bytes against the stats
# ------------------------------------------------------------------------------------------------------------

def _delta(a: Dict[str, Any], b: Dict[str, Any], key: str) -> Optional[int]:
    if a.get(key) is None or b.get(key) is None:
        return None
    return b[key] - a[key]


def _socket_delta(before: Dict[str, Dict[str, int]], after: Dict[str, Dict[str, int]]) -> Dict[str, int]:
    """Summed growth of the sockets' byte counters between two samples (a socket opened between them counts
    from 0; one closed between them is lost, which a window between barriers of a running job never sees)."""
    zero = dict.fromkeys(_SS_FIELDS, 0)
    return {f: sum(v[f] - before.get(k, zero)[f] for k, v in after.items()) for f in _SS_FIELDS}


def counted(phase: Dict[str, Any]) -> Dict[str, Any]:
    """One rank's window (marks ``start`` .. ``end``) of one phase: per direction the raw interface bytes and
    packets, the TCP payload (``bytes - HEADER_BYTES * packets``), the background (the idle window's payload per
    second times the window's seconds) and ``net`` = payload - background, which is what the steps' collectives
    put on the link; with a ``busy`` mark also ``net_busy``, the payload minus the busy window's rate (a rank busy
    training cycles about as often as one burning CPU and at most as often as an idle one, so the background
    lies between the two rates, and the steps' bytes at most at ``payload``); ``tcp``: the sockets' acknowledged and
    received bytes over the window (each byte once: no headers, no retransmitted copies), the same minus the idle
    rate (``net_sent``, ``net_received``), and the bytes retransmitted; beside them the stats' wire bytes over the
    same steps, TCP retransmissions and step times."""
    m = phase["marks"]
    a, b, c = m["start"], m["end"], m["idle"]
    seconds, idle_seconds = b["t"] - a["t"], c["t"] - b["t"]
    out: Dict[str, Any] = {"steps": phase["steps"], "seconds": seconds, "idle_seconds": idle_seconds,
                           "numel": phase["numel"]}
    for d in ("tx", "rx"):
        raw, packets = _delta(a, b, f"{d}_bytes"), _delta(a, b, f"{d}_packets")
        idle_payload = _delta(b, c, f"{d}_bytes") - HEADER_BYTES * _delta(b, c, f"{d}_packets")
        payload = raw - HEADER_BYTES * packets
        background = idle_payload * seconds / idle_seconds
        out[d] = {"raw": raw, "packets": packets, "payload": payload, "background": background,
                  "background_per_s": idle_payload / idle_seconds, "net": payload - background}
        if "busy" in m:
            e = m["busy"]
            busy_payload = _delta(c, e, f"{d}_bytes") - HEADER_BYTES * _delta(c, e, f"{d}_packets")
            out[d]["busy_background_per_s"] = busy_payload / (e["t"] - c["t"])
            out[d]["net_busy"] = payload - out[d]["busy_background_per_s"] * seconds
    if "sockets" in a:
        tcp_idle = {k: v / idle_seconds for k, v in _socket_delta(b["sockets"], c["sockets"]).items()}
        tcp = _socket_delta(a["sockets"], b["sockets"])
        tcp["net_sent"] = tcp["bytes_acked"] - tcp_idle["bytes_acked"] * seconds
        tcp["net_received"] = tcp["bytes_received"] - tcp_idle["bytes_received"] * seconds
        out["tcp"] = tcp
    out["stats"] = {"sent": _delta(a, b, "wire_bytes_sent"), "received": _delta(a, b, "wire_bytes_received"),
                    "dense": _delta(a, b, "wire_bytes_dense"), "payload_sent": _delta(a, b, "bytes_sent")}
    out["tcp_retrans_segs"] = _delta(a, b, "tcp_retrans_segs")
    times = phase.get("step_seconds") or []
    out["step_seconds"] = sum(times) / len(times) if times else None
    return out


# ------------------------------------------------------------------------------------------------------------
# model: a dedicated stack of linear layers, one phase per compression
# ------------------------------------------------------------------------------------------------------------

def make_compression(spec: str):
    """``none``, ``fp16``, ``adtopk:0.01``, ``topk:0.01``, ``powersgd:1`` -> a ``hat.Compression``."""
    import horovod_adtopk as hat
    name, _, arg = spec.partition(":")
    if name == "none":
        return hat.Compression.none
    if name == "fp16":
        return hat.Compression.fp16
    if name in ("adtopk", "topk"):
        return getattr(hat.Compression, name)(ratio=float(arg or 0.01))
    if name == "powersgd":
        return hat.Compression.powersgd(rank=int(arg or 1))
    raise SystemExit(f"unknown compression {spec!r}")


def run_model(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    import horovod.torch as hvd
    import horovod_adtopk as hat

    phases = []
    for spec in args.phases:
        torch.manual_seed(args.seed)  # the same initial model on every rank
        layers: List[torch.nn.Module] = []
        for i, (a, b) in enumerate(zip(args.dims[:-1], args.dims[1:])):
            layers.append(torch.nn.Linear(a, b))
            if i < len(args.dims) - 2:
                layers.append(torch.nn.ReLU())
        model = torch.nn.Sequential(*layers)
        tag = spec.replace(":", "_").replace(".", "p")
        named = [(f"{tag}.{n}", p) for n, p in model.named_parameters()]
        base = torch.optim.SGD(model.parameters(), lr=args.lr)
        opt = hat.DistributedOptimizer(base, named_parameters=named, compression=make_compression(spec),
                                       op=hvd.Average)
        gen = torch.Generator().manual_seed(1000 + hvd.rank())  # each rank its own data
        x = torch.randn(args.batch, args.dims[0], generator=gen)
        y = torch.randn(args.batch, args.dims[-1], generator=gen)
        meter = Meter(args.drain)
        times: List[float] = []

        def step() -> None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        for _ in range(args.warm):
            step()
        meter.mark("start", opt)
        last = time.monotonic()
        for _ in range(args.steps):
            step()
            now = time.monotonic()
            times.append(now - last)
            last = now
        meter.mark("end", opt)
        time.sleep(args.idle)
        meter.mark("idle", opt)
        if args.busy:
            burn(args.busy)
            meter.mark("busy", opt)
        phases.append({"phase": spec, "steps": args.steps, "warm": args.warm,
                       "numel": sum(p.numel() for p in model.parameters()),
                       "shapes": {n: list(p.shape) for n, p in named},
                       "step_seconds": times, "marks": meter.marks})
    return {"mode": "model", "dims": args.dims, "batch": args.batch, "phases": phases}


# ------------------------------------------------------------------------------------------------------------
# job: examples/train.py, the window marked from the engine's step
# ------------------------------------------------------------------------------------------------------------

def run_job(args: argparse.Namespace) -> Dict[str, Any]:
    import train  # examples/train.py (examples/ on PYTHONPATH)

    start = time.time()
    targs = train.parse_args(args.train_args)
    job = train.setup(targs, start)
    meter = Meter(args.drain)
    times: List[float] = []
    state = {"step": 0, "last": None}
    inner = job.engine.step

    def step(model, opt, clip_grad) -> None:
        inner(model, opt, clip_grad)
        state["step"] += 1
        now = time.monotonic()
        if state["last"] is not None:
            times.append(now - state["last"])
        if state["step"] == args.warm:
            meter.mark("start", job.opt)
            state["last"] = time.monotonic()
        elif state["step"] == args.warm + args.steps:
            meter.mark("end", job.opt)
            time.sleep(args.idle)
            meter.mark("idle", job.opt)
            if args.busy:
                burn(args.busy)
                meter.mark("busy", job.opt)
            state["last"] = None
        elif state["last"] is not None:
            state["last"] = now

    job.engine.step = step
    try:
        progress = train.resume(job)
        train.train(job, progress)
    except train.JobFailed as failed:
        raise SystemExit(failed.status)
    numel = sum(p.numel() for p in job.model.parameters() if p.requires_grad)
    phase = {"phase": "job", "steps": args.steps, "warm": args.warm, "numel": numel,
             "shapes": {n: list(p.shape) for n, p in job.model.named_parameters() if p.requires_grad},
             "step_seconds": times, "marks": meter.marks, "train_args": args.train_args}
    return {"mode": "job", "phases": [phase]}


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.wire_worker", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("model", "job"))
    p.add_argument("outdir")
    p.add_argument("--warm", type=int, default=2, help="steps before the window")
    p.add_argument("--steps", type=int, default=5, help="steps in the window")
    p.add_argument("--idle", type=float, default=2.0, help="seconds of the idle window")
    p.add_argument("--busy", type=float, default=0.0,
                   help="seconds of a window after the idle one where every rank computes (CPU load as in training, "
                        "no collective): a second background rate, 0 for none")
    p.add_argument("--drain", type=float, default=0.2, help="seconds between a mark's barrier and its sample")
    p.add_argument("--phases", nargs="+", default=["none", "adtopk:0.01"], help="model mode: compressions")
    p.add_argument("--dims", type=int, nargs="+", default=[1024, 2048, 1024, 16], help="model mode: layer widths")
    p.add_argument("--batch", type=int, default=16, help="model mode: batch per rank")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.train_args = argv[cut + 1:]  # job mode: examples/train.py's arguments, after `--`
    if args.mode == "job" and not args.train_args:
        p.error("job mode: give examples/train.py's arguments after `--`")
    if args.warm < 1 or args.steps < 1:
        p.error("--warm and --steps must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import horovod.torch as hvd
    if args.mode == "model":
        hvd.init()
        record = run_model(args)
    else:
        record = run_job(args)  # train.setup starts Horovod
    record.update(rank=hvd.rank(), size=hvd.size(), hostname=socket.gethostname(), iface=IFACE)
    out = Path(args.outdir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
