"""examples/minimal.py, the first example a user reads, run as a user runs it: ``horovodrun -np 2``.

From a folder outside the repository and without PYTHONPATH, so the script needs nothing but torch, Horovod
and the installed package. One epoch of Fashion-MNIST on 2 ranks (about 15 s on 2 idle cores), under a timeout
that kills the whole process tree.
"""
from __future__ import annotations

import re
import sys

from tests.harness import HOROVODRUN, REPO, run_command

MINIMAL = str(REPO / "examples" / "minimal.py")
TIMEOUT = 240


def test_minimal_example_trains_and_compresses(tmp_path):
    cmd = [HOROVODRUN, "-np", "2", "--gloo", sys.executable, MINIMAL]
    rc, out, _ = run_command(cmd, timeout=TIMEOUT, env={"HOROVOD_CYCLE_TIME": "1", "PYTHONPATH": ""},
                             cwd=str(tmp_path))
    assert rc is not None, f"timed out after {TIMEOUT}s and was killed\n{out[-4000:]}"
    assert rc == 0, f"exit {rc}\n{out[-4000:]}"

    epochs = re.findall(r"epoch 1: train loss ([0-9.]+), test accuracy ([0-9.]+)", out)
    assert len(epochs) == 1, f"expected one epoch line, from rank 0 only\n{out[-4000:]}"
    loss, accuracy = map(float, epochs[0])
    assert accuracy > 0.6, f"test accuracy {accuracy} (chance: 0.1; about 0.84 measured)\n{out[-4000:]}"
    assert loss < 1.0

    traffic = re.findall(r"link carried ([0-9.]+) MB sent / ([0-9.]+) MB received instead of ([0-9.]+) MB for a "
                         r"dense allreduce at (\d+) ranks \((\d+)x less\), density ([0-9.]+)", out)
    assert len(traffic) == 1, out[-4000:]
    sent, received, dense = map(float, traffic[0][:3])
    world, factor, density = int(traffic[0][3]), int(traffic[0][4]), float(traffic[0][5])
    # ADTopk at ratio 0.01 at 2 ranks: each rank receives the other's values + int16 indices of 1% of the
    # entries (the biases allreduced), against a ring allreduce's 2 (W-1)/W = 1 x the fp32 gradient each way
    assert world == 2 and sent == received, traffic
    assert 0 < sent < dense / 20 and factor >= 20, traffic
    assert 0.005 < density < 0.05, traffic


def test_minimal_example_says_how_to_get_the_data(tmp_path):
    rc, out, _ = run_command([sys.executable, MINIMAL, "--data-dir", str(tmp_path)], timeout=TIMEOUT,
                             env={"PYTHONPATH": ""}, cwd=str(tmp_path))
    assert rc == 1, f"exit {rc}\n{out[-4000:]}"
    assert "apt-get install dataset-fashion-mnist" in out and "Traceback" not in out


def test_readme_shows_the_lines_of_the_script():
    """The README's first Python block is an excerpt of examples/minimal.py: every line of it is in the script."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    script = (REPO / "examples" / "minimal.py").read_text()
    code = {line.split("  #")[0].rstrip() for line in script.splitlines()}
    shown = [line.split("  #")[0].rstrip() for line in block.splitlines() if line.strip()]
    assert "hat.DistributedOptimizer(optimizer, named_parameters=model.named_parameters()," in block
    missing = [line for line in shown if line not in code]
    assert not missing, f"README lines not in examples/minimal.py: {missing}"
