"""The report's capability probes import vLLM in child processes (about 27 s on 2
cores, minutes on a loaded machine): they run once per vLLM installation, in a
process that outlives a short run and leaves the answer for every later one."""

from __future__ import annotations

import json
import time

import pytest

from harness.pytest import report
from harness.vllm import probe_cache

ANSWER = ({"nccl_path": "factory", "errors": {}},
          {"shm": {"loadable": True, "reason": "ep"},
           "nccl": {"loadable": True, "reason": "imports"},
           "ipc": {"loadable": False, "reason": "ModuleNotFoundError: ray"}})

# A stand-in for report.PROBE_CHILD: counts its runs in CALLS, sleeps DELAY seconds,
# then does what the real one does with ANSWER.
FAKE_CHILD = """import json, sys, time
from harness.vllm import probe_cache
open(CALLS, "a").write("probe\\n")
time.sleep(DELAY)
value = ANSWER
probe_cache.store(value)
open(sys.argv[1], "w").write(json.dumps(value))
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _child(tmp_path, delay=0.0, answer=ANSWER):
    calls = tmp_path / "calls"
    code = (FAKE_CHILD.replace("CALLS", repr(str(calls))).replace("DELAY", repr(delay))
            .replace("ANSWER", repr(answer)))
    return code, (lambda: len(calls.read_text().splitlines()) if calls.exists() else 0)


def test_one_probe_per_installation(cache_dir, tmp_path):
    code, calls = _child(tmp_path)
    assert probe_cache.answer(code, timeout=60) == (ANSWER, None) and calls() == 1
    value, source = probe_cache.answer(code, timeout=60)
    assert value == ANSWER and calls() == 1
    assert source == str(probe_cache.cache_path()) and source.startswith(str(cache_dir))


def test_a_probe_that_outlives_the_wait_still_fills_the_cache(cache_dir, tmp_path):
    code, calls = _child(tmp_path, delay=3.0)
    t0 = time.monotonic()
    assert probe_cache.answer(code, timeout=0.5) == (None, None)
    assert time.monotonic() - t0 < 2.5  # waited only as long as it was told
    deadline = time.monotonic() + 60
    while probe_cache.load()[0] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert probe_cache.answer(code, timeout=60)[0] == ANSWER and calls() == 1


def test_another_installation_is_probed_again(cache_dir, tmp_path, monkeypatch):
    code, calls = _child(tmp_path)
    probe_cache.answer(code, timeout=60)
    key = probe_cache.install_key()
    for field, value in (("vllm_version", "9.9.9"), ("vllm_metadata_mtime_ns", 1),
                         ("site_mtime_ns", 2), ("harness", "0.0.1"), ("probe_code", "x"),
                         ("python", "/other/python")):
        monkeypatch.setattr(probe_cache, "install_key", lambda f=field, v=value: {**key, f: v})
        assert probe_cache.load()[0] is None, field


def test_the_key_names_the_installed_vllm():
    from harness.core.facts import installed_vllm

    key = probe_cache.install_key()
    version, dist = installed_vllm()
    assert (key["vllm_version"], key["vllm_dist"]) == (version, dist)
    if dist:
        assert key["vllm_metadata"].endswith(".dist-info") and key["vllm_metadata_mtime_ns"]


@pytest.mark.parametrize("value", [
    ({"error": "RuntimeError: vLLM probe child failed"}, ANSWER[1]),
    (ANSWER[0], {**ANSWER[1], "ipc": {"loadable": False,
                                      "reason": "importing x did not finish within 120s"}}),
    (ANSWER[0], {**ANSWER[1], "nccl": {"loadable": None, "reason": "OSError"}}),
], ids=["probe error", "timeout", "unknown"])
def test_an_incomplete_answer_is_not_kept(cache_dir, value):
    assert probe_cache.store(value) is False
    assert probe_cache.load()[0] is None


def test_an_unreadable_cache_is_only_a_cost(cache_dir, tmp_path):
    path = probe_cache.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert probe_cache.load() == (None, path)
    code, calls = _child(tmp_path)
    assert probe_cache.answer(code, timeout=60) == (ANSWER, None)
    assert json.loads(path.read_text())["value"][1]["ipc"]["loadable"] is False


def test_a_second_report_run_does_not_probe_again(pytester, monkeypatch, cache_dir, tmp_path):
    """--harness-report alone once added ~27 s of probing to every run, --collect-only
    of four unit tests included."""
    from harness import known_issues as ki

    code, calls = _child(tmp_path)
    monkeypatch.setattr(report, "PROBE_CHILD", code)
    monkeypatch.delenv(report.PROBE_ENV, raising=False)
    monkeypatch.setenv(ki.ENV_PATH, "none")
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    for i in range(2):
        r = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q",
                               "--harness-report", f"r{i}.json")
        assert r.ret == 0, r.stdout.str()
    assert calls() == 1
    first, second = (json.loads((pytester.path / f"r{i}.json").read_text())["capabilities"]
                     for i in range(2))
    assert first["trainer_api"] == second["trainer_api"] == ANSWER[0]
    assert first["probe_cache"] is None and second["probe_cache"].startswith(str(cache_dir))


# ----------------------------------------------------------------------------- the rest of its cost

def test_a_report_run_with_the_answer_cached_starts_no_python(pytester, monkeypatch,
                                                              cache_dir):
    """With the probes' answer on disk, --harness-report starts no interpreter: no
    probe, no `import torch` to count GPUs."""
    import subprocess
    import sys

    from harness import known_issues as ki
    from harness.run import layouts

    assert probe_cache.store(ANSWER)
    started = []
    real_popen = subprocess.Popen

    class Popen(real_popen):
        def __init__(self, args, *a, **kw):
            if isinstance(args, (list, tuple)) and args and args[0] == sys.executable:
                started.append(args)
            super().__init__(args, *a, **kw)

    monkeypatch.setattr(subprocess, "Popen", Popen)
    monkeypatch.delenv(report.PROBE_ENV, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(ki.ENV_PATH, raising=False)  # the shipped known issues
    layouts.gpu_count.cache_clear()
    pytester.makepyfile(test_x="def test_x():\n    pass\n")
    r = pytester.runpytest("-p", "no:cacheprovider", "--collect-only", "-q",
                           "--harness-report", "r.json")
    layouts.gpu_count.cache_clear()
    assert r.ret == 0, r.stdout.str()
    assert started == []
    caps = json.loads((pytester.path / "r.json").read_text())["capabilities"]
    assert caps["probe_seconds"] < 1 and caps["trainer_api"] == ANSWER[0]


def test_gpus_are_counted_without_importing_a_cpu_build_of_torch(monkeypatch):
    import importlib.metadata
    import shutil
    import subprocess

    from harness.run import layouts

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no nvidia-smi
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda d: "2.13.0+cpu" if d == "torch" else real(d))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    layouts.gpu_count.cache_clear()
    try:
        assert layouts.gpu_count() == 0
    finally:
        layouts.gpu_count.cache_clear()


def test_a_known_issue_exception_is_checked_without_importing_its_module(monkeypatch):
    import sys

    from harness import known_issues as ki

    monkeypatch.delitem(sys.modules, "harness.pause.checks", raising=False)
    issue = ki.KnownIssue(id="x", upstream="u", affected=">=0", symptom="s", tests=("*",),
                          raises="harness.pause.checks.MissingFinishReason")
    issue.check_raises()
    assert "harness.pause.checks" not in sys.modules
    for bad, error in (("harness.pause.checks.NoSuchFailure", AttributeError),
                       ("harness.no_such_module.Failure", ImportError),
                       ("NoSuchError", AttributeError)):
        with pytest.raises(error):
            ki.KnownIssue(id="x", upstream="u", affected=">=0", symptom="s", tests=("*",),
                          raises=bad).check_raises()
    assert issue.raises_spec().__name__ == "MissingFinishReason"  # imported when it marks
