#!/usr/bin/env bash
# Device check for the Triton selection kernels (horovod_adtopk/triton_kernels.py).
#
# Needs one CUDA GPU with PyTorch + Triton, no network; Horovod (built with NCCL operations) only for the
# horovod and hvd_jobs stages, which fail with the reason where it is missing. Run from the repository root:
#
#     bash scripts/gpu_check.sh            # logs and JSON in ${OUT:-gpu_check_out}/
#
# Stages (each under its own timeout; a failed stage does not stop the next; the exit status is non-zero
# if any stage failed), sized to about 14 minutes in all (over one 10-minute command: name the stages wanted in
# GPU_CHECK_STAGES):
#   1. versions      nvidia-smi, python, torch, triton, the CUDA device
#   2. tests         pytest tests/test_triton_kernels.py on CUDA (in parallel where pytest-xdist is installed)
#   3. bench         CUDA-event timings (median of 20 after warm-up) on the largest tensors of ResNet-50,
#                    VGG-16, BERT-base and GPT-2 small (fp32; BERT's also bf16) at ratios 0.01 and 0.001:
#                    one read pass (a.sum()), ADTopk Triton (fused with the grad add, and without; with and
#                    without the early exit from the radix rounds), torch.topk per fiber on |a|, the
#                    package's two whole paths for a CUDA tensor (Triton, and the torch fallback: error
#                    feedback add, selection, zeroing), exact global torch.topk on the flattened |a|, and
#                    Triton's global top-k; plus checks that Triton's per-fiber magnitudes equal
#                    torch.topk's and that the early exit selects the same entries. Table on stdout, JSON in
#                    $OUT/bench.json.
#   4. ddp           benchmarks/ddp_check.py: the DDP engine (horovod_adtopk.ddp) end to end on CUDA tensors:
#                    2 processes on the one GPU over Gloo and 1 process over NCCL, every step's averaged
#                    gradients checked against the same runs on the CPU; then the step time of the 25M MLP
#                    (1 process, NCCL) with DDP dense, DDP + ADTopk and DDP + PyTorch's PowerSGD hook.
#                    JSON in $OUT/ddp_check.json.
#   5. horovod       benchmarks/hvd_gpu_check.py: the Horovod engine (hat.DistributedOptimizer) end to end as one
#                    process (horovodrun -np 1, NCCL operations on CUDA tensors) with exchange_when_alone=True:
#                    every compressor family's averaged gradients on CUDA against the same seed on the CPU
#                    (positions equal but for near-ties, values within 1e-5 relative), the fixed-size rules'
#                    gradient hooks under torch.cuda.set_sync_debug_mode("error"), local steps with 2-bit
#                    values and hierarchical=True's fallback at one rank. Fails with a one-line reason where
#                    Horovod (or its NCCL operations) is missing. JSON in $OUT/hvd_gpu_check.json.
#   5b. hvd_jobs     examples/train.py under horovodrun on CUDA, as one process with NCCL operations and
#                    --exchange-when-alone (NCCL takes one rank per GPU): the CNN main job (ADTopk 0.01 per step,
#                    40 steps, on a small synthetic Fashion-MNIST written as IDX files: the GPU machine has no
#                    dataset), the GPT job (ADTopk 0.01 per step, bf16 autocast, 20 steps) and the README's
#                    local-steps recipe for AdamW (ADTopk 0.25, H = 4, outer SGD lr 1, feedback decay 0.95, 2-bit
#                    values in groups of 64; 20 steps), both GPT jobs on the repository's Markdown. Checks per job:
#                    the log says cuda, the steps, payload bytes counted by the exchange (bytes_sent > 0, which is
#                    0 at one rank without --exchange-when-alone), 0 < density < bound, bytes sent / dense < bound,
#                    the compression mark in the log, a finite test loss. replicas_identical needs two ranks, which
#                    the NCCL build cannot put on one GPU: recorded as "not applicable at 1 rank". With a CUDA
#                    build with CPU operations instead (scripts/horovod_gpu_kit.sh cpuops) the jobs run on 2 ranks
#                    sharing the GPU over Gloo (CUDA tensors staged through host memory) and replicas_identical
#                    must be true. Fails with the reason where neither build is there. Never yet run on a GPU.
#                    JSON in $OUT/hvd_jobs.json (and each job's summary and log in $OUT/hvd_jobs_*).
#   6. gpt           the transformer job (examples/train.py --model gpt, AdamW, bf16 autocast, the tied head) with
#                    ADTopk (the per-step hook; whole columns joined into fibers of >= 2,048, the job's default)
#                    for 20 steps: 2 processes on the one GPU through the DDP engine (Gloo, CUDA tensors), on a
#                    text made of the repository's own Markdown files (the GPU machine has no Shakespeare);
#                    checks that it ran on cuda with joined columns, compressed (density < 0.1), ended with a
#                    finite loss and with bitwise equal parameters on both ranks (the summary's
#                    replicas_identical).
#                    Summary in $OUT/gpt.json.
#   7. gpt_local     the same job with local steps and the SparseLoCo-style outer exchange (ADTopk 0.05, H = 5,
#                    outer SGD lr 1, error feedback decayed by 0.95, 2-bit values: horovod_adtopk/quantize.py on
#                    CUDA tensors) for 20 steps; checks cuda, density < 0.02 (elements; 0.01 for the sparse
#                    tensors), a finite loss and equal parameters on both ranks.
#                    Summary in $OUT/gpt_local.json.
#   8. bucket        benchmarks/bench_bucket_select.py --stage bucket: whole-bucket selection vs a copy and vs the
#                    per-layer path (GPT-2 small, BERT-base, ResNet-50), bitwise and host-sync checks.
#   9. step          benchmarks/bench_bucket_select.py --stage step: GPT-2-small step time on the DDP engine, ADTopk
#                    vs dense, PowerSGD (rank 4), fp16_compress_hook. Both in $OUT/bench_bucket_select.json.
#
# GPU_CHECK_STAGES="versions ddp" runs only the stages named (to repeat one after a fix within the device time);
# GPU_CHECK_LIMITS="tests=75 bench=40" gives the stages named other timeouts, and GPU_CHECK_BENCH_BUDGET_S
# the seconds after which the bench starts no new shape (to fit what is left of a lease). The stages run in
# the order versions, tests, ddp, horovod, hvd_jobs, gpt, gpt_local, bench: the checks of results before the
# timings. GPU_CHECK_DRY=1 runs the benchmark stage on CPU tensors under the Triton interpreter with tiny shapes,
# the ddp stage on CPU tensors over Gloo with a small MLP, the horovod stage with --dry (CPU tensors, Gloo) and
# the hvd_jobs stage's three jobs on CPU tensors under horovodrun -np 2 --gloo (a few steps, two-layer GPTs),
# where replicas_identical must be true (GPU_CHECK_HVD_JOBS_NP=1: one rank with --exchange-when-alone, as on the
# GPU; GPU_CHECK_HVD_JOBS="recipe" runs only the jobs named) (to check the script where there is no GPU).
set -u
# Nothing is installed on the GPU machine: the package, the job and the benchmarks run from this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

OUT_DIR="${OUT:-gpu_check_out}"
PY="${PYTHON:-python}"
DRY="${GPU_CHECK_DRY:-0}"
STAGES="${GPU_CHECK_STAGES:-}"  # e.g. "versions ddp": run only these stages (default: all)
LIMITS="${GPU_CHECK_LIMITS:-}"  # e.g. "tests=75 bench=40": other timeouts (seconds) for the stages named
mkdir -p "$OUT_DIR"
FAILED=""

run_stage() {  # run_stage NAME SECONDS FUNCTION: log to $OUT_DIR/NAME.log, echo a summary, record failure
    local name="$1" limit="$2" fn="$3" item
    for item in $LIMITS; do  # GPU_CHECK_LIMITS="tests=75 bench=40" overrides a stage's timeout
        [ "${item%%=*}" = "$name" ] && limit="${item#*=}"
    done
    if [ -n "$STAGES" ] && [[ " $STAGES " != *" $name "* ]]; then
        echo "=== stage $name skipped (GPU_CHECK_STAGES=\"$STAGES\")"
        return
    fi
    echo "=== stage $name (timeout ${limit}s)"
    local t0=$SECONDS
    # timeout runs programs, not shell functions: run the exported function in a child bash.
    timeout --kill-after=10 "$limit" bash -c "$fn" > "$OUT_DIR/$name.log" 2>&1
    local rc=$?
    tail -n 60 "$OUT_DIR/$name.log"
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "!!! stage $name timed out after ${limit}s"
        echo "!!! stage $name failed (rc=$rc) after $((SECONDS - t0))s"
        FAILED="$FAILED $name"
    else
        echo "=== stage $name ok in $((SECONDS - t0))s"
    fi
}

versions() {
    if command -v nvidia-smi > /dev/null 2>&1; then
        nvidia-smi || true
    else
        echo "nvidia-smi: not found"
    fi
    "$PY" - <<'PYEOF'
import platform
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:  # reported, and the tests stage will fail or skip
    print("triton: not importable:", exc)
try:
    import horovod  # noqa: F401
    import horovod.torch as hvd
    print("horovod", horovod.__version__, "nccl ops", hvd.nccl_built(), "gloo", hvd.gloo_built())
except Exception as exc:  # reported, and the horovod stage will fail with the reason
    print("horovod: not importable (the horovod stage needs it):", exc)
PYEOF
}

run_tests() {
    # tests/test_kernels.py tests the CPU kernels only (CI runs it): the GPU's time goes to the Triton ones.
    local files="tests/test_triton_kernels.py"
    local par=()
    # pytest-xdist, where it is installed, compiles the kernels' many variants in parallel.
    [ "$DRY" != "1" ] && "$PY" -c "import xdist" 2> /dev/null && par=(-n "${GPU_CHECK_TEST_WORKERS:-8}")
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider "${par[@]}" $files
}

bench() {
    OUT_DIR="$OUT_DIR" GPU_CHECK_DRY="$DRY" "$PY" - <<'PYEOF'
import json
import math
import os
import statistics
import sys
import time

DRY = os.environ.get("GPU_CHECK_DRY", "0") == "1"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from horovod_adtopk import kernels as K  # noqa: E402  (no Horovod: the package __init__ is lazy)
from horovod_adtopk import triton_kernels as tk  # noqa: E402

OUT_DIR = os.environ.get("OUT_DIR", "gpu_check_out")
# Stop starting new shapes after this many seconds (the stage timeout is a little longer).
BUDGET_S = float(os.environ.get("GPU_CHECK_BENCH_BUDGET_S", "125"))

if DRY:
    DEVICE = "cpu"
    SHAPES = [("dry row fibers", (6, 40)), ("dry column fibers", (40, 3, 1, 2))]
    RATIOS = [0.1, 0.01]
    WARMUP, REPEATS = 0, 1
else:
    if not torch.cuda.is_available():
        sys.exit("bench: CUDA is not available (set GPU_CHECK_DRY=1 for the CPU dry run)")
    if not tk.available():
        sys.exit("bench: Triton is not importable")
    DEVICE = "cuda"
    # Transformer shapes first: with a short budget (GPU_CHECK_BENCH_BUDGET_S) they are the ones measured.
    SHAPES = [
        ("BERT-base FFN in", (3072, 768)),
        ("BERT-base FFN out", (768, 3072)),
        ("BERT-base attention", (768, 768)),
        ("GPT-2 c_attn", (2304, 768)),
        ("GPT-2 wte", (50257, 768)),
        ("BERT-base FFN in bf16", (3072, 768), torch.bfloat16),
        ("BERT-base FFN out bf16", (768, 3072), torch.bfloat16),
        ("BERT-base attention bf16", (768, 768), torch.bfloat16),
        ("BERT-base word embeddings", (30522, 768)),
        ("VGG-16 fc6", (4096, 25088)),
        ("VGG-16 fc7", (4096, 4096)),
        ("VGG-16 conv5 / ResNet-50 layer4 conv", (512, 512, 3, 3)),
        ("ResNet-50 layer4 conv1x1", (2048, 512, 1, 1)),
        ("ResNet-50 fc", (1000, 2048)),
    ]
    RATIOS = [0.01, 0.001]
    WARMUP, REPEATS = 3, 20


def timed(fn):
    """Median milliseconds of REPEATS runs after WARMUP (CUDA events on the GPU)."""
    for _ in range(WARMUP):
        fn()
    times = []
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def fiber_view(shape):
    rows = shape[0]
    cols = math.prod(shape[1:])
    axis = 1 if cols >= rows else 0  # the package's axis="auto"
    return rows, cols, axis


results = []
t_start = time.perf_counter()
gen = torch.Generator(device=DEVICE).manual_seed(0)
for name, shape, *dt in SHAPES:
    if time.perf_counter() - t_start > BUDGET_S:
        print(f"time budget reached, skipping {name} {shape}", flush=True)
        continue
    dtype = dt[0] if dt else torch.float32
    rows, cols, axis = fiber_view(shape)
    n_fibers, L = (rows, cols) if axis == 1 else (cols, rows)
    a = torch.randn(rows * cols, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)
    g = (torch.randn(rows * cols, generator=gen, device=DEVICE, dtype=torch.float32) * 1e-3).to(dtype)
    res = a.clone()
    for ratio in RATIOS:
        k = max(1, int(math.floor(ratio * L)))
        kg = max(1, int(math.floor(ratio * a.numel())))
        row = {"name": name, "shape": list(shape), "rows": rows, "cols": cols, "axis": axis,
               "num_fibers": n_fibers, "fiber_len": L, "k": k, "global_k": kg, "ratio": ratio,
               "numel": a.numel(), "device": DEVICE, "dtype": str(dtype).replace("torch.", "")}

        def fallback():
            m = a.view(rows, cols)
            if axis == 0:
                m = m.t().contiguous()
            return torch.topk(m.abs(), k, dim=1, sorted=False)

        # Correctness on the real size: per-fiber magnitudes equal torch.topk's (ties may pick other
        # positions, never other magnitudes).
        values, local = tk.adtopk_select(a, rows, cols, axis, k)
        want = fallback().values.sort(dim=1).values
        got = values.abs().sort(dim=1).values
        row["check_magnitudes_equal"] = bool(torch.equal(got, want))
        row["check_local_ascending"] = bool(k == 1 or (local[:, 1:] > local[:, :-1]).all())
        gv, gf = tk.topk_select(a, kg)
        row["check_global_equal"] = bool(torch.equal(gv.abs().sort().values,
                                                      torch.topk(a.abs(), kg, sorted=False).values.sort().values))
        row["ms_read_pass"] = timed(lambda: a.sum())
        row["ms_adtopk_triton_fused_grad"] = timed(lambda: tk.adtopk_select(res, rows, cols, axis, k, grad=g))
        row["ms_adtopk_triton"] = timed(lambda: tk.adtopk_select(a, rows, cols, axis, k))
        # The radix rounds without the early exit (every round to the last bit of the k-th key), and the
        # same result checked bit for bit.
        tk.EARLY_EXIT = False
        row["ms_adtopk_triton_all_rounds"] = timed(lambda: tk.adtopk_select(a, rows, cols, axis, k))
        v_all, l_all = tk.adtopk_select(a, rows, cols, axis, k)
        tk.EARLY_EXIT = True
        row["check_early_exit_same"] = bool(torch.equal(l_all, local) and torch.equal(v_all, values))
        # The package's two paths for a CUDA tensor, whole: error-feedback add, selection, zeroing of the
        # sent entries (Triton fused; the torch fallback as kernels.py runs it without Triton).
        row["ms_path_triton_ef"] = timed(lambda: tk.adtopk_select(res, rows, cols, axis, k, grad=g, zero_sent=True))
        row["ms_path_torch_ef"] = timed(lambda: K._torch_adtopk_select(res, rows, cols, axis, k, g, True))
        row["ms_torch_topk_per_fiber"] = timed(fallback)
        row["ms_torch_topk_global"] = timed(lambda: torch.topk(a.abs(), kg, sorted=False))
        row["ms_triton_topk_global"] = timed(lambda: tk.topk_select(a, kg))
        row["read_GBps"] = a.numel() * a.element_size() / (row["ms_read_pass"] * 1e-3) / 1e9
        results.append(row)
        print(json.dumps(row), flush=True)

cols_ = [("read", "ms_read_pass"), ("adtopk+grad", "ms_adtopk_triton_fused_grad"), ("adtopk", "ms_adtopk_triton"),
         ("all rounds", "ms_adtopk_triton_all_rounds"), ("topk/fiber", "ms_torch_topk_per_fiber"),
         ("path triton", "ms_path_triton_ef"), ("path torch", "ms_path_torch_ef"),
         ("topk global", "ms_torch_topk_global"), ("triton global", "ms_triton_topk_global")]
head = f"{'tensor':30s} {'shape':>18s} ax {'ratio':>6s} {'k':>5s} " + " ".join(f"{c:>11s}" for c, _ in cols_) + "  x read  ok"
print()
print("milliseconds, median of", REPEATS, "after", WARMUP, "warm-up runs;", DEVICE)
print(head)
for r in results:
    ok = (r["check_magnitudes_equal"] and r["check_local_ascending"] and r["check_global_equal"]
          and r["check_early_exit_same"])
    print(f"{r['name'][:30]:30s} {str(tuple(r['shape'])):>18s} {r['axis']:2d} {r['ratio']:6.3f} {r['k']:5d} "
          + " ".join(f"{r[key]:11.3f}" for _, key in cols_)
          + f"  {r['ms_adtopk_triton_fused_grad'] / r['ms_read_pass']:6.1f}  {'yes' if ok else 'NO'}")

meta = {"torch": torch.__version__, "triton": __import__("triton").__version__, "device": DEVICE,
        "device_name": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (interpreter dry run)",
        "warmup": WARMUP, "repeats": REPEATS}
os.makedirs(OUT_DIR, exist_ok=True)
with open(os.path.join(OUT_DIR, "bench.json"), "w") as f:
    json.dump({"meta": meta, "results": results}, f, indent=1)
print("wrote", os.path.join(OUT_DIR, "bench.json"))
bad = [r for r in results if not (r["check_magnitudes_equal"] and r["check_local_ascending"]
                                  and r["check_global_equal"] and r["check_early_exit_same"])]
if bad:
    sys.exit(f"bench: {len(bad)} correctness check(s) failed")
if not results:
    sys.exit("bench: no shape was measured")
PYEOF
}

ddp_check() {
    if [ "$DRY" = "1" ]; then
        "$PY" benchmarks/ddp_check.py --dry --out "$OUT_DIR"
    else
        "$PY" benchmarks/ddp_check.py --out "$OUT_DIR"
    fi
}

find_horovodrun() {  # find_horovodrun STAGE: sets the caller's controller (--gloo where built) and hvdrun, or says why not
    controller="$("$PY" -c "import horovod.torch as h; print('--gloo' if h.gloo_built() else '')" 2> /dev/null)" || {
        echo "$1 stage: Horovod (horovod.torch) is not importable with $PY; nothing was run"
        return 1
    }
    hvdrun="$(dirname "$(command -v "$PY")")/horovodrun"
    [ -x "$hvdrun" ] || hvdrun="$(command -v horovodrun)" || {
        echo "$1 stage: horovodrun is not installed beside $PY nor on PATH; nothing was run"
        return 1
    }
}

horovod_check() {  # one process under horovodrun; a missing Horovod or launcher fails at once with the reason
    local hvdrun controller
    find_horovodrun horovod || return 1
    local dry=()
    [ "$DRY" = "1" ] && dry=(--dry)
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=2 "$hvdrun" -np 1 $controller "$PY" benchmarks/hvd_gpu_check.py "${dry[@]}" --out "$OUT_DIR"
}

gpt_job() {  # gpt_job NAME MAX_DENSITY LOG_MARK JOB_FLAGS...: 20 steps of the gpt job on 2 processes, then the checks
    local name="$1" max_density="$2" mark="$3" text="$OUT_DIR/gpt_text" torchrun
    shift 3
    mkdir -p "$text"
    for f in README.md BENCHMARKS.md; do cp "$f" "$text/${f%.md}.txt"; done
    torchrun="$(dirname "$(command -v "$PY")")/torchrun"
    [ -x "$torchrun" ] || torchrun="torchrun"
    local device=(--ddp-backend gloo)
    [ "$DRY" = "1" ] && device+=(--no-cuda)
    OMP_NUM_THREADS=2 "$torchrun" --standalone --nproc-per-node 2 examples/train.py --engine ddp "${device[@]}" \
        --dataset shakespeare --data-dir "$text" --model gpt "$@" \
        --epochs 3 --max-steps 20 --test-batches 2 --no-progress --log-every 0 \
        --summary-json "$OUT_DIR/$name.json" || return 1
    "$PY" - "$name" "$max_density" "$mark" "$OUT_DIR" "$DRY" <<'PYEOF'
import json, math, sys
name, max_density, mark, out, dry = sys.argv[1:]
res = json.load(open(f"{out}/{name}.json"))
log = open(f"{out}/{name}.log").read()
want = "cpu" if dry == "1" else "cuda"
same = res.get("replicas_identical") is True
ok = (f"torchrun init, {want})" in log and mark in log and res["density"] < float(max_density)
      and math.isfinite(res["test_loss"]) and res["step"] == 20 and same)
print(f"{name}: device {want}, density {res['density']:.5f}, test loss {res['test_loss']:.3f}, "
      f"{res['wall_time']:.1f} s for 20 steps, ranks' parameters {'bitwise equal' if same else 'DIFFER'}: "
      f"{'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PYEOF
}

gpt() {
    gpt_job gpt 0.1 "short columns joined" --bf16 --compressor adtopk --ratio 0.01 --no-warmup --error-feedback-on gradient
}

gpt_local() {  # density counts elements: about 0.05 / 5 for the sparse tensors, plus the dense 1-D ones
    gpt_job gpt_local 0.02 "2-bit values" --compressor adtopk --ratio 0.05 --sync-every 5 --outer-lr 1 \
        --outer-momentum 0 --outer-feedback-decay 0.95 --outer-value-bits 2
}

hvd_fmnist() {  # hvd_fmnist DIR: a small synthetic Fashion-MNIST as IDX files (the GPU machine has no dataset)
    "$PY" - "$1" <<'PYEOF'
import os, sys
import numpy as np
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
for split, n in (("train", 2048), ("t10k", 512)):  # noise plus a bright band of columns placed by the label
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 60, (n, 28, 28)) + 150 * (np.arange(28)[None, None, :] // 3 == labels[:, None, None])
    for name, arr in ((f"{split}-images-idx3-ubyte", images), (f"{split}-labels-idx1-ubyte", labels)):
        with open(os.path.join(out, name), "wb") as f:
            f.write(bytes([0, 0, 8, arr.ndim]) + np.array(arr.shape, dtype=">u4").tobytes())
            f.write(arr.astype(np.uint8).tobytes())
PYEOF
}

hvd_jobs() {  # examples/train.py under horovodrun: the CNN and the GPT with ADTopk per step, the transformer recipe
    local hvdrun controller np device=() extra=() gpt_small=() bf16=() text="$OUT_DIR/gpt_text" fm="$OUT_DIR/hvd_fmnist"
    local cnn_steps gpt_steps recipe_steps failed=0
    find_horovodrun hvd_jobs || return 1
    if [ "$DRY" = "1" ]; then  # CPU tensors, 2 ranks over Gloo: the replicas' check applies; tiny runs
        np=2 controller=--gloo device=(--no-cuda) gpt_small=(--gpt-layers 2)
        cnn_steps=6 gpt_steps=3 recipe_steps=4
        # GPU_CHECK_HVD_JOBS_NP=1: the GPU run's one rank with --exchange-when-alone, on the CPU
        [ "${GPU_CHECK_HVD_JOBS_NP:-2}" = 1 ] && np=1 extra=(--exchange-when-alone)
    else
        local build
        build="$("$PY" -c "import torch, horovod.torch as h
print('nocuda' if not torch.cuda.is_available() else 'nccl' if h.nccl_built() else 'cpuops' if h.cuda_built() else 'cpu')")"
        case "$build" in
            nccl)  # one GPU: NCCL takes one rank only, so -np 1 with the exchange run over a world of one
                np=1 extra=(--exchange-when-alone) ;;
            cpuops)  # a CUDA build with CPU operations (horovod_gpu_kit.sh cpuops): 2 ranks share the GPU over Gloo
                np=2 controller=--gloo ;;
            *)
                echo "hvd_jobs stage: needs a CUDA device and Horovod built with NCCL operations (hvd.nccl_built()) or for CUDA with CPU operations (found: $build); nothing was run"
                return 1 ;;
        esac
        bf16=(--bf16)
        cnn_steps=40 gpt_steps=20 recipe_steps=20
    fi
    hvd_fmnist "$fm" || return 1
    mkdir -p "$text"
    for f in README.md BENCHMARKS.md; do cp "$f" "$text/${f%.md}.txt"; done
    local common=(--no-progress --log-every 0 --test-batches 2 "${device[@]}" "${extra[@]}")
    run_hvd_job() {  # run_hvd_job NAME STEPS FLAGS...: one job; its output also in $OUT_DIR/hvd_jobs_NAME.log
        local name="$1" steps="$2"
        shift 2
        # shellcheck disable=SC2086
        OMP_NUM_THREADS=2 "$hvdrun" -np "$np" $controller "$PY" examples/train.py "$@" "${common[@]}" \
            --max-steps "$steps" --summary-json "$OUT_DIR/hvd_jobs_$name.json" 2>&1 | tee "$OUT_DIR/hvd_jobs_$name.log"
        return "${PIPESTATUS[0]}"
    }
    rm -f "$OUT_DIR"/hvd_jobs_*.json
    # GPU_CHECK_HVD_JOBS="recipe": only the jobs named (default: all three)
    local wanted=" ${GPU_CHECK_HVD_JOBS:-cnn gpt recipe} "
    wants() { [[ "$wanted" == *" $1 "* ]]; }
    ! wants cnn || run_hvd_job cnn "$cnn_steps" --data-dir "$fm" --epochs 5 --compressor adtopk --ratio 0.01 \
        --no-warmup || failed=1
    ! wants gpt || run_hvd_job gpt "$gpt_steps" --dataset shakespeare --data-dir "$text" --model gpt "${gpt_small[@]}" "${bf16[@]}" \
        --epochs 20 --compressor adtopk --ratio 0.01 --no-warmup --error-feedback-on gradient || failed=1
    # README's local-steps recipe for AdamW: ADTopk 0.25, H = 4, outer SGD lr 1, feedback decay 0.95, 2-bit values
    ! wants recipe || run_hvd_job recipe "$recipe_steps" --dataset shakespeare --data-dir "$text" --model gpt "${gpt_small[@]}" \
        --epochs 20 --compressor adtopk --ratio 0.25 --sync-every 4 --outer-lr 1 --outer-momentum 0 \
        --outer-feedback-decay 0.95 --outer-value-bits 2 --outer-value-group 64 || failed=1
    [ "$failed" = 0 ] || echo "hvd_jobs stage: a job exited non-zero (logs: $OUT_DIR/hvd_jobs_*.log)"
    # Each job's checks from its summary and log: device, ranks, steps, compressed, finite loss, equal replicas
    "$PY" - "$OUT_DIR" "$DRY" "$np" "$wanted" "$cnn_steps" "$gpt_steps" "$recipe_steps" <<'PYEOF' || failed=1
import json, math, os, sys
out, dry, np_, wanted, *steps = sys.argv[1:]
np_ = int(np_)
want = "cpu" if dry == "1" else "cuda"
# name: (steps, the most density (elements sent / elements; 0 means nothing went through the exchange), the
# most payload bytes sent / dense bytes, a mark its log must hold)
jobs = {"cnn": (int(steps[0]), 0.02, 0.03, "compressor adtopk: ratio 0.01"),
        "gpt": (int(steps[1]), 0.1, 0.1, "short columns joined"),
        "recipe": (int(steps[2]), 0.08, 0.04, "2-bit values")}
jobs = {name: spec for name, spec in jobs.items() if name in wanted.split()}
record = {"device": want, "ranks": np_, "exchange_when_alone": np_ == 1, "jobs": {}}
ok_all = True
for name, (n_steps, max_density, max_bytes, mark) in jobs.items():
    path, log_path = f"{out}/hvd_jobs_{name}.json", f"{out}/hvd_jobs_{name}.log"
    if not os.path.exists(path):
        print(f"{name}: no summary ({path}), the job did not finish: FAILED")
        record["jobs"][name] = {"ok": False, "failed_checks": ["no summary"]}
        ok_all = False
        continue
    res, log = json.load(open(path)), open(log_path).read()
    bytes_frac = res["bytes_sent"] / res["bytes_dense"] if res["bytes_dense"] else float("nan")
    checks = {
        f"ran on {want}": f"{np_} rank(s) (horovod init, {want})" in log,
        f"{np_} rank(s) in the summary": res["world_size"] == np_,
        f"{n_steps} steps": res["step"] == n_steps,
        "payload bytes counted by the exchange (bytes_sent > 0)": res["bytes_sent"] > 0,
        f"density in (0, {max_density})": 0 < res["density"] < max_density,
        f"bytes sent / dense < {max_bytes}": bytes_frac < max_bytes,
        f"log holds {mark!r}": mark in log,
        "finite test loss": math.isfinite(res["test_loss"]),
    }
    if np_ > 1:
        checks["replicas_identical"] = res.get("replicas_identical") is True
        same = "bitwise equal" if res.get("replicas_identical") is True else "DIFFER"
    else:  # the summary's True at one rank compares nothing
        same = "not applicable at 1 rank"
    failed = [k for k, v in checks.items() if not v]
    ok_all = ok_all and not failed
    record["jobs"][name] = {"ok": not failed, "failed_checks": failed, "steps": res["step"],
                            "density": res["density"], "bytes_sent": res["bytes_sent"],
                            "bytes_dense": res["bytes_dense"], "test_loss": res["test_loss"],
                            "wall_time": res["wall_time"],
                            "replicas_identical": res.get("replicas_identical") if np_ > 1 else same}
    print(f"{name}: {want}, {np_} rank(s), {res['step']} steps, density {res['density']:.5f}, payload bytes "
          f"{bytes_frac:.4f} of dense, test loss {res['test_loss']:.3f}, replicas {same}: "
          + ("ok" if not failed else "FAILED: " + "; ".join(failed)))
record["ok"] = ok_all
with open(f"{out}/hvd_jobs.json", "w") as f:
    json.dump(record, f, indent=1)
print(f"hvd_jobs: {'all checks passed' if ok_all else 'FAILED'} (record: {out}/hvd_jobs.json)")
sys.exit(0 if ok_all else 1)
PYEOF
    return "$failed"
}

export OUT_DIR PY DRY
export -f versions run_tests bench ddp_check find_horovodrun horovod_check hvd_fmnist hvd_jobs gpt_job gpt gpt_local

# Stages bucket and step: benchmarks/bench_bucket_select.py (its docstring says what they measure). bucket: the
# whole-bucket ADTopk selection on GPT-2 small, BERT-base and ResNet-50 against a minimum-traffic copy and the
# per-layer path (bitwise equal, no host sync); step: a GPT-2-small step on the DDP engine, ADTopk against dense
# DDP, PowerSGD (rank 4) and fp16_compress_hook. JSON in $OUT/bench_bucket_select.json.
bucket_bench() {
    local dry=()
    [ "$DRY" = "1" ] && dry=(--dry)
    "$PY" benchmarks/bench_bucket_select.py --stage bucket "${dry[@]}" --out "$OUT_DIR"
}
step_bench() {
    local dry=()
    [ "$DRY" = "1" ] && dry=(--dry)
    "$PY" benchmarks/bench_bucket_select.py --stage step "${dry[@]}" --out "$OUT_DIR"
}
export -f bucket_bench step_bench

if [ "$DRY" = "1" ]; then
    echo "GPU_CHECK_DRY=1: benchmark stage (CPU tensors under the Triton interpreter), ddp, horovod and hvd_jobs stages (CPU, Gloo)"
    run_stage bench 300 bench
    run_stage ddp 180 ddp_check
    run_stage horovod 180 horovod_check
    run_stage hvd_jobs 300 hvd_jobs
    run_stage gpt 180 gpt
    run_stage gpt_local 180 gpt_local
    run_stage bucket 120 bucket_bench
    run_stage step 120 step_bench
else  # stage limits add up to about 14 minutes (over one 10-minute command: name the stages wanted)
    run_stage versions 30 versions
    run_stage tests 120 run_tests
    run_stage ddp 100 ddp_check
    run_stage horovod 60 horovod_check
    run_stage hvd_jobs 90 hvd_jobs  # three horovodrun launches of about 20 s each (the gpt stage took 25 s)
    run_stage gpt 70 gpt
    run_stage gpt_local 50 gpt_local
    run_stage bucket 90 bucket_bench
    run_stage step 90 step_bench
    run_stage bench 140 bench
fi

if [ -n "$FAILED" ]; then
    echo "FAILED stages:$FAILED (logs in $OUT_DIR/)"
    exit 1
fi
echo "all stages passed (logs in $OUT_DIR/)"
