"""The example out-of-tree backend (examples/file_backend, docs/backends.md), registered
as a user's backend is, held to the harness's own tests.

It is registered without ``pip install``: a temporary directory holds a ``*.dist-info``
whose entry_points.txt declares what the example's pyproject.toml declares (its
``Backend`` in ``weight_sync_harness.backends``, its ``register`` in
``vllm.general_plugins``); that directory and examples/file_backend go on the PYTHONPATH
of a child pytest run, and from it to the vLLM server the run starts. The child runs the
seed flow and parity tests, and the pause test that updates the weights, over the
variant ``file`` (``-k file``) on one server: llama float32 on the CPU, the twins,
bfloat16 and vLLM's own trainer code left out (the twins and bfloat16 are servers of
their own; vLLM's trainer factory has no ``file`` engine: those cases skip saying so).
They must pass; with the example's deliberate bug on (``FILE_BACKEND_BREAK=drop``:
the server leaves the largest tensor of every update out while every route answers 200)
the seed flow's parity check must fail, and "gibberish before" still pass.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness

REPO = Path(harness.__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "file_backend"
# The seed flow and parity tests, and the pause test that updates the weights (the
# other pause tests do not touch the data plane, and take minutes on a CPU server).
TESTS = ("tests/test_sync.py", "tests/test_parity.py",
         "tests/test_pause_resume.py::test_weight_update_while_requests_held")
ONE_SERVER = "file and not bf16 and not twin and not via"
SESSION_LIMIT = 1500.0  # one child run: its server's start (1-4 min on 2 cores) and its tests
STOPPED_WITHIN = 60.0


def entry_points_txt() -> str:
    """The entry points the example's pyproject.toml declares, as a dist-info lists them."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    groups = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["entry-points"]
    assert set(groups) == {"vllm.general_plugins", "weight_sync_harness.backends"}, groups
    return "".join(f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items())
                   + "\n" for group, eps in groups.items())


def registered_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child run in which the example is registered: what
    ``pip install -e examples/file_backend`` would do, as a directory on the PYTHONPATH."""
    info = tmp_path / "entry-points" / "file_backend_example-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: file-backend-example\n"
                                   "Version: 0\n")
    (info / "entry_points.txt").write_text(entry_points_txt())
    # not the run's own settings (HARNESS_*, PYTEST_*: an xdist worker's among them)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "PYTEST_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(info.parent), str(EXAMPLE),
                                                        os.environ.get("PYTHONPATH")])),
               HARNESS_REPORT_PROBES="0", PYTHONUNBUFFERED="1", **extra)
    return env


def run_child(tmp_path: Path, *args: str, **env: str) -> tuple[int, str, dict]:
    """A child pytest run over the example: (exit code, output, its report's test
    entries by node id)."""
    out, report = tmp_path / "output.txt", tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider", "-p", "no:xdist",
           "-q", "-rA", "--rootdir", str(REPO), "--timeout", str(int(SESSION_LIMIT)),
           "--vllm-backend", "file", "--vllm-max-servers", "1",
           "--vllm-log-dir", str(tmp_path / "logs"), "--harness-report", str(report)]
    t0 = time.monotonic()
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                                env=registered_env(tmp_path, **env))
        try:
            rc = proc.wait(SESSION_LIMIT)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the harness tears its servers down on SIGTERM
            try:
                proc.wait(STOPPED_WITHIN)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
            raise AssertionError(f"the child run did not end within {SESSION_LIMIT:.0f}s: "
                                 f"{' '.join(cmd)}\n{out.read_text(errors='replace')[-4000:]}")
    text = out.read_text(errors="replace")
    tests = {t["nodeid"]: t for t in json.loads(report.read_text())["tests"]} \
        if report.exists() else {}
    counts = [t["outcome"] for t in tests.values()]
    print(f"child run: exit {rc}, {len(tests)} tests in {time.monotonic() - t0:.0f}s, "
          + json.dumps({o: counts.count(o) for o in sorted(set(counts))}))
    return rc, text, tests


def entry(tests: dict, test: str, text: str) -> dict:
    """The report's entry of ``test`` over the variant ``file`` (exactly one)."""
    found = [t for n, t in tests.items() if f"::{test}[file-" in n]
    assert len(found) == 1, f"{test} ran {len(found)} time(s) over 'file':\n{text[-4000:]}"
    return found[0]


def test_the_example_backend_passes_the_seed_flow_parity_and_pause_tests(tmp_path):
    rc, text, tests = run_child(tmp_path, *TESTS, "-k", ONE_SERVER)
    assert rc == 0 and tests, f"exit {rc}:\n{text[-6000:]}"
    bad = {n: t["outcome"] for n, t in tests.items()
           if t["outcome"] not in ("passed", "xfailed", "skipped")}
    assert not bad, f"{bad}\n{text[-6000:]}"
    for test in ("test_gibberish_before_sync", "test_parity_after_sync",
                 "test_repeated_syncs_last_one_wins", "test_a_then_b_then_a_again",
                 "test_first_sync_on_a_new_group", "test_request_while_paused_waits_for_resume"):
        assert entry(tests, test, text)["outcome"] == "passed", text[-6000:]
    held = [t["outcome"] for n, t in tests.items() if "::test_weight_update_while_requests_held[" in n]
    assert held and set(held) == {"passed"}, text[-6000:]
    assert all("[file-" in n for n in tests), sorted(tests)


@pytest.mark.selftest
def test_the_example_backend_broken_on_purpose_fails_the_parity_check(tmp_path):
    rc, text, tests = run_child(tmp_path, "tests/test_sync.py", "-k",
                                "file and (gibberish_before_sync or parity_after_sync) "
                                "and not via", FILE_BACKEND_BREAK="drop")
    assert rc == pytest.ExitCode.TESTS_FAILED, f"exit {rc}:\n{text[-6000:]}"
    # every route answered 200 and the server still computes something else: the
    # parity oracle says so, and nothing before it failed
    assert entry(tests, "test_gibberish_before_sync", text)["outcome"] == "passed", text[-6000:]
    parity = entry(tests, "test_parity_after_sync", text)
    assert parity["outcome"] == "failed", text[-6000:]
    assert "differ from the reference" in (parity["message"] or ""), parity["message"]
