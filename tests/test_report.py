"""The published results pages are what the records give.

``benchmarks/report.py`` writes docs/results.md and BENCHMARKS.md from the JSON records under docs/. These
tests regenerate both into a temporary directory and compare them with the committed pages byte for byte, so
a number edited by hand, or a record changed without regenerating, fails here. They also check what no
published page may hold: a path of the machine it was written on, an issue number, a dated work-log heading.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/results.md", "BENCHMARKS.md")


def _report():
    spec = importlib.util.spec_from_file_location("adtopk_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["adtopk_report"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES)
def test_page_is_what_the_records_give(tmp_path, page):
    _report().main(["--out-dir", str(tmp_path), "--no-plots"])
    want = (tmp_path / page).read_text()
    have = (ROOT / page).read_text()
    if have != want:
        diff = [f"line {i + 1}:\n  published: {a}\n  records:   {b}"
                for i, (a, b) in enumerate(zip(have.splitlines(), want.splitlines())) if a != b][:5]
        pytest.fail(f"{page} differs from what benchmarks/report.py makes of the records "
                    f"(run `python benchmarks/report.py`):\n" + "\n".join(diff or ["(lengths differ)"]))


MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home)(?:/|\b)")
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE)
DATED_HEADING = re.compile(r"^#+ .*(?:\b\d{4}-\d{2}-\d{2}\b|\b(?:first|second|third|fourth|fifth|sixth) sessions?\b)",
                           re.IGNORECASE | re.MULTILINE)


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES)
def test_page_holds_no_machine_path_issue_number_or_dated_heading(page):
    text = (ROOT / page).read_text()
    assert not MACHINE_PATH.findall(text), f"{page} names a path of this machine: {MACHINE_PATH.findall(text)[:3]}"
    assert not ISSUE.findall(text), f"{page} names an issue: {ISSUE.findall(text)[:3]}"
    assert not DATED_HEADING.findall(text), f"{page} has a dated work-log heading: {DATED_HEADING.findall(text)[:3]}"


@pytest.mark.quick
def test_the_checks_catch_what_they_look_for():
    """The patterns above must fire on the things they forbid (and not on the report's own anchors)."""
    assert MACHINE_PATH.search("see /home/someone/project/docs") and MACHINE_PATH.search("wrote /tmp/x.json")
    assert not MACHINE_PATH.search("docs/convergence/long/runs/x.json")
    assert ISSUE.search("as issue 56 asks") and ISSUE.search("fixed in #57") and ISSUE.search("Issue 28's target")
    assert not ISSUE.search("[Clean exit](#clean-exit)")
    assert DATED_HEADING.search("### 1g. The final ranking (2026-12-06)")
    assert DATED_HEADING.search("### 3.0 At length (second and third sessions)")
    assert not DATED_HEADING.search("## Clean exit {#clean-exit}")


@pytest.mark.quick
def test_every_summary_row_links_a_section_that_exists():
    text = (ROOT / "docs/results.md").read_text()
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', text))
    summary = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(#([\w-]+)\)", summary)
    assert links, "the summary table links no section"
    assert set(links) <= anchors, f"summary links to missing sections: {set(links) - anchors}"
