"""The JSON report (--harness-report): what a whole run writes, with JUnit XML alongside."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import sys
import threading
import types
import xml.etree.ElementTree as ET
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

import harness
from harness import known_issues as ki
from harness.pytest import report
import harness.vllm
from harness import transfer
from harness.transfer import capabilities

INNER_TESTS = """
import pytest

def test_ok(request):
    request.node.user_properties.append(("case", {"backend": "shm", "engine": "shm",
        "packed": False, "layout": "cpu", "dtype": "float32", "model": "llama"}))
    request.node.user_properties.append(("metrics", {"max_abs_dlogprob": 2e-6,
                                                     "tokens_compared": 60}))
    request.node.user_properties.append(("metrics", {"sync_seconds": 0.5, "sync_bytes": 1024,
                                                     "mean_abs_dlogprob": float("nan")}))

def test_fails():
    assert 1 == 2, "boom"

@pytest.mark.skip(reason="needs 2 GPUs")
def test_skipped():
    pass

@pytest.mark.xfail(reason="plain xfail")
def test_xfailed():
    assert False

@pytest.mark.xfail(reason="might work")
def test_xpassed():
    pass

def test_known():
    raise RuntimeError("upstream bug")

def test_known_fixed():
    pass

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_error(broken):
    pass
"""

INNER_ISSUES = """
[[issue]]
id = "inner-known"
upstream = "example#1"
affected = ">=0.1"
tests = ["*::test_known", "*::test_known_fixed"]
symptom = "upstream bug"
"""


@pytest.fixture
def inner_run(pytester, monkeypatch):
    issues = pytester.path / "issues.toml"
    issues.write_text(INNER_ISSUES)
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.setenv(ki.ENV_PATH, str(issues))
    monkeypatch.setenv(report.PROBE_ENV, "0")
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    monkeypatch.setattr(ki, "target_version", lambda config: ("0.32.0", "faked"))

    (pytester.path / "out").mkdir()

    def run(*args):
        r = pytester.runpytest("-p", "no:cacheprovider", "--harness-report", "out/report.json",
                               "--junitxml", "out/junit.xml", *args)
        return r, json.loads((pytester.path / "out" / "report.json").read_text())
    return run


def test_report_document(inner_run, pytester):
    r, rep = inner_run("--vllm-model", "llama", "--vllm-dtype", "fp32")
    assert rep["schema"] == report.SCHEMA_VERSION
    assert set(rep) == {"schema", "header", "capabilities", "summary", "tests", "known_issues",
                        "servers", "plan", "timing", "uncovered_capabilities"}

    h = rep["header"]
    assert h["vllm"] == report.vllm_distribution()
    assert h["torch"] == importlib.metadata.version("torch")
    assert h["python"] == ".".join(map(str, sys.version_info[:3]))
    assert h["selection"]["models"] == ["llama"] and h["selection"]["dtypes"] == ["float32"]
    assert h["seed"] == 0 and h["exitstatus"] == 1 and h["complete"] is True
    i = h["args"].index("--vllm-model")
    assert h["args"][i:i + 4] == ["--vllm-model", "llama", "--vllm-dtype", "fp32"]
    assert h["executable"] == sys.executable
    # the run's directory is written relative to itself: the report names no machine path
    assert "-m pytest" in h["command"] and h["command"].startswith("cd . && ")
    assert h["cwd"] == "." and str(pytester.path) not in json.dumps(rep)
    assert h["wall_seconds"] > 0 and h["start_time"].endswith("+00:00")
    assert set(h["gpus"]) == {"present", "used", "names"}

    tests = {t["nodeid"].split("::")[1]: t for t in rep["tests"]}
    assert {n: t["outcome"] for n, t in tests.items()} == {
        "test_ok": "passed", "test_fails": "failed", "test_skipped": "skipped",
        "test_xfailed": "xfailed", "test_xpassed": "xpassed", "test_known": "xfailed",
        "test_known_fixed": "failed", "test_error": "error"}
    ok = tests["test_ok"]
    # metrics merged across user_properties entries; NaN kept as a string (valid JSON)
    assert ok["metrics"] == {"max_abs_dlogprob": 2e-6, "tokens_compared": 60,
                             "sync_seconds": 0.5, "sync_bytes": 1024, "mean_abs_dlogprob": "nan"}
    assert ok["case"]["backend"] == "shm" and ok["known_issue"] is None
    assert ok["duration"] >= 0
    assert tests["test_skipped"]["reason"] == "needs 2 GPUs"
    assert tests["test_xfailed"]["reason"] == "plain xfail"
    assert "boom" in tests["test_fails"]["message"]
    assert "fixture broke" in tests["test_error"]["message"]
    assert tests["test_known"]["known_issue"] == "inner-known"
    assert tests["test_known"]["reason"].startswith("known issue inner-known (example#1)")
    assert tests["test_known_fixed"]["xpass_strict"] is True
    assert "fixed — remove this entry" in tests["test_known_fixed"]["message"]

    s = rep["summary"]
    assert (s["total"], s["passed"], s["failed"], s["error"], s["skipped"], s["xfailed"],
            s["xpassed"]) == (8, 1, 2, 1, 1, 2, 1)
    names = lambda ids: sorted(i.split("::")[1] for i in ids)  # noqa: E731
    assert names(s["known"]) == ["test_known"]
    assert names(s["fixed_known_issues"]) == ["test_known_fixed"]
    assert names(s["new_failures"]) == ["test_error", "test_fails"]

    entry = rep["known_issues"]["entries"][0]
    assert entry["id"] == "inner-known" and entry["status"] == "fixed — remove this entry"
    assert rep["known_issues"]["vllm_version"] == "0.32.0"

    caps = rep["capabilities"]
    assert caps["routes"] is None and "no vLLM server" in caps["routes_error"]
    assert "/update_weights" in caps["routes_used"]
    assert caps["trainer_api"] == {"error": f"probes disabled ({report.PROBE_ENV}=0)"}
    eps = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins")
           if e.value.startswith("harness.transfer.shm")]
    assert caps["backends"]["shm"]["loadable"] is bool(eps)
    assert rep["servers"] == []

    out = r.stdout.str()
    assert "reproduce: cd " in out and "--harness-report out/report.json" in out
    assert "harness report written to" in out


def test_a_run_killed_midway_leaves_the_report_of_what_finished(pytester, monkeypatch):
    # A GPU job's time limit kills pytest without a sessionfinish; the tests that ran
    # before must still be on disk, marked incomplete.
    monkeypatch.setenv(report.PROBE_ENV, "0")
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    pytester.makepyfile(test_cut="""
import os, pytest

@pytest.mark.skip(reason="not this one")
def test_skipped():
    pass

def test_first(request):
    request.node.user_properties.append(("metrics", {"max_abs_dlogprob": 1e-6}))

def test_killed():
    os._exit(137)
""")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-report", "cut.json")
    assert r.ret == 137
    rep = json.loads((pytester.path / "cut.json").read_text())
    assert rep["header"]["complete"] is False and rep["header"]["exitstatus"] is None
    outcomes = {t["nodeid"].split("::")[1]: t["outcome"] for t in rep["tests"]}
    assert outcomes == {"test_first": "passed", "test_skipped": "skipped"}
    assert rep["tests"][1]["metrics"] == {"max_abs_dlogprob": 1e-6}


def test_an_interrupted_test_is_not_reported_as_skipped(pytester, monkeypatch):
    # Ctrl-C, or ci/gpu-run.sh's GPU_RUN_SECONDS: the test under way was set up and
    # never finished; the run is marked incomplete.
    monkeypatch.setenv(report.PROBE_ENV, "0")
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    pytester.makepyfile(test_int="""
def test_done():
    pass

def test_cut():
    raise KeyboardInterrupt

def test_never():
    pass
""")
    r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-report", "int.json")
    assert r.ret == pytest.ExitCode.INTERRUPTED
    rep = json.loads((pytester.path / "int.json").read_text())
    assert rep["header"]["complete"] is False and rep["header"]["exitstatus"] == 2
    assert {t["nodeid"].split("::")[1]: t["outcome"] for t in rep["tests"]} == {
        "test_done": "passed", "test_cut": "interrupted"}
    assert rep["summary"]["interrupted"] == 1


def test_junit_xml_still_written(inner_run, pytester):
    inner_run()
    root = ET.parse(pytester.path / "out" / "junit.xml").getroot()
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) >= {"test_ok", "test_fails", "test_known", "test_error"}
    assert cases["test_fails"].find("failure") is not None
    props = {p.get("name"): p.get("value") for p in cases["test_known"].iter("property")}
    assert props.get("known_issue") == "inner-known"
    metrics = [p.get("value") for p in cases["test_ok"].iter("property")
               if p.get("name") == "metrics"]
    assert len(metrics) == 2 and "max_abs_dlogprob" in metrics[0]


# ----------------------------------------------------------------------------- capabilities

OPENAPI = {
    "openapi": "3.1.0", "info": {"title": "FastAPI", "version": "0.1.0"},
    "paths": {
        "/health": {"get": {}},
        "/update_weights": {"post": {}},
        "/pause": {"post": {"parameters": [
            {"name": "mode", "in": "query", "required": False,
             "schema": {"$ref": "#/components/schemas/PauseMode"}},
            {"name": "clear_cache", "in": "query", "schema": {"type": "boolean"}},
        ]}},
    },
    "components": {"schemas": {"PauseMode": {"enum": ["abort", "wait", "keep"],
                                             "type": "string", "default": "abort"}}},
}


def test_pause_capabilities_forms():
    assert report.pause_capabilities(OPENAPI) == {
        "route": True, "modes": ["abort", "wait", "keep"], "default": "abort",
        "params": ["clear_cache", "mode"]}
    # read by harness.pause.openapi, as the pause checks read it: query parameters only
    mode = {"name": "mode", "in": "query", "schema": {
        "anyOf": [{"enum": ["abort", "wait"]}, {"type": "null"}], "default": "abort"}}
    inline = {"paths": {"/pause": {"post": {"parameters": [mode]}}}}
    assert report.pause_capabilities(inline)["modes"] == ["abort", "wait"]
    assert report.pause_capabilities({"paths": {}}) == {"route": False, "modes": [],
                                                        "default": None, "params": []}


class _OpenAPIHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = json.dumps(OPENAPI if self.path == "/openapi.json" else {}).encode()
        self.send_response(200 if self.path in ("/openapi.json", "/health") else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def openapi_server():
    srv = HTTPServer(("127.0.0.1", 0), _OpenAPIHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_routes_captured_from_the_pool(pytester, monkeypatch, openapi_server):
    """Routes and pause modes come from the first server the pool started, captured
    before the pool's teardown stops it."""
    pytester.makeconftest(f"""
import pytest
from harness.pytest.run_state import STATE

class Cfg:
    def describe(self):
        return "fake config"

class Srv:
    url = {openapi_server!r}
    cfg = Cfg()
    version = "9.9.9"
    attached = False
    def alive(self):
        return True

class Pool:
    servers = {{Cfg(): Srv()}}
    started = [{{"config": "fake config", "start_seconds": 1.5, "version": "9.9.9",
                 "log": "x.log"}}]
    restarts = []
    samples = []
    t0 = 0.0

    def start_figures(self):
        return {{"servers_started": 1, "start_seconds_sum": 1.5, "start_wall_seconds": 1.5,
                 "restarts": 0}}

    def stop_all(self):
        pass

    class processes:  # the trainer processes, closed after the servers
        @staticmethod
        def close():
            pass

@pytest.fixture(autouse=True)
def fake_pool(request):
    request.config.stash[STATE].pool = Pool()
""")
    pytester.makepyfile(test_one="def test_one(): pass")
    monkeypatch.setenv(report.PROBE_ENV, "0")
    monkeypatch.setenv(ki.ENV_PATH, "none")
    r = pytester.runpytest("-p", "no:cacheprovider", "--harness-report", "r.json")
    r.assert_outcomes(passed=1)
    rep = json.loads((pytester.path / "r.json").read_text())
    caps = rep["capabilities"]
    assert caps["routes"] == ["/health", "/pause", "/update_weights"]
    assert caps["pause"]["modes"] == ["abort", "wait", "keep"]
    assert caps["routes_source"]["url"] == openapi_server
    assert rep["servers"] == [{"config": "fake config", "start_seconds": 1.5,
                               "version": "9.9.9", "log": "x.log"}]


def test_probes_use_vllm_api(monkeypatch):
    fake = types.SimpleNamespace(
        probe=lambda engines, isolated=False: {"isolated": isolated, "engines": sorted(engines)},
        backend_importable=lambda module: ("nccl" in module, f"{module} says hi"))
    monkeypatch.setattr(capabilities, "vllm_api", fake)
    api, backends = capabilities.backend_capabilities(True)
    assert api == {"isolated": True, "engines": ["ipc", "nccl"]}
    nccl_module = transfer.backend("nccl").vllm_api.module
    assert backends["nccl"] == {"loadable": True, "reason": f"{nccl_module} says hi"}
    assert backends["ipc"]["loadable"] is False
    assert backends["shm"]["loadable"] is True  # its vllm.general_plugins entry point


def test_probe_failure_is_recorded(monkeypatch):
    def probe(engines, isolated=False):
        raise RuntimeError("vLLM probe child failed (exit 1)")

    fake = types.SimpleNamespace(
        probe=probe, backend_importable=lambda module: (_ for _ in ()).throw(OSError("no python")))
    monkeypatch.setattr(capabilities, "vllm_api", fake)
    api, backends = capabilities.backend_capabilities(True)
    assert api == {"error": "RuntimeError: vLLM probe child failed (exit 1)"}
    assert backends["ipc"] == {"loadable": None, "reason": "OSError: no python"}


def test_an_interrupted_run_does_not_wait_for_the_probes(pytester, monkeypatch):
    """Ctrl-C must end a run at once, also when the capability probes (vLLM imported in
    a child, minutes on a loaded host with no cached answer) are still running: the
    report says they were, instead of waiting up to PROBE_WAIT_S for them."""
    monkeypatch.delenv(report.PROBE_ENV, raising=False)
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    pid_file = pytester.path / "probe.pid"
    pytester.makeconftest(f"""
import harness.vllm.probe_cache, harness.pytest.report
harness.vllm.probe_cache.load = lambda: (None, None)  # no cached answer
harness.pytest.report.PROBE_CHILD = (
    "import os, sys, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
    "time.sleep(300)")  # a probe that does not finish in time
""")
    pytester.makepyfile(test_int="""
def test_cut():
    raise KeyboardInterrupt
""")
    try:
        r = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--harness-report",
                                          "int.json", timeout=100)
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert r.ret == pytest.ExitCode.INTERRUPTED
    rep = json.loads((pytester.path / "int.json").read_text())
    assert rep["capabilities"]["trainer_api"] == {
        "error": "probes still running when the report was written"}


def test_trainer_starts_count_only_the_syncs_that_started_a_trainer():
    """The report's ``trainer_starts``: a warm sync (no ``start_seconds``) is not one;
    a sync whose trainer took over a spare is counted as such; each piece gets its
    median and sum over the syncs that have it."""
    syncs = [{"start_seconds": 0.1, "spare": True, "load_seconds": 1.0, "push_seconds": 4.0},
             {"start_seconds": 0.5, "spare": False, "load_seconds": 3.0, "push_seconds": 9.0,
              "close_seconds": 2.0},
             {"sync_seconds": 0.02, "first": False}]
    got = report.trainer_starts(syncs)
    assert got["count"] == 2 and got["spare"] == 1
    assert got["seconds"]["load_seconds"] == {"median": 3.0, "sum": 4.0}
    assert got["seconds"]["close_seconds"] == {"median": 2.0, "sum": 2.0}
    assert "sync_seconds" not in got["seconds"]  # only the warm sync has one
    assert report.trainer_starts([]) == {"count": 0, "spare": 0, "seconds": {}}
