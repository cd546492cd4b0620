"""Issue 56: a rank that finished must exit 0; ``horovod_adtopk.ddp.teardown`` lets Gloo's workers finish first.

The abort (a ``pt_gloo_runloop`` thread asking for the GIL after the interpreter began finalizing) is a race;
what is checked here deterministically is the waiting itself, on real threads named as PyTorch names Gloo's
workers: it returns only once every such thread sleeps, and gives up after its timeout. The examples and the
training job exit 0 in tests/test_integrations.py and tests/test_ddp.py (no tolerance, no retry), the DDP
tests' ranks end through ``hat.ddp.shutdown()`` (tests/_ddp_launch.py), and
benchmarks/bench_clean_exit.py launches them many times under load.
"""
import ctypes
import os
import sys
import threading
import time

import pytest

from horovod_adtopk.ddp import teardown
from tests.harness import REPO, run_command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task (Linux)")


def named_worker(body) -> threading.Thread:
    """A thread named like Gloo's workers (``prctl(PR_SET_NAME)``) running ``body``."""
    named = threading.Event()

    def run():
        ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)
        named.set()
        body()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert named.wait(10)
    return thread


def test_idle_or_no_workers_return_at_once():
    """No worker thread (or only idle ones, left by a group another test built in this process): True at once."""
    start = time.monotonic()
    assert teardown.wait_for_gloo_workers(timeout=5)
    assert time.monotonic() - start < 1.0


def test_waits_until_a_busy_worker_sleeps():
    """A worker that keeps running for 0.6 s (as one dropping a collective, GIL and all), then sleeps on an
    event: the wait ends after it went to sleep, not before."""
    release = threading.Event()
    busy_until = time.monotonic() + 0.6

    def body():
        x = 0
        while time.monotonic() < busy_until:
            x += 1
        release.wait()

    thread = named_worker(body)
    assert teardown.gloo_worker_count() >= 1
    assert teardown.wait_for_gloo_workers(timeout=20)
    assert time.monotonic() >= busy_until
    release.set()
    thread.join(5)


def test_gives_up_after_the_timeout():
    """A worker that never sleeps: False after about ``timeout`` seconds (an exit is delayed, never hung)."""
    stop = time.monotonic() + 3.0

    def body():
        while time.monotonic() < stop:
            pass

    thread = named_worker(body)
    start = time.monotonic()
    assert teardown.wait_for_gloo_workers(timeout=0.3) is False
    assert 0.3 <= time.monotonic() - start < 2.0
    thread.join(5)


def test_plain_ddp_script_with_the_workaround_exits_0():
    """The troubleshooting page's reproducer (no horovod_adtopk in it) with ``--workaround``, under torchrun:
    every rank finishes and exits 0."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    rc, log, _ = run_command([torchrun, "--standalone", "--nproc-per-node", "2",
                              str(REPO / "docs" / "clean_exit" / "gloo_exit_abort.py"), "--workaround"],
                             timeout=240, env={"GLOO_SOCKET_IFNAME": "lo"})
    assert rc == 0, log[-6000:]
    assert "rank 0 done" in log and "rank 1 done" in log, log[-6000:]
