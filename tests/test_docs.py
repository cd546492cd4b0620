"""The documentation: the site builds with warnings as errors, every code block runs in a test or names the test
that covers it, and no page names an issue number, a dated work-log heading or a path of one machine.

Pages are README.md and every page of the site's navigation (mkdocs.yml). The records under docs/ (JSON, the
benchmark scripts' tables) are evidence the pages link to, not pages; the markdown beside them (notes on the
records, outside the navigation) and BENCHMARKS.md are held to the same no-issue-number, no-dated-heading,
no-machine-path rule. About 15 s in all: the build takes about
3 s, the DDP quickstart under torchrun about 8 s.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import REPO, run_command

MKDOCS = Path(sys.executable).parent / "mkdocs"
FENCE = re.compile(r"^```")
MARK = re.compile(r"^<!-- (run: (?P<runner>[\w-]+)[^>]*|not run[^;]*; covered by (?P<tests>.+?)) -->$")


def nav_pages() -> list:
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    pages = []

    def walk(node):
        if isinstance(node, str):
            pages.append(REPO / "docs" / node)
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config["nav"])
    return pages


def pages() -> list:
    return [REPO / "README.md"] + nav_pages()


def record_pages() -> list:
    """Every markdown file under docs/ outside the navigation (the notes beside the records), and BENCHMARKS.md."""
    nav = set(nav_pages())
    return sorted(p for p in (REPO / "docs").rglob("*.md") if p not in nav) + [REPO / "BENCHMARKS.md"]


def code_blocks(path: Path) -> list:
    """(line number, the line before the fence, language, code) of every fenced block of a page."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            start, lang = i, lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and not FENCE.match(lines[j]):
                j += 1
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            blocks.append((start + 1, before.strip(), lang, "\n".join(lines[start + 1:j])))
            i = j + 1
        else:
            i += 1
    return blocks


def marked(runner: str) -> list:
    found = []
    for page in pages():
        for line, before, _, code in code_blocks(page):
            m = MARK.match(before)
            if m and m.group("runner") == runner:
                found.append((page, line, code))
    return found


def test_site_builds_strict_without_warnings(tmp_path):
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} missing: run bash scripts/setup.sh (it installs the documentation tools)")
    proc = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert proc.returncode == 0 and not warnings, log[-6000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for name in ("DistributedOptimizer", "Compression", "SparseCompressor", "Outer", "broadcast_parameters"):
        assert f'id="horovod_adtopk.' in api and name in api, name
    ddp = (tmp_path / "site" / "reference" / "ddp" / "index.html").read_text()
    for name in ("register", "CompressionState", "local_steps", "shutdown"):
        assert name in ddp, name


def test_every_nav_page_exists_and_the_readme_is_short():
    missing = [str(p.relative_to(REPO)) for p in nav_pages() if not p.exists()]
    assert not missing, missing
    assert len((REPO / "README.md").read_text().splitlines()) <= 260


def test_every_code_block_runs_or_names_the_test_that_covers_it():
    problems = []
    for page in pages():
        for line, before, _, _ in code_blocks(page):
            m = MARK.match(before)
            where = f"{page.relative_to(REPO)}:{line}"
            if not m:
                problems.append(f"{where}: no <!-- run: ... --> or <!-- not run: ...; covered by ... --> before it")
                continue
            if m.group("runner"):
                if m.group("runner") not in RUNNERS:
                    problems.append(f"{where}: no runner {m.group('runner')!r} in tests/test_docs.py")
                continue
            for ref in re.split(r"\s+and\s+|,\s*", re.sub(r"\s*\([^)]*\)", "", m.group("tests"))):
                ref = ref.strip()
                file, _, name = ref.partition("::")
                test_file = REPO / file
                if not (file.startswith("tests/") and name and test_file.exists()):
                    problems.append(f"{where}: {ref!r} is not tests/FILE.py::TEST")
                elif not re.search(rf"^def {re.escape(name)}\(", test_file.read_text(), re.M):
                    problems.append(f"{where}: {file} has no test {name}")
    assert not problems, "\n".join(problems)


BAD = [
    (re.compile(r"\bissues? #?\d+|(?<=[ (])#\d{1,4}\b", re.I), "an issue number"),  # not a debugger's "#3" frame,
    (re.compile(r"^#+ .*\b20\d\d-\d\d-\d\d", re.M), "a dated heading"),
    (re.compile(r"(?<![\w.~])/(work|tmp|root|home)/"), "a path of one machine"),
]


def bad_spans(paths: list, patterns: list) -> list:
    problems = []
    for page in paths:
        text = page.read_text()
        for pattern, what in patterns:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{page.relative_to(REPO)}:{line}: {what}: {m.group(0)!r}")
    return problems


def test_no_issue_numbers_dated_headings_or_machine_paths():
    problems = bad_spans(pages(), BAD)
    assert not problems, "\n".join(problems)


#: a work-log heading named after a session rather than a date
SESSION_HEADING = (re.compile(r"^#+ .*\b(?:first|second|third|fourth|fifth|sixth|later) sessions?\b|^#+ .*\bsession of\b",
                              re.I | re.M), "a work-log heading")


def test_record_pages_hold_no_issue_numbers_dated_headings_or_machine_paths():
    found = record_pages()
    assert REPO / "docs" / "convergence" / "RESULTS.md" in found and REPO / "BENCHMARKS.md" in found
    problems = bad_spans(found, BAD + [SESSION_HEADING])
    assert not problems, "\n".join(problems)


def test_the_checks_catch_what_they_look_for():
    assert BAD[0][0].search("as issue 55 says") and BAD[0][0].search("see #57")
    assert not BAD[0][0].search("#3  abort ()")
    assert BAD[1][0].search("### 1f. On a GPU (2026-12-04)") and not BAD[1][0].search("a run on 2026-12-04")
    assert BAD[2][0].search("cd /home/someone/project") and not BAD[2][0].search("~/.cache/x")
    assert MARK.match("<!-- not run: needs a GPU; covered by tests/test_x.py::test_y -->")
    assert SESSION_HEADING[0].search("## 3.0 At length (second and third sessions)")
    assert SESSION_HEADING[0].search("# Session of the kernels") and not SESSION_HEADING[0].search("the third session ran")


def test_concepts_picture_is_the_scripts_output():
    spec = importlib.util.spec_from_file_location("docs_figure", REPO / "scripts" / "docs_figure.py")
    docs_figure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_figure)
    assert (REPO / "docs" / "img" / "concepts.svg").read_text() == docs_figure.svg()


def run_ddp_quickstart(tmp_path):
    (found,) = [(p, line, code) for p, line, code in marked("ddp-quickstart") if p.name == "README.md"]
    script = tmp_path / "quickstart_ddp.py"
    script.write_text(found[2] + "\n")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    rc, out, _ = run_command([torchrun, "--standalone", "--nproc-per-node", "2", str(script)], timeout=120,
                             env={"OMP_NUM_THREADS": "1", "PYTHONPATH": ""}, cwd=str(tmp_path))
    assert rc is not None, f"timed out and was killed\n{out[-4000:]}"
    assert rc == 0, f"exit {rc}\n{out[-4000:]}"
    m = re.findall(r"W=(\d+): ([0-9.]+) MB sent, ([0-9.]+) MB received, dense allreduce ([0-9.]+) MB \((\d+)x less\)",
                   out)
    assert len(m) == 1, out[-4000:]
    world, sent, received, dense, factor = int(m[0][0]), *map(float, m[0][1:4]), int(m[0][4])
    assert world == 2 and 0 < sent < dense / 20 and factor >= 20, m


RUNNERS = {"ddp-quickstart": run_ddp_quickstart}


def test_ddp_quickstart_runs_under_torchrun(tmp_path):
    """The README's DDP block as a user runs it: saved to a file, 2 ranks under torchrun, from outside the
    repository without PYTHONPATH, under a timeout that kills the process group."""
    run_ddp_quickstart(tmp_path)


def test_quickstarts_agree():
    """Getting started shows the README's quickstarts: the same code."""
    readme = {code for _, _, lang, code in code_blocks(REPO / "README.md") if lang == "python"}
    started = [code for _, _, lang, code in code_blocks(REPO / "docs" / "getting-started.md") if lang == "python"]
    assert started and all(code in readme for code in started)
