"""``harness diff`` of two bench files: a throughput drop beyond the threshold, per
backend and size, is a regression (exit 1); each backend's change is shown; mixing a
bench file with a test report, or unlike hosts, is bad input (exit 2)."""

from __future__ import annotations

import copy
import json

import pytest

from harness.commands import diff
from harness.commands.diff import bench as diff_bench
from harness.core import text


def _case(backend, size_gb, gbps, *, layout="2gpu-split", ratio=None, error=None):
    summary = None if gbps is None else {
        "bytes": int(size_gb * 1e9), "gbps": gbps, "ratio": ratio,
        "warm_pause_to_resume_seconds": {"median": size_gb / gbps + 0.05},
        "cold_pause_to_resume_seconds": 3.0}
    return {"backend": backend, "layout": layout, "dtype": "bfloat16", "size_gb": size_gb,
            "summary": summary, "error": error}


def _bench(version, cases, *, gpus=2, limit=100.0):
    return {"kind": "harness-bench", "schema": 1,
            "header": {"vllm": {"version": version}, "start_time": "t",
                       "gpus": {"used": gpus, "names": ["NVIDIA H200"] * gpus},
                       "machine": "x86_64", "options": {"dtype": "bfloat16"}, "complete": True},
            "limits": [{"path": "nccl", "devices": {"src": 1, "dst": [0]},
                        "sizes": [{"bytes": 10**9, "gbps": limit}]}],
            "cases": cases}


A = _bench("0.26.0", [_case("nccl-packed", 1, 12.0, ratio=0.12),
                      _case("nccl-packed", 4, 14.0),
                      _case("nccl-unpacked", 1, 8.0),
                      _case("ipc-packed", 1, 13.0, layout="1gpu-colocated")])


def test_a_drop_beyond_the_threshold_is_a_regression_a_smaller_one_is_not():
    b = copy.deepcopy(A)
    b["header"]["vllm"]["version"] = "0.27.1"
    b["cases"][0]["summary"]["gbps"] = 6.0    # nccl-packed 1 GB: -50%
    b["cases"][1]["summary"]["gbps"] = 12.6   # nccl-packed 4 GB: -10%
    b["cases"][2]["summary"]["gbps"] = 9.6    # nccl-unpacked: +20%
    d = diff_bench.compare_bench(A, b, max_drop=0.2)
    levels = {(r["backend"], r["size_gb"]): r["level"] for r in d["cases"]}
    assert levels == {("nccl-packed", 1): "REGRESSION", ("nccl-packed", 4): "info",
                      ("nccl-unpacked", 1): "info", ("ipc-packed", 1): "info"}
    per = {r["backend"]: r for r in d["backends"]}
    assert per["nccl-packed"]["change"] == pytest.approx((0.5 * 0.9) ** 0.5 - 1)
    assert per["nccl-packed"]["level"] == "REGRESSION"
    assert per["nccl-unpacked"]["change"] == pytest.approx(0.2)
    assert len(d["regressions"]) == 1 and "nccl-packed 1 GB" in d["regressions"][0]
    assert diff_bench.compare_bench(A, b, max_drop=0.6)["regressions"] == []


def test_a_case_lost_or_failed_in_b_is_a_regression_unless_missing_is_allowed():
    b = copy.deepcopy(A)
    b["cases"] = [c for c in b["cases"] if c["backend"] != "nccl-unpacked"]
    b["cases"][0] = _case("nccl-packed", 1, None, error="TrainerError: NCCL hung\n...")
    b["cases"].append(_case("shm", 1, 0.5, layout="cpu"))
    d = diff_bench.compare_bench(A, b)
    why = {(r["backend"], r["size_gb"]): (r["level"], r["why"]) for r in d["cases"]}
    assert why[("nccl-unpacked", 1)] == ("REGRESSION", "measured in A, not in B")
    assert why[("nccl-packed", 1)][0] == "REGRESSION"
    assert "failed in B: TrainerError: NCCL hung" in why[("nccl-packed", 1)][1]
    assert why[("shm", 1)] == ("info", "new in B")
    allowed = diff_bench.compare_bench(A, b, allow_missing=True)
    assert [r for r in allowed["cases"] if r["level"] == "REGRESSION"] == \
        [r for r in allowed["cases"] if r["backend"] == "nccl-packed" and r["size_gb"] == 1]


def test_unlike_hosts_are_refused_unless_allowed():
    b = _bench("0.27.1", A["cases"], gpus=1)
    with pytest.raises(diff.BadInput, match="not like with like"):
        diff_bench.compare_bench(A, b)
    assert "GPU count" in diff_bench.compare_bench(A, b, allow_unlike_hosts=True)["unlike_hosts"]


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc))
    return p


def test_cli_exit_codes_and_the_per_backend_change(tmp_path, capsys):
    b = copy.deepcopy(A)
    b["header"]["vllm"]["version"] = "0.27.1"
    b["cases"][0]["summary"]["gbps"] = 6.0
    b["limits"][0]["sizes"][0]["gbps"] = 50.0
    pa, pb = _write(tmp_path, "a.json", A), _write(tmp_path, "b.json", b)
    assert diff.main([str(pa), str(pb)]) == 1
    out = capsys.readouterr().out
    assert "== nccl-packed: -29% GB/s over 2 sizes  REGRESSION" in out
    assert "== nccl-unpacked: +0% GB/s over 1 size" in out
    assert "REGRESSED: 1" in out and "beyond the 20% threshold" in out
    assert "nccl  1   100     50      -50%" in out  # the raw limit moved too: the host's
    assert max(len(ln) for ln in out.splitlines()) <= text.output_width()
    assert diff.main([str(pa), str(pb), "--max-drop", "0.6"]) == 0
    assert "No regression." in capsys.readouterr().out
    assert diff.main([str(pa), str(pb), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["kind"] == "bench"


def test_a_bench_file_and_a_test_report_are_not_compared(tmp_path, capsys):
    pa = _write(tmp_path, "a.json", A)
    report = _write(tmp_path, "r.json", {"header": {}, "tests": []})
    assert diff.main([str(pa), str(report)]) == 2
    err = capsys.readouterr().err
    assert "is a bench file (harness bench) and" in err and err.count("\n") == 1
    assert diff.main([str(report), str(pa)]) == 2
    broken = _write(tmp_path, "broken.json", dict(A, cases=[{"backend": "shm"}]))
    assert diff.main([str(pa), str(broken)]) == 2
    assert "case 0 lacks" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--max-drop", "5"], "--max-drop: a fraction of the GB/s between 0 and 1 (0.2 = a 20% drop), "
                          "got '5'"),
    (["--max-drop", "1"], "--max-drop: a fraction of the GB/s between 0 and 1"),
    (["--max-drop", "-0.1"], "--max-drop: a fraction of the GB/s between 0 and 1"),
    (["--max-drop", "abc"], "--max-drop: a fraction of the GB/s between 0 and 1"),
    (["--threshold-rel", "-1"], "--threshold-rel: a relative change >= 0 (0.5 = 50%), got '-1'"),
])
def test_a_threshold_that_means_nothing_is_one_line_and_exit_2(argv, says, tmp_path, capsys):
    pa = _write(tmp_path, "a.json", A)
    assert diff.main([str(pa), str(pa), *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"harness diff: {says}") and err.count("\n") == 1, err
    assert out == ""
