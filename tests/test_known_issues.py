"""Known issues: the real upstream one, and the mechanism that turns entries into
strict xfails ("known") and tells you when one is fixed ("fixed — remove this entry")."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest



# ----------------------------------------------------------------------------- upstream

def _minimal_engine_cls(base):
    """A WeightTransferEngine that keeps vLLM's own update_weights (the code under
    test) and implements only what the base class declares abstract."""

    @dataclasses.dataclass
    class InitInfo(base.WeightTransferInitInfo):
        pass

    @dataclasses.dataclass
    class UpdateInfo(base.WeightTransferUpdateInfo):
        names: list

    class MinimalEngine(base.WeightTransferEngine[InitInfo, UpdateInfo]):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            pass

        def finish_weight_update(self):
            pass

        def receive_weights(self, update_info):
            self.received.append(update_info)
            self.model.load_weights([(n, None) for n in update_info.names])

        def shutdown(self):
            pass

        # abstract in 0.26 / 0.27.1, gone in 0.32
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            raise NotImplementedError

    return MinimalEngine


class _FakeModel:
    def __init__(self):
        self.loaded: list[str] = []

    def load_weights(self, weights):
        self.loaded += [n for n, _ in weights]
        return set(self.loaded)


def _stub_vllm_config():
    return SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace())


def test_base_update_weights_without_accelerator():
    """vLLM's WeightTransferEngine.update_weights must work on a host without an
    accelerator. Known issue base-update-weights-accelerator-sync: it ends with an
    unconditional torch.accelerator.synchronize(), which raises on CPU-only hosts."""
    base = pytest.importorskip("vllm.distributed.weight_transfer.base")
    import torch

    engine_cls = _minimal_engine_cls(base)
    model = _FakeModel()
    engine = engine_cls(SimpleNamespace(backend="minimal"), _stub_vllm_config(),
                        torch.device("cpu"), model)
    engine.received = []
    engine.update_weights({"names": ["layer.weight"]})
    assert [u.names for u in engine.received] == [["layer.weight"]]
    assert model.loaded == ["layer.weight"]


def test_shm_engine_update_weights_without_accelerator(tmp_path):
    """The harness's shm engine works around the issue above: update_weights loads a
    bucket on a CPU-only host, and still rejects a bucket whose metadata lies."""
    pytest.importorskip("vllm.distributed.weight_transfer.base")
    import torch
    from safetensors.torch import save_file

    from harness.transfer.shm_engine import ShmWeightTransferEngine

    model = _FakeModel()
    loaded = {}
    model.load_weights = lambda weights: loaded.update(dict(weights))
    engine = ShmWeightTransferEngine(SimpleNamespace(backend="shm"), _stub_vllm_config(),
                                     torch.device("cpu"), model)
    engine.init_transfer_engine(engine.parse_init_info({"root": str(tmp_path)}))
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    save_file({"layer.weight": w}, str(tmp_path / "b.safetensors"))
    info = {"path": str(tmp_path / "b.safetensors"), "names": ["layer.weight"],
            "dtype_names": ["float32"], "shapes": [[2, 3]]}
    engine.update_weights(info)
    assert torch.equal(loaded["layer.weight"], w)
    with pytest.raises(ValueError, match="announced as float32\\[3, 2\\]"):
        engine.update_weights(dict(info, shapes=[[3, 2]]))


@pytest.mark.models("llama")
@pytest.mark.dtypes("float32")
def test_partial_update_keeps_unsent_weights(session):
    """A sync that leaves one tensor out must leave that tensor as it was. Known issue
    partial-fused-update-uninitialized-shard: for llama the left-out q_proj is one shard
    of the fused qkv_proj; layerwise reload rebuilds the layer from fresh memory and
    loads only the k/v shards it received, so q holds whatever that memory held."""
    from harness.oracles import parity

    ref = session.reference()
    session.sync()                      # the full model: parity
    full = session.compare(ref)
    parity.assert_logprobs_close(full)
    result = session.sync(corrupt="drop")   # the same weights, minus one tensor
    assert result["corruption"].startswith("dropped model.layers.1.self_attn.q_proj")
    after = session.compare(ref)  # garbage holding NaN/inf raises parity.NonFiniteOutput
    session.record(**{f"partial_{k}": v for k, v in after.metrics().items()})
    parity.assert_logprobs_close(after)
