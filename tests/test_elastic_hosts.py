"""Horovod elastic across 3 emulated hosts with the real job: faults survived, ranks identical, accuracy kept.

One cluster for the module: hosts ``<name>-h0..h2`` (tests/cluster.py: own network namespace, hostname, sshd,
``eth1`` at 1 Gbit/s, each host's own name on 127.0.1.1). Every run is ``horovodrun -np 3 --min-np 2
--max-np 3 --host-discovery-script S`` from h0, where S prints the lines of a file the test edits (``host:1``
per host), running ``examples/train.py --elastic`` (Fashion-MNIST on its first 11520 examples, the small CNN,
ADTopk at 0.01 after 10 dense rounds and a density warm-up over 20, a fixed global batch of 192, 3 epochs of
60 steps, a commit every 10 steps); each rank
logs its view to ``--elastic-log`` (tests/elastic_runs.py reads it). Runs:

* the fault-free reference (the accuracy target);
* (a) SIGKILL of h2's rank in the middle of epoch 3 (a few steps after the step-140 commit): the survivors'
  next collective fails, they roll back to the last commit (the steps since are replayed) and go on as 2 ranks;
* (c) h2 removed from the discovery file early in epoch 2 (after the step-60 commit), then (d) added
  back as soon as the 2 ranks train: Horovod tells the ranks within seconds, they act at their next
  commit (nothing replayed), the job shrinks to 2 ranks and grows back to 3 (the new worker starts from
  scratch and receives rank 0's state in the sync). The job must still be training when Horovod tells it:
  the driver polls the discovery script once a second and the ranks look at a commit, 1.4-3.3 s from the
  edit to the interrupt here, while 2 ranks run up to 20 steps a second. With 2 epochs the re-add came 40
  steps before the end and a faster CI machine finished the job on 2 ranks; with 3 epochs about 100 steps
  are left. On a quiet machine the 2 ranks train within a second of the removal's announcement, so (d) can be
  announced in the same whole second: stock Horovod 0.28.1 stamps its announcements in whole seconds and
  every rank would drop it; our build of Horovod stamps them in fractional seconds (scripts/patch_horovod.sh,
  fix 3). Horovod picks the first ranks' hosts in an arbitrary order, so the removed h2 is sometimes rank 0
  (the coordinator): that case passes too.

The SIGKILL comes late in the run (epoch 3 of 3) on purpose: with a sparse compressor a smaller world sends
fewer entries per step (each rank's top 1%), and a lost rank's residual is lost, so the longer a short run
trains on 2 ranks the further it ends from the 3-rank run; faults after the step-20 commit measured -0.57 to
-0.97 points of accuracy in 120 steps.

Checks per run: horovodrun exits 0, the summary says both epochs were trained, the expected world sizes in
order, every membership's ranks start bitwise identical (the ``synced`` digest) and agree at every commit and at
the end, the final test accuracy (on the whole test set) within 1 point of the reference, the time from the
fault to the first completed step after it under 60 s (printed), nothing left on any host. For (a) the test
prints what the lost rank held: its last residual norm against its gradient norm of that step.

Skipped only where namespaces cannot be made (not root, no CAP_NET_ADMIN). Settings (``ENV``):
``HOROVOD_GLOO_TIMEOUT_SECONDS=10`` (a survivor that was not connected to the killed rank waits in its
collective until Gloo's timeout: 30.8 s from the SIGKILL to training again with the default 30 s, 0.5-11.4 s
with 10 s) and ``HOROVOD_FUSION_THRESHOLD=0`` (reproducible runs, so the accuracy difference is the fault's).
The link-down fault (b) is in benchmarks/elastic_faults.py (docs/elastic): survived once the driver's ssh
sessions have a keepalive (the cluster's ssh drop-in), else no new membership forms.
Measured with 2 epochs: 3 min 42 s for the module (runs of 64-72 s), 7 min 51 s at load average 14-17 on the 2 shared
cores (runs of 130-160 s, each mostly start-up of 3 ranks); with 3 epochs on a quiet machine, 2 min 15 s (runs of
38-48 s).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster, module_cluster
from tests.elastic_runs import ElasticRun, analyse, job_args, lost_residual

SAMPLES, EPOCHS, COMMIT = 11520, 3, 10  # a global batch of 192: 60 steps per epoch whatever the world size
TIMEOUT = 300  # one run, launch to exit, on a loaded 2-core machine
RECOVERY_LIMIT = 60.0
STEP_SECONDS = 0.3  # about one step of 3 ranks here
# The run ends at about 80% accuracy, still on the steep part of its curve, so a different membership history
# (batch 96 per rank while 2 ranks train, a new worker with no residual) moves the end by seed-noise amounts:
# a CI run on a slower 2-core machine, h2 written back at step 80, ended +0.78 points above the reference.
# Broken state transfers are caught exactly (the membership digests); this bound catches lost training.
ACCURACY_TOLERANCE = 0.01
# Gloo's timeout bounds how long a survivor that was not connected to the lost rank waits in its collective
# (10 s; Gloo's default of 30 s measured 30.8 s from the SIGKILL to training again). Tensor fusion off: with
# more than 2 ranks the fused buffer's layout depends on timing and changes the sums in the last bits, so two
# fault-free runs differed by up to 0.9 points of accuracy; without it a run is reproducible and the accuracy
# difference is the fault's.
ENV = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10", "HOROVOD_FUSION_THRESHOLD": "0"}
ARGS = job_args(SAMPLES, EPOCHS, COMMIT)


@pytest.fixture(scope="module")
def cluster():
    yield from module_cluster(3, f"ea{os.getpid() % 10 ** 6}", link="1gbit", loopback_names=True)


def check_run(run: ElasticRun, rc, sizes, faults=None) -> dict:
    """The checks every run passes; returns the analysis."""
    out = run.output()
    assert rc is not None, f"timed out after {TIMEOUT}s and was killed\n{out[-8000:]}"
    assert rc == 0, f"horovodrun exited {rc}\n{out[-8000:]}"
    final = run.final()
    assert final is not None and final["epoch"] == EPOCHS, f"the job did not finish its epochs: {final}\n{out[-4000:]}"
    assert final["test_examples"] == 10000, final
    got = analyse(run.events(), faults or {})
    assert got["world_sizes"] == sizes, f"memberships {got['memberships']}\n{out[-6000:]}"
    for ms in got["memberships"]:
        assert ms["ranks_synced"] == ms["size"] and ms["synced_identical"], f"membership not identical: {ms}"
    assert got["disagreements"] == [], got["disagreements"]
    assert got["ends"] == sizes[-1], f"{got['ends']} ranks ended, expected {sizes[-1]}"
    assert run.left_behind == {}, f"processes left on the hosts: {run.left_behind}"
    return got


@pytest.fixture(scope="module")
def reference(cluster: Cluster, tmp_path_factory) -> dict:
    run = ElasticRun(cluster, tmp_path_factory.mktemp("reference"), ARGS, env=ENV).start()
    rc = run.wait(TIMEOUT)
    print(f"fault-free 3-host elastic run: {run.seconds:.1f} s")
    check_run(run, rc, [3])
    return run.final()


def close_to_reference(final: dict, reference: dict, what: str) -> None:
    diff = final["test_accuracy"] - reference["test_accuracy"]
    print(f"{what}: final test accuracy {100 * final['test_accuracy']:.2f}% vs fault-free "
          f"{100 * reference['test_accuracy']:.2f}% ({100 * diff:+.2f} pt)")
    assert abs(diff) <= ACCURACY_TOLERANCE, f"{what}: accuracy {final['test_accuracy']} vs {reference['test_accuracy']}"


def _sigkill_run(cluster: Cluster, outdir: Path):
    run = ElasticRun(cluster, outdir, ARGS, env=ENV).start()
    try:
        run.wait_for_commit(140, 3, TIMEOUT)
        time.sleep(STEP_SECONDS * COMMIT / 2)  # between two commits: the survivors replay the steps since the last
        victims = [p.pid for p in run.ranks_on(2)]
        t_fault = run.kill_host_ranks(2)
    finally:
        rc = run.wait(TIMEOUT)
    return run, rc, victims, t_fault


def test_sigkill_one_host_mid_epoch(cluster: Cluster, reference: dict, tmp_path: Path):
    run, rc, victims, t_fault = _sigkill_run(cluster, tmp_path / "run1")
    if rc is None:
        # Known intermittent (about 1 run in 4 on the 2 shared cores, not reproduced on demand): a survivor logs
        # Gloo's "Connection closed by peer" and its collective never returns, inside Horovod. Shown, then the
        # run is tried once more; a second hang fails the test.
        print(f"(a) run 1 hung after the SIGKILL and was killed after {TIMEOUT} s; its log's end:\n"
              f"{run.output()[-3000:]}\n(a) trying once more")
        run, rc, victims, t_fault = _sigkill_run(cluster, tmp_path / "run2")
    got = check_run(run, rc, [3, 2], {"sigkill": t_fault})
    seconds, shrunk = got["recovery"]["sigkill"], got["memberships"][1]
    lost = lost_residual(run.events(), victims)
    print(f"(a) SIGKILL of h2's rank: training again after {seconds:.1f} s on {shrunk['size']} ranks from step "
          f"{shrunk['start_step']} ({got['memberships'][0]['replayed']} steps replayed); run {run.seconds:.1f} s")
    print(f"(a) the lost rank's last residual (step {lost['step']}): norm {lost['residual_norm']:.4f} against its "
          f"gradient norm {lost['grad_norm']:.4f} of that step ({lost['ratio']:.2f}x)")
    assert seconds is not None and seconds <= RECOVERY_LIMIT, got["recovery"]
    assert 0 <= got["memberships"][0]["replayed"] <= COMMIT
    assert shrunk["hosts"] == sorted(h.name for h in cluster.hosts[:2])
    close_to_reference(run.final(), reference, "(a)")


def test_remove_then_add_back_a_host(cluster: Cluster, reference: dict, tmp_path: Path):
    run = ElasticRun(cluster, tmp_path, ARGS, env=ENV).start()
    try:
        run.wait_for_commit(60, 3, TIMEOUT)
        t_removed = run.set_hosts([0, 1])  # Horovod tells the ranks within seconds; they see it at a commit
        run.wait_for_membership(2, TIMEOUT)  # as soon as the 2 ranks train (they see it 1-2 commits later)
        # Often within the second in which the removal was announced: stock Horovod 0.28.1 stamps announcements
        # in whole seconds and would drop this one; scripts/patch_horovod.sh fixes that.
        t_added = run.set_hosts([0, 1, 2])
    finally:
        rc = run.wait(TIMEOUT)
    last = max((e["step"] for e in run.events() if e["event"] == "commit" and e["time"] <= t_added), default=0)
    print(f"(d) h2 written back after the step-{last} commit, {EPOCHS * SAMPLES // 192 - last} steps before the end")
    got = check_run(run, rc, [3, 2, 3], {"removed": t_removed, "added": t_added})
    ms = got["memberships"]
    print(f"(c) h2 removed from discovery: training on 2 ranks after {got['recovery']['removed']:.1f} s from step "
          f"{ms[1]['start_step']}; (d) added back: training on 3 ranks after {got['recovery']['added']:.1f} s "
          f"from step {ms[2]['start_step']}; run {run.seconds:.1f} s")
    for what in ("removed", "added"):
        assert got["recovery"][what] is not None and got["recovery"][what] <= RECOVERY_LIMIT, got["recovery"]
    assert [m["replayed"] for m in ms] == [0, 0, 0], ms  # a host change is seen at a commit: nothing replayed
    assert ms[2]["hosts"] == sorted(h.name for h in cluster.hosts)
    close_to_reference(run.final(), reference, "(c)+(d)")


@pytest.mark.parametrize("argv, message", [
    (["--elastic", "--max-steps", "10"], "drop --max-steps"),
    (["--elastic", "--commit-every", "0"], "--commit-every must be >= 1"),
    (["--elastic", "--checkpoint-dir", "x", "--checkpoint-every", "15", "--commit-every", "10"],
     "must be a multiple of --commit-every"),
    (["--elastic", "--tensorboard", "x"], "rank 0, which writes it, may change"),
    (["--elastic-log", "x"], "--elastic-log needs --elastic"),
    (["--train-samples", "0"], "--train-samples must be >= 1"),
])
def test_elastic_flags_that_cannot_work_exit_2_with_the_reason(argv, message, capsys):
    from examples.job import options
    with pytest.raises(SystemExit) as exc:
        options.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
