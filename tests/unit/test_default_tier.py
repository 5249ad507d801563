"""The default CPU tier keeps every test function: ``python -m pytest`` on a host
without GPUs (README line 2, ``.ci/run``) collects each function that
``tests/default_tier.txt`` lists at least once. Sweeps over architectures, dtypes and
twins may move to ``--harness-depth full``; a function may not drop out of CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LISTED = ROOT / "tests" / "default_tier.txt"


def listed() -> list[str]:
    return [line.strip() for line in LISTED.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def collected_functions() -> set[str]:
    """``file::function`` of every test the default selection collects, on a host
    without GPUs whatever this one has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(CUDA_VISIBLE_DEVICES="", HARNESS_REPORT_PROBES="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "tests", "--ignore=tests/unit"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {line.split("[", 1)[0] for line in r.stdout.splitlines() if "::" in line}


def test_every_listed_function_is_in_the_default_tier():
    got = collected_functions()
    missing = [f for f in listed() if f not in got]
    assert not missing, (f"{len(missing)} test function(s) of the default tier are no longer "
                         f"collected on a host without GPUs: {missing[:10]}")


def test_the_list_names_no_function_twice():
    names = listed()
    assert len(names) == len(set(names)) and len(names) >= 123, len(names)


def gpu_functions(depth: str) -> set[str]:
    """``file::function`` of what ``-k "ipc and not smollm2"`` collects for one H200 (the
    GPU CI selection, planned for that host) at ``depth``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update(HARNESS_REPORT_PROBES="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                        "-p", "no:cacheprovider", "-k", "ipc and not smollm2",
                        "--harness-plan-host", "gpus=1,cores=16,gpu_memory_gib=139,ram_gib=128",
                        "--harness-depth", depth],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {line.split("[", 1)[0] for line in r.stdout.splitlines() if "::" in line}


def test_quick_depth_on_a_gpu_keeps_every_test_function_of_full_depth():
    """On GPUs quick depth (the default) trims the architecture sweep's cases, never a test
    function: every function the GPU CI selection runs at full depth it runs at quick."""
    full, quick = gpu_functions("full"), gpu_functions("quick")
    missing = sorted(full - quick)
    assert not missing, f"{len(missing)} function(s) only at full depth on a GPU: {missing[:10]}"
    assert len(quick) >= 120, len(quick)
