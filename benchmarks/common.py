"""Helpers shared by the benchmark scripts in this directory (not a benchmark itself).

Every ``bench_*.py`` script imports this file as a sibling module (``import common``): Python puts the
directory of the script it runs on ``sys.path``, so ``python benchmarks/bench_compress.py`` finds it
without any path editing. ``horovod_adtopk`` is imported as an installed package (``pip install -e .``,
which ``scripts/setup.sh`` does).

What is here:

- :func:`machine_info`: CPU model, core counts, memory, versions, for every benchmark's JSON;
- :func:`ms`, :func:`fmt`, :func:`ratio`, :func:`table`: number formatting and plain-text tables;
  :func:`csv_list`, :func:`csv_ints`, :func:`csv_floats`: comma-separated options;
- :func:`write_json`: write a report (parent folders created);
- :func:`write_record`: write a benchmark record with the command, the commit (:func:`git_commit`), the date
  and the machine: every script whose JSON a table of ``docs/results.md`` reads writes it through this;
- :func:`run_command`: run a job (``horovodrun ...``) in its own session under a timeout, killing the
  whole process tree afterwards, optionally at the lowest priority and copying its output into a log;
  :data:`HOROVODRUN` and :data:`TORCHRUN` are the launchers beside this Python, :func:`launch_ranks` the
  command that starts a script on N local ranks with either;
- :func:`mean_std`, :func:`against_dense`: the mean +- sample standard deviation over seeds, and a mean
  against dense's, as the convergence scripts tabulate them; :func:`load_step_times`: the step times of
  ``bench_step.py`` records, for the modelled times to accuracy;
- :func:`load_example`: import a module of ``examples/`` (the training job's models and data sets);
- :func:`repo_package`: the repository's ``examples`` or ``tests`` package, registered by its path (no
  import-path edits), for ``import examples.job`` or ``from tests.cluster import Cluster``;
- :func:`model_shapes`: parameter names and shapes of ResNet-50, VGG-16, BERT-base and the benchmark MLP,
  built on the ``meta`` device (nothing allocated), with their parameter counts checked.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO_ROOT / "examples"
_BIN = Path(sys.executable).parent


def _launcher(name: str) -> str:
    """``name`` (a console script) of the running Python's environment if there is one, else whatever PATH finds."""
    return str(_BIN / name) if (_BIN / name).exists() else name


HOROVODRUN = _launcher("horovodrun")
TORCHRUN = _launcher("torchrun")


# --- machine --------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: Any = None, threads: Optional[int] = None) -> Dict[str, Any]:
    """The machine a benchmark ran on; ``device`` (a torch device) and ``threads`` are added when given."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    info: Dict[str, Any] = {
        "cpu_model": cpu_model(), "logical_cpus": os.cpu_count(), "usable_cpus": usable, "memory_gb": memory_gb,
        "platform": platform.platform(), "python": platform.python_version(),
        **{pkg: package_version(pkg) for pkg in ("torch", "numpy", "horovod", "horovod_adtopk")},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if threads is not None:
        info["torch_threads"] = threads
    if device is not None:
        info["device"] = str(device)
        if getattr(device, "type", None) == "cuda":
            import torch

            info["gpu"] = torch.cuda.get_device_name(device)
            info["cuda"] = torch.version.cuda
    return info


# --- formatting and output ------------------------------------------------------------------------------------


def ms(seconds: float, decimals: int = 3) -> str:
    """Milliseconds as text: ``decimals`` places below 10 s, whole milliseconds above."""
    return f"{seconds * 1e3:.{decimals}f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def fmt(value: Any, spec: str, none: str = "-") -> str:
    """``format(value, spec)``, or ``none`` for a missing value."""
    return none if value is None else format(value, spec)


def ratio(num: float, den: float, spec: str = ".2f") -> str:
    return format(num / den, spec) if den > 0 else "-"


def csv_list(text: str) -> List[str]:
    """A comma-separated command-line value as a list (blanks dropped): ``type=csv_list`` in argparse."""
    return [t.strip() for t in text.split(",") if t.strip()]


def csv_ints(text: str) -> List[int]:
    return [int(t) for t in csv_list(text)]


def csv_floats(text: str) -> List[float]:
    return [float(t) for t in csv_list(text)]


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns as wide as their widest cell, a dashed rule under the header."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def write_json(path: Any, data: Any) -> Path:
    """Write ``data`` as indented JSON (values JSON does not know become strings); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def portable_argv(argv: Optional[Sequence[str]] = None) -> List[str]:
    """``argv`` (default ``sys.argv``) with this machine's paths taken out.

    A path inside the repository becomes relative to its root; the Python running the script becomes
    ``python`` and a launcher beside it (``horovodrun``, ``torchrun``) its bare name; any other absolute path
    keeps only its last component (``.../name``).
    """
    out: List[str] = []
    root = str(REPO_ROOT) + os.sep
    for arg in (sys.argv if argv is None else argv):
        arg = str(arg)
        if arg == sys.executable:
            out.append("python")
            continue
        if os.path.isabs(arg) and Path(arg).parent == _BIN:
            out.append(Path(arg).name)
            continue
        arg = arg.replace(root, "")
        key, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value.startswith(os.sep):
            value = "..." + os.sep + Path(value).name
        out.append(key + eq + value)
    return out


def command_text(argv: Sequence[str]) -> str:
    """``argv`` as the one line a record stores: :func:`portable_argv`, joined by spaces."""
    return " ".join(portable_argv(argv))


def git_commit() -> Optional[str]:
    """``git rev-parse HEAD`` of the repository, with `` (with uncommitted changes)`` when tracked files differ."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=str(REPO_ROOT), capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=str(REPO_ROOT), timeout=30).returncode
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")


def write_record(path: Any, payload: Dict[str, Any], command: Optional[Sequence[str]] = None) -> Path:
    """Write a benchmark record: ``payload`` plus where it came from.

    Adds ``command`` (``command`` or ``sys.argv``, without this machine's paths: :func:`portable_argv`),
    ``commit`` (:func:`git_commit`), ``date`` (UTC, ISO 8601) and ``machine`` (:func:`machine_info`: CPU model,
    cores, memory, torch and the other versions). A ``machine`` or ``date`` already in ``payload`` is kept.
    ``benchmarks/report.py`` reads these three fields; a record without them is reported as lacking provenance.
    """
    record = dict(payload)
    record["command"] = command_text([sys.executable, *sys.argv] if command is None else command)
    record["commit"] = git_commit()
    record.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    record.setdefault("machine", machine_info())
    return write_json(path, record)


# --- launching jobs -------------------------------------------------------------------------------------------


def _descendants(pid: int) -> List[int]:
    try:
        import psutil  # a Horovod dependency
    except ImportError:  # pragma: no cover
        return []
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant (collected before anything dies).

    horovodrun puts the ranks in process groups of their own, so killing the launcher's group is not
    enough; the descendants are found through the process tree.
    """
    victims = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def _renice_sessions(pid: int) -> None:
    """Put the session of ``pid`` and of every descendant at autogroup nice 19.

    ``nice`` alone is not enough where the kernel groups processes by session
    (``/proc/sys/kernel/sched_autogroup_enabled``): CPU time is then shared between sessions whatever the nice
    values inside them, and horovodrun and torchrun start their workers in sessions of their own.
    """
    for p in [pid, *_descendants(pid)]:
        try:
            Path(f"/proc/{p}/autogroup").write_text("19")
        except OSError:
            pass


def run_command(cmd: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None, cwd: Any = None,
                on_line: Optional[Callable[[str], None]] = None, lowest_priority: bool = False,
                log_path: Any = None) -> Tuple[Optional[int], str, float]:
    """Run ``cmd`` in its own session; after it exits, or after ``timeout`` seconds, kill its process tree.

    The environment is this process's plus ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1``, then ``env``.
    ``cwd`` defaults to the repository root. ``on_line`` is called with every output line as it arrives
    (stdout and stderr merged); with ``log_path`` the output is also appended to that file as it arrives,
    after a line ``$ <command>`` (:func:`command_text`).

    ``lowest_priority``: run under ``nice -n 19`` and, every few seconds while waiting, put the sessions of
    all its processes at autogroup nice 19 too (:func:`_renice_sessions`), so that tests and other work on the
    machine come first; Gloo then gets an hour to receive (``HOROVOD_GLOO_TIMEOUT_SECONDS``, unless set), as a
    rank starved for minutes would otherwise end the job after Gloo's default 30 s.

    Returns ``(returncode, output, seconds)``; returncode is None on timeout.
    """
    cmd = (["nice", "-n", "19"] if lowest_priority else []) + [str(c) for c in cmd]
    full_env = dict(os.environ)
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if lowest_priority:
        full_env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "3600")
    full_env.update(env or {})
    start = time.monotonic()
    deadline = start + timeout
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as log, open(os.devnull if log_path is None else log_path, "ab") as copy:
        copy.write(f"$ {command_text(cmd)}\n".encode())
        proc = subprocess.Popen(cmd, cwd=str(cwd or REPO_ROOT), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=full_env, start_new_session=True)

        def pump() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                log.write(raw)
                copy.write(raw)
                copy.flush()
                if on_line is not None:
                    on_line(raw.decode(errors="replace"))

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        rc: Optional[int] = None
        while True:
            if lowest_priority:
                _renice_sessions(proc.pid)
            try:
                rc = proc.wait(timeout=max(0.0, min(deadline - time.monotonic(), 5.0 if lowest_priority else timeout)))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    break
        kill_tree(proc)  # on success nothing should be left; make sure
        reader.join(timeout=10)
        log.seek(0)
        output = log.read().decode(errors="replace")
    return rc, output, time.monotonic() - start


def launch_ranks(np_: int, argv: Sequence[str], engine: str = "horovod") -> List[str]:
    """The command that starts ``argv`` (a Python script and its arguments) on ``np_`` local ranks.

    ``engine`` "horovod": ``horovodrun -np N --gloo python ...``; "ddp": ``torchrun --standalone
    --nproc-per-node N ...`` with the training job's ``--engine ddp`` appended (``examples/train.py``'s DDP
    engine, which every script that launches it this way runs).
    """
    if engine == "ddp":
        return [TORCHRUN, "--standalone", "--nproc-per-node", str(np_), *map(str, argv), "--engine", "ddp"]
    if engine != "horovod":
        raise ValueError(f"unknown engine {engine!r}; valid: horovod, ddp")
    return [HOROVODRUN, "-np", str(np_), "--gloo", sys.executable, *map(str, argv)]


# --- aggregating runs -----------------------------------------------------------------------------------------


def mean_std(values: Sequence[Optional[float]], finite_only: bool = True) -> Tuple[Optional[float], Optional[float]]:
    """The mean and the sample standard deviation of ``values`` (the std is None below two values).

    ``finite_only``: None and non-finite values are left out, and (None, None) is returned when none is left.
    Otherwise every value counts, None as NaN (a run that diverged): a NaN makes the mean NaN, and the std too.
    The mean is ``statistics.mean``'s, correctly rounded (``fmean`` may differ in the last bit).
    """
    if finite_only:
        vals = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not vals:
            return None, None
    else:
        vals = [math.nan if v is None else float(v) for v in values]
        if any(math.isnan(v) for v in vals):
            return math.nan, None if len(vals) < 2 else math.nan
    return statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else None


def against_dense(mean: float, dense_mean: float, points: bool) -> float:
    """A mean against dense's: the difference in percentage points (``points``, for accuracies) or the ratio."""
    return 100 * (mean - dense_mean) if points else mean / dense_mean


def load_step_times(paths: Sequence[Any], rate: Optional[str] = None, np_: Optional[int] = None,
                    by_ratio: Optional[Callable[[str], bool]] = None) -> Dict[str, Dict[str, Dict[Any, tuple]]]:
    """``{model: {mode: {ratio or None: (median step seconds, file name, commit)}}}`` from ``bench_step.py``
    records, for the modelled times of the convergence scripts.

    Only the cells of link ``rate`` and of ``np_`` ranks when given. A mode for which ``by_ratio(mode)`` holds
    is keyed by the record's ratio (its step time depends on it), every other mode by None; where several
    cells or files give the same key, the first wins.
    """
    out: Dict[str, Dict[str, Dict[Any, tuple]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        ratio = data.get("config", {}).get("ratio")
        for cell in data.get("cells", []):
            if (rate is not None and cell.get("rate") != rate) or (np_ is not None and cell.get("np") != np_):
                continue
            for mode, res in cell.get("modes", {}).items():
                key = ratio if by_ratio is not None and by_ratio(mode) else None
                slot = out.setdefault(cell["model"], {}).setdefault(mode, {})
                if key not in slot:
                    slot[key] = (res["median_s"], Path(path).name, data.get("commit") or data.get("git_commit"))
    return out


# --- examples/ and model shapes -------------------------------------------------------------------------------


def load_example(name: str) -> types.ModuleType:
    """``examples/<name>.py`` as a module (loaded once), e.g. ``load_example("models").build_model("mlp")``.

    ``examples/`` holds scripts, not an installed package; this loads a file of it by path.
    """
    key = f"_adtopk_examples_{name}"
    return sys.modules[key] if key in sys.modules else register_module(key, EXAMPLES_DIR / f"{name}.py")


def register_module(name: str, path: Path, package_dir: Optional[Path] = None) -> types.ModuleType:
    """Load the file ``path`` as module ``name`` (a package whose submodules are found in ``package_dir`` when
    given) and register it in ``sys.modules``; nothing is registered if it fails to load."""
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=None if package_dir is None else [str(package_dir)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def repo_package(name: str) -> types.ModuleType:
    """The repository's package ``name`` (``examples``, ``tests``) registered by its path, so that a script run
    as ``python benchmarks/x.py`` can ``import examples.job`` or ``from tests.cluster import Cluster`` without
    editing the import path. The package already imported (e.g. under pytest) is returned as it is."""
    if name not in sys.modules:
        register_module(name, REPO_ROOT / name / "__init__.py", REPO_ROOT / name)
    return sys.modules[name]


#: Parameter totals the shape loaders must reproduce (BatchNorm statistics are buffers, not counted).
PARAM_COUNTS: Dict[str, int] = {
    "resnet50": 25_557_032,
    "vgg16": 138_357_544,
    "bert-base": 109_482_240,
    "mlp": 25_214_986,
}
MODEL_SHAPE_NAMES: Tuple[str, ...] = tuple(PARAM_COUNTS)
#: How to get the optional packages the shape loaders use.
INSTALL_HINT = {"transformers": "pip install transformers"}


def _require(module: str, purpose: str) -> types.ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise SystemExit(f"{purpose} needs the '{module}' package, which is not importable ({exc}).\n"
                         f"Install it into this environment: {sys.executable} -m {INSTALL_HINT[module]}") from exc


def _build_on_meta(name: str):
    import torch

    if name in ("resnet50", "vgg16"):
        # Our own layouts of the torchvision models (same parameter names and shapes): torchvision's
        # wheels are tied to one torch build (the PyPI wheel needs the CUDA torch), see examples/models.py.
        models = load_example("models")
        cls = {"resnet50": models.ResNet50, "vgg16": models.VGG16}[name]
        with torch.device("meta"):
            return cls()
    if name == "bert-base":
        transformers = _require("transformers", "the bert-base layer shapes")
        with torch.device("meta"):
            return transformers.BertModel(transformers.BertConfig())  # bert-base-uncased sizes, with pooler
    if name == "mlp":
        with torch.device("meta"):
            return load_example("models").MLP((2048, 4096, 4096, 10))
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODEL_SHAPE_NAMES)}")


_SHAPES: Dict[str, List[Tuple[str, Tuple[int, ...]]]] = {}


def model_shapes(name: str) -> List[Tuple[str, Tuple[int, ...]]]:
    """``[(parameter name, shape), ...]`` in registration order for "resnet50", "vgg16", "bert-base", "mlp".

    Built on the meta device (no memory, no downloads). Raises RuntimeError when the total differs from
    :data:`PARAM_COUNTS` (e.g. another transformers release changed BERT's defaults).
    """
    if name not in _SHAPES:
        model = _build_on_meta(name)
        shapes = [(n, tuple(int(s) for s in p.shape)) for n, p in model.named_parameters()]
        total = sum(math.prod(s) for _, s in shapes)
        if total != PARAM_COUNTS[name]:
            raise RuntimeError(f"{name}: {total:,} parameters, expected {PARAM_COUNTS[name]:,}")
        _SHAPES[name] = shapes
    return list(_SHAPES[name])
