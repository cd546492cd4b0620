"""The payload layer on real ranks (DDP's Gloo process group at 3 ranks, Horovod at 2): the built-in dense sum
and bfloat16 gather, and an int8 wire kind defined only in tests/payload_workers.py (a new kind plugs into
:func:`horovod_adtopk.payload.run` without any engine file), against numpy: values and the bytes ``Stats``
counted for the collective each kind uses."""
from __future__ import annotations

import numpy as np
import pytest

from tests.payload_workers import SHAPES, inputs
from tests.test_sharded import run_ddp


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even) -> float32, on the bits."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def int8(x: np.ndarray):
    scale = np.float32(np.abs(x).max()) / np.float32(127)
    return scale, np.clip(np.round(x / scale), -127, 127).astype(np.int8)


def reference(world: int) -> dict:
    xs = [inputs(r) for r in range(world)]
    out = {}
    for name in SHAPES:
        out[f"dense.{name}"] = sum(x[name].astype(np.float64) for x in xs) / world
        total = np.zeros(xs[0][name].size, np.float32)
        for x in xs:  # rank order, float32
            total += bf16(x[name].reshape(-1))
        out[f"bf16.{name}"] = total * np.float32(1.0 / world)
        total = np.zeros(xs[0][name].size, np.float32)
        for x in xs:
            scale, codes = int8(x[name].reshape(-1))
            total += codes.astype(np.float32) * scale
        out[f"int8.{name}"] = total * np.float32(1.0 / world)
    return out


def expected_traffic(world: int, name: str) -> list:
    kind, tensor = name.split(".")
    n = int(np.prod(SHAPES[tensor]))
    if kind == "dense":  # ring allreduce: 2 (W-1)/W of the payload each way, in W chunks
        payload = 4 * n
        chunk = -(-payload // world)
        return [payload, 2 * (world - 1) * min(chunk, payload), 2 * (world - 1) * min(chunk, payload)]
    payload = 2 * n if kind == "bf16" else 4 + n
    return [payload, (world - 1) * payload, (world - 1) * payload]


def check(results, world):
    ref = reference(world)
    for r, res in enumerate(results):
        assert res["world"] == world and res["rank"] == r
        assert sorted(res["out"]) == sorted(ref)
        for name, want in ref.items():
            got = np.asarray(res["out"][name], dtype=np.float32)
            np.testing.assert_array_equal(got, np.asarray(results[0]["out"][name], np.float32), err_msg=name)
            if name.startswith("dense"):
                np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-6, atol=1e-6, err_msg=name)
            else:  # decoded and summed in rank order: the same float32 arithmetic as numpy's
                np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-7, atol=1e-7, err_msg=name)
        for name, counted in res["traffic"].items():
            kind = name.split(".")[0]
            want = expected_traffic(world, name)
            if kind == "dense":
                assert counted[0] == want[0] and abs(counted[1] - want[1]) <= 2 * world, (name, counted, want)
            else:
                assert counted == want, (name, counted, want)


def test_kinds_on_ddp_ranks_match_numpy():
    check(run_ddp("payload_workers:ddp_kinds", 3, {}, timeout=180), 3)


def test_kinds_on_horovod_ranks_match_numpy():
    from tests.harness import run_ranks
    check(run_ranks("payload_workers:horovod_kinds", np=2, timeout=180), 2)
