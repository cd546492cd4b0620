"""Issue 2: the multi-rank harness itself, with real Horovod on Gloo and MPI."""
import numpy as np
import pytest

from tests.harness import launch, run_ranks

CONTROLLERS = ["gloo", "mpi"]


@pytest.mark.parametrize("controller", CONTROLLERS)
@pytest.mark.parametrize("np_", [2, 3])
def test_allgather_uneven_and_allreduce(controller, np_):
    results = run_ranks("smoke_collectives", np=np_, controller=controller, timeout=90)
    expected_gather = np.concatenate([np.full((r + 1, 3), float(r)) + np.arange(3.0) for r in range(np_)])
    expected_sum = np.array([sum(r + 1 for r in range(np_)), sum(2.0 * r for r in range(np_))])
    for rank, res in enumerate(results):
        assert res["rank"] == rank and res["size"] == np_
        np.testing.assert_array_equal(np.array(res["gathered"]), expected_gather)
        np.testing.assert_array_equal(np.array(res["summed"]), expected_sum)


def test_hung_job_is_killed_within_timeout():
    # A worker that never returns: the harness must kill the whole job, not hang.
    rc, log, outdir, seconds = launch("hang_forever", np=2, controller="gloo", timeout=15)
    assert rc is None
    assert seconds < 45
