"""A pytest run of this repository in a child process (collection or ``--harness-plan``:
nothing runs), made once per test run and shared by every test that asks for the same.

A collection of the whole suite takes 10-13 s of CPU on 2 cores, nine tenths of it the
test modules' imports (torch, vLLM, peft); several unit tests check what one selection
collects or plans, so each run is made once: the first test that asks makes it, the
others (on any pytest-xdist worker of the same run) read it. A run is known by
everything that can change it: the Python, the repository, the arguments and the whole
environment the child gets. It is kept in the test run's temporary folder (the parent
of the workers' ``--basetemp``), so nothing outlives the run: a later run, after any
change, makes its own.

The child's environment is the test process's without the run's own settings
(``HARNESS_*``, ``PYTEST_*``), the report's vLLM probes off, and what the caller adds.
Its pytest is given ``-q -p no:cacheprovider --harness-report FILE`` before the
caller's arguments; what it collected comes back with its output: each item's node id
and whether a skip mark is on it, the report (its ``plan`` with ``--harness-plan``), and
with ``--harness-shard`` the needs of the whole selection that the shard was cut from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parents[2]

# The default selection of `python -m pytest` (README line 2, .ci/run) on the CPU CI's
# host, without GPUs whatever this one has; one H200, the GPU CI's host.
CPU_HOST = "gpus=0,cores=2,ram_gib=24"
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
H200_HOST = "gpus=1,cores=16,gpu_memory_gib=139,ram_gib=128"

# Collects (or plans) and writes what it collected to argv[1]; the rest is pytest's.
CHILD = """
import pickle, sys
import pytest

class Record:
    items, needs = [], None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session):
        from harness.pytest import sharding
        self.items = [(it.nodeid, any(m.name == "skip" for m in it.iter_markers()))
                      for it in session.items]
        shards = session.config.stash.get(sharding.SHARDS, None)
        self.needs = None if shards is None else shards[1]

record = Record()
code = pytest.main(sys.argv[2:], plugins=[record])
with open(sys.argv[1], "wb") as f:
    pickle.dump((record.items, record.needs), f)
sys.exit(code)
"""


@dataclasses.dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    items: list[tuple[str, bool]]   # (node id, a skip mark is on it), in run order
    report: dict | None             # the --harness-report JSON
    needs: list | None              # with --harness-shard: the whole selection's needs

    def nodeids(self, under: str = "") -> list[str]:
        return [n for n, _ in self.items if n.startswith(under)]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "PYTEST_"))}
    out["HARNESS_REPORT_PROBES"] = "0"
    return {**out, **(env or {})}


def key(args: tuple[str, ...], env: dict[str, str]) -> str:
    """What tells one child run from another within a test run: the Python, the
    repository, the arguments and the environment (the files and the host are the
    test run's, whose folder holds the runs)."""
    return hashlib.sha256(json.dumps([sys.executable, str(ROOT), list(args), sorted(env.items())])
                          .encode()).hexdigest()[:20]


class ChildRuns:
    """``runs(*args, env=...)``: the shared Run of ``pytest *args`` in ``ROOT``."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> Run:
        full = child_env(env)
        base = self.folder / key(args, full)
        with FileLock(f"{base}.lock"):
            if not base.with_suffix(".run").exists():
                run = self._make(base, args, full)
                base.with_suffix(".run").write_bytes(pickle.dumps(run))
            return pickle.loads(base.with_suffix(".run").read_bytes())

    def plan(self, host: str, *args: str, env: dict[str, str] | None = None) -> dict:
        """``--harness-plan`` of a selection for ``host``: the report's plan, having
        checked that the run printed it and ran nothing."""
        r = self("--harness-plan", "--harness-plan-host", host, *args, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "server plan for" in r.stdout and "passed" not in r.stdout, r.stdout[-2000:]
        assert r.report["tests"] == [], "a plan runs nothing"
        return r.report["plan"]

    def cpu_default(self) -> Run:
        """The plan of `python -m pytest` on the CPU CI's host (every file under tests/)."""
        return self("--harness-plan", "--harness-plan-host", CPU_HOST, env=NO_GPU)

    def _make(self, base: Path, args: tuple[str, ...], env: dict[str, str]) -> Run:
        items = base.with_suffix(".items")
        report = base.with_suffix(".json")
        r = subprocess.run([sys.executable, "-c", CHILD, str(items), "-q", "-p", "no:cacheprovider",
                            "--harness-report", str(report), *args],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        got, needs = pickle.loads(items.read_bytes()) if items.exists() else ([], None)
        return Run(r.returncode, r.stdout, r.stderr, got,
                   json.loads(report.read_text()) if report.exists() else None, needs)
