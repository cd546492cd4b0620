"""Elastic runs of the real job across emulated hosts, their faults and what their ``--elastic-log`` says.

Shared by tests/test_elastic_hosts.py (faults a, c+d) and benchmarks/elastic_faults.py (a, b, c+d, with a
table). One run: ``horovodrun -np 3 --min-np 2 --max-np 3 --host-discovery-script S`` started on host 0 of a
``tests.cluster.Cluster``, where S prints the lines of a file (``host:1`` per host) that the caller edits;
every rank runs ``examples/train.py --elastic --elastic-log LOG``. ``ElasticRun`` starts it, waits for a
committed step, injects a fault and waits for the end; ``analyse`` reads the log into the checks (identical
ranks per membership, recovery times, steps replayed, the lost rank's residual).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional

import psutil

from tests.cluster import Cluster
from tests.harness import HOROVODRUN, REPO

TRAIN = REPO / "examples" / "train.py"
ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'examples'}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def job_args(samples: int, epochs: int, commit_every: int, batch_size: int = 64, dense_rounds: int = 10,
             density_warmup: int = 20) -> List[str]:
    """The job every run trains: Fashion-MNIST, the small CNN, ADTopk at 0.01 with its default warm-up, a fixed
    global batch (``--elastic-batch global``: the same samples in each step whatever the world size, so a
    faulted run stays comparable step for step with the fault-free one)."""
    return ["--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01", "--epochs", str(epochs),
            "--dense-rounds", str(dense_rounds), "--density-warmup", str(density_warmup),
            "--train-samples", str(samples), "--batch-size", str(batch_size), "--commit-every", str(commit_every),
            "--no-progress", "--log-every", "0", "--elastic", "--elastic-batch", "global"]


class ElasticRun:
    """One elastic job on ``cluster`` (its driver on host 0), in ``outdir``."""

    def __init__(self, cluster: Cluster, outdir: Path, train_args: List[str], env: Optional[Dict[str, str]] = None,
                 hosts: Optional[List[int]] = None, np: int = 3, min_np: int = 2) -> None:
        self.cluster, self.outdir = cluster, Path(outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.log_path, self.hosts_file = self.outdir / "elastic.jsonl", self.outdir / "hosts"
        self.summary = self.outdir / "summary.json"
        self.discover = self.outdir / "discover.sh"
        self.discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        self.discover.chmod(0o755)
        self.set_hosts(list(range(cluster.n)) if hosts is None else hosts)
        self.cmd = [HOROVODRUN, "-np", str(np), "--min-np", str(min_np), "--max-np", str(cluster.n),
                    "--host-discovery-script", str(self.discover), "--network-interface", cluster.iface,
                    "--ssh-identity-file", str(cluster.key), "--gloo",
                    sys.executable, str(TRAIN), *train_args, "--elastic-log", str(self.log_path),
                    "--summary-json", str(self.summary)]
        self.env = {**os.environ, **ENV, **(env or {})}
        self.proc: Optional[subprocess.Popen] = None
        self.start_time = 0.0
        self.seconds: Optional[float] = None

    def set_hosts(self, indices: List[int]) -> float:
        """Write the discovery file (atomically) with these hosts, one slot each; returns the time."""
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{self.cluster.hosts[i].name}:1\n" for i in indices))
        os.replace(tmp, self.hosts_file)
        return time.time()

    def start(self) -> "ElasticRun":
        with open(self.outdir / "job.log", "wb") as log:
            self.start_time = time.time()
            self.proc = self.cluster.popen(0, self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def output(self) -> str:
        path = self.outdir / "job.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def events(self) -> List[dict]:
        if not self.log_path.is_file():
            return []
        rows = []
        for line in self.log_path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line being written
                pass
        return rows

    def wait_for_commit(self, step: int, size: int, timeout: float) -> dict:
        """Block until every rank of a ``size``-rank membership committed ``step`` or later; the last row."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended (exit {self.proc.returncode}) before step {step}\n"
                                   f"{self.output()[-6000:]}")
            rows = [e for e in self.events() if e["event"] == "commit" and e["size"] == size and e["step"] >= step]
            if len({e["rank"] for e in rows}) >= size:
                return rows[-1]
            time.sleep(0.2)
        raise TimeoutError(f"no commit of step {step} on {size} ranks within {timeout:.0f} s\n{self.output()[-6000:]}")

    def wait_for_membership(self, size: int, timeout: float) -> dict:
        """Block until every rank of a ``size``-rank membership started training (logged ``synced``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the job ended (exit {self.proc.returncode}) before {size} ranks trained\n"
                                   f"{self.output()[-6000:]}")
            rows = [e for e in self.events() if e["event"] == "synced" and e["size"] == size]
            by_members = defaultdict(list)
            for e in rows:
                by_members[e["members"]].append(e)
            done = [m for m, es in by_members.items() if len(es) >= size]
            if done:
                return by_members[done[-1]][-1]
            time.sleep(0.2)
        raise TimeoutError(f"no {size}-rank membership within {timeout:.0f} s\n{self.output()[-6000:]}")

    def ranks_on(self, host: int) -> List[psutil.Process]:
        """The rank processes (``python examples/train.py``) on host ``host``."""
        found = []
        for p in self.cluster.processes(host):
            try:
                if p.cmdline()[1:2] == [str(TRAIN)]:
                    found.append(p)
            except psutil.Error:
                pass
        return found

    def kill_host_ranks(self, host: int) -> float:
        """SIGKILL the ranks on ``host`` (only those); returns the time."""
        victims = self.ranks_on(host)
        if not victims:
            raise RuntimeError(f"no rank runs on host {host}")
        t = time.time()
        for p in victims:
            p.send_signal(signal.SIGKILL)
        return t

    def wait(self, timeout: float) -> Optional[int]:
        """The exit status of horovodrun (None: killed after ``timeout`` s); leaves nothing on the hosts."""
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout - (time.time() - self.start_time)))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            self.seconds = time.time() - self.start_time
            deadline = time.monotonic() + 10
            self.left_behind = self.cluster.leftovers(str(TRAIN))
            while self.left_behind and time.monotonic() < deadline:
                time.sleep(0.2)
                self.left_behind = self.cluster.leftovers(str(TRAIN))
            self.cluster.reap()
        return rc

    def final(self) -> Optional[dict]:
        return json.loads(self.summary.read_text()) if self.summary.is_file() else None


def analyse(events: List[dict], faults: Dict[str, float]) -> dict:
    """What the log of one run says.

    ``memberships``: in order of start, each with its members id, size, hosts, start step, and whether all
    its ranks' ``synced`` digests agree. ``disagreements``: every (membership, step) whose commit digests
    differ, and a final ``end`` whose digests differ. ``recovery``: per fault, seconds from the fault time to
    the first step completed by a membership that started after it; ``replayed``: steps a failed membership
    had done past the step its successor started from."""
    synced: Dict[str, List[dict]] = defaultdict(list)
    commits: Dict[tuple, List[dict]] = defaultdict(list)
    firsts: Dict[str, List[dict]] = defaultdict(list)
    failed: Dict[str, List[dict]] = defaultdict(list)
    ends = [e for e in events if e["event"] == "end"]
    order: List[str] = []
    for e in events:
        if e["event"] == "synced":
            if e["members"] not in synced:
                order.append(e["members"])
            synced[e["members"]].append(e)
        elif e["event"] == "commit":
            commits[(e["members"], e["step"])].append(e)
        elif e["event"] == "first_step":
            firsts[e["members"]].append(e)
    by_pid_members = {(e["pid"], e["members"]) for e in events if e["event"] == "synced"}
    for e in events:
        if e["event"] == "failed":  # the membership this process was in when the collective failed
            mine = [m for m in order if (e["pid"], m) in by_pid_members and synced[m][0]["time"] <= e["time"]]
            if mine:
                failed[mine[-1]].append(e)
    memberships = []
    for i, m in enumerate(order):
        rows = synced[m]
        start = min(r["time"] for r in rows)
        first = min((r["time"] for r in firsts.get(m, [])), default=None)
        nxt = synced[order[i + 1]][0]["step"] if i + 1 < len(order) else None
        memberships.append({
            "members": m, "size": rows[0]["size"], "ranks_synced": len(rows),
            "hosts": sorted({h for r in rows for h in r["hosts"]}), "start_step": rows[0]["step"],
            "start_time": start, "first_step_time": first,
            "synced_identical": len({r["digest"] for r in rows}) == 1,
            "failed_at_step": max((f["step"] for f in failed.get(m, [])), default=None),
            "replayed": (max(f["step"] for f in failed[m]) - nxt) if failed.get(m) and nxt is not None else 0,
            "commits": len({s for (mm, s) in commits if mm == m})})
    disagreements = [f"{m} step {s}: {sorted({r['digest'][:12] for r in rows})}"
                     for (m, s), rows in commits.items() if len({r["digest"] for r in rows}) > 1]
    if len({e["digest"] for e in ends}) > 1:
        disagreements.append(f"end: {sorted({e['digest'][:12] for e in ends})}")
    recovery = {}
    for name, t in faults.items():
        after = [ms for ms in memberships if ms["start_time"] > t and ms["first_step_time"] is not None]
        recovery[name] = after[0]["first_step_time"] - t if after else None
    return {"memberships": memberships, "disagreements": disagreements, "recovery": recovery,
            "ends": len(ends), "end_size": ends[0]["size"] if ends else None,
            "world_sizes": [ms["size"] for ms in memberships]}


def lost_residual(events: List[dict], pids: List[int]) -> Optional[dict]:
    """The last commit line of the killed processes ``pids``: the residual norm they held and their gradient
    norm of that step (what the run lost with them)."""
    rows = [e for e in events if e["event"] == "commit" and e["pid"] in pids and e.get("grad_norm") is not None]
    if not rows:
        return None
    last = rows[-1]
    return {"step": last["step"], "residual_norm": last["residual_norm"], "grad_norm": last["grad_norm"],
            "ratio": last["residual_norm"] / last["grad_norm"] if last["grad_norm"] else None}
