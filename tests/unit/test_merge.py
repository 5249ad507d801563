"""harness merge: the reports of one run's shards as one report, which harness diff,
harness matrix and the known-issues verifier read as the unsharded run; and every
refusal (reports that are not parts of one run) is one line, exit 2.

The shards are cut from a real report on record (1 x H200, -k ipc, green): its tests,
servers and host samples split in two as --harness-shard 1/2 and 2/2 would write them.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from harness import known_issues
from harness.commands import cli
from harness.commands import diff
from harness.commands import matrix
from harness.commands.merge import MergeError, merge_reports
from harness.core import reportfile
from harness.known_issues.verify import verify
from harness.pytest.report import summarize

ROOT = Path(__file__).resolve().parents[2]
WHOLE = ROOT / "reports" / "gpu" / "h200-vllm-0.26.0-k-ipc-green.json.gz"


@pytest.fixture(scope="module")
def whole() -> dict:
    return json.loads(reportfile.read_text(WHOLE))


def _shard(whole: dict, k: int, cut: int) -> dict:
    """Part ``k`` (1 or 2) of ``whole``: the tests before ``cut`` or from it on."""
    r = copy.deepcopy(whole)
    tests = r["tests"][:cut] if k == 1 else r["tests"][cut:]
    mine = {t["nodeid"] for t in tests}
    half = len(r["servers"]) // 2
    r["tests"], r["summary"] = tests, summarize(tests)
    r["servers"] = r["servers"][:half] if k == 1 else r["servers"][half:]
    h = r["header"]
    h["options"] = {**h["options"], "harness_shard": [k, 2],
                    "harness_report": f"./shard-{k}.json", "vllm_log_dir": f"./logs-{k}"}
    h["args"] = [*h["args"], "--harness-shard", f"{k}/2"]
    h["wall_seconds"] = whole["header"]["wall_seconds"] - (100 if k == 1 else 0)
    t = r["timing"]
    t["servers_started"] = len(r["servers"])
    t["start_seconds_sum"] = round(sum(s["start_seconds"] for s in r["servers"]), 1)
    samples = t["host_samples"]
    t["host_samples"] = samples[:len(samples) // 2] if k == 1 else samples[len(samples) // 2:]
    for e in r["known_issues"]["entries"]:
        e["tests_outcomes"] = {n: o if n in mine else "not run"
                               for n, o in e["tests_outcomes"].items()}
        if e["status"] == "known" and "known" not in e["tests_outcomes"].values():
            e["status"] = "applied, not run"
    return r


@pytest.fixture(scope="module")
def shards(whole) -> list[dict]:
    cut = len(whole["tests"]) // 2
    return [_shard(whole, 1, cut), _shard(whole, 2, cut)]


@pytest.fixture(scope="module")
def merged(shards) -> dict:
    return merge_reports(shards)


def _write(tmp_path: Path, name: str, report: dict) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(report))
    return str(p)


def test_two_shards_merge_to_the_outcomes_of_the_whole_run(whole, shards, merged):
    assert merged["summary"] == whole["summary"]
    assert [(t["nodeid"], t["outcome"]) for t in merged["tests"]] == [
        (t["nodeid"], t["outcome"]) for t in whole["tests"]]
    assert ({e["id"]: (e["status"], e["tests_outcomes"]) for e in merged["known_issues"]["entries"]}
            == {e["id"]: (e["status"], e["tests_outcomes"])
                for e in whole["known_issues"]["entries"]})
    assert len(merged["servers"]) == len(whole["servers"])
    assert [s["shard"] for s in merged["servers"]] == sorted(s["shard"] for s in merged["servers"])
    t = merged["timing"]
    assert t["servers_started"] == whole["timing"]["servers_started"]
    assert t["syncs"] == 2 * whole["timing"]["syncs"]  # each part kept the whole's figure
    assert t["start_wall_seconds"] == whole["timing"]["start_wall_seconds"]  # the longest
    assert len(t["host_samples"]) == len(whole["timing"]["host_samples"])
    assert t["trainer_starts"]["count"] == whole["timing"]["trainer_starts"]["count"]
    h = merged["header"]
    assert h["wall_seconds"] == whole["header"]["wall_seconds"]  # the longest shard
    assert [s["wall_seconds"] for s in merged["shards"]] == [
        whole["header"]["wall_seconds"] - 100, whole["header"]["wall_seconds"]]
    assert [s["shard"] for s in merged["shards"]] == [[1, 2], [2, 2]]
    assert h["exitstatus"] == 0 and h["complete"] is True


def test_partial_reports_of_one_run_merge_too(whole):
    """The workers of one run write the same header; only their tests differ."""
    a, b = copy.deepcopy(whole), copy.deepcopy(whole)
    a["tests"], b["tests"] = whole["tests"][:10], whole["tests"][10:]
    assert merge_reports([a, b])["summary"] == whole["summary"]


@pytest.mark.parametrize("exits, merged", [((0, 0), 0), ((0, 1), 1), ((5, 0), 0),
                                           ((5, 5), 5), ((1, 2), 2), ((0, None), None)])
def test_the_exit_status_is_the_worst_part(shards, exits, merged):
    parts = copy.deepcopy(shards)
    for p, code in zip(parts, exits):
        p["header"]["exitstatus"] = code
    assert merge_reports(parts)["header"]["exitstatus"] == merged


def _unlike(shards, change) -> list[dict]:
    parts = copy.deepcopy(shards)
    change(parts[1])
    return parts


REFUSALS = {
    "commit": (lambda r: r["header"]["git"].update(commit="0" * 40), "different commit"),
    "vllm": (lambda r: r["header"]["vllm"].update(version="0.27.1"), "different vLLM"),
    "keyword": (lambda r: r["header"].update(args=["-k", "nccl", "--harness-shard", "2/2"]),
                "different selection ({'-k': ['ipc and not smollm2']} against {'-k': ['nccl']})"),
    "option": (lambda r: r["header"]["options"].update(vllm_dtype=["bfloat16"]),
               "different selection"),
    "shards": (lambda r: r["header"]["options"].update(harness_shard=[2, 3]),
               "different selection ({'shards': 2} against {'shards': 3})"),
    "schema": (lambda r: r.update(schema=2), "different schema (3 against 2)"),
}


@pytest.mark.parametrize("what", list(REFUSALS))
def test_reports_of_unlike_runs_are_refused(shards, what):
    change, says = REFUSALS[what]
    with pytest.raises(MergeError) as e:
        merge_reports(_unlike(shards, change), ["shard-1.json", "shard-2.json"])
    assert "shard-1.json and shard-2.json are not parts of one run" in str(e.value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_overlapping_reports_are_refused_naming_a_test(shards):
    parts = copy.deepcopy(shards)
    parts[1]["tests"].append(parts[0]["tests"][3])
    with pytest.raises(MergeError, match=r"^a.json and b.json overlap: both have tests/"):
        merge_reports(parts, ["a.json", "b.json"])
    with pytest.raises(MergeError, match="no report"):
        merge_reports([])


def test_the_command_merges_and_refuses_in_one_line(tmp_path, shards, whole, capsys):
    a, b = _write(tmp_path, "a.json", shards[0]), _write(tmp_path, "b.json", shards[1])
    out = tmp_path / "all.json"
    assert cli.main(["merge", a, b, "-o", str(out)]) == 0
    assert json.loads(out.read_text())["summary"] == whole["summary"]
    assert f"merged 2 reports: {whole['summary']['total']} tests" in capsys.readouterr().out
    assert cli.main(["merge", a, a, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harness merge: {a} and {a} overlap: both have ")
    assert err.count("\n") == 1
    assert cli.main(["merge", a, str(tmp_path / "none.json"), "-o", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- read as one run

def test_harness_diff_reads_the_merged_report_as_the_whole_run(tmp_path, whole, merged, capsys):
    w, m = _write(tmp_path, "whole.json", whole), _write(tmp_path, "merged.json", merged)
    assert diff.main([w, m, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["regressions"] == [] and not d["tests"], d["tests"]
    assert diff.main([m, w]) == 0


def test_harness_matrix_reads_the_merged_report_as_the_whole_run(tmp_path, whole, merged):
    w, m = _write(tmp_path, "whole.json", whole), _write(tmp_path, "merged.json", merged)
    assert matrix.render(matrix.load([m])) == matrix.render(matrix.load([w]))


def test_the_known_issues_verifier_reads_the_merged_report_as_the_whole_run(whole, merged):
    issues = known_issues.load(known_issues.issues_path())
    got_whole, notes_whole = verify(issues, [("run", whole)])
    got_merged, notes_merged = verify(issues, [("run", merged)])
    assert got_merged == got_whole and notes_merged == notes_whole
    assert any(c.backed for c in got_merged)
