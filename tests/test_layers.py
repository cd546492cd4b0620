"""The layering rules of the package, checked on its source and on the small shared pieces:

- Horovod is called only by ``communicator.py`` (collectives, sizes, ranks); elsewhere ``hvd.`` names only
  Horovod's constants and types (``hvd.Sum``, ``hvd.Average``, ``hvd.global_process_set``, ...), and the elastic
  handler is registered in ``elastic.py`` alone;
- an exchange kind is declared by the compressor (``exchange_kind``), never detected by ``hasattr``;
- both optimizer classes keep their elastic bookkeeping in one :class:`horovod_adtopk.elastic.Membership`,
  whose residual rescaling is checked here against numpy.
"""
import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import horovod_adtopk as hat
from horovod_adtopk import elastic, lowrank
from horovod_adtopk.memory import ErrorFeedback

pytestmark = pytest.mark.quick
PACKAGE = Path(hat.__file__).resolve().parent


def _sources():
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _horovod_calls(path: Path):
    """``hvd.<name>(...)`` calls and ``horovod...`` function calls in a module (names bound to Horovod modules)."""
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name.startswith("horovod.")}
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases:
            calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.func.value.id}.{node.func.attr}()")
    return calls


def test_only_the_communicator_calls_horovod():
    calls = [c for p in _sources() if p.name != "communicator.py" or p.parent != PACKAGE for c in _horovod_calls(p)]
    assert calls == [], "Horovod called outside communicator.py:\n" + "\n".join(calls)
    # the detector itself finds the communicator's calls (so an empty list above means something)
    assert any("hvd.allgather_async()" in c for c in _horovod_calls(PACKAGE / "communicator.py"))


def test_elastic_handler_registered_in_one_place():
    users = [p.relative_to(PACKAGE).as_posix() for p in _sources() if "set_handler_registry" in p.read_text()]
    assert users == ["elastic.py"]


def test_exchange_kinds_are_declared_not_detected():
    offenders = [p.relative_to(PACKAGE).as_posix() for p in _sources()
                 if "hasattr(compression, \"make_exchange\")" in p.read_text() or "make_exchange" in p.read_text()]
    assert offenders == []
    assert lowrank.runs_own_rounds(hat.Compression.powersgd(rank=2))
    for c in (hat.Compression.adtopk(ratio=0.01), hat.Compression.topk(ratio=0.01), hat.Compression.randomk(ratio=0.1),
              hat.Compression.none, hat.Compression.fp16, None):
        assert not lowrank.runs_own_rounds(c), c


def test_membership_rescales_residuals_like_numpy():
    rng = np.random.default_rng(57)
    memory = ErrorFeedback()
    ref = {}
    for name, shape in (("a", (4, 6)), ("b", (10,))):
        g = rng.standard_normal(shape).astype(np.float32)
        memory.compensate(name, torch.from_numpy(g.copy()))
        ref[name] = g.copy()
    members = elastic.Membership(4, enabled=True)
    assert not members.changed_without_sync(4) and members.changed_without_sync(3)
    assert not elastic.Membership(4, enabled=False).changed_without_sync(3)
    assert members.synced() is False  # the first sync starts the job
    members.moved_to(4, memory, force=False)  # same size, not forced: nothing recorded, nothing scaled
    assert members.report()["membership_changes"] == 0
    members.moved_to(3, memory)  # 4 -> 3 ranks: residuals * 3/4
    assert members.synced() is True
    members.moved_to(6, memory)  # 3 -> 6: * 6/3
    for name, r in ref.items():
        want = (r * np.float32(3 / 4)) * np.float32(6 / 3)
        np.testing.assert_allclose(memory.residuals[name].numpy(), want, rtol=1e-6)
    rep = members.report()
    assert rep == {"membership_changes": 2, "syncs": 2, "world_sizes": [4, 3, 6], "residual_scale": [0.75, 2.0]}
    rep["world_sizes"].append(99)  # a copy: the optimizer's record is not reachable through stats()
    assert members.report()["world_sizes"] == [4, 3, 6] and members.world == 6


def test_no_file_edits_the_import_path():
    """What several places import belongs in the library, a test helper or an importable package: no tracked
    Python file inserts into ``sys.path`` (benchmarks use ``common.repo_package``, tests ``example_module``)."""
    import re
    import subprocess

    repo = PACKAGE.parent
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=repo, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    edit = re.compile(r"sys\.path\s*(\.\s*(insert|append|extend|remove|pop)\b|\[[^\]]*\]\s*=|\+=|=[^=])")
    offenders = [f"{f}:{n}" for f in files for n, line in enumerate((repo / f).read_text().splitlines(), 1)
                 if edit.search(line)]
    assert offenders == [], offenders
    stem = "sys." + "path"  # the detector finds both forms (written split so that this file is not a hit)
    assert edit.search(stem + ".insert(0, here)") and edit.search(stem + "[:0] = [a]")
