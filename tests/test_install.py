"""The package as a user gets it: installed into the environment, used from a script outside the repository.

No PYTHONPATH, the working directory a temporary folder outside the checkout, the script launched by
``horovodrun -np 2 --gloo`` as a user would. The job runs in its own session under a timeout that kills
the whole process tree (tests.harness.kill_tree), so a hung rank fails the test instead of CI.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.harness import HOROVODRUN, REPO, kill_tree

TIMEOUT = 150

USER_SCRIPT = textwrap.dedent('''
    import torch
    import horovod.torch as hvd
    import horovod_adtopk as hat

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size())
    opt = hat.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hat.Compression.adtopk(ratio=0.1, min_numel=1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(1 + hvd.rank())
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
    for step in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    stats = opt.stats()
    if hvd.rank() == 0:
        print("USER_RESULT", hvd.size(), round(float(loss.detach()), 4), stats["density"], stats["bytes_sent"], flush=True)
        print("PACKAGE_FILE", hat.__file__, flush=True)
''')


def user_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HOROVOD_CYCLE_TIME="1", PYTHONUNBUFFERED="1",
               # the environment's own bin first, as after `source .venv/bin/activate`
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""))
    return env


def run_as_user(cmd, cwd: Path):
    """(returncode or None on timeout, output): in its own session, process tree killed at the end."""
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=str(cwd), env=user_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        kill_tree(proc)
        log.seek(0)
        return rc, log.read().decode(errors="replace")


@pytest.fixture
def outside() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="hat-user-"))
    assert REPO not in folder.resolve().parents, f"{folder} lies inside the repository"
    yield folder
    import shutil
    shutil.rmtree(folder, ignore_errors=True)


def expected_package_dir() -> Path:
    return REPO / "horovod_adtopk"


def check_package_file(printed: str) -> None:
    path = Path(printed.strip()).resolve()
    assert path.name == "__init__.py" and path.parent.name == "horovod_adtopk", path
    if REPO in Path(sys.prefix).resolve().parents:
        # The README's set-up: .venv inside this checkout, package installed from it in editable mode.
        assert path.parent == expected_package_dir(), f"imported {path}, not this repository's package"
    else:
        # An environment shared with another checkout: the package comes from an editable install of
        # some checkout, not from a copy in site-packages.
        assert "site-packages" not in path.parts, f"imported a copy from site-packages: {path}"


def test_import_from_outside_the_repository(outside):
    start = time.monotonic()
    rc, out = run_as_user([sys.executable, "-c", "import horovod_adtopk as hat; print('PACKAGE_FILE', hat.__file__); "
                                                 "print('NAMES', ','.join(hat.Compression.names()))"], outside)
    assert rc == 0, (f"`python -c 'import horovod_adtopk'` fails outside the repository (is the package "
                     f"installed? scripts/setup.sh installs it): exit {rc}\n{out[-4000:]}")
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("PACKAGE_FILE", "NAMES")))
    check_package_file(lines["PACKAGE_FILE"])
    assert "adtopk" in lines["NAMES"].split(",")
    assert time.monotonic() - start < TIMEOUT


def test_user_script_under_horovodrun(outside):
    (outside / "user_script.py").write_text(USER_SCRIPT)
    rc, out = run_as_user([HOROVODRUN, "-np", "2", "--gloo", sys.executable, "user_script.py"], outside)
    assert rc is not None, f"horovodrun timed out after {TIMEOUT}s and was killed\n{out[-6000:]}"
    assert rc == 0, f"user script failed under horovodrun (exit {rc})\n{out[-6000:]}"
    result = [line for line in out.splitlines() if "<stdout>:USER_RESULT" in line or line.startswith("USER_RESULT")]
    assert len(result) == 1, out[-4000:]  # rank 0 only
    size, loss, density, bytes_sent = result[0].split("USER_RESULT", 1)[1].split()
    assert int(size) == 2 and float(loss) > 0
    assert 0 < float(density) < 0.5 and float(bytes_sent) > 0  # the sparse path was used
    package = [line for line in out.splitlines() if "PACKAGE_FILE /" in line]
    check_package_file(package[0].split("PACKAGE_FILE", 1)[1])
