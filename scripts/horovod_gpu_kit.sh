#!/usr/bin/env bash
# Build Horovod 0.28.1 (scripts/patch_horovod.sh applied) with NCCL GPU operations and Gloo on a GPU machine that
# has no network, from files carried in the working tree.
#
#   bash scripts/horovod_gpu_kit.sh prepare   # here, with a network: the sdist and its sums into the kit folder
#   bash scripts/horovod_gpu_kit.sh dry       # here: everything but compiling (sums, patch, environment)
#   bash scripts/horovod_gpu_kit.sh build     # on the GPU machine, offline: build (or install a carried wheel)
#   bash scripts/horovod_gpu_kit.sh cpuops    # the same for a CUDA build with CPU operations (see below)
#   bash scripts/horovod_gpu_kit.sh dry cpuops  # here: `dry` for that build
#
# `cpuops` builds Horovod for the CUDA torch without GPU operations (HOROVOD_GPU_OPERATIONS unset, no NCCL): its
# torch ops stage CUDA tensors through host memory and run Horovod's CPU operations over Gloo, so that several
# ranks can share the one GPU (NCCL refuses two ranks on one GPU): `horovodrun -np 2 --gloo`. Its wheel has its own
# KEY (..._cpuops_...); installing it replaces the NCCL build in that Python, and `build` puts that one back (from
# the carried or the kit's wheel: seconds).
#
# The kit folder is build/gpu_kit/ (ignored by git; HOROVOD_GPU_KIT_DIR names another). It holds the sdist as
# downloaded, deps/ (the wheels `import horovod.torch` needs beyond torch, for a Python 3.12), SHA256SUMS and
# kit.txt; the patch is applied at build time from scripts/patch_horovod.sh (tracked, so it travels with the
# working tree), to a scratch copy. `build` writes the stripped wheel to
# wheels/KEY/ in the kit folder and, when $OUT is set, to $OUT/gpu_kit/wheels/KEY/ (copy that wheels/ folder into
# the kit folder here, and a later GPU run carries it and installs it instead of building). KEY names the Horovod
# version, the torch version, the Python tag and the patch's hash: a wheel is used only where all four match.
#
# Environment knobs:
#   PY                      the Python to build for (default: /opt/torch/.venv/bin/python3 where it exists,
#                           else python3; `dry` also tries pyenv's 3.12)
#   HOROVOD_GPU_KIT_DIR     the kit folder (default: build/gpu_kit in the repository)
#   HOROVOD_GPU_KIT_SDIST   `prepare` copies this local sdist instead of downloading one
#   HOROVOD_GPU_KIT_TIMEOUT seconds the compile may take (default 450; the whole `build` stays under ~9 minutes)
#   HOROVOD_BUILD_CUDA_CC_LIST  CUDA architectures (default 90: Hopper, the H100 and H200)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOROVOD_VERSION=0.28.1
scratch=""  # a temporary folder of dry and build, removed on exit
SDIST_NAME="horovod-$HOROVOD_VERSION.tar.gz"
KIT="${HOROVOD_GPU_KIT_DIR:-$ROOT/build/gpu_kit}"
GPU_PY_DEFAULT=/opt/torch/.venv/bin/python3
PATCH="$ROOT/scripts/patch_horovod.sh"
# What `import horovod.torch` and horovodrun import beyond torch (Horovod's own requirements), as wheels for
# CPython 3.12 on x86-64 Linux, installed on the GPU machine only where its Python lacks them.
DEPS="cloudpickle==3.1.3 packaging==26.4 psutil==7.2.2 pyyaml==6.0.4"
DEPS_PY=3.12
PATCH_HASH=$(sha256sum "$PATCH" | cut -c1-8)
VARIANT=nccl  # nccl: NCCL GPU operations (build); cpuops: CUDA tensors through the CPU operations (cpuops)

# the cores this process may use (nproc alone would follow OMP_NUM_THREADS)
JOBS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)

say() { echo "[gpu_kit] $*"; }
die() { echo "[gpu_kit] ERROR: $*" >&2; exit 1; }
usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

pick_python() {  # pick_python [try-pyenv]: the interpreter to build for, or empty
  if [ -n "${PY:-}" ]; then command -v "$PY" || true; return; fi
  if [ -x "$GPU_PY_DEFAULT" ]; then echo "$GPU_PY_DEFAULT"; return; fi
  if [ "${1:-}" = try-pyenv ]; then
    local root
    root=$( (command -v pyenv >/dev/null && pyenv root) 2>/dev/null || echo "$HOME/.pyenv")
    local p
    for p in "$root"/versions/3.12*/bin/python3; do
      [ -x "$p" ] && { echo "$p"; return; }
    done
  fi
  command -v python3 || true
}

small_scratch() {  # a temporary folder for the unpacked sdist alone: in memory where /dev/shm is writable
  if [ -d /dev/shm ] && [ -w /dev/shm ]; then mktemp -d -p /dev/shm; else mktemp -d; fi
}

check_sums() {  # the carried files match the manifest
  [ -f "$KIT/SHA256SUMS" ] || die "$KIT/SHA256SUMS missing: run 'bash scripts/horovod_gpu_kit.sh prepare' where there is a network"
  [ -f "$KIT/$SDIST_NAME" ] || die "$KIT/$SDIST_NAME missing: run 'bash scripts/horovod_gpu_kit.sh prepare'"
  (cd "$KIT" && sha256sum --quiet --strict -c SHA256SUMS) || die "the kit's files do not match $KIT/SHA256SUMS"
  say "sums ok: $(wc -l < "$KIT/SHA256SUMS") file(s) in SHA256SUMS"
}

unpack_and_patch() {  # unpack_and_patch SCRATCH: prints the patched source folder
  tar -xzf "$KIT/$SDIST_NAME" -C "$1"
  local src="$1/horovod-$HOROVOD_VERSION"
  [ -f "$src/setup.py" ] || die "$SDIST_NAME has no horovod-$HOROVOD_VERSION/setup.py"
  bash "$PATCH" "$src" >&2 || die "scripts/patch_horovod.sh did not apply to $SDIST_NAME"
  echo "$src"
}

# ---- the environment of the build -------------------------------------------------------------------------
# find_nvidia PY: sets NVIDIA_DIR, the folder of the python namespace package nvidia (NCCL, the CUDA wheels), or ""
find_nvidia() {
  NVIDIA_DIR=""
  [ -n "$1" ] || return 0
  NVIDIA_DIR=$("$1" -c "import nvidia; print(list(nvidia.__path__)[0])" 2>/dev/null || true)
  return 0
}

# find_cuda PY: sets CUDA_PREFIX (the toolkit folder above nvcc's bin/) and NVCC, or leaves them empty.
find_cuda() {
  NVCC="" CUDA_PREFIX=""
  local cand site
  cand=$(command -v nvcc 2>/dev/null || true)
  if [ -z "$cand" ] && [ -n "$NVIDIA_DIR" ]; then
    site=$(dirname "$NVIDIA_DIR")
    for c in "$site"/nvidia/cu*/bin/nvcc "$site"/nvidia/cuda_nvcc/bin/nvcc; do [ -x "$c" ] && { cand=$c; break; }; done
  fi
  [ -z "$cand" ] && [ -x /usr/local/cuda/bin/nvcc ] && cand=/usr/local/cuda/bin/nvcc
  [ -n "$cand" ] || return 0
  # nvcc may be a wrapper script: its own dry run names the toolkit's top folder
  local top
  top=$("$cand" -dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  [ -n "$top" ] || top=$(dirname "$(dirname "$(readlink -f "$cand")")")
  CUDA_PREFIX=$(readlink -f "$top")
  NVCC="$CUDA_PREFIX/bin/nvcc"
  [ -x "$NVCC" ] || NVCC=$(readlink -f "$cand")
  return 0
}

# find_nccl PY: sets NCCL_INC and NCCL_SO (libnccl.so.2 of the python package nvidia.nccl), or leaves them empty.
find_nccl() {
  NCCL_INC="" NCCL_SO=""
  [ -n "$1" ] || return 0
  local base="$NVIDIA_DIR/nccl"
  [ -n "$NVIDIA_DIR" ] && [ -d "$base" ] || return 0
  [ -f "$base/include/nccl.h" ] && NCCL_INC="$base/include"
  local so
  for so in "$base"/lib/libnccl.so.2 "$base"/lib/libnccl.so.*; do [ -f "$so" ] && { NCCL_SO=$so; break; }; done
  return 0
}

# find_libcuda: the driver's libcuda.so.1, or empty.
find_libcuda() {
  LIBCUDA=$( (ldconfig -p 2>/dev/null || true) | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')
  if [ -z "$LIBCUDA" ]; then
    local d
    for d in /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/nvidia/lib64 /usr/lib/wsl/lib; do
      [ -e "$d/libcuda.so.1" ] && { LIBCUDA="$d/libcuda.so.1"; break; }
    done
  fi
  return 0
}

# make_links LINKS: the private folder of links (nothing outside it is touched):
#   LINKS/cuda     a mirror of the toolkit: its entries linked, lib and lib64 real folders of links to the files of
#                  the toolkit's lib (and lib64), plus an unversioned libcudart.so where the toolkit has none
#   LINKS/lib      libnccl.so -> libnccl.so.2 of nvidia.nccl, libcuda.so -> the driver's libcuda.so.1
make_links() {
  local links="$1" e f name
  rm -rf "$links" && mkdir -p "$links/lib"
  if [ -n "$CUDA_PREFIX" ]; then
    mkdir -p "$links/cuda/lib" "$links/cuda/lib64"
    for e in "$CUDA_PREFIX"/*; do
      name=$(basename "$e")
      case "$name" in lib|lib64) ;; *) ln -s "$e" "$links/cuda/$name" ;; esac
    done
    for d in lib lib64; do
      [ -d "$CUDA_PREFIX/$d" ] || continue
      for f in "$CUDA_PREFIX/$d"/*; do
        name=$(basename "$f")
        [ -e "$links/cuda/lib/$name" ] || ln -s "$f" "$links/cuda/lib/$name"
        [ -e "$links/cuda/lib64/$name" ] || ln -s "$f" "$links/cuda/lib64/$name"
      done
    done
    if [ ! -e "$links/cuda/lib64/libcudart.so" ]; then
      f=$(ls "$links"/cuda/lib64/libcudart.so.[0-9]* 2>/dev/null | head -1 || true)
      [ -n "$f" ] && ln -s "$(readlink -f "$f")" "$links/cuda/lib64/libcudart.so" \
        && ln -s "$(readlink -f "$f")" "$links/cuda/lib/libcudart.so"
    fi
  fi
  [ -n "$NCCL_SO" ] && ln -s "$NCCL_SO" "$links/lib/libnccl.so"
  [ -n "$LIBCUDA" ] && ln -s "$LIBCUDA" "$links/lib/libcuda.so"
  { echo "# source this before running Horovod built by the kit (libcuda.so for horovod.torch's dlopen)"
    echo "export LD_LIBRARY_PATH=\"$links/lib${NCCL_SO:+:$(dirname "$NCCL_SO")}\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
  } > "$links/env.sh"
}

# build_env LINKS: exports the build's variables (and lists them in BUILD_VARS)
build_env() {
  local links="$1"
  BUILD_VARS="HOROVOD_GPU_OPERATIONS HOROVOD_GPU HOROVOD_CUDA_HOME HOROVOD_NCCL_HOME HOROVOD_NCCL_INCLUDE HOROVOD_NCCL_LIB
    HOROVOD_NCCL_LINK HOROVOD_BUILD_CUDA_CC_LIST HOROVOD_WITH_PYTORCH HOROVOD_WITH_GLOO HOROVOD_WITHOUT_TENSORFLOW
    HOROVOD_WITHOUT_MXNET HOROVOD_WITH_MPI HOROVOD_WITHOUT_MPI HOROVOD_WITHOUT_NVTX CMAKE_POLICY_VERSION_MINIMUM
    MAKEFLAGS LIBRARY_PATH LD_LIBRARY_PATH CUDA_RUNTIME"
  export HOROVOD_CUDA_HOME="${CUDA_PREFIX:+$links/cuda}"
  if [ "$VARIANT" = cpuops ]; then
    # no GPU operation defined: the CUDA torch makes horovod/torch's CMake add CUDA itself, and its ops register
    # the CUDA tensors' *CudaOnCPU entry points (copy to host, the CPU operation, copy back)
    unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_ALLGATHER HOROVOD_GPU_BROADCAST \
      HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER HOROVOD_NCCL_HOME HOROVOD_NCCL_INCLUDE HOROVOD_NCCL_LIB \
      HOROVOD_NCCL_LINK
    export HOROVOD_GPU=CUDA
  else
    unset HOROVOD_GPU
    export HOROVOD_GPU_OPERATIONS=NCCL
    export HOROVOD_NCCL_HOME="${NCCL_INC:+$(dirname "$NCCL_INC")}"
    export HOROVOD_NCCL_INCLUDE="$NCCL_INC"
    export HOROVOD_NCCL_LIB="${NCCL_SO:+$links/lib}"
    export HOROVOD_NCCL_LINK=SHARED
  fi
  export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-90}"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  # NVTX: CUDA 13 ships only the header-only NVTX 3, which Horovod 0.28.1's CMake does not look for.
  export HOROVOD_WITHOUT_NVTX=1
  if command -v mpicxx >/dev/null 2>&1; then
    export HOROVOD_WITH_MPI=1; unset HOROVOD_WITHOUT_MPI
  else
    export HOROVOD_WITHOUT_MPI=1; unset HOROVOD_WITH_MPI
  fi
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export MAKEFLAGS="-j$JOBS"
  export LIBRARY_PATH="$links/lib${CUDA_PREFIX:+:$links/cuda/lib64}${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$links/lib${NCCL_SO:+:$(dirname "$NCCL_SO")}${CUDA_PREFIX:+:$links/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Horovod links the CUDA runtime statically; toolkits from Python packages may ship only the shared one.
  CUDA_RUNTIME=Static
  [ -n "$CUDA_PREFIX" ] && [ ! -e "$links/cuda/lib64/libcudart_static.a" ] && CUDA_RUNTIME=Shared
  [ -n "$CUDA_PREFIX" ] && [ -d "$links/cuda/bin" ] && export PATH="$links/cuda/bin:$PATH"
  return 0
}

print_env() {
  local v
  for v in $BUILD_VARS; do
    if [ "$v" = CUDA_RUNTIME ]; then
      echo "  (CUDA runtime linked: $CUDA_RUNTIME)"
    elif [ -n "${!v+x}" ]; then
      echo "  export $v=${!v:-<empty: not found>}"
    fi
  done
}

py_key() {  # py_key PY: the wheel's key for this Python and torch, or fails
  "$1" - "$HOROVOD_VERSION" "$PATCH_HASH" "$VARIANT" <<'PYEOF'
import sys
import torch
v = sys.version_info
print(f"horovod-{sys.argv[1]}_torch-{torch.__version__.replace('+', '_')}_cp{v[0]}{v[1]}_{sys.argv[3]}_patch-{sys.argv[2]}")
PYEOF
}

strip_wheel() {  # strip_wheel PY WHEEL: strips the wheel's shared libraries in place, rewriting its RECORD
  "$1" - "$2" <<'PYEOF'
import base64, hashlib, os, shutil, subprocess, sys, tempfile, zipfile
wheel = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp)
    before = os.path.getsize(wheel)
    if shutil.which("strip") is None:
        print("[gpu_kit] WARNING: no strip (binutils): the wheel stays as built")
        sys.exit(0)
    for n in names:
        if n.endswith(".so") or ".so." in n:
            subprocess.run(["strip", "--strip-unneeded", os.path.join(tmp, n)], check=True)
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    for n in names:
        if n == record:
            rows.append(f"{n},,")
            continue
        data = open(os.path.join(tmp, n), "rb").read()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{n},sha256={digest},{len(data)}")
    with open(os.path.join(tmp, record), "w") as f:
        f.write("\n".join(rows) + "\n")
    out = wheel + ".tmp"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for n in names:
            z.write(os.path.join(tmp, n), n)
    os.replace(out, wheel)
    print(f"[gpu_kit] stripped {os.path.basename(wheel)}: {before / 2**20:.1f} MiB -> {os.path.getsize(wheel) / 2**20:.1f} MiB")
PYEOF
}

verify() {  # verify PY: Horovod imports, initialises and has NCCL built (cpuops: CUDA without NCCL)
  # the Gloo controller: a lone process needs no launcher (an MPI build would otherwise start MPI as a singleton)
  (cd "${TMPDIR:-/tmp}" && HOROVOD_CONTROLLER=gloo HOROVOD_CPU_OPERATIONS=gloo "$1" - "$VARIANT" <<'PYEOF'
import sys
import torch
import horovod
import horovod.torch as hvd
hvd.init()
print(f"[gpu_kit] horovod {horovod.__version__}, torch {torch.__version__}: size {hvd.size()}, "
      f"nccl_built {hvd.nccl_built()}, gloo_built {hvd.gloo_built()}, mpi_built {hvd.mpi_built()}")
try:
    from horovod.common.util import gpu_available
    print(f"[gpu_kit] gpu_available('torch') = {gpu_available('torch')}, cuda available {torch.cuda.is_available()}")
except ImportError:
    pass
assert hvd.gloo_built(), "Horovod was built without Gloo"
if sys.argv[1] == "cpuops":
    assert not hvd.nccl_built(), "the cpuops build has NCCL operations (CUDA tensors would go to NCCL)"
    assert hvd.cuda_built(), "the cpuops build has no CUDA (CUDA tensors would be refused)"
    if torch.cuda.is_available():  # a CUDA tensor through the CPU operations comes back on its device
        x = torch.arange(6, dtype=torch.float32, device="cuda")
        y = hvd.allreduce(x, op=hvd.Sum, name="kit.verify")
        z = hvd.allgather(x, name="kit.verify.gather")
        assert y.is_cuda and torch.equal(y, x) and z.is_cuda and torch.equal(z, x), (y, z)
        print("[gpu_kit] a CUDA tensor through allreduce and allgather (CPU operations): ok")
else:
    assert hvd.nccl_built(), "Horovod was built without NCCL"
PYEOF
  )
}

# ---- the modes ------------------------------------------------------------------------------------------
prepare() {
  mkdir -p "$KIT"
  if [ -n "${HOROVOD_GPU_KIT_SDIST:-}" ]; then
    cp "$HOROVOD_GPU_KIT_SDIST" "$KIT/$SDIST_NAME"
  elif [ ! -f "$KIT/$SDIST_NAME" ]; then
    local py
    py=$(pick_python)
    [ -n "$py" ] || die "no Python to run pip download with"
    "$py" -m pip download -qq --no-deps --no-binary :all: -d "$KIT" "horovod==$HOROVOD_VERSION"
  fi
  [ -f "$KIT/$SDIST_NAME" ] || die "no $SDIST_NAME in $KIT after the download"
  if [ -n "${HOROVOD_GPU_KIT_SDIST:-}" ]; then
    say "offline (HOROVOD_GPU_KIT_SDIST): no runtime wheels in deps/; the GPU machine's Python must have them"
  else
    local py
    py=$(pick_python)
    rm -rf "$KIT/deps"
    # shellcheck disable=SC2086
    "$py" -m pip download -qq --no-deps --only-binary :all: --python-version "$DEPS_PY" --implementation cp \
      --abi "cp${DEPS_PY/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$KIT/deps" $DEPS
  fi
  (cd "$KIT" && sha256sum "$SDIST_NAME" $(ls deps/*.whl 2>/dev/null) > SHA256SUMS)
  { echo "horovod $HOROVOD_VERSION sdist, unpatched: scripts/patch_horovod.sh is applied at build time"
    echo "patch_horovod.sh at prepare time: sha256 $(sha256sum "$PATCH" | cut -d' ' -f1)"
  } > "$KIT/kit.txt"
  local scratch
  scratch=$(small_scratch); unpack_and_patch "$scratch" >/dev/null; rm -rf "$scratch"
  local rel="${KIT#"$ROOT"/}"
  say "kit ready in $rel: $(du -sh "$KIT" | cut -f1) ($(du -sb "$KIT" | cut -f1) bytes); the patch applies"
  say "carry: [\"$rel\"]"
  say "command on the GPU machine: bash scripts/horovod_gpu_kit.sh build"
}

dry() {
  check_sums
  local py
  scratch=$(small_scratch)
  trap 'rm -rf "$scratch"' EXIT
  unpack_and_patch "$scratch" >/dev/null
  say "patch applies cleanly to a scratch copy of $SDIST_NAME"
  # the patch is idempotent: a second run rewrites no file
  local src="$scratch/horovod-$HOROVOD_VERSION" changed
  touch "$scratch/marker"
  bash "$PATCH" "$src" >/dev/null 2>&1 || die "a second run of scripts/patch_horovod.sh failed"
  changed=$(find "$src" -type f -newer "$scratch/marker")
  [ -z "$changed" ] || die "a second run of scripts/patch_horovod.sh rewrote: $changed"
  say "a second run of the patch changes nothing"
  py=$(pick_python try-pyenv)
  if [ -n "$py" ]; then say "python: $py ($("$py" -S -c 'import platform; print(platform.python_version())'))"
  else say "python: not found"; fi
  find_nvidia "$py"; find_cuda "$py"; find_nccl "$py"; find_libcuda
  say "nvcc: ${NVCC:-not found}${NVCC:+ ($("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/CUDA \1/p'))}"
  say "NCCL (python package nvidia.nccl of that Python): ${NCCL_INC:-not found}${NCCL_SO:+, $NCCL_SO}"
  say "driver libcuda.so.1: ${LIBCUDA:-not found}"
  say "MPI compiler: $(command -v mpicxx || echo 'not found (the build would set HOROVOD_WITHOUT_MPI=1)')"
  make_links "$scratch/links"
  build_env "$scratch/links"
  if [ "$VARIANT" = cpuops ]; then
    say "variant cpuops: no GPU operations, no NCCL: CUDA tensors through the CPU operations (Gloo)"
  fi
  say "links it would make (private folder LINKS):"
  (cd "$scratch/links" && find . -maxdepth 3 -type l \( -name 'libcudart.so' -o -name 'libnccl.so' -o -name 'libcuda.so' \) \
      -printf '    LINKS/%P -> %l\n' | sort)
  say "the environment it would export (LINKS: a private folder of links in the kit):"
  print_env | sed "s|$scratch/links|LINKS|g"
  # the wheel's key imports torch (seconds): only for a Python that could build (one with NCCL)
  if { [ "$VARIANT" = cpuops ] || [ -n "$NCCL_INC" ]; } \
      && "$py" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    say "wheel key for this Python: $(py_key "$py")"
  fi
  say "CMake configure: skipped: Horovod's configure enables PyTorch only with a torch importable by the build's"
  say "  Python, checks CUDA torch against HOROVOD_GPU_OPERATIONS, and FindNCCL needs nccl.h and libnccl;"
  if [ "$VARIANT" = cpuops ]; then
    say "  (cpuops needs no NCCL; its configure needs nvcc and a CUDA torch)"
  else
    [ -n "$NCCL_INC" ] || say "  here the Python has no nvidia.nccl, so the configure would fail on NCCL, not on the kit"
    [ -n "$NCCL_INC" ] && say "  here NCCL is present, but the configure with CUDA compiles test programs (minutes on two cores)"
  fi
  local w
  for w in "$KIT"/wheels/*/horovod-*.whl; do
    [ -f "$w" ] || continue
    (cd "$(dirname "$w")" && sha256sum --quiet --strict -c SHA256SUMS) || die "carried wheel $w does not match its SHA256SUMS"
    say "carried wheel: ${w#"$KIT"/} (sums ok)"
  done
  say "dry run ok"
}

build() {
  local t0=$SECONDS py key log links wheel_dir out_dir
  py=$(pick_python)
  [ -n "$py" ] || die "no Python found (set PY)"
  key=$(py_key "$py") || die "$py cannot import torch"
  say "python $py, wheel key $key (variant $VARIANT)"
  check_sums
  links="$KIT/links"
  find_nvidia "$py"; find_cuda "$py"; find_nccl "$py"; find_libcuda
  make_links "$links"
  wheel_dir="$KIT/wheels/$key"
  out_dir="${OUT:+$OUT/gpu_kit/wheels/$key}"
  log="$KIT/build.log"
  if ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    (cd "$wheel_dir" && sha256sum --quiet --strict -c SHA256SUMS) || die "carried wheel in $wheel_dir does not match its SHA256SUMS"
    say "installing the carried wheel $(basename "$wheel_dir"/horovod-*.whl) (no build)"
    "$py" -m pip install -q --no-index --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  else
    [ -n "$NVCC" ] || die "nvcc not found (PATH, the Python's nvidia packages, /usr/local/cuda)"
    if [ "$VARIANT" = nccl ]; then
      [ -n "$NCCL_INC" ] && [ -n "$NCCL_SO" ] \
        || die "NCCL not found: $py has no python package nvidia.nccl with include/nccl.h and lib/libnccl.so.2"
    fi
    "$py" -c "import setuptools" 2>/dev/null \
      || die "$py has no setuptools: pip wheel --no-build-isolation needs it (nothing can be fetched here)"
    build_env "$links"
    say "environment:"; print_env
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    local src
    src=$(unpack_and_patch "$scratch")
    if [ "$CUDA_RUNTIME" = Shared ]; then
      # the toolkit has no libcudart_static.a: link the shared runtime (a build-time edit of the scratch copy)
      sed -i 's/set(CMAKE_CUDA_RUNTIME_LIBRARY "Static")/set(CMAKE_CUDA_RUNTIME_LIBRARY "Shared")/' "$src/CMakeLists.txt"
      grep -q 'CMAKE_CUDA_RUNTIME_LIBRARY "Shared"' "$src/CMakeLists.txt" || die "could not switch to the shared CUDA runtime"
    fi
    say "compiling with $JOBS jobs (limit ${HOROVOD_GPU_KIT_TIMEOUT:-450}s), log in ${log#"$ROOT"/}"
    local rc=0
    timeout --kill-after=15 "${HOROVOD_GPU_KIT_TIMEOUT:-450}" \
      "$py" -m pip wheel -v --no-index --no-deps --no-build-isolation -w "$scratch/wheel" "$src" > "$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
      grep -n -m 20 -E 'error|Error|CMake Error' "$log" | tail -n 20 >&2 || true
      tail -n 60 "$log" >&2
      [ -n "${OUT:-}" ] && mkdir -p "$OUT/gpu_kit" && cp "$log" "$OUT/gpu_kit/"
      [ "$rc" -eq 124 ] && die "the compile passed its ${HOROVOD_GPU_KIT_TIMEOUT:-450}s limit"
      die "Horovod build failed (rc=$rc) after $((SECONDS - t0))s"
    fi
    say "compiled in $((SECONDS - t0))s"
    local whl
    whl=$(ls "$scratch"/wheel/horovod-*.whl)
    strip_wheel "$py" "$whl"
    mkdir -p "$wheel_dir"
    cp "$whl" "$wheel_dir"/
    (cd "$wheel_dir" && sha256sum horovod-*.whl > SHA256SUMS)
    "$py" -m pip install -q --no-index --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  fi
  if ls "$KIT"/deps/*.whl >/dev/null 2>&1; then
    # only what the Python lacks: a requirement already met is left as it is
    "$py" -m pip install -q --no-index --no-deps --find-links "$KIT/deps" cloudpickle packaging psutil pyyaml \
      || say "WARNING: could not install the carried runtime wheels (deps/)"
  fi
  # shellcheck disable=SC1091
  source "$links/env.sh"
  verify "$py" || die "the installed Horovod failed its check"
  if [ -n "$out_dir" ]; then
    mkdir -p "$out_dir"
    cp "$wheel_dir"/horovod-*.whl "$wheel_dir"/SHA256SUMS "$out_dir"/
    [ -f "$log" ] && cp "$log" "$OUT/gpu_kit/"
    say "wheel written to \$OUT/gpu_kit/wheels/$key/ ($(du -sh "$out_dir" | cut -f1))"
  fi
  say "ok in $((SECONDS - t0))s; before running Horovod: source ${links#"$ROOT"/}/env.sh"
  if [ "$VARIANT" = cpuops ]; then
    say "CUDA tensors go through the CPU operations: several ranks share the GPU with horovodrun --gloo"
  fi
}

case "${1:-}" in
  prepare) prepare ;;
  dry)
    case "${2:-}" in
      "") ;;
      cpuops) VARIANT=cpuops ;;
      *) die "unknown variant '$2' of dry: none (the NCCL build) or cpuops" ;;
    esac
    dry ;;
  build) build ;;
  cpuops) VARIANT=cpuops; build ;;
  -h|--help|help) usage ;;
  *) usage >&2; echo >&2; die "unknown mode '${1:-}': use prepare, dry, build or cpuops" ;;
esac
