"""The plan's measured test durations (harness.run.durations): the committed table names
test functions that exist, the estimate takes a function's figure where there is one and
the constant where not, and the table is measured from reports as documented (medians,
waits for servers left out, failures and tests without a server ignored)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.commands import cli
from harness.run import durations
from harness.run import plan as P
from harness.vllm.server import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
GPU = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)
CPU = P.Host(gpus=0, cores=2, gpu_memory_gib=0, ram_gib=24)
CASE = {"backend": "shm", "layout": "cpu", "dtype": "float32", "model": "llama"}


def _defined_functions() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names |= set(re.findall(r"^\s*(?:async\s+)?def (test\w*)\(", path.read_text(), re.M))
    return names


@pytest.mark.parametrize("kind", durations.KINDS)
def test_the_committed_table_names_test_functions_that_exist(kind):
    table = durations.table(kind)
    assert len(table) > 40, "the table lost most of its functions"
    missing = sorted(set(table) - _defined_functions())
    assert missing == [], f"measured functions no test defines (rename? refresh the table): {missing}"
    assert all(isinstance(s, float) and s >= durations.FLOOR_SECONDS for s in table.values())
    sources = json.loads(durations.PATH.read_text())["source"][kind]
    assert sources and all((ROOT / s["report"]).is_file() and s["tests"] > 0 for s in sources)


def _need(nodeid: str) -> P.ServerNeed:
    return P.ServerNeed(nodeid, ServerConfig(model="/zoo/llama", backend="ipc", device_ids=(0,)))


def test_the_estimate_is_the_measured_median_where_known_and_the_constant_elsewhere():
    name = "test_concurrent_streams_through_pause_sync_resume_cycles"
    _, gpu_test = P.estimates(GPU)
    _, cpu_test = P.estimates(CPU)
    slow = _need(f"tests/test_pause_resume.py::{name}[ipc-packed-1gpu-colocated-fp32-llama]")
    assert gpu_test(slow) == durations.table("gpu")[name] > P.TEST_SECONDS["gpu"]
    assert cpu_test(slow) == durations.table("cpu")[name]
    unknown = _need("tests/test_new.py::test_not_measured_yet[c]")
    assert gpu_test(unknown) == P.TEST_SECONDS["gpu"]
    assert cpu_test(unknown) == P.TEST_SECONDS["cpu"]
    assert gpu_test(None) == cpu_test(None) == P.NO_SERVER_TEST_SECONDS


def test_function_of_is_the_name_between_the_path_and_the_case():
    assert durations.function_of("tests/a.py::test_x[shm-cpu-fp32-llama]") == "test_x"
    assert durations.function_of("tests/a.py::TestK::test_y[p::q]") == "test_y"
    assert durations.function_of("tests/a.py::test_z") == "test_z"


def _entry(nodeid: str, duration: float, outcome: str = "passed", case=CASE, **timing) -> dict:
    return {"nodeid": nodeid, "outcome": outcome, "duration": duration, "case": case,
            "timing": timing}


def _report(tests: list[dict], gpus: int = 0) -> dict:
    return {"schema": 3,
            "header": {"start_time": "2026-12-03T10:00:00+00:00", "git": {"commit": "abc"},
                       "gpus": {"used": gpus}},
            "tests": tests}


SYNTHETIC = _report([
    # three cases of one function: 2, 3 and 4 s of their own; median 3
    _entry("tests/t.py::test_a[1]", 10.0, server_wait=8.0, other=2.0),
    _entry("tests/t.py::test_a[2]", 60.04, lock_wait=57.0),   # a sleep behind starts
    _entry("tests/t.py::test_a[3]", 5.0, "xfailed", twin_wait=1.0),
    # what must not count: a hang cut by its timeout, an interruption, an error, a skip
    _entry("tests/t.py::test_a[4]", 600.0, "failed"),
    _entry("tests/t.py::test_a[5]", 300.0, "interrupted"),
    _entry("tests/t.py::test_a[6]", 300.0, "error"),
    _entry("tests/t.py::test_a[7]", 0.0, "skipped"),
    # a test that only waited: the floor
    _entry("tests/t.py::test_b[1]", 40.0, server_wait=40.0),
    # a test without a server
    _entry("tests/unit/u.py::test_c", 9.0, case=None),
])


def test_a_report_is_measured_into_medians_without_waits_or_failures():
    assert durations.measure([SYNTHETIC]) == {"test_a": 3.0, "test_b": 0.1}


def test_update_rewrites_one_kind_and_keeps_the_other(tmp_path):
    path = tmp_path / "durations.json"
    path.write_text(json.dumps({"gpu": {"test_old": 9.0}, "cpu": {"test_stale": 1.0}}))
    data, left_out = durations.update(path, "cpu", [("r.json", SYNTHETIC)], {"test_a", "test_b"})
    assert data == json.loads(path.read_text()) and left_out == []
    assert data["gpu"] == {"test_old": 9.0}
    assert data["cpu"] == {"test_a": 3.0, "test_b": 0.1}
    assert data["source"]["cpu"] == [{"report": "r.json", "commit": "abc", "tests": 4,
                                      "start_time": "2026-12-03T10:00:00+00:00"}]
    with pytest.raises(ValueError):
        durations.update(path, "tpu", [], set())


def test_a_function_renamed_since_the_reports_is_left_out(tmp_path):
    """The green GPU report names test_a_sync_while_asleep_fails_clearly_or_works, since
    renamed: a figure under the old name would describe no test."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_t.py").write_text("def test_a(case):\n    pass\n")
    assert durations.defined_functions(tmp_path / "tests") == {"test_a"}
    data, left_out = durations.update(tmp_path / "d.json", "gpu", [("r.json", SYNTHETIC)],
                                      {"test_a"})
    assert data["gpu"] == {"test_a": 3.0} and left_out == ["test_b"]


def test_the_command_takes_the_reports_kind_and_refuses_a_mix(tmp_path, capsys):
    cpu, gpu, out = tmp_path / "cpu.json", tmp_path / "gpu.json", tmp_path / "d.json"
    cpu.write_text(json.dumps(SYNTHETIC))
    gpu.write_text(json.dumps(_report(SYNTHETIC["tests"][:2], gpus=1)))
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_t.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")

    def run(*args: str) -> int:
        return cli.main(["durations", *args, "--out", str(out), "--tests", str(tests)])

    assert run(str(gpu)) == 0
    assert capsys.readouterr().out.startswith("gpu: 1 test functions from 2 tests in 1 reports")
    assert json.loads(out.read_text())["gpu"] == {"test_a": 2.5}
    assert run(str(cpu), str(gpu)) == 2
    assert "--kind" in capsys.readouterr().err
    assert run(str(cpu), str(gpu), "--kind", "cpu") == 0
    assert json.loads(out.read_text())["cpu"] == {"test_a": 3.0, "test_b": 0.1}
    assert run(str(tmp_path / "none.json")) == 2
    assert capsys.readouterr().err.startswith("harness durations: cannot read ")
    (tests / "test_t.py").unlink()
    assert run(str(cpu)) == 0
    assert capsys.readouterr().out.endswith(f"left out, not defined under {tests}: test_a, test_b\n")
    assert cli.main(["durations", str(cpu), "--out", str(out), "--tests", str(tmp_path / "x")]) == 2
