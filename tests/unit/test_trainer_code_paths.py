"""trainer_code_path: which of vLLM's trainer APIs the vllm trainer code takes
per engine and release, from capabilities as the probe reports them (0.26, 0.27.1 and
0.32 as read in their sources). No vLLM."""

from __future__ import annotations

import pytest

from harness import transfer
from harness.transfer import registry as backends
from harness.vllm import api as vllm_api


def _caps(**kw):
    caps = {"vllm_version": "X", "errors": {}, "HTTPVLLMWeightSyncClient": True,
            "ModuleSource": True, "WeightTransferTrainerFactory": True,
            "factory_takes_backend": False, "IPCTrainerInitInfo": True,
            "NCCLTrainerInitInfo": True, "IPCWeightTransferEngine.trainer_send_weights": False}
    caps.update(kw)
    return caps


@pytest.fixture
def registry(monkeypatch):
    """The trainer factory's live registry (trainer_code_path reads it, not the probe:
    shm registers itself in the trainer process after the probe ran)."""
    factory = type("WeightTransferTrainerFactory", (), {"_registry": {}})

    def lookup(name):
        assert name == "WeightTransferTrainerFactory", name
        return factory

    monkeypatch.setattr(vllm_api, "lookup", lookup)
    return factory._registry


def test_032_every_engine_through_the_factory(registry):
    registry.update(ipc=1, nccl=1, shm=1)
    for engine in ("ipc", "nccl", "shm"):
        path, what = backends.trainer_code_path(engine, _caps())
        assert path == "factory", (engine, what)
    assert "IPCTrainerInitInfo(rank=0" in backends.trainer_code_path("ipc", _caps())[1]
    assert "ShmTrainerInitInfo(rank=0" in backends.trainer_code_path("shm", _caps())[1]


def test_0271_ipc_through_the_factory_nccl_not_offered(registry):
    registry.update(ipc=1, shm=1)
    caps = _caps(NCCLTrainerInitInfo=False)
    assert backends.trainer_code_path("ipc", caps)[0] == "factory"
    assert backends.trainer_code_path("shm", caps)[0] == "factory"
    path, why = backends.trainer_code_path("nccl", caps)
    assert path is None and "static nccl_common.trainer_init" in why


def test_026_static_ipc_and_shm_through_the_backend_first_factory(registry):
    registry.update(shm=1)  # 0.26 registers no trainer engine of its own
    caps = _caps(factory_takes_backend=True, IPCTrainerInitInfo=False,
                 NCCLTrainerInitInfo=False,
                 **{"IPCWeightTransferEngine.trainer_send_weights": True})
    path, what = backends.trainer_code_path("ipc", caps)
    assert path == "static" and "'send_mode': 'http'" in what
    path, what = backends.trainer_code_path("shm", caps)
    assert path == "factory-by-backend" and "WeightTransferConfig" in what
    assert backends.trainer_code_path("nccl", caps)[0] is None


def test_an_unregistered_shm_says_what_is_registered(registry):
    registry.update(ipc=1, nccl=1)
    path, why = backends.trainer_code_path("shm", _caps())
    assert path is None and "not registered" in why and "ipc, nccl" in why


def test_missing_client_or_source_or_module(registry):
    registry.update(ipc=1)
    assert "HTTPVLLMWeightSyncClient" in backends.trainer_code_path(
        "ipc", _caps(HTTPVLLMWeightSyncClient=False))[1]
    assert "ModuleSource" in backends.trainer_code_path("ipc", _caps(ModuleSource=False))[1]
    errors = {transfer.backend("ipc").vllm_api.module: "ModuleNotFoundError: No module named 'ray'"}
    path, why = backends.trainer_code_path("ipc", _caps(errors=errors))
    assert path is None and "No module named 'ray'" in why


def test_registered_without_its_init_info(registry):
    registry.update(ipc=1)
    path, why = backends.trainer_code_path("ipc", _caps(IPCTrainerInitInfo=False))
    assert path is None and "no IPCTrainerInitInfo" in why
