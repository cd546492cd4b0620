"""Test cases shared by both engines' workers (Horovod ``tests/workers.py``, DDP ``tests/ddp_workers.py``):
parameters, compressors and per-rank gradients built identically, so the two engines can be compared
tensor by tensor. Imports no Horovod (the DDP workers run without it)."""
from __future__ import annotations

import hashlib

import torch

import horovod_adtopk as hat

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def case_params(case):
    """``{name: Parameter}`` of a case's ``shapes``, the same random values in every process."""
    dtype = DTYPES[case.get("dtype", "float32")]
    gen = torch.Generator().manual_seed(1234)
    params = torch.nn.ParameterDict()
    for name, shape in case["shapes"].items():
        params[name.replace(".", "__")] = torch.nn.Parameter(torch.randn(shape, generator=gen, dtype=dtype))
    return {name: params[name.replace(".", "__")] for name in case["shapes"]}


def case_compression(case):
    """The case's compressor (``none`` / ``fp16``: Horovod's dense compressors, None where it is absent)."""
    kind = case.get("compressor", "adtopk")
    if kind in ("none", "fp16"):
        return hat.Compression.get(kind)
    kwargs = dict(case.get("kwargs", {}))
    if "value_dtype" in kwargs and kwargs["value_dtype"] is not None:
        kwargs["value_dtype"] = DTYPES[kwargs["value_dtype"]]
    return hat.Compression.get(kind, **kwargs)


def local_gradient(case_index: int, rank: int, step: int, name: str, shape, dtype, scale: float = 1.0):
    """A rank's gradient of ``name`` at ``step``: seeded by all four, the same in every process."""
    seed = int(hashlib.sha256(f"{case_index}/{rank}/{step}/{name}".encode()).hexdigest()[:8], 16)
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)
