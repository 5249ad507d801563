"""NCCL: the trainer is rank 0 of a group with the server's workers. The server answers
/init_weight_transfer_engine once every rank has joined, /update_weights once the broadcast
it announces has arrived: each call is kept in flight while the trainer does its part."""

from __future__ import annotations

import dataclasses
from typing import Any

from harness.portable.base import Unusable, free_port, say
from harness.portable.steps import in_flight
from harness.portable.trainer_api import _wt, engine_module, factory_for, weight_source


def rendezvous(client: Any, device: str) -> dict[str, Any]:
    size = int(client.call("GET", "/get_world_size")["world_size"]) + 1
    group = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": size}
    say(f"NCCL group: trainer rank 0 on {device}, world size {size}, port {group['master_port']}")
    return group
# [region factory]


def send_nccl(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """vLLM's factory trainer API (0.28.0+): its trainer engine calls the routes on ``client``."""
    device = sc["trainer_device"]
    info = engine_module("nccl").NCCLTrainerInitInfo(rank=0, packed=sc["packed"],
                                                     **rendezvous(client, device))
    factory, source = factory_for("nccl"), weight_source(weights)
    trainer, = in_flight(timeout, device, (
        "WeightTransferTrainerFactory.trainer_init (with /init_weight_transfer_engine)",
        lambda: factory.trainer_init(info, client=client, source=source)))
    in_flight(timeout, device, ("send_weights (/start_weight_update, /update_weights beside "
                                "the broadcast, /finish_weight_update)", trainer.send_weights))
    return "WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo) + send_weights"
# [end]
# [region static]


def send_nccl_static(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """vLLM 0.26's (and 0.27.1's) static API, the routes called here."""
    device, packed, mod = sc["trainer_device"], sc["packed"], engine_module("nccl")
    engine, group = mod.NCCLWeightTransferEngine, rendezvous(client, device)
    open_group = getattr(engine, "trainer_init", None) or _wt("nccl_common").trainer_init
    _, comm = in_flight(timeout, device, (
        "/init_weight_transfer_engine",
        lambda: client.init_weight_transfer_engine({**group, "rank_offset": 1})), (
        "NCCLWeightTransferEngine.trainer_init (as rank 0)", lambda: open_group(dict(group))))
    update = {"names": [n for n, _ in weights], "shapes": [list(t.shape) for _, t in weights],
              "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights]}
    if "packed" in {f.name for f in dataclasses.fields(mod.NCCLWeightTransferUpdateInfo)}:
        update["packed"] = packed  # 0.26: packed rides each update
    elif packed:
        raise Unusable("packed requested, but NCCLWeightTransferUpdateInfo has no 'packed' here")
    # NCCL reads numel elements from data_ptr(): broadcast contiguous memory only
    args = {"group": comm, "src": 0, "packed": packed,
            "post_iter_func": lambda item: item[1].contiguous()}
    args_cls = getattr(mod, "NCCLTrainerSendWeightsArgs", None)

    def broadcast() -> None:
        engine.trainer_send_weights(iter(weights), args_cls(**args) if args_cls else args)
        if device.startswith("cuda"):  # enqueued is not sent: wait before the tensors change
            import torch

            torch.cuda.current_stream().synchronize()

    client.start_weight_update()
    in_flight(timeout, device, ("/update_weights", lambda: client.update_weights(update)),
              ("NCCLWeightTransferEngine.trainer_send_weights (broadcast)", broadcast))
    client.finish_weight_update()
    return "NCCLWeightTransferEngine.trainer_init + trainer_send_weights, routes called here"
# [end]
