"""``harness bench`` end to end on this host: the reference backend against real vLLM
servers (started side by side), two small sizes, the raw host-copy limit in the same
run; the table, the JSON and the plot it writes.

The acceptance run (three sizes, under five minutes on two cores) is the command in
docs/bench.md; this one is shorter so that the suite stays fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.bench, pytest.mark.timeout(420)]


def test_bench_shm_prints_the_table_and_writes_json_and_plot(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run(
        [sys.executable, "-m", "harness.commands.cli", "bench", "--vllm-backend", "shm",
         "--sizes", "0.01,0.03", "--warm", "2", "--out", str(out),
         "--vllm-log-dir", str(tmp_path / "logs"), "--vllm-start-timeout", "900",
         "--vllm-sync-timeout", "120"],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # progress on stderr, one line per sync: a cold and two warm per size
    assert proc.stderr.count("shm 0.01 GB: ") == 3 and proc.stderr.count("shm 0.03 GB: ") == 3
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("shm ")]
    assert len(rows) == 4, proc.stdout  # two sizes in each of the two tables
    assert "limit host: host memory copy" in proc.stdout

    doc = json.loads((out / "bench.json").read_text())
    assert doc["kind"] == "harness-bench" and doc["header"]["complete"] is True
    assert [c["size_gb"] for c in doc["cases"]] == [0.01, 0.03]
    for case, model in zip(doc["cases"], doc["models"]):
        s = case["summary"]
        assert case["error"] is None and len(case["warm"]) == 2
        assert case["bytes"] == model["bytes"] and case["tensors"] == model["tensors"]
        assert s["gbps"] > 0 and 0 < s["ratio"] < 1.5 and s["limit_gbps"] > 0
        assert s["cold_init_seconds"] is not None and s["cold_init_seconds"] >= 0
        assert all(s["phases"][k] is not None for k in ("start", "update", "finish"))
        assert s["warm_pause_to_resume_seconds"]["median"] >= s["warm_sync_seconds"]["median"]
    assert [lim["path"] for lim in doc["limits"]] == ["host"]
    assert str(ROOT) not in (out / "bench.json").read_text()  # no machine directories
    assert (out / "bench.txt").read_text() in proc.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot: not drawn" in proc.stdout
    else:
        assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert len(doc["servers"]) == 2 and all(s["error"] is None for s in doc["servers"])
