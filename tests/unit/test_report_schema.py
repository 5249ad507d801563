"""The report's schema (harness/core/report_schema.py): the committed reports load; a file
that is not a report this harness reads is one line naming the file and what is wrong;
what the writer writes is what the schema declares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_type_hints

import pytest

from harness import known_issues as ki
from harness.core import report_schema as rs
from harness.core import reportfile
from harness.pytest import report

ROOT = Path(__file__).resolve().parents[2]
# one committed report of each schema, and one that harness merge wrote
COMMITTED = {1: "reports/gpu/h200x2-vllm-0.26.0-nccl-shm.json.gz",
             2: "reports/cpu-vllm-0.32.0.json.gz",
             3: "reports/cpu-vllm-0.32.0-a-b-a.json",
             "merged": "reports/cpu-shard-e2e/merged.json.gz"}


def _keys(typed) -> set[str]:
    return set(get_type_hints(typed))


def _committed(which=3) -> dict:
    return json.loads(reportfile.read_text(ROOT / COMMITTED[which]))


@pytest.mark.parametrize("which", list(COMMITTED))
def test_a_committed_report_loads(which):
    r = rs.load(ROOT / COMMITTED[which])
    assert r["schema"] == (which if isinstance(which, int) else rs.SCHEMA_VERSION)
    assert r["tests"] and all(t["outcome"] in rs.OUTCOMES for t in r["tests"])
    assert set(r) <= _keys(rs.Report), set(r) - _keys(rs.Report)


def _write(tmp_path, data) -> Path:
    p = tmp_path / "r.json"
    p.write_text(json.dumps(data))
    return p


def _fails_with(path: Path, why: str) -> None:
    with pytest.raises(rs.ReportError) as e:
        rs.load(path)
    assert str(e.value) == f"cannot read {path}: {why}"
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", list(rs.REQUIRED))
def test_a_report_without_a_required_key_is_one_line(tmp_path, key):
    r = _committed()
    del r[key]
    _fails_with(_write(tmp_path, r),
                f"not a harness report (no '{key}'; write one with pytest --harness-report PATH)")


@pytest.mark.parametrize("schema, why", [
    (rs.SCHEMA_VERSION + 1, f"report schema {rs.SCHEMA_VERSION + 1} (written by a newer "
                            f"harness); this harness reads schemas 1 to {rs.SCHEMA_VERSION}"),
    (0, f"report schema 0; this harness reads schemas 1 to {rs.SCHEMA_VERSION}"),
    ("3", "not a harness report ('schema' is not a number: '3')"),
    (True, "not a harness report ('schema' is not a number: 'True')"),
])
def test_a_report_of_a_schema_this_harness_does_not_read_is_one_line(tmp_path, schema, why):
    r = _committed()
    r["schema"] = schema
    _fails_with(_write(tmp_path, r), why)


def test_a_test_record_without_its_outcome_is_one_line(tmp_path):
    r = _committed()
    i = len(r["tests"]) - 1
    nodeid = r["tests"][i]["nodeid"]
    del r["tests"][i]["outcome"]
    _fails_with(_write(tmp_path, r), f"test record {i} has no 'outcome' ({nodeid})")
    r["tests"][i] = "passed"
    _fails_with(_write(tmp_path, r), f"test record {i} is not an object")


def test_a_file_that_is_not_a_report_is_one_line(tmp_path):
    _fails_with(_write(tmp_path, [1, 2]), "not a harness report (a JSON list, not an object; "
                                          "write one with pytest --harness-report PATH)")
    (tmp_path / "r.json").write_text("<html>502</html>")
    _fails_with(tmp_path / "r.json", "not JSON (line 1 column 1)")
    _fails_with(tmp_path / "none.json", "no such file")


TINY_RUN = """
import pytest

def test_ok(request):
    request.node.user_properties.append(("case", {"backend": "shm", "layout": "cpu"}))
    request.node.user_properties.append(("metrics", {"max_abs_dlogprob": float("nan")}))
    request.node.user_properties.append(("sync", {"sync_seconds": 0.5, "first": True,
                                                  "start_seconds": 1.0}))
    request.node.user_properties.append(("phase", {"sync": 0.5}))

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="needs 2 GPUs")
def test_skipped():
    pass
"""


def test_what_the_writer_writes_is_what_the_schema_declares(pytester, monkeypatch):
    """A tiny run's report loads, and every key of it, of its tests, summary, timing and
    known issues is one its type declares (the header's, besides the versions and host
    of harness.core.environment)."""
    from harness.core import environment

    pytester.makepyfile(test_tiny=TINY_RUN)
    issues = pytester.path / "issues.toml"
    issues.write_text('[[issue]]\nid = "x"\nupstream = "u"\naffected = ">=0.1"\n'
                      'tests = ["*::test_none"]\nsymptom = "s"\n')
    monkeypatch.setenv(ki.ENV_PATH, str(issues))
    monkeypatch.setenv(report.PROBE_ENV, "0")
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    monkeypatch.setattr(ki, "target_version", lambda url: ("0.32.0", "faked by the test"))
    pytester.runpytest("-p", "no:cacheprovider", "--harness-report", "out.json")
    r = rs.load(pytester.path / "out.json")
    assert r["schema"] == rs.SCHEMA_VERSION
    assert set(r) <= _keys(rs.Report), set(r) - _keys(rs.Report)
    assert [t["outcome"] for t in r["tests"]] == ["passed", "failed", "skipped"]
    for t in r["tests"]:
        assert set(t) == _keys(rs.ReportedTest), set(t) ^ _keys(rs.ReportedTest)
    assert set(r["summary"]) <= _keys(rs.Summary) | set(rs.OUTCOMES)
    assert set(r["timing"]) == _keys(rs.Timing), set(r["timing"]) ^ _keys(rs.Timing)
    assert set(r["known_issues"]) == _keys(rs.KnownIssues)
    assert {"id", "status", "tests_outcomes"} <= set(r["known_issues"]["entries"][0])
    extra = set(environment.versions(extra=("tokenizers", "pytest"))) | set(environment.host())
    assert set(r["header"]) <= _keys(rs.Header) | extra, set(r["header"]) - _keys(rs.Header)
    assert r["tests"][0]["metrics"] == {"max_abs_dlogprob": "nan"}  # NaN is not JSON
