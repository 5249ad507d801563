"""The trainer's CUDA IPC send: handles to its tensors, posted in /update_weights,
through vLLM's trainer API for the installed release."""

from __future__ import annotations

import base64
import pickle
from pathlib import Path
from typing import Any

from harness.portable.base import say
from harness.portable.steps import Step
from harness.portable.trainer_api import _wt, engine_module, trainer_api, weight_source


def setup_ipc(sc: dict[str, Any], workdir: Path) -> list[Path]:
    """Before the server starts: fail here, named, rather than halfway through a sync."""
    say(f"      vLLM's trainer API for ipc: {trainer_api('ipc')}")
    return []


def json_safe_update_info(update_info: Any) -> Any:
    """CUDA IPC handles are not JSON: over HTTP they travel pickled and base64-encoded
    as ``ipc_handles_pickled`` (vLLM's own HTTP client does the same)."""
    if isinstance(update_info, list):
        return [json_safe_update_info(u) for u in update_info]
    if not isinstance(update_info, dict) or update_info.get("ipc_handles") is None:
        return update_info
    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(
        pickle.dumps(update_info["ipc_handles"])).decode("ascii")
    return out


def send_ipc(client: Any, weights: list[tuple[str, Any]], sc: dict[str, Any],
             timeout: float) -> str:
    """CUDA IPC handles to the trainer's tensors, posted in /update_weights; the workers
    open them on the same physical GPU (matched by UUID)."""
    import torch

    device, packed = sc["trainer_device"], sc["packed"]
    if device.startswith("cuda"):  # vLLM names the GPU of the current device in each handle
        torch.cuda.set_device(torch.device(device))
    mod = engine_module("ipc")
    if trainer_api("ipc") == "factory":
        factory = _wt("factory").WeightTransferTrainerFactory
        info = mod.IPCTrainerInitInfo(rank=0, packed=packed)
        source = weight_source(weights)
        trainer = Step("WeightTransferTrainerFactory.trainer_init (/init_weight_transfer_engine)",
                       lambda: factory.trainer_init(info, client=client, source=source),
                       device).result(timeout)
        Step("send_weights (/start_weight_update, /update_weights, /finish_weight_update)",
             trainer.send_weights, device).result(timeout)
        return "WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo) + send_weights"

    client.init_weight_transfer_engine({})  # 0.26's IPC init info has no fields
    client.start_weight_update()
    Step("IPCWeightTransferEngine.trainer_send_weights (send_mode http: /update_weights)",
         lambda: mod.IPCWeightTransferEngine.trainer_send_weights(
             iter(weights), {"send_mode": "http", "url": client.url, "packed": packed}),
         device).result(timeout)
    client.finish_weight_update()
    return ("IPCWeightTransferEngine.trainer_send_weights(send_mode='http'), init/start/finish "
            "called by this script")
