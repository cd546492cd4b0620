"""The DDP engine under torchrun's elastic agent across 3 emulated hosts (issue 31, part 3).

One cluster for the module (tests/cluster.py: hosts ``<name>-h0..h2``, own network namespace, hostname, ``eth1``
at 1 Gbit/s, each host's own name on 127.0.1.1). On every host one torchrun agent::

    torchrun --nnodes 2:3 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint <h0>:PORT --max-restarts 3
             --monitor-interval 0.5 --rdzv-conf RDZV_CONF -m tests.elastic_ddp_worker OUTDIR
             <examples/train.py --engine ddp --elastic ...>

runs examples/train.py (Fashion-MNIST CNN, one epoch of 79 steps of 3 x 256 samples under a cosine schedule,
ADTopk at ratio 0.01 with momentum correction, a short compression warm-up so that the residuals matter, a
checkpoint every 5 steps) through tests/elastic_ddp_worker.py, which
records when each worker process completed its first step and, at the end, every rank's parameter digest and
final test accuracy (the whole test set).

* the reference: the same command, no fault, 3 nodes from the start to the end.
* the fault: once the job has checkpointed step 15 at 3 nodes, SIGKILL of host 2's agent and worker. The
  survivors' workers fail (Gloo: the peer's connection closed), their agents re-rendezvous at 2 nodes (the dead
  node leaves after keep_alive_interval x keep_alive_max_attempt = 3 s without heartbeats, then
  last_call_timeout = 5 s) and the new workers resume from the newest checkpoint at world size 2. After their
  next checkpoint, host 2's agent is started again: the agents at 2 nodes see a waiting node (every
  monitor-interval), restart their workers, and the job resumes at 3 nodes and finishes.
  Checks: every agent exits 0; each change is logged ("elastic: world size 3 -> 2", "2 -> 3", residuals
  folded, pending update kept); every rank ends bitwise identical at the planned step; the final accuracy is
  at most 0.5 pt below the reference's (and at most 2 pt above); the recovery (fault -> first completed step at 2 nodes) is within 60 s;
  nothing is left on any host. The recovery and rejoin times are printed.

Exact equality with the reference cannot hold: at 2 nodes each step averages 2 batches instead of 3, the
epoch's remaining samples are dealt to other ranks, and the steps since the last checkpoint are replayed.

Settings that get the recovery under 60 s: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the agents (without it
the restarted workers read the lost round's Gloo addresses from the shared store and fail until the restarts run
out, and the rejoining agent waits forever for MASTER_ADDR; the job warns), ``GLOO_SOCKET_IFNAME=eth1``, the
rendezvous settings of ``RDZV_CONF``, ``--monitor-interval 0.5``, and no exit barrier after a failure (the job's
``_shutdown``). A SIGKILL closes the peer's sockets, so Gloo fails at once: the process group's 120 s timeout
plays no part here (it would for a link that dies silently).

Measured on 2 shared cores (load average 5-14, other test jobs running): the module 5 min 54 s; the reference
93 s; recovery 41 s (5 s until the survivors' workers had failed and exited, 19 s of re-rendezvous, spawn and
imports, 17 s of set-up, checkpoint load and the first step), 23-49 s over 4 runs; rejoin 34-65 s; final
accuracy 76.45% against 76.05% (+0.40 pt; other runs +0.38 pt and +1.47 pt). The fold of the pending update is exact to
float32 rounding (max difference 1.2e-7 at norm 18.9).

Skipped only where namespaces cannot be made (not root, no CAP_NET_ADMIN); sshd is installed by the cluster.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

from tests.cluster import Cluster, module_cluster
from tests.harness import REPO, kill_tree
from tests.reference import check_fold_3_to_2

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
BATCH = 256  # per rank at 3 nodes: one epoch is ceil(ceil(60000 / 3) / 256) = 79 steps, the cosine anneals to 0
STEPS = 79
CKPT_EVERY = 5
FAULT_AFTER = 15  # the fault comes once this step is checkpointed at 3 nodes
TIMEOUT = 300  # one job, launch to exit, on a loaded 2-core machine
RECOVERY_LIMIT = 60.0
# The fault must not cost accuracy: at most 0.5 pt below the reference. Above it, the faulted run is another valid
# trajectory (2 ranks of 384 samples after the fault, residuals folded, steps replayed) of a one-epoch run that
# is still on the steep part of its curve: measured +0.38, +0.40 and, in one CI run, +1.47 pt; 2 pt above still
# catches a gross change of the plan (e.g. a doubled learning rate).
ACCURACY_BELOW, ACCURACY_ABOVE = 0.005, 0.02
# The dead node is dropped after keep_alive_interval x keep_alive_max_attempt s without a heartbeat; once the
# minimum number of nodes (2) is there, the rendezvous closes after last_call_timeout s (a third node arriving
# before closes it at once).
RDZV_CONF = "join_timeout=180,last_call_timeout=5,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
TRAIN_ARGS = ["--engine", "ddp", "--elastic", "--dataset", "fashion-mnist", "--compressor", "adtopk", "--ratio", "0.01",
              "--dense-rounds", "5", "--density-warmup", "20", "--warmup-steps", "10", "--batch-size", str(BATCH),
              "--epochs", "1",
              "--checkpoint-every", str(CKPT_EVERY), "--no-progress", "--log-every", "0"]
ENV = {"PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'examples'}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       # Gloo would otherwise use the hostname's address: 127.0.1.1 on every host
       "GLOO_SOCKET_IFNAME": "eth1",
       # a fresh store per rendezvous round (job.elastic_resume.SHARED_STORE_WARNING says why)
       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.fixture(scope="module")
def cluster():
    yield from module_cluster(3, f"eb{os.getpid() % 10 ** 5}", link="1gbit", loopback_names=True)


class Job:
    """One elastic job: a torchrun agent per host, each with its own log in ``outdir``."""

    def __init__(self, c: Cluster, outdir: Path, port: int) -> None:
        self.c, self.outdir, self.port = c, outdir, port
        self.agents: List[subprocess.Popen] = []
        self.logs: List[Path] = []

    def start_agent(self, host: int) -> subprocess.Popen:
        cmd = [TORCHRUN, "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{self.c.hosts[0].name}:{self.port}", "--rdzv-id", f"job{self.port}",
               "--max-restarts", "3", "--monitor-interval", "0.5", "--rdzv-conf", RDZV_CONF,
               "-m", "tests.elastic_ddp_worker", str(self.outdir), *TRAIN_ARGS,
               "--checkpoint-dir", str(self.outdir / "ckpt")]
        log_path = self.outdir / f"agent{len(self.agents)}-h{host}.log"
        with open(log_path, "wb") as log:
            proc = self.c.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                                env={**os.environ, **ENV})
        self.agents.append(proc)
        self.logs.append(log_path)
        return proc

    def output(self) -> str:
        return "\n".join(f"===== {p.name}\n" + p.read_text(errors="replace") for p in self.logs if p.is_file())

    def events(self) -> List[dict]:
        d = self.outdir / "events"
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []

    def records(self) -> List[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.outdir.glob("rank*.json"))]

    def wait_for(self, what: str, predicate, deadline: float) -> None:
        while time.monotonic() < deadline:
            if predicate():
                return
            done = [p.returncode for p in self.agents if p.poll() is not None]
            if done and all(p.poll() is not None for p in self.agents[:2]):
                break
            time.sleep(0.2)
        pytest.fail(f"{what}: not seen (agents' exits {[p.poll() for p in self.agents]})\n{self.output()[-10000:]}")

    def finish(self, deadline: float) -> List[Optional[int]]:
        """Wait for every agent (killing what is still there at the deadline); every host's leftovers."""
        for p in self.agents:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                kill_tree(p)
                p.wait(timeout=30)
        return [p.returncode for p in self.agents]

    def stop(self) -> Dict[str, List[str]]:
        for p in self.agents:
            if p.poll() is None:
                kill_tree(p)
                p.wait(timeout=30)
        settle = time.monotonic() + 10
        left = self.c.leftovers()
        while left and time.monotonic() < settle:
            time.sleep(0.2)
            left = self.c.leftovers()
        self.c.reap()
        return left


def newest_step(ckpt_dir: Path) -> int:
    try:
        return int((ckpt_dir / "latest").read_text().strip()[len("ckpt-step"):-len(".pt")])
    except (OSError, ValueError):
        return -1


def check_end(job: Job, rcs: List[Optional[int]], left: dict) -> List[dict]:
    """Every live agent exited 0, the 3 ranks ended at STEPS with one digest, nothing left on the hosts."""
    out = job.output()
    assert all(rc == 0 for rc in rcs), f"agents exited {rcs}\n{out[-10000:]}"
    recs = job.records()
    assert len(recs) == 3 and all(r["world"] == 3 and r["step"] == STEPS for r in recs), f"{recs}\n{out[-8000:]}"
    assert len({r["digest"] for r in recs}) == 1, f"ranks differ at the end: {[r['digest'][:12] for r in recs]}"
    assert sorted(r["hostname"] for r in recs) == sorted(h.name for h in job.c.hosts), recs
    assert left == {}, f"processes left on the hosts after the job: {left}"
    return recs


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory) -> dict:
    """The fault-free job: 3 nodes from start to end."""
    outdir = tmp_path_factory.mktemp("elastic_ref")
    job = Job(cluster, outdir, 29511)
    start = time.monotonic()
    try:
        for h in range(3):
            job.start_agent(h)
        rcs = job.finish(start + TIMEOUT)
    finally:
        left = job.stop()
    return {"job": job, "rcs": rcs, "left": left, "seconds": time.monotonic() - start}


def test_reference_three_nodes(reference):
    job = reference["job"]
    recs = check_end(job, reference["rcs"], reference["left"])
    worlds = {(e["world"], e["restart"]) for e in job.events()}
    assert worlds == {(3, 0)}, f"the reference did not run at 3 nodes throughout: {job.events()}"
    print(f"reference (3 nodes, {STEPS} steps): {reference['seconds']:.1f} s, "
          f"test accuracy {100 * recs[0]['test_accuracy']:.2f}%")


def test_host_lost_then_rejoins(cluster: Cluster, reference, tmp_path: Path):
    ref = reference["job"].records()
    assert len(ref) == 3, "the reference run failed (see test_reference_three_nodes)"
    job = Job(cluster, tmp_path, 29512)
    start = time.monotonic()
    deadline = start + TIMEOUT
    try:
        for h in range(3):
            job.start_agent(h)
        job.wait_for(f"checkpoint of step {FAULT_AFTER} at 3 nodes",
                     lambda: newest_step(tmp_path / "ckpt") >= FAULT_AFTER and len(job.events()) == 3, deadline)
        victims = cluster.processes(2)  # host 2's torchrun agent and its worker
        t_fault = time.time()
        for p in victims:
            p.send_signal(signal.SIGKILL)
        at_fault = newest_step(tmp_path / "ckpt")

        def at_two():
            return [e for e in job.events() if e["world"] == 2]
        job.wait_for("a completed step at 2 nodes", lambda: len(at_two()) == 2, deadline)
        resumed = at_two()[0]["resumed_from"]
        job.wait_for("a checkpoint at 2 nodes", lambda: newest_step(tmp_path / "ckpt") >= resumed + CKPT_EVERY,
                     deadline)
        t_join = time.time()
        job.start_agent(2)
        job.wait_for("a completed step at 3 nodes after the rejoin",
                     lambda: len([e for e in job.events() if e["world"] == 3 and e["first_step_done"] > t_join]) == 3,
                     deadline)
        rcs = job.finish(deadline)
    finally:
        left = job.stop()
    out = job.output()
    killed, live = rcs[2], rcs[:2] + rcs[3:]
    assert killed == -signal.SIGKILL, f"host 2's first agent exited {killed}"
    recs = check_end(job, live, left)

    events = job.events()
    two = sorted(e["first_step_done"] for e in events if e["world"] == 2)
    three = sorted(e["first_step_done"] for e in events if e["world"] == 3 and e["first_step_done"] > t_join)
    recovery, rejoin = two[0] - t_fault, three[0] - t_join
    lines = [ln for ln in out.splitlines() if "elastic: world size" in ln]
    print(f"fault after the step-{at_fault} checkpoint; recovery (SIGKILL -> first step at 2 nodes) {recovery:.1f} s; "
          f"rejoin (agent started -> first step at 3 nodes) {rejoin:.1f} s; whole job "
          f"{time.monotonic() - start:.1f} s\n  " + "\n  ".join(lines))
    shrink = [ln for ln in lines if "world size 3 -> 2" in ln]
    grow = [ln for ln in lines if "world size 2 -> 3" in ln]
    assert shrink and grow, f"the world-size changes were not logged\n{out[-10000:]}"
    assert all("folded" in ln for ln in shrink + grow), "\n".join(lines)
    assert recovery <= RECOVERY_LIMIT, f"recovery took {recovery:.1f} s\n{out[-10000:]}"
    acc, ref_acc = recs[0]["test_accuracy"], ref[0]["test_accuracy"]
    print(f"final test accuracy {100 * acc:.2f}% against the reference's {100 * ref_acc:.2f}% "
          f"({100 * (acc - ref_acc):+.2f} pt)")
    assert -ACCURACY_BELOW <= acc - ref_acc <= ACCURACY_ABOVE, f"accuracy {acc:.4f} vs the reference's {ref_acc:.4f}"


# --------------------------------------------------------------------------------------------------------
# The fold itself, without a cluster: a gathered DDP-engine state written at 3 ranks, loaded at 2
# --------------------------------------------------------------------------------------------------------

FOLD_SPECS = [{"compressor": "adtopk", "kwargs": {"ratio": 0.05, "min_numel": 0, "hybrid": False}},
              {"compressor": "dgc", "kwargs": {"ratio": 0.05, "momentum": 0.9, "min_numel": 0, "hybrid": False},
               "naming": "positional"}]


def test_gathered_ddp_state_folds_residuals_into_two_ranks(tmp_path: Path):
    """hat.ddp's CompressionState.gather_state_dict() at 3 Gloo ranks, loaded by 2 new processes: new rank j holds
    (2/3) * sum of the old ranks i with i mod 2 == j (residuals, and DGC's velocities), so
    sum_j r'_j / 2 == sum_i r_i / 3 (numpy reference); no warning; both ranks step on to the same parameters."""
    from tests.test_ddp import ddp_results

    k = 4
    args = {"k": k, "ckpt_dir": str(tmp_path), "compressors": FOLD_SPECS}
    ddp_results("fold_resume", 3, dict(args, phase="write"), timeout=180)
    *second, outdir = ddp_results("fold_resume", 2, dict(args, phase="read"), timeout=180)
    for si, spec in enumerate(FOLD_SPECS):
        assert [r[str(si)]["round"] for r in second] == [k + 1, k + 1]
        assert [r[str(si)]["warnings"] for r in second] == [[], []], spec
        assert second[0][str(si)]["digest"] == second[1][str(si)]["digest"]
        saved = torch.load(tmp_path / f"fold{si}.pt", weights_only=True)["hook"]
        assert saved["world_size"] == 3 and sorted(saved["ranks"]) == [0, 1, 2]
        stores = ["residuals"] + (["velocities"] if spec["kwargs"].get("momentum") else [])
        for store in stores:
            names = saved["ranks"][0]["memory"][store].keys()
            assert names, (spec, store)
            for name in names:
                new = [np.load(Path(outdir, f"fold{si}_rank{j}.npz"))[f"{store}/{name}"] for j in range(2)]
                # rank 2's memory is not empty
                assert saved["ranks"][2]["memory"][store][name].abs().sum() > 0, (spec, store, name)
                check_fold_3_to_2(saved["ranks"], store, name, new)
