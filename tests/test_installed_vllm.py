"""harness.vllm.api against the installed vLLM, in child processes: the capability
probe, whether vLLM's engine modules import, and that importing the harness loads
neither torch nor vLLM. No server, but each test imports vLLM in a child (seconds).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness import transfer
from harness.transfer import registry
from harness.vllm import api as vllm_api

pytest.importorskip("vllm")

PROBE_BOOLS = [
    "WeightTransferTrainerFactory", "WeightSource", "ModuleSource", "ParamMeta",
    "HTTPVLLMWeightSyncClient", "NCCLTrainerInitInfo", "IPCTrainerInitInfo",
    "NCCLWeightTransferEngine.trainer_send_weights", "IPCWeightTransferEngine.trainer_send_weights",
    "nccl_common.trainer_init", "NCCLWeightTransferEngine.trainer_init",
]


def test_probe_reports_every_capability():
    caps = registry.probe()
    for key in PROBE_BOOLS:
        assert isinstance(caps[key], bool), key
    assert isinstance(caps["trainer_factory_backends"], list)
    assert caps["nccl_path"] in ("factory", "static", "raw", "unimportable")
    assert caps["ipc_path"] in ("factory", "static", "raw", "unimportable")
    assert caps["vllm_version"]
    assert caps["errors"] == {}, caps["errors"]
    caps["errors"]["x"] = "y"  # callers get a copy, not the cached dict
    assert registry.probe()["errors"] == {}


def test_probe_on_vllm_032_picks_the_trainer_factory():
    caps = registry.probe()
    if not caps["vllm_version"].startswith("0.32."):
        pytest.skip(f"installed vLLM is {caps['vllm_version']}")
    assert caps["NCCLTrainerInitInfo"] and caps["IPCTrainerInitInfo"]
    assert {"nccl", "ipc"} <= set(caps["trainer_factory_backends"])
    assert not caps["factory_takes_backend"]
    # 0.32 has no static senders any more; packed rides the init info, not the update.
    assert not caps["NCCLWeightTransferEngine.trainer_send_weights"]
    assert not caps["IPCWeightTransferEngine.trainer_send_weights"]
    assert caps["nccl_update_info_fields"] == ["names", "dtype_names", "shapes"]
    assert (caps["nccl_path"], caps["ipc_path"]) == ("factory", "factory")


def test_importing_the_harness_modules_loads_no_torch_or_vllm():
    code = ("import sys, harness.vllm.api, harness.transfer.nccl, harness.transfer.ipc; "
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_isolated_probe_matches_in_process_probe():
    assert registry.probe(isolated=True) == registry.probe()


def test_backend_importable_on_installed_vllm():
    for engine in ("nccl", "ipc"):
        ok, why = vllm_api.backend_importable(transfer.backend(engine).vllm_api.module)
        assert ok, why


def test_backend_importable_names_the_cause(tmp_path, monkeypatch):
    # A stand-in engine module under a directory named vllm, failing like 0.26's
    # ipc_engine.py does without ray.
    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "fake_ipc_engine.py").write_text("import os\nimport no_such_module_for_harness\n")
    monkeypatch.setenv("PYTHONPATH", str(pkg))
    ok, why = vllm_api.backend_importable("fake_ipc_engine")
    assert not ok
    assert why.startswith("ModuleNotFoundError: No module named 'no_such_module_for_harness' (")
    assert "fake_ipc_engine.py raises it at module level: line 2, " \
           "`import no_such_module_for_harness`" in why
