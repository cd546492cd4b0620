#!/usr/bin/env python
"""Wire bytes per rank and step, counted on each emulated host's link, against ``opt.stats()``.

How to run (as root, from the repository root; it starts and stops its own emulated cluster of
``tests/cluster.py`` named ``wbench``: one network namespace per host, its ``eth1`` capped with ``tc``)::

    .venv/bin/python benchmarks/bench_wire_bytes.py                      # W = 8, every configuration
    .venv/bin/python benchmarks/bench_wire_bytes.py --world 2 4 8 --configs dense adtopk
    .venv/bin/python benchmarks/bench_wire_bytes.py --world 4 --steps 8 --out docs/scale/wire_bytes_w4.json

Every configuration is examples/train.py's own job (``--dataset shakespeare --model gpt``: the job's 1.0 M-
parameter GPT, batch 8 x 64 tokens per rank, AdamW) under ``horovodrun --gloo`` with one rank per host, so a
host's ``eth1`` carries exactly its rank's traffic, run through tests/wire_worker.py's ``job`` mode: after
``--warm`` steps and after ``--steps`` more, every rank passes a barrier and samples its host's ``eth1`` through
netlink (``ip -s -j link``), TCP's counters, its sockets' byte counters (``ss -tin``) and ``opt.stats()``; then
it sleeps ``--idle`` seconds with no collective, samples again, computes for ``--busy`` seconds with no
collective and samples a last time. Per rank, direction and step the table gives:

* *counted*: the window's TCP payload on the interface (bytes minus 66 bytes of Ethernet/IP/TCP headers per
  counted packet) minus the background, three ways: at the idle window's payload rate (Horovod's background
  loop allreduces its cache bit vector once per cycle, idle or not, and ssh sends keepalives), at the busy
  window's rate (ranks that compute cycle less often), and none. A rank busy training cycles about as often as
  a busy one, and never more often than an idle one, so the steps' bytes lie between the idle-rate and no-
  background figures, near the busy-rate one;
* *tcp*: the sockets' acknowledged bytes (each payload byte once: no headers, no retransmitted copies) minus
  the idle rate, and *retrans*, the bytes TCP sent a second time, which the interface counts twice;
* *stats*: the differences of ``wire_bytes_sent`` / ``wire_bytes_received`` / ``wire_bytes_dense`` over the same
  steps, and the ring allreduce reference ``2 (W-1)/W * 4 * numel`` computed here.

tests/test_wire_bytes.py explains the method and checks it against that reference. Horovod runs with
``HOROVOD_CYCLE_TIME=50`` (ms; ``--cycle-time-ms``; its default is 1): the background is per cycle, and at
10 ms it was 50 kB/s per rank at W = 8 on this 2-core machine, 70-80 kB per ~1.5 s step, against 470 kB of
ADTopk payload: the idle-rate and no-background figures then lay 11% apart; at 50 ms, 11 kB/s. The cycle time
decides when collectives start, not their bytes; it adds up to a cycle per negotiation round to a step, so
compare the step times between rows of one run, not with Horovod's defaults (``--cycle-time-ms 1``).

Configurations (``--configs``; each the job's own flags, ``CONFIGS`` below):

=================  =============================================================================================
``dense``          ``--compressor none``: Horovod's ring allreduce of fp32 gradients
``fp16``           ``--compressor fp16``: the same in float16
``adtopk``         ADTopk 0.01 every step, error feedback on the gradient (the plain ``hat.DistributedOptimizer``
                   per-step path; the job's default for AdamW would be feedback on the update)
``adtopk_update``  ADTopk 0.01 every step with the job's AdamW default: error feedback on the update (local
                   steps with H = 1 and an outer SGD at lr 1)
``topk``           Top-k 0.01 every step, error feedback on the gradient
``powersgd``       ``--compressor powersgd --powersgd-rank 4``
``recipe``         the README's AdamW transformer recipe: ADTopk 0.25 on the pseudo-gradient of 4 local steps,
                   ``Outer.sgd(lr=1.0, feedback_decay=0.95, value_bits=2, value_group=64)``
``adtopk_sharded``  ``adtopk`` with ``--exchange sharded``: the per-step owner-sharded exchange
``recipe_allgather``  the recipe with ``--outer-exchange allgather`` (every payload gathered, as before the
                   owner-sharded exchange; ``recipe`` runs the default ``auto``, which shards from 3 ranks on)
``adtopk_update_allgather``  ``adtopk_update`` with its payloads gathered (``adtopk_update``: ``auto``)
``diloco``         dense DiLoCo: ``--compressor none --sync-every 4`` (outer Nesterov lr 0.7, momentum 0.9)
``hierarchical``   skipped: the job has no flag for it, and with one rank per host ``hierarchical=True`` falls
                   back to the flat exchange (tests/test_hierarchical.py runs it at 2 ranks per host)
=================  =============================================================================================

The window (``--warm 4 --steps 8`` by default) holds whole intervals of the local-steps configurations (H = 4):
their per-step figures are averages over two syncs. Outputs: a table on stdout and ``--out`` JSON (default
``docs/scale/wire_bytes.json``) with the command, git commit (at the start, at the end and at each job's
start, with the files modified in the working tree), machine, date, every rank's window and the summaries.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import common

REPO = common.REPO_ROOT
common.repo_package("tests")  # tests.cluster, tests.wire_worker
from tests.wire_worker import HEADER_BYTES, counted  # noqa: E402

JOB = ["--dataset", "shakespeare", "--model", "gpt", "--batch-size", "8", "--seq-len", "64", "--test-batches", "1",
       "--test-batch-size", "64", "--no-progress", "--log-every", "0", "--seed", "1"]
PER_STEP_SPARSE = ["--no-warmup", "--error-feedback-on", "gradient"]
CONFIGS: Dict[str, Optional[List[str]]] = {
    "dense": ["--compressor", "none"],
    "fp16": ["--compressor", "fp16"],
    "adtopk": ["--compressor", "adtopk", "--ratio", "0.01", *PER_STEP_SPARSE],
    "adtopk_update": ["--compressor", "adtopk", "--ratio", "0.01", "--no-warmup"],
    "adtopk_sharded": ["--compressor", "adtopk", "--ratio", "0.01", *PER_STEP_SPARSE, "--exchange", "sharded"],
    "topk": ["--compressor", "topk", "--ratio", "0.01", *PER_STEP_SPARSE],
    "powersgd": ["--compressor", "powersgd", "--powersgd-rank", "4"],
    "recipe": ["--compressor", "adtopk", "--ratio", "0.25", "--sync-every", "4", "--outer-lr", "1",
               "--outer-momentum", "0", "--outer-feedback-decay", "0.95", "--outer-value-bits", "2",
               "--outer-value-group", "64"],
    "recipe_allgather": ["--compressor", "adtopk", "--ratio", "0.25", "--sync-every", "4", "--outer-lr", "1",
                         "--outer-momentum", "0", "--outer-feedback-decay", "0.95", "--outer-value-bits", "2",
                         "--outer-value-group", "64", "--outer-exchange", "allgather"],
    "adtopk_update_allgather": ["--compressor", "adtopk", "--ratio", "0.01", "--no-warmup", "--outer-exchange",
                                "allgather"],
    "diloco": ["--compressor", "none", "--sync-every", "4"],
    "hierarchical": None,
}
SKIPPED = {"hierarchical": "the job has no hierarchical flag, and at one rank per host hierarchical=True falls back "
                           "to the flat exchange (nothing to measure that the flat rows do not)"}


def run_config(cluster, name: str, world: int, args: argparse.Namespace, workdir: Path) -> Dict[str, Any]:
    """One configuration at one world size: the job on hosts h0..h(W-1); every rank's window, summarised."""
    outdir = workdir / f"{name}_w{world}"
    train_args = [*JOB, "--max-steps", str(args.warm + args.steps), *CONFIGS[name], *args.job_args]
    cmd = [common.HOROVODRUN, "-np", str(world), "-H", cluster.host_list(1, list(range(world))), "--gloo",
           "--network-interface", cluster.iface, "--ssh-identity-file", str(cluster.key),
           sys.executable, "-m", "tests.wire_worker", "job", str(outdir), "--warm", str(args.warm),
           "--steps", str(args.steps), "--idle", str(args.idle), "--busy", str(args.busy), "--", *train_args]
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'examples'}", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "HOROVOD_CYCLE_TIME": str(args.cycle_time_ms)}
    git = git_state()  # the code this job imports (a working tree may change between jobs)
    rc, output, seconds = cluster.run(0, cmd, timeout=args.timeout, env=env, cwd=str(REPO))
    records = sorted((json.loads(p.read_text()) for p in outdir.glob("rank*.json")), key=lambda r: r["rank"])
    result: Dict[str, Any] = {"config": name, "world": world, "train_args": train_args, "job_seconds": seconds,
                              "rc": rc, "git": git}
    if rc != 0 or len(records) != world:
        result["error"] = f"exit {rc}, {len(records)} of {world} rank records"
        result["log_tail"] = output[-4000:]
        return result
    ranks = [counted(rec["phases"][0]) for rec in records]
    result["ranks"] = ranks
    result["hostnames"] = [rec["hostname"] for rec in records]
    result["summary"] = summarise(ranks, world, args.steps)
    final = [ln for ln in output.splitlines() if "Final test" in ln]
    result["final_line"] = final[-1] if final else None
    return result


def summarise(ranks: List[Dict[str, Any]], world: int, steps: int) -> Dict[str, Any]:
    """Means over the ranks, per step, of the counted bytes (three estimates of the background: the idle rate,
    the busy rate, none) and the stats; the spread of counted/stats over every rank and direction."""
    def mean(f) -> Optional[float]:
        vals = [f(r) for r in ranks]
        return None if any(v is None for v in vals) else statistics.fmean(vals)

    def per_step(d: str, key: str):
        return mean(lambda r: r[d][key] / steps if r[d].get(key) is not None else None)

    def stat(key: str):
        return mean(lambda r: r["stats"][key] / steps if r["stats"][key] is not None else None)

    def spread(key: str):
        ratios = [r[d][key] / r["stats"][k] for r in ranks for d, k in (("tx", "sent"), ("rx", "received"))
                  if r["stats"][k] and r[d].get(key) is not None]
        return [min(ratios), max(ratios)] if ratios else None

    numel = ranks[0]["numel"]
    ref = 2 * (world - 1) / world * 4 * numel
    out: Dict[str, Any] = {"numel": numel, "dense_ring_reference_per_step": ref}
    for d, name in (("tx", "sent"), ("rx", "received")):
        out[f"counted_{name}_per_step"] = per_step(d, "net")  # background at the idle rate
        out[f"counted_busy_{name}_per_step"] = per_step(d, "net_busy")  # background at the busy rate
        out[f"payload_{name}_per_step"] = per_step(d, "payload")  # no background subtracted: an upper bound
        out[f"raw_{d}_per_step"] = per_step(d, "raw")
        out[f"packets_{d}_per_step"] = per_step(d, "packets")
        out[f"stats_{name}_per_step"] = stat(name)
    if all("tcp" in r for r in ranks):  # the sockets' reading: each byte once, no headers, minus the idle rate
        out["tcp_sent_per_step"] = mean(lambda r: r["tcp"]["net_sent"] / steps)
        out["tcp_received_per_step"] = mean(lambda r: r["tcp"]["net_received"] / steps)
        out["tcp_retrans_bytes_per_step"] = mean(lambda r: r["tcp"]["bytes_retrans"] / steps)
        ratios = [r["tcp"][f"net_{k}"] / r["stats"][k] for r in ranks for k in ("sent", "received") if r["stats"][k]]
        out["tcp_over_stats"] = [min(ratios), max(ratios)] if ratios else None
    out.update({
        "stats_dense_per_step": stat("dense"), "stats_payload_sent_per_step": stat("payload_sent"),
        "background_idle_per_s": mean(lambda r: r["tx"]["background_per_s"]),
        "background_busy_per_s": mean(lambda r: r["tx"].get("busy_background_per_s")),
        "counted_over_stats": spread("net"), "counted_busy_over_stats": spread("net_busy"),
        "payload_over_stats": spread("payload"),
        "step_seconds": mean(lambda r: r["step_seconds"]),
        "window_seconds": mean(lambda r: r["seconds"]),
        "tcp_retrans_segs_per_step": sum(r["tcp_retrans_segs"] or 0 for r in ranks) / (len(ranks) * steps),
    })
    best = out["counted_busy_sent_per_step"] or out["counted_sent_per_step"]
    out["counted_x_less_than_dense"] = ref / best if best else None
    return out


def kb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e3:,.1f}"


def span(pair: Optional[List[float]]) -> str:
    return "-" if not pair else f"{pair[0]:.3f}-{pair[1]:.3f}"


def print_table(results: List[Dict[str, Any]]) -> None:
    head = ["config", "W", "stats sent", "stats recv", "counted sent: idle-bg / busy-bg / no-bg", "counted recv",
            "counted/stats idle-bg", "busy-bg", "no-bg", "tcp sent", "tcp/stats", "retrans", "stats dense",
            "ring ref", "x less", "step s", "bg idle/busy kB/s"]
    rows, notes = [], []
    for r in results:
        s = r.get("summary")
        if s is None:
            notes.append(f"{r['config']} W={r['world']}: {r.get('error') or r.get('skipped', '')}")
            continue
        rows.append([r["config"], str(r["world"]), kb(s["stats_sent_per_step"]), kb(s["stats_received_per_step"]),
                     f"{kb(s['counted_sent_per_step'])} / {kb(s['counted_busy_sent_per_step'])} / "
                     f"{kb(s['payload_sent_per_step'])}", kb(s["counted_busy_received_per_step"]),
                     span(s["counted_over_stats"]), span(s["counted_busy_over_stats"]), span(s["payload_over_stats"]),
                     kb(s.get("tcp_sent_per_step")), span(s.get("tcp_over_stats")),
                     kb(s.get("tcp_retrans_bytes_per_step")), kb(s["stats_dense_per_step"]),
                     kb(s["dense_ring_reference_per_step"]),
                     common.fmt(s["counted_x_less_than_dense"], ".1f"), common.fmt(s["step_seconds"], ".3f"),
                     f"{kb(s['background_idle_per_s'])} / {kb(s['background_busy_per_s'])}"])
    print("kB per rank and step (means over the ranks); counted = eth1 bytes minus 66 B per packet minus the "
          "background at the idle rate / at the busy rate / none (recv: busy); tcp = the sockets' acknowledged bytes "
          "(each once) minus the idle rate; retrans = bytes TCP sent twice; ratios: min-max over ranks and directions")
    print(common.table(head, rows))
    for n in notes:
        print(n)


def git_state() -> Dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=str(REPO), capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    dirty = [ln[3:] for ln in git("status", "--porcelain", "--untracked-files=no").splitlines() if ln.strip()]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "dirty_files": dirty,
            "package_dirty": any(f.startswith("horovod_adtopk/") for f in dirty)}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[8], help="world sizes (one rank per emulated host)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--steps", type=int, default=8, help="steps in the counted window (a multiple of 4: local steps)")
    ap.add_argument("--warm", type=int, default=4, help="steps before the window")
    ap.add_argument("--idle", type=float, default=3.0, help="seconds of the idle (background) window")
    ap.add_argument("--busy", type=float, default=3.0,
                    help="seconds of the busy window (every rank computes, no collective; a second background rate)")
    ap.add_argument("--link", default="1gbit", help="tc rate of every host's link (tests/cluster.py)")
    ap.add_argument("--cycle-time-ms", type=float, default=50.0,
                    help="HOROVOD_CYCLE_TIME of the jobs (Horovod's default: 1; see the module docstring)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per job before its process tree is killed")
    ap.add_argument("--job-args", nargs=argparse.REMAINDER, default=[],
                    help="more examples/train.py flags for every job (last on the command line)")
    ap.add_argument("--out", default="docs/scale/wire_bytes.json")
    args = ap.parse_args(argv)
    if any(w < 2 for w in args.world):
        ap.error("--world: 2 or more ranks (one per host)")
    if args.steps < 1 or args.warm < 1:
        ap.error("--steps and --warm must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from tests.cluster import Cluster, ClusterUnavailable, unavailable_reason
    why = unavailable_reason()
    if why:
        raise SystemExit(f"bench_wire_bytes needs an emulated cluster (tests/cluster.py): {why}")
    started = datetime.datetime.now(datetime.timezone.utc)
    git_at_start = git_state()
    results: List[Dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="wire-bench-"))
    try:
        with Cluster(hosts=max(args.world), name="wbench", link=args.link, start_timeout=240) as cluster:
            for world in args.world:
                for name in args.configs:
                    if CONFIGS[name] is None:
                        results.append({"config": name, "world": world, "skipped": SKIPPED[name]})
                        continue
                    res = run_config(cluster, name, world, args, workdir)
                    results.append(res)
                    s = res.get("summary")
                    print(f"{name} W={world}: job {res['job_seconds']:.0f} s; "
                          + (f"sent per step: stats {kb(s['stats_sent_per_step'])} kB, counted "
                             f"{kb(s['counted_sent_per_step'])} / {kb(s['counted_busy_sent_per_step'])} / "
                             f"{kb(s['payload_sent_per_step'])} kB (idle / busy / no background)"
                             if s else res.get("error", "")), flush=True)
    except ClusterUnavailable as exc:
        raise SystemExit(f"no emulated cluster here: {exc}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(results)
    report = {
        "benchmark": "bench_wire_bytes",
        "date": started.isoformat(timespec="seconds"),
        "git": git_at_start,
        "git_at_end": git_state(),
        "machine": common.machine_info(),
        "settings": {"world": args.world, "steps": args.steps, "warm": args.warm, "idle_s": args.idle,
                     "busy_s": args.busy,
                     "link": args.link, "horovod_cycle_time_ms": args.cycle_time_ms, "job": JOB,
                     "job_args": args.job_args, "header_bytes_per_packet": HEADER_BYTES,
                     "one_rank_per_host": True, "controller": "gloo"},
        "method": ("counted = (eth1 bytes - 66 x packets) over the window of --steps steps between two barriers, "
                   "minus the idle window's payload rate x the window's seconds (counted_busy: the busy window's "
                   "rate; payload: no background); tcp = the sockets' bytes_acked / bytes_received over the window "
                   "minus the idle rate; stats = differences of opt.stats() over the same steps; per rank and step"),
        "results": results,
    }
    # write_record adds the command and the commit at the end (``git`` and ``git_at_end`` say more)
    path = common.write_record(REPO / args.out if not Path(args.out).is_absolute() else args.out, report,
                               ["python", "benchmarks/bench_wire_bytes.py",
                                *(argv if argv is not None else sys.argv[1:])])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
