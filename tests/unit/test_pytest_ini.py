"""The project's own pytest configuration raises no warning, whatever plugins a run
turns off: `cache_dir` in pytest.ini gave "PytestConfigWarning: Unknown config option:
cache_dir" in every run made with `-p no:cacheprovider` (CI runners' usual flag, and
ci/matrix.sh's), because the option belongs to the plugin that was turned off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow_unit  # a child pytest per parameter
@pytest.mark.parametrize("extra", [[], ["-p", "no:cacheprovider"]], ids=["plain", "no-cache"])
def test_the_project_configuration_warns_of_nothing(extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "HARNESS_"))} | {"CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *extra,
                        "-W", "error::pytest.PytestConfigWarning",
                        "tests/unit/test_pytest_ini.py"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Unknown config option" not in out, out[-2000:]
