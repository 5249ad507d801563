"""HARNESS_SHM_DISCARD_UPDATES: the shm engine reads and checks an update, then loads
nothing and runs no reload lifecycle (a server whose updates do not land, on purpose)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from harness.transfer import shm_engine  # noqa: E402


class _Model:
    def __init__(self):
        self.loaded: list[str] = []

    def load_weights(self, weights):
        self.loaded += [n for n, _ in weights]


def _engine(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(shm_engine, "reload_lifecycle", lambda: (
        lambda model: calls.append("start"), lambda model, cfg, dev: calls.append("finish")))
    eng = object.__new__(shm_engine.ShmWeightTransferEngine)
    eng.model, eng.model_config, eng.device = _Model(), None, torch.device("cpu")
    eng.root, eng.reprocess_tied, eng.retained = None, False, None
    eng.init_transfer_engine(shm_engine.ShmWeightTransferInitInfo(root=str(tmp_path)))
    save_file({"w": torch.ones(2, 3)}, str(tmp_path / "b0.safetensors"))
    info = shm_engine.ShmWeightTransferUpdateInfo(
        path=str(tmp_path / "b0.safetensors"), names=["w"], dtype_names=["float32"],
        shapes=[[2, 3]])
    return eng, info, calls


def _update(eng, info):
    eng.start_weight_update()
    eng.receive_weights(info)
    eng.finish_weight_update()


def test_an_update_loads_without_the_switch(tmp_path, monkeypatch):
    monkeypatch.delenv(shm_engine.DISCARD_ENV, raising=False)
    eng, info, calls = _engine(tmp_path, monkeypatch)
    _update(eng, info)
    assert eng.model.loaded == ["w"] and calls == ["start", "finish"]


def test_the_switch_discards_every_update(tmp_path, monkeypatch):
    monkeypatch.setenv(shm_engine.DISCARD_ENV, "1")
    eng, info, calls = _engine(tmp_path, monkeypatch)
    _update(eng, info)
    assert eng.model.loaded == [] and calls == []


def test_the_switch_still_checks_the_update(tmp_path, monkeypatch):
    monkeypatch.setenv(shm_engine.DISCARD_ENV, "1")
    eng, info, _ = _engine(tmp_path, monkeypatch)
    info.shapes = [[3, 2]]
    with pytest.raises(ValueError, match="announced as"):
        eng.receive_weights(info)
