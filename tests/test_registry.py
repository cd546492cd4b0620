"""The registry is the one source of compressor names, summaries and accepted options."""
import re
from pathlib import Path

import pytest
import torch

import horovod_adtopk as hat
from horovod_adtopk.compressors import SparseCompressor

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_table() -> dict:
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"^\| `([a-z0-9_]+)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2).replace("\\|", "|")
    return rows


def test_readme_table_is_the_registry():
    assert readme_table() == hat.Compression.summaries()


def test_every_registered_compressor_is_reachable_and_documented():
    for name in hat.Compression.sparse_names():
        cls = getattr(hat.Compression, name)
        assert issubclass(cls, SparseCompressor) and cls.name == name and cls.summary
    assert hat.Compression.names()[:2] == ["none", "fp16"]
    with pytest.raises(AttributeError, match="choose one of"):
        hat.Compression.nosuch


def test_from_options_passes_only_what_a_compressor_takes():
    flags = dict(ratio=0.05, value_dtype=torch.float16, threshold=None, min_numel=64, momentum=0.9, seed=3,
                 density_warmup=10, density_start=0.5, rank=2)
    ad = hat.Compression.from_options("adtopk", **flags)
    assert (ad.ratio, ad.value_dtype, ad.min_numel, ad.momentum, ad.density_warmup) == \
        (0.05, torch.float16, 64, 0.9, 10)
    rk = hat.Compression.from_options("randomk", **flags)
    assert rk.seed == 3
    ps = hat.Compression.from_options("powersgd", **{**flags, "density_warmup": 0})
    assert (ps.rank, ps.min_numel, ps.seed) == (2, 64, 3)
    assert hat.Compression.from_options("none", **flags) is hat.Compression.none
    with pytest.raises(ValueError):
        hat.Compression.from_options("adtopk", ratio=0.0)
