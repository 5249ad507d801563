"""CUDA IPC: handles to the trainer's tensors go in /update_weights; each names the trainer's
current CUDA device, and the workers open them on the same physical GPU (matched by UUID)."""

from __future__ import annotations

import base64
import pickle
from typing import Any

from harness.portable.steps import in_flight
from harness.portable.trainer_api import engine_module, factory_for, weight_source
# [region factory]


def send_ipc(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """vLLM's factory trainer API (0.27.1+): its trainer engine calls the routes on ``client``."""
    info = engine_module("ipc").IPCTrainerInitInfo(rank=0, packed=sc["packed"])
    # calls /init_weight_transfer_engine
    trainer = factory_for("ipc").trainer_init(info, client=client, source=weight_source(weights))
    trainer.send_weights()  # /start_weight_update, /update_weights, /finish_weight_update
    return "WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo) + send_weights"


def json_safe_update_info(update_info: Any) -> Any:
    """CUDA IPC handles are not JSON: over HTTP they travel pickled and base64-encoded as
    ``ipc_handles_pickled`` (vLLM's own HTTP client does the same; the worker unpickles
    them only with VLLM_ALLOW_INSECURE_SERIALIZATION=1). Payloads without handles (NCCL,
    shm) pass unchanged; a list (several update infos in one call, 0.32) item by item."""
    if isinstance(update_info, list):
        return [json_safe_update_info(u) for u in update_info]
    if not isinstance(update_info, dict) or update_info.get("ipc_handles") is None:
        return update_info
    if update_info.get("ipc_handles_pickled") is not None:
        raise ValueError("update_info carries both ipc_handles and ipc_handles_pickled")
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return out
# [end]
# [region static]


def send_ipc_static(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """vLLM 0.26's static API: IPCWeightTransferEngine.trainer_send_weights posts the handles
    in /update_weights itself (send_mode "http"), the other routes are called here."""
    engine = engine_module("ipc").IPCWeightTransferEngine
    client.init_weight_transfer_engine({})  # 0.26's IPC init info has no fields
    client.start_weight_update()
    in_flight(timeout, sc["trainer_device"], (
        "IPCWeightTransferEngine.trainer_send_weights (send_mode http: /update_weights)",
        lambda: engine.trainer_send_weights(
            iter(weights), {"send_mode": "http", "url": client.url, "packed": sc["packed"]})))
    client.finish_weight_update()
    return "IPCWeightTransferEngine.trainer_send_weights(send_mode='http'), other routes here"
# [end]
