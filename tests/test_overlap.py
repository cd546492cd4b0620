"""The overlap worker (horovod_adtopk.overlap) on its own: order, errors, the setting's validation.

Its results against the numpy reference, through real gradient hooks on 2 Gloo ranks, and bitwise equality
with overlap=False over 100 training steps are in tests/test_optimizer.py.
"""
import threading

import pytest
import torch

import horovod_adtopk as hat
from horovod_adtopk import overlap
from horovod_adtopk.exchange import Exchange


class Recorded(Exchange):
    def __init__(self, log, i):
        self.log, self.i = log, i

    def finish(self):
        self.log.append(("finish", self.i))


def test_builds_run_in_submission_order_off_the_calling_thread_and_account_on_it():
    worker, log, accounted = overlap.Overlap(), [], []
    main = threading.get_ident()

    def build(i):
        log.append(("build", i, threading.get_ident() != main))
        return Recorded(log, i), ("t", i)

    deferred = [worker.submit(lambda i=i: build(i), (), lambda acc: accounted.append((acc, threading.get_ident())))
                for i in range(5)]
    for d in reversed(deferred):
        d.finish()
    worker.close()
    assert [e for e in log if e[0] == "build"] == [("build", i, True) for i in range(5)]
    assert [e for e in log if e[0] == "finish"] == [("finish", i) for i in reversed(range(5))]
    assert [a for a, _ in accounted] == [("t", i) for i in reversed(range(5))]
    assert all(tid == main for _, tid in accounted)
    assert worker.report()["exchanges"] == 5


def test_an_error_in_the_worker_is_raised_where_the_exchange_is_waited_for():
    worker = overlap.Overlap()

    def broken():
        raise RuntimeError("selection failed")

    d = worker.submit(broken, (), lambda acc: None)
    with pytest.raises(RuntimeError, match="selection failed"):
        d.finish()
    ok = worker.submit(lambda: (Recorded([], 0), None), (), lambda acc: None)
    ok.finish()  # the worker survives a failed build
    worker.drain()
    worker.close()


def test_setting_is_validated_and_auto_follows_spare_cores(monkeypatch):
    with pytest.raises(ValueError, match="overlap must be False, True or \"auto\""):
        overlap.check_setting("yes")
    assert overlap.make(False, 1) is None and isinstance(overlap.make(True, 64), overlap.Overlap)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(overlap.os, "sched_getaffinity", lambda pid: set(range(4)))
    assert isinstance(overlap.make("auto", 2), overlap.Overlap)  # 2 cores per rank, 1 torch thread
    assert overlap.make("auto", 4) is None  # 1 core per rank: nothing to spare


def test_distributed_optimizer_rejects_a_bad_overlap_setting():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="overlap must be"):
        hat.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                 compression=hat.Compression.adtopk(ratio=0.1), overlap="sometimes")
