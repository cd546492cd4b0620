"""scripts/horovod_gpu_kit.sh where there is no GPU and no network: its modes' arguments, the `prepare` of a kit from
a local sdist, and the `dry` mode (the sums, the patch applied to a scratch copy, the environment a GPU build
would export).

Two kits: a tiny sdist made here holding only the lines scripts/patch_horovod.sh edits (always runs), and the real
Horovod 0.28.1 sdist where one is on this machine: the kit's own (build/gpu_kit/, written by `prepare`) or the one
scripts/setup.sh keeps beside its cached wheel. About 10 s.
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.harness import REPO

SCRIPT = REPO / "scripts" / "horovod_gpu_kit.sh"
SDIST = "horovod-0.28.1.tar.gz"
#: the sha256 of the Horovod 0.28.1 sdist; the kit's SHA256SUMS must name the same file
SDIST_SHA256 = "92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"

#: the lines of the 0.28.1 sources that scripts/patch_horovod.sh edits, in files of the same names
TINY_FILES = {
    "setup.py": "# stand-in\n",
    "CMakeLists.txt": "project(horovod)\nset(CMAKE_CXX_STANDARD 14)\n",
    "horovod/torch/CMakeLists.txt": "set(CMAKE_CXX_STANDARD 14)\n",
    "third_party/gloo/CMakeLists.txt": 'set(CMAKE_CXX_FLAGS "${CMAKE_CXX_FLAGS} -std=c++11 -fPIC")\n',
    "horovod/common/gloo/gloo_context.cc": (
        "void GlooContext::InitializeForProcessSet(const GlooContext& global_context,\n"
        "                                          const std::vector<int>& registered_ranks) {\n"
        "  gloo::transport::tcp::attr device_attr;\n"
        "  device_attr.iface = gloo_iface_;\n"
        "  device_attr.ai_family = AF_UNSPEC;\n"
        "  auto dev = CreateDevice(device_attr);\n"
        "}\n"),
    "horovod/runner/elastic/driver.py": "import time\n\n\ndef _epoch_time_s():\n    return int(time.time())\n",
}


def make_sdist(path: Path, files: dict) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"horovod-0.28.1/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def kit(mode: str, kit_dir: Path, sdist: Path | None = None, timeout: float = 60, variant: str | None = None):
    env = dict(os.environ, HOROVOD_GPU_KIT_DIR=str(kit_dir), PY=sys.executable)
    env.pop("HOROVOD_GPU_KIT_SDIST", None)
    if sdist is not None:
        env["HOROVOD_GPU_KIT_SDIST"] = str(sdist)
    proc = subprocess.run(["bash", str(SCRIPT), mode, *([variant] if variant else [])], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO))
    return proc.returncode, proc.stdout + proc.stderr


def real_sdist() -> Path | None:
    cache = Path(os.environ.get("HOROVOD_ADTOPK_CACHE", Path.home() / ".cache" / "horovod_adtopk"))
    for cand in [REPO / "build" / "gpu_kit" / SDIST, *sorted(cache.glob(f"*/{SDIST}"))]:
        if cand.is_file():
            return cand
    return None


def check_dry_output(out: str, variant: str = "nccl") -> None:
    assert "sums ok" in out and "patch applies cleanly" in out and "a second run of the patch changes nothing" in out
    common = ("export HOROVOD_BUILD_CUDA_CC_LIST=90", "export HOROVOD_WITH_PYTORCH=1", "export HOROVOD_WITH_GLOO=1",
              "export HOROVOD_WITHOUT_TENSORFLOW=1", "export HOROVOD_WITHOUT_MXNET=1",
              "export CMAKE_POLICY_VERSION_MINIMUM=3.5", f"export MAKEFLAGS=-j{os.cpu_count()}")
    nccl = ("export HOROVOD_GPU_OPERATIONS=NCCL", "export HOROVOD_NCCL_LINK=SHARED")
    for line in common:
        assert line in out, line
    for line in nccl:  # cpuops: no GPU operation and no NCCL variable may reach Horovod's CMake
        assert (line in out) == (variant == "nccl"), (variant, line)
    if variant == "cpuops":
        assert "export HOROVOD_GPU=CUDA" in out
        assert "export HOROVOD_NCCL" not in out and "export HOROVOD_GPU_OPERATIONS" not in out
        assert "variant cpuops: no GPU operations, no NCCL" in out
    else:
        assert "export HOROVOD_GPU=" not in out
    mpi = "export HOROVOD_WITH_MPI=1" if shutil.which("mpicxx") else "export HOROVOD_WITHOUT_MPI=1"
    assert mpi in out
    assert "nvcc: " in out and "NCCL (python package nvidia.nccl" in out and "driver libcuda.so.1: " in out
    assert "CMake configure: skipped" in out and "[gpu_kit] dry run ok" in out, out[-3000:]


def test_modes_and_usage(tmp_path):
    rc, out = kit("--help", tmp_path / "kit")
    assert rc == 0 and "prepare" in out and "dry" in out and "build" in out, out
    rc, out = kit("compile", tmp_path / "kit")
    assert rc != 0 and "unknown mode 'compile'" in out, out
    rc, out = kit("dry", tmp_path / "absent")
    assert rc != 0 and "SHA256SUMS missing" in out, out
    rc, out = kit("dry", tmp_path / "absent", variant="mpi")
    assert rc != 0 and "unknown variant 'mpi'" in out, out
    rc, out = kit("--help", tmp_path / "kit")
    assert "cpuops" in out and "horovodrun -np 2 --gloo" in out, out


def test_dry_on_a_tiny_kit(tmp_path):
    sdist = make_sdist(tmp_path / SDIST, TINY_FILES)
    kit_dir = tmp_path / "kit"
    rc, out = kit("prepare", kit_dir, sdist)
    assert rc == 0, out
    assert 'carry: ["' in out and "bash scripts/horovod_gpu_kit.sh build" in out, out
    assert (kit_dir / "SHA256SUMS").read_text().split() == [
        subprocess.run(["sha256sum", str(sdist)], capture_output=True, text=True).stdout.split()[0], SDIST]
    rc, out = kit("dry", kit_dir)
    assert rc == 0, out
    check_dry_output(out)
    rc, out = kit("dry", kit_dir, variant="cpuops")
    assert rc == 0, out
    check_dry_output(out, "cpuops")
    # a changed file is caught by the sums
    make_sdist(kit_dir / SDIST, {**TINY_FILES, "setup.py": "# changed\n"})
    rc, out = kit("dry", kit_dir)
    assert rc != 0 and "do not match" in out, out


def test_prepare_fails_where_the_patch_does_not_apply(tmp_path):
    sdist = make_sdist(tmp_path / SDIST, {**TINY_FILES, "CMakeLists.txt": "project(horovod)\n"})
    rc, out = kit("prepare", tmp_path / "kit", sdist)
    assert rc != 0 and "did not apply" in out and "not found in CMakeLists.txt" in out, out


def test_dry_on_the_real_sdist(tmp_path):
    sdist = real_sdist()
    if sdist is None:
        pytest.skip(f"no {SDIST} on this machine: neither build/gpu_kit/ (bash scripts/horovod_gpu_kit.sh prepare) "
                    "nor scripts/setup.sh's wheel cache holds one (setup.sh keeps it when it builds the wheel)")
    digest = subprocess.run(["sha256sum", str(sdist)], capture_output=True, text=True).stdout.split()[0]
    assert digest == SDIST_SHA256, f"{sdist} is not the Horovod 0.28.1 sdist"
    kit_dir = tmp_path / "kit"
    rc, out = kit("prepare", kit_dir, sdist)
    assert rc == 0, out
    rc, out = kit("dry", kit_dir)
    assert rc == 0, out
    check_dry_output(out)
    rc, out = kit("dry", kit_dir, variant="cpuops")
    assert rc == 0, out
    check_dry_output(out, "cpuops")
