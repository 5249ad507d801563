"""The trainer's CUDA IPC send: handles to its tensors, posted in /update_weights,
through vLLM's trainer API for the installed release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.portable.base import say
from harness.portable.steps import Step
from harness.portable.trainer_api import _wt, engine_module, trainer_api, weight_source


def setup_ipc(sc: dict[str, Any], workdir: Path) -> list[Path]:
    """Before the server starts: fail here, named, rather than halfway through a sync."""
    say(f"      vLLM's trainer API for ipc: {trainer_api('ipc')}")
    return []


def send_ipc(client: Any, weights: list[tuple[str, Any]], sc: dict[str, Any],
             timeout: float) -> str:
    """CUDA IPC handles to the trainer's tensors, posted in /update_weights; the workers
    open them on the same physical GPU (matched by UUID)."""
    import torch

    device, packed = sc["trainer_device"], sc["packed"]
    if device.startswith("cuda"):  # vLLM names the GPU of the current device in each handle
        torch.cuda.set_device(torch.device(device))
    api = trainer_api("ipc")
    mod = engine_module("ipc")
    if api == "factory":
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
