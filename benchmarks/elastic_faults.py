#!/usr/bin/env python
"""Faults under Horovod elastic across 3 emulated hosts: what the real job survives, how fast, what it loses.

How to run (as root, from the repository root; it starts and stops its own emulated cluster of
``tests/cluster.py``, named ``efbench``: network namespaces, sshd, veths capped at 1 Gbit/s)::

    PYTHONPATH=. python benchmarks/elastic_faults.py --out docs/elastic/faults.json --md docs/elastic/faults.md
    PYTHONPATH=. python benchmarks/elastic_faults.py --faults a b --gloo-timeout 30

Every run is ``horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script S`` from host 0 (S prints a
file of ``host:1`` lines that this script edits) running ``examples/train.py --elastic`` on Fashion-MNIST
(its first ``--samples`` examples, the small CNN, ADTopk at 0.01 after 10 dense rounds and a density
warm-up over 20, a fixed global batch of 192 so every step sees the same samples whatever the world size,
a commit every 10 steps, tensor fusion off so runs are reproducible); tests/elastic_runs.py starts it,
injects the fault and reads every rank's ``--elastic-log``. Runs, each with one fault on host 2 in the
middle of epoch 2 of 2 (a few steps after the step-80 commit; ``--fault-after``):

* ``none``: the fault-free reference;
* ``a``: SIGKILL of host 2's rank;
* ``b``: host 2's ``eth1`` taken down (``ip link set eth1 down``: its link to every other host silently
  dies); it stays down;
* ``b+c``: as ``b``, and host 2 leaves the discovery file 5 s later (what a health check would do);
* ``c+d``: host 2 removed from the discovery file after the step-70 commit, then added back as soon as
  the 2 ranks train.

Per run: survived (horovodrun exit 0 and both epochs trained), the world sizes in order, whether every
membership's ranks were bitwise identical at its start, at each commit and at the end, the seconds from the
fault to the first step completed by the next membership, the steps replayed (done after the last commit,
rolled back), the final test accuracy (the whole test set) against the fault-free run, and for ``a`` what
the lost rank held: the norm of its last committed residual against the norm of its own gradient of that
step. Outputs: a table on stdout, ``--out`` JSON, ``--md`` the same table in Markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import common
from common import table

REPO = common.REPO_ROOT
common.repo_package("tests")
from tests.cluster import Cluster  # noqa: E402
from tests.elastic_runs import ElasticRun, analyse, job_args, lost_residual  # noqa: E402

FAULTS = ("none", "a", "b", "b+c", "c+d")
DESCRIBE = {"none": "none (reference)", "a": "(a) SIGKILL of h2's rank", "b": "(b) eth1 of h2 down",
            "b+c": "(b) eth1 down + h2 out of discovery 5 s later", "c+d": "(c) h2 out of discovery, (d) back"}
STEP_SECONDS = 0.3


def one_run(cluster: Cluster, fault: str, outdir: Path, args: argparse.Namespace) -> dict:
    """Run the job with ``fault``; return what happened."""
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": str(args.gloo_timeout), "HOROVOD_FUSION_THRESHOLD": "0"}
    run = ElasticRun(cluster, outdir, job_args(args.samples, args.epochs, args.commit_every), env=env).start()
    faults: Dict[str, float] = {}
    victims: List[int] = []
    note = ""
    try:
        if fault != "none":
            run.wait_for_commit(args.fault_after if fault != "c+d" else args.fault_after - 10, 3, args.timeout)
            if fault in ("a", "b", "b+c"):
                time.sleep(STEP_SECONDS * args.commit_every / 2)  # between two commits
            victims = [p.pid for p in run.ranks_on(2)]
            if fault == "a":
                faults["fault"] = run.kill_host_ranks(2)
            elif fault in ("b", "b+c"):
                faults["fault"] = time.time()
                cluster.set_link(2, up=False)
                if fault == "b+c":
                    time.sleep(5)
                    run.set_hosts([0, 1])
            else:
                faults["fault"] = run.set_hosts([0, 1])
                run.wait_for_membership(2, args.timeout)  # as soon as the 2 ranks train
                faults["added"] = run.set_hosts([0, 1, 2])
    except (RuntimeError, TimeoutError) as exc:
        note = str(exc).splitlines()[0]
    finally:
        rc = run.wait(args.timeout)
        if fault in ("b", "b+c"):
            cluster.set_link(2, up=True)
    final = run.final()
    got = analyse(run.events(), faults)
    survived = rc == 0 and final is not None and final.get("epoch") == args.epochs
    identical = all(m["synced_identical"] and m["ranks_synced"] == m["size"] for m in got["memberships"]) \
        and not got["disagreements"]
    row = {"fault": fault, "describe": DESCRIBE[fault], "rc": rc, "survived": survived, "seconds": run.seconds,
           "world_sizes": got["world_sizes"], "identical": identical, "disagreements": got["disagreements"],
           "recovery_seconds": got["recovery"].get("fault"), "readd_seconds": got["recovery"].get("added"),
           "replayed": sum(m["replayed"] for m in got["memberships"]),
           "final_step": final.get("step") if final else None,
           "test_accuracy": final.get("test_accuracy") if final else None,
           "memberships": got["memberships"], "left_behind": run.left_behind, "note": note}
    if fault == "a":
        row["lost_residual"] = lost_residual(run.events(), victims)
    if not survived:
        out = run.output().splitlines()
        said = [ln for ln in out if "rror" in ln or "imed out" in ln or "exit" in ln][-8:]
        row["log_tail"] = [re.sub(r"/\S*/(horovod-[0-9.]+/)", r"\1", ln) for ln in said]  # no build paths
    return row


def fmt_row(r: dict, ref_acc: Optional[float]) -> List[str]:
    acc = r["test_accuracy"]
    vs = f"{100 * (acc - ref_acc):+.2f} pt" if acc is not None and ref_acc is not None and r["fault"] != "none" else ""
    rec = "" if r["recovery_seconds"] is None else f"{r['recovery_seconds']:.1f}"
    if r["readd_seconds"] is not None:
        rec += f" / {r['readd_seconds']:.1f} (back)"
    lost = r.get("lost_residual")
    survived = "yes" if r["survived"] else (f"no (exit {r['rc']})" if r["rc"] is not None else
                                            f"no (no new membership; killed at {r['seconds']:.0f} s)")
    return [r["describe"], survived, "->".join(map(str, r["world_sizes"])),
            "yes" if r["identical"] else "NO", rec or "-", str(r["replayed"]),
            "-" if acc is None else f"{100 * acc:.2f}% {vs}".strip(),
            f"{lost['residual_norm']:.2f} vs {lost['grad_norm']:.2f}" if lost else "-", f"{r['seconds']:.0f}"]


HEAD = ["fault", "survived", "world", "ranks identical", "recovery s", "steps replayed", "final accuracy",
        "lost residual vs grad norm", "run s"]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--samples", type=int, default=11520)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--fault-after", type=int, default=80,
                   help="the fault comes a few steps after this commit of 3 ranks (c+d: the removal after the "
                        "commit 10 steps earlier, the host back when the 2 ranks train)")
    p.add_argument("--gloo-timeout", type=int, default=10, help="HOROVOD_GLOO_TIMEOUT_SECONDS")
    p.add_argument("--timeout", type=float, default=360.0, help="seconds per run, launch to exit")
    p.add_argument("--out", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)
    faults = ["none"] + [f for f in args.faults if f != "none"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="elastic-faults-") as tmp, \
            Cluster(hosts=3, name="efbench", link="1gbit", loopback_names=True) as cluster:
        for fault in faults:
            print(f"run: {DESCRIBE[fault]} ...", flush=True)
            rows.append(one_run(cluster, fault, Path(tmp) / fault.replace("+", "_"), args))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "memberships"}), flush=True)
    ref_acc = rows[0]["test_accuracy"]
    text = table(HEAD, [fmt_row(r, ref_acc) for r in rows])
    print(text)
    settings = {"samples": args.samples, "epochs": args.epochs, "commit_every": args.commit_every,
                "global_batch": 192, "HOROVOD_GLOO_TIMEOUT_SECONDS": args.gloo_timeout,
                "HOROVOD_FUSION_THRESHOLD": 0, "HOROVOD_ELASTIC_TIMEOUT": os.environ.get("HOROVOD_ELASTIC_TIMEOUT",
                                                                                       "600 (default)"),
                "discovery_interval_s": 1.0, "fault_after_commit": args.fault_after}
    if args.out:
        # write_record adds the command, the commit, the date and the machine (report.py reads them)
        common.write_record(args.out, {"settings": settings, "runs": rows},
                            None if argv is None else ["python", "benchmarks/elastic_faults.py", *argv])
    if args.md:
        write_markdown(args.md, rows, settings)
    return 0


def write_markdown(path: str, rows: List[dict], settings: dict) -> None:
    """The table in Markdown, under a line with the settings."""
    ref_acc = rows[0]["test_accuracy"]
    md = ["Settings: " + ", ".join(f"{k} {v}" for k, v in settings.items()), "",
          "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    md += ["| " + " | ".join(fmt_row(r, ref_acc)) + " |" for r in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    sys.exit(main())
