"""A report names the run's files relative to where pytest ran, never the machine's
own paths: it can be committed as written."""

from harness.pytest.report import relative_paths


def test_paths_under_the_run_directory_are_written_relative_to_it():
    root = "/srv/ci/checkout"
    report = {"cwd": root, "command": f"cd {root} && {root}/.venv/bin/python -m pytest",
              "servers": [{"log": f"{root}/.harness-cache/logs/vllm-1.log"}],
              "other": "/srv/ci/checkout-2/x", "elsewhere": "/usr/lib/python3", "n": 3}
    got = relative_paths(report, root + "/")
    assert got["cwd"] == "."
    assert got["command"] == "cd . && ./.venv/bin/python -m pytest"
    assert got["servers"][0]["log"] == "./.harness-cache/logs/vllm-1.log"
    assert got["other"] == "/srv/ci/checkout-2/x"   # a sibling directory is not under it
    assert got["elsewhere"] == "/usr/lib/python3" and got["n"] == 3


def test_a_run_that_ran_nothing_keeps_an_earlier_runs_report(pytester, monkeypatch):
    """A --collect-only (or --harness-plan) run given the path of an earlier real run's
    report overwrote it with an empty one (total 0). It keeps it now, and says so in
    one line; a path with no report of a run yet is still written (a plan's report)."""
    import json

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HARNESS_REPORT_PROBES", "0")
    pytester.makepyfile(test_one="def test_a(case):\n    pass\n")
    args = ("-p", "no:cacheprovider", "--vllm-backend", "shm", "--vllm-layout", "cpu")
    real = pytester.path / "real.json"
    r = pytester.runpytest(*args, "--harness-report", str(real))
    r.assert_outcomes(passed=1)
    before = real.read_text()
    assert json.loads(before)["summary"]["total"] == 1
    for extra in (["--collect-only"], ["--harness-plan"]):
        r = pytester.runpytest(*args, *extra, "--harness-report", str(real))
        assert real.read_text() == before, extra
        said = [ln for ln in r.outlines if ln.startswith("harness report")]
        assert said == [f"harness report: not written: no test ran, and {real} holds an "
                        "earlier run's report (1 tests); kept"], r.outlines
    fresh = pytester.path / "plan.json"
    pytester.runpytest(*args, "--harness-plan", "--harness-report", str(fresh))
    assert json.loads(fresh.read_text())["tests"] == []
