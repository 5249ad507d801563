"""Known issues bound their symptom (harness/known_issues/bounds.py): a failure that
matches an entry's pattern but records numbers beyond its bounds is a new failure. The
paths and the judgement, every shipped entry against its committed known runs and
against ten times its symptom, and pytest runs of a stand-in. No server."""

from __future__ import annotations

import glob
import json
import math
import re
from pathlib import Path

import pytest

from harness import known_issues as ki
from harness.core import reportfile
from harness.known_issues import bounds

ROOT = Path(__file__).resolve().parents[2]
# a symptom given as a size, a count or a fraction: such an entry has bounds, or says
# in `unbounded` why none fits
NUMERIC_SYMPTOM = re.compile(r"\bnats?\b|logprob|\d+ of \d+|\d+/\d+|\d\.?\d*e-\d")


# ----------------------------------------------------------------------------- paths

def test_values_follow_dotted_paths_lists_wildcards_and_dotted_keys():
    m = {"max_abs_dlogprob": 3.5, "flag": True, "bad": float("nan"), "text": "nan",
         "steps": [{"max_abs_dlogprob": 1e-5}, {"max_abs_dlogprob": 9.8}],
         "ssm": {"A_log": {"kept": 11.3}, "conv1d.weight": {"kept": 9.9},
                 "D": {"kept": "non-finite logprobs"}, "all_shifted": 1e-5}}
    assert bounds.values(m, "max_abs_dlogprob") == [3.5]
    assert bounds.values(m, "steps.max_abs_dlogprob") == [1e-5, 9.8]
    assert sorted(bounds.values(m, "ssm.*.kept")) == [9.9, 11.3]  # the string is left out
    assert bounds.values(m, "ssm.conv1d.weight.kept") == [9.9]
    assert bounds.values(m, "flag") == [1.0]
    assert bounds.values(m, "bad") == [] and bounds.values(m, "text") == []
    assert bounds.values(m, "missing") == [] and bounds.values(m, "steps.missing") == []


def test_judgement_says_how_far_from_the_bound():
    b = bounds.Bound("max_abs_dlogprob", 0.0, 2e-3)
    inside = bounds.judge((b,), {"max_abs_dlogprob": 8.5e-4})[0]
    assert inside.within and inside.describe() == (
        "max_abs_dlogprob: got 0.00085, known up to 0.002: within, 42% of the upper bound")
    out = bounds.judge((b,), {"max_abs_dlogprob": 9.83})[0]
    assert not out.within and "BEYOND, 4.92e+03x the upper bound" in out.describe()
    assert bounds.beyond_message("x", [inside, out]) == (
        "beyond known issue x: got max_abs_dlogprob 9.83, known up to 0.002 "
        "(4.92e+03x the upper bound)")
    low = bounds.judge((bounds.Bound("g", 4, 4),), {"g": 0})[0]
    assert bounds.beyond_message("y", [low]).startswith(
        "beyond known issue y: got g 0, known down to 4")
    none = bounds.judge((b,), {})[0]
    assert not none.recorded and not bounds.beyond([none])
    assert none.describe() == "max_abs_dlogprob: not recorded (known up to 0.002)"


@pytest.mark.parametrize("table, error", [
    ('bounds = { m = [2.0, 1.0] }', "low <= high"),
    ('bounds = { m = 3.0 }', "low <= high"),
    ('bounds = { m = [0, "x"] }', "low <= high"),
    ('bounds = { "a..b" = [0, 1] }', "dotted metric path"),
    ('bounds = { m = [0, 1] }\nunbounded = "why"', "exclude each other"),
])
def test_bad_bounds_are_refused(tmp_path, table, error):
    f = tmp_path / "k.toml"
    f.write_text('[[issue]]\nid = "a"\nupstream = "u"\naffected = ">=0.26"\nsymptom = "s"\n'
                 f'tests = ["t"]\n{table}\n')
    with pytest.raises(ValueError, match=error):
        ki.load(f)


# ----------------------------------------------------------------------------- the shipped entries

def _known_runs() -> dict[str, list[tuple[str, dict]]]:
    """Entry id -> (report, metrics) of every committed run that came out known."""
    out: dict[str, list[tuple[str, dict]]] = {}
    for f in sorted(glob.glob(str(ROOT / "reports" / "**" / "*.json"), recursive=True)):
        try:
            d = json.loads(Path(f).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(d, dict) or not isinstance(d.get("tests"), list):
            continue
        for t in d["tests"]:
            if t.get("known_issue") and t.get("outcome") == "xfailed":
                out.setdefault(t["known_issue"], []).append(
                    (f"{Path(f).name} {t['nodeid']}", t.get("metrics") or {}))
    return out


SHIPPED = ki.load(ki.DEFAULT_PATH)
BOUNDED = [i for i in SHIPPED if i.bounds]


def test_every_numeric_symptom_has_bounds_or_says_why_not():
    missing = [i.id for i in SHIPPED
               if NUMERIC_SYMPTOM.search(i.symptom) and not (i.bounds or i.unbounded)]
    assert not missing, f"entries whose symptom is a number, without bounds: {missing}"
    assert len(BOUNDED) >= 6


@pytest.mark.parametrize("issue", BOUNDED, ids=[i.id for i in BOUNDED])
def test_every_committed_known_run_is_within_its_bounds(issue):
    """The bounds were chosen from these runs' spread (docs/known-issues.md): a bound
    that excludes one of them would turn a known failure into a new one."""
    runs = _known_runs().get(issue.id, [])
    outside = [f"{name}: {j.describe()}" for name, m in runs for j in issue.judge(m)
               if j.recorded and not j.within]
    assert not outside, "\n".join(outside)


@pytest.mark.parametrize("issue", BOUNDED, ids=[i.id for i in BOUNDED])
def test_ten_times_the_symptom_is_beyond_every_bounded_entry(issue):
    """The worst value each bound's known runs recorded, ten times over (or the upper
    bound's where no run recorded it), in the shape the test records it: beyond."""
    runs = _known_runs().get(issue.id, [])
    caught = []
    for b in issue.bounds:
        seen = [v for _, m in runs for v in bounds.values(m, b.path)]
        worst = max(seen) if seen else b.high
        if worst <= 0:
            continue  # a count at 0 (greedy 0 of 4) has no "ten times worse"
        metrics = _nested(b.path, 10 * worst)
        judged = issue.judge(metrics)
        assert bounds.beyond(judged), f"{b.path} = {10 * worst} is within {b.range_text()}"
        caught.append(bounds.beyond_message(issue.id, judged))
    assert caught, f"{issue.id}: no bound sees a symptom ten times worse"
    assert all(m.startswith(f"beyond known issue {issue.id}: got ") for m in caught)


def _nested(path: str, value: float) -> dict:
    node: object = value
    for part in reversed(path.split(".")):
        node = {("x" if part == "*" else part): node}
    return node  # type: ignore[return-value]


# ----------------------------------------------------------------------------- pytest runs

STANDIN = '''
import pytest

@pytest.mark.parametrize("size", [{within}, {worse}], ids=["as-known", "ten-times-worse"])
def test_partial_update_keeps_unsent_weights(case, request, size):
    """A stand-in of tests/test_known_issues.py's test: it records what the real one
    records and fails with the real one's words, by ``size`` nats."""
    request.node.user_properties.append(
        ("metrics", {{"partial_max_abs_dlogprob": size, "partial_greedy_identical": 0}}))
    raise AssertionError(f"teacher-forced logprobs: max |Δlogprob| {{size}} > 0.0001")
'''


def test_a_stand_in_ten_times_worse_than_the_shipped_entry_fails_the_run(pytester, monkeypatch):
    """The shipped entry partial-fused-update-uninitialized-shard against a stand-in of
    its test at its path: as bad as the known runs (4.56 nats) it is known; ten times
    worse it fails the run, saying so, and the report counts it as a new failure."""
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_known_issues.py").write_text(
        STANDIN.format(within=4.56, worse=45.6))
    monkeypatch.delenv(ki.ENV_PATH, raising=False)  # the shipped file
    monkeypatch.setattr(ki, "target_version", lambda url: ("0.32.0", "faked by the test"))
    monkeypatch.setattr(ki, "host_kind", lambda: "cpu")
    report = pytester.path / "report.json"
    # importlib: the inner modules share the suite's basenames (tests/test_lora.py, ...),
    # which a worker that ran the suite has imported already ("import file mismatch")
    r = pytester.runpytest("-rA", "-p", "no:cacheprovider", "--import-mode=importlib",
                           "--vllm-layout", "cpu",
                           "--harness-report", str(report), "tests/test_known_issues.py")
    r.assert_outcomes(failed=1, xfailed=1)
    out = r.stdout.str()
    assert ("beyond known issue partial-fused-update-uninitialized-shard: got "
            "partial_max_abs_dlogprob 45.6, known up to 12 (3.8x the upper bound)") in out, out
    assert "the failure, which matches the entry's pattern" in out
    assert re.search(r"XFAIL tests/test_known_issues.py::test_partial_update_keeps_unsent_"
                     r"weights\[shm-cpu-fp32-llama-as-known\]", out), out
    summary = out[out.index("= known issues ="):]
    assert "partial-fused-update-uninitialized-shard: a failure BEYOND its bounds" in summary
    assert "partial_max_abs_dlogprob: got 4.56, known 1 to 12: within, 38% of the upper " \
           "bound" in summary
    data = json.loads(report.read_text())
    worse = [t for t in data["tests"] if "ten-times-worse" in t["nodeid"]][0]
    assert worse["outcome"] == "failed" and worse["nodeid"] in data["summary"]["new_failures"]
    assert worse["message"].startswith("beyond known issue partial-fused-update")
    judged = {b["path"]: b for b in worse["known_issue_bounds"]}
    assert judged["partial_max_abs_dlogprob"]["within"] is False
    assert math.isclose(judged["partial_max_abs_dlogprob"]["worst"], 45.6)
    known = [t for t in data["tests"] if "as-known" in t["nodeid"]][0]
    assert known["outcome"] == "xfailed" and known["known_issue_bounds"][0]["within"] is True


def test_diff_calls_a_failure_beyond_its_known_issue_a_regression(tmp_path, monkeypatch, capsys):
    """``harness diff``: a test known in A that fails beyond its entry's bounds in B is a
    regression, and the bounds section shows how far B went."""
    from harness.commands import diff

    nodeid = "tests/test_known_issues.py::test_partial_update_keeps_unsent_weights[shm-cpu-fp32-llama]"
    base = json.loads(reportfile.read_text(ROOT / "reports" / "cpu-vllm-0.32.0.json.gz"))
    test_a = next(t for t in base["tests"] if t["nodeid"] == nodeid)
    test_b = dict(test_a, outcome="failed", message="beyond known issue partial-fused-update-"
                  "uninitialized-shard: got partial_max_abs_dlogprob 45.6, known up to 12",
                  metrics=dict(test_a["metrics"], partial_max_abs_dlogprob=45.6))
    a, b = dict(base, tests=[test_a]), dict(base, tests=[test_b])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    monkeypatch.setenv("COLUMNS", "200")
    assert diff.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    out = capsys.readouterr().out
    assert "fails in B beyond its known issue" in out, out
    section = out[out.index("== Known issues' bounds"):out.index("== Capabilities")]
    assert "partial_max_abs_dlogprob" in section and "3.8x the upper bound" in section, section
