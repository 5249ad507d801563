"""Figures the docs state that can be checked against the code or the committed
reports: a figure that drifts from what it describes fails here, not in a reader's
hands. (Times measured on a loaded host cannot be checked; counts can.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

from harness.core import reportfile

ROOT = Path(__file__).resolve().parents[2]


def test_reports_readme_counts_match_the_committed_reports():
    """reports/README.md said 749 tests for cpu-vllm-0.32.0-suite.json, whose summary
    totals 768."""
    text = (ROOT / "reports" / "README.md").read_text()
    found = re.findall(r"`([\w.-]+\.json(?:\.gz)?)`:[\s\S]{0,300}?(\d+) tests, (\d+) passed, (\d+) known "
                       r"issues, (\d+) skipped, (\d+) failed", text, re.S)
    assert found, "no report figures found in reports/README.md"
    for name, total, passed, known, skipped, failed in found:
        summary = json.loads(reportfile.read_text(ROOT / "reports" / name))["summary"]
        stated = {"total": int(total), "passed": int(passed), "xfailed": int(known),
                  "skipped": int(skipped), "failed": int(failed)}
        assert stated == {k: summary.get(k, 0) for k in stated}, name


def test_the_unit_test_count_in_the_costs_is_current(child_pytest):
    """docs/costs.md's `pytest tests/unit` row (the README's before) states how many tests
    it runs; within 5% of what is collected today (the suite grows, the figure follows):
    the default selection's tests under tests/unit, which need no server and so no host."""
    text = (ROOT / "docs" / "costs.md").read_text()
    m = re.search(r"\| `pytest tests/unit` \|[^|]*\|[^|(]*\((\d+) tests", text)
    assert m, "the costs' tests/unit row is gone"
    r = child_pytest.cpu_default()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    stated, now = int(m.group(1)), len(r.nodeids("tests/unit/"))
    assert abs(stated - now) <= 0.05 * now, (stated, now)
    layout = (ROOT / "docs" / "layout.md").read_text()
    assert "under a minute" not in layout


def test_the_two_gpu_nccl_plan_figures_are_the_plan(child_pytest):
    """docs/costs.md's 2-GPU `-k "nccl and not smollm2"` row (tests, servers; the
    README's before) is what the planner makes of that selection for its host:
    recomputed, not trusted."""
    text = (ROOT / "docs" / "costs.md").read_text()
    m = re.search(r'\| `-k "nccl and not smollm2"` \| 2 x H200 \| planned: (\d+) tests on '
                  r'(\d+) servers', text)
    assert m, "the costs' 2-GPU nccl row is gone"
    plan = child_pytest.plan("gpus=2,cores=32,ram_gib=256", "-k", "nccl and not smollm2")
    assert (int(m.group(1)), int(m.group(2))) == (plan["tests"], len(plan["servers"])), (
        "README states", m.group(0), "the plan today", plan["tests"], len(plan["servers"]))


def test_the_readme_gpu_section_says_which_python_gpu_run_uses():
    """The README's GPU section ran `bash ci/gpu-run.sh` without saying that it uses the
    first python3 on PATH and may `pip install -e .` into it (only the CI section said)."""
    script = (ROOT / "ci" / "gpu-run.sh").read_text()
    assert "python3 -m pytest" in script and "python3 -m pip install" in script
    text = (ROOT / "README.md").read_text()
    gpu = text.split("## On a GPU machine", 1)[1].split("\n## ", 1)[0]
    assert "first `python3` on `PATH`" in gpu and "pip install" in gpu and "-e ." in gpu, gpu


def test_the_readme_one_gpu_plan_figures_are_the_dry_run(child_pytest):
    """The README's GPU plan said 6.6 min while the dry run said 5.5: its figures for
    `-k "ipc and not smollm2"` on one H200 (tests, servers, starts and the estimate with
    `-n auto`) are the planner's today, recomputed."""
    from child_pytest import H200_HOST

    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r'`-k "ipc and not smollm2"` is (\d+) tests on (\d+) servers; with `-n auto` '
                  r'\((\d+) workers\), (\d+) starts and about ([\d.]+) min estimated', text)
    assert m, "the README's one-GPU plan figures are gone"
    r = child_pytest("-n", "auto", "--harness-plan", "--harness-plan-host", H200_HOST,
                     "-k", "ipc and not smollm2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    side = re.search(r"with (\d+) workers \(-n \d+\): (\d+) server starts .*?about ([\d.]+) min "
                     r"of wall time expected", r.stdout)
    assert side, r.stdout[-3000:]
    plan = r.report["plan"]
    stated = tuple(m.groups())
    now = (str(plan["tests"]), str(len(plan["servers"])), side.group(1), side.group(2),
           side.group(3))
    assert stated == now, ("README states", stated, "the dry run today", now)


def test_the_readme_opens_with_its_four_commands_and_names_every_command():
    """The README (395 lines) opened with two commands, and its list of the `harness`
    commands left `durations` out. It opens with line 1 and 2 as CI and the guide run
    them, the quick test and the GPU run, and names every command."""
    from harness.commands.cli import COMMANDS

    text = (ROOT / "README.md").read_text()
    block = text.split("```\n", 2)[1].splitlines()
    assert block == ["bash ci/setup.sh && .venv/bin/harness demo",
                     ".venv/bin/python -m pytest -n auto",
                     ".venv/bin/python -m pytest -m smoke",
                     "bash ci/gpu-run.sh OUT -k ipc"], block
    what = text.split("## What it is", 1)[1].split("\n## ", 1)[0]
    named = re.search(r"a command line, `harness` \(([^)]*)\)", " ".join(what.split()))
    assert named, what
    assert sorted(re.findall(r"`(\w+)`", named.group(1))) == sorted(COMMANDS)
    assert len(text.splitlines()) <= 240, "the README grew back: move the detail into docs/"
