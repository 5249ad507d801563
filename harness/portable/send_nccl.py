"""The trainer's NCCL send: rank 0 of a group whose other ranks are the server's workers."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.portable.base import Unusable, free_port, say
from harness.portable.steps import Step
from harness.portable.trainer_api import _wt, engine_module, factory_for, weight_source


def rendezvous(client: Any, device: str) -> dict[str, Any]:
    """The NCCL group: the trainer is rank 0, the server's workers the other ranks."""
    group = {"master_address": "127.0.0.1", "master_port": free_port(),
             "world_size": client.world_size() + 1}
    say(f"      NCCL group: trainer rank 0 on {device}, world size {group['world_size']}, "
        f"rendezvous 127.0.0.1:{group['master_port']}")
    return group
# [region factory]


def send_nccl(client: Any, weights: list[tuple[str, Any]], sc: dict[str, Any],
              timeout: float) -> str:
    """vLLM's factory trainer API (0.32+): its NCCL trainer engine calls the routes
    through ``client`` and keeps each in flight while it does its part of the collective
    (/init_weight_transfer_engine returns once every rank has joined, /update_weights
    once the broadcast it announces has arrived)."""
    device = sc["trainer_device"]
    info = engine_module("nccl").NCCLTrainerInitInfo(rank=0, packed=sc["packed"],
                                                     **rendezvous(client, device))
    factory = factory_for("nccl")
    source = weight_source(weights)
    trainer = Step("WeightTransferTrainerFactory.trainer_init (with "
                   "/init_weight_transfer_engine)",
                   lambda: factory.trainer_init(info, client=client, source=source),
                   device).result(timeout)
    Step("send_weights (/start_weight_update, /update_weights beside the broadcast, "
         "/finish_weight_update)", trainer.send_weights, device).result(timeout)
    return "WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo) + send_weights"
# [end]
# [region static]


def send_nccl_static(client: Any, weights: list[tuple[str, Any]], sc: dict[str, Any],
                     timeout: float) -> str:
    """vLLM 0.26's static API (0.27.1's too): NCCLWeightTransferEngine's trainer_init
    and trainer_send_weights, with the routes called here, each in flight while the
    trainer does its part (/init_weight_transfer_engine returns once every rank has
    joined, /update_weights once the broadcast it announces has arrived)."""
    import torch

    device, packed = sc["trainer_device"], sc["packed"]
    mod = engine_module("nccl")
    engine, group = mod.NCCLWeightTransferEngine, rendezvous(client, device)
    open_group = getattr(engine, "trainer_init", None) or _wt("nccl_common").trainer_init
    http = Step("/init_weight_transfer_engine", lambda: client.init_weight_transfer_engine(
        {**group, "rank_offset": 1}))
    comm = Step("NCCLWeightTransferEngine.trainer_init (NCCL rendezvous as rank 0)",
                lambda: open_group(dict(group)), device).result(timeout, (http,))
    http.result(timeout)

    update_info = {"names": [n for n, _ in weights],
                   "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
                   "shapes": [list(t.shape) for _, t in weights]}
    fields = {f.name for f in dataclasses.fields(mod.NCCLWeightTransferUpdateInfo)}
    if "packed" in fields:  # 0.26: packed rides each update
        update_info["packed"] = packed
    elif packed:
        raise Unusable("packed requested, but this vLLM's NCCLWeightTransferUpdateInfo has no "
                       f"'packed' field (fields: {sorted(fields)})")
    # NCCL reads numel elements from data_ptr(): broadcast contiguous memory only.
    args = {"group": comm, "src": 0, "packed": packed,
            "post_iter_func": lambda item: item[1].contiguous()}
    args_cls = getattr(mod, "NCCLTrainerSendWeightsArgs", None)

    def broadcast() -> None:
        engine.trainer_send_weights(iter(weights), args_cls(**args) if args_cls else args)
        if device.startswith("cuda"):  # enqueued is not sent: wait before the tensors change
            torch.cuda.current_stream().synchronize()

    client.start_weight_update()
    http = Step("/update_weights", lambda: client.update_weights(update_info))
    Step("NCCLWeightTransferEngine.trainer_send_weights (broadcast)", broadcast,
         device).result(timeout, (http,))
    http.result(timeout)
    client.finish_weight_update()
    return "NCCLWeightTransferEngine.trainer_init + trainer_send_weights, routes called here"
# [end]
