"""NCCL: the trainer is rank 0 of a group with the server's workers; /init_weight_transfer_engine
and /update_weights return once the trainer has done its part, so each is kept in flight beside
it. One sender for the harness (harness/transfer/nccl.py wraps it) and the repro scripts."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from harness.portable.base import Unusable, free_port, say
from harness.portable.steps import in_flight
from harness.portable.trainer_api import _wt, engine_module, factory_for, weight_source


class NcclSender:
    """Rank 0 of one server's NCCL group: ``init()`` joins it, ``send(weights)`` per update.
    ``api``: ``factory`` (0.28.0+: vLLM's trainer engine calls the routes on ``client``) or
    ``static`` (0.26, 0.27.1: vLLM's rendezvous and broadcast, the routes called here)."""

    geometry: dict = {}  # vLLM's packed-buffer fields (the harness's options)
    watch: Any = None    # the harness's client: a failed route ends every wait (in_flight)
    engine: Any = None   # factory: vLLM's trainer engine
    group: Any = None    # static: the trainer's communicator
    # [region harness]
    hold_before_broadcast_s = 0.0  # fault tests kill the trainer in this wait
    # [end]

    def __init__(self, client: Any, *, packed: bool, api: str, device: Any, world_size: int,
                 timeout: float, master_port: int | None = None):
        self.client, self.packed, self.api, self.device = client, packed, api, str(device)
        self.rendezvous = {"master_address": "127.0.0.1", "world_size": world_size,
                           "master_port": master_port or free_port()}
        self.timeout = timeout

    def init(self) -> None:
        r = self.rendezvous
        say(f"NCCL group: trainer rank 0 on {self.device}, world size {r['world_size']}, "
            f"port {r['master_port']}")
        getattr(self, f"_init_{self.api}")()

    def send(self, weights: list) -> str:  # one update; which vLLM API did it, in words
        return getattr(self, f"_send_{self.api}")(weights)

    def steps(self, *calls: tuple[str, Callable[[], Any]]) -> list:
        return in_flight(self.timeout, self.device, *calls, watch=self.watch)
    # [region factory]

    def _init_factory(self) -> None:
        cls = engine_module("nccl").NCCLTrainerInitInfo
        info = cls(rank=0, packed=self.packed, **self.rendezvous, **self.geometry)
        factory, source = factory_for("nccl"), weight_source([])
        self.engine, = self.steps((
            "WeightTransferTrainerFactory.trainer_init (with /init_weight_transfer_engine)",
            lambda: factory.trainer_init(info, client=self.client, source=source)))

    def _send_factory(self, weights: list) -> str:
        self.engine.source = weight_source(weights)
        self.steps(("send_weights (/start_weight_update, /update_weights beside the broadcast, "
                    "/finish_weight_update)", self.engine.send_weights))
        return "WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo) + send_weights"
    # [end]
    # [region static]

    group_api = "nccl_common.trainer_init"  # what opens rank 0's communicator, in words
    fields: list | None = None  # the update info's fields, where known without vLLM's class

    def open_group(self) -> Any:  # (the harness's raw path has its own, and broadcaster)
        return _wt("nccl_common").trainer_init(dict(self.rendezvous))

    def broadcaster(self, weights: list) -> Callable[[], None]:  # built before any route
        mod = engine_module("nccl")
        args_cls = getattr(mod, "NCCLTrainerSendWeightsArgs", None)
        # NCCL reads numel elements from data_ptr(): broadcast contiguous memory only
        args = {"group": self.group, "src": 0, "packed": self.packed,
                "post_iter_func": lambda item: item[1].contiguous(), **self.geometry}
        args = args_cls(**args) if args_cls else args
        return lambda: mod.NCCLWeightTransferEngine.trainer_send_weights(iter(weights), args)

    def _init_static(self) -> None:
        r = self.rendezvous
        _, self.group = self.steps(
            ("/init_weight_transfer_engine",
             lambda: self.client.init_weight_transfer_engine({**r, "rank_offset": 1})),
            (f"{self.group_api} (NCCL rendezvous as rank 0 of {r['world_size']} at "
             f"{r['master_address']}:{r['master_port']})", self.open_group))

    def _send_static(self, weights: list) -> str:
        # the update info's fields (0.26 reads packed and the geometry in each update)
        fields = self.fields if self.fields is not None else [
            f.name for f in dataclasses.fields(engine_module("nccl").NCCLWeightTransferUpdateInfo)]
        if self.packed and "packed" not in fields:
            raise Unusable("packed requested, but this vLLM's NCCLWeightTransferUpdateInfo "
                           f"has no 'packed' field (fields: {sorted(fields)})")
        update = {"names": [n for n, _ in weights],
                  "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
                  "shapes": [list(t.shape) for _, t in weights],
                  **{k: v for k, v in {"packed": self.packed, **self.geometry}.items()
                     if k in fields}}
        broadcast = self.broadcaster(weights)

        def trainer_side() -> None:
            # [region harness]
            if self.hold_before_broadcast_s:
                print(f"nccl: /update_weights in flight, holding {self.hold_before_broadcast_s}s "
                      "before the broadcast", flush=True)
                time.sleep(self.hold_before_broadcast_s)
            # [end]
            broadcast()
            if self.device.startswith("cuda"):  # enqueued is not sent: wait before they change
                import torch

                torch.cuda.current_stream().synchronize()

        self.client.start_weight_update()
        self.steps(("/update_weights", lambda: self.client.update_weights(update)),
                   (f"broadcast of {len(weights)} tensors", trainer_side))
        self.client.finish_weight_update()
        return ("nccl_common.trainer_init + NCCLWeightTransferEngine.trainer_send_weights, "
                "the routes called beside them")
    # [end]


def send_nccl(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """The script's sync: a group of the server's ranks and this one, one update."""
    world_size = int(client.call("GET", "/get_world_size")["world_size"]) + 1
    sender = NcclSender(client, packed=sc["packed"], api=sc["trainer_api"],
                        device=sc["trainer_device"], world_size=world_size, timeout=timeout)
    sender.init()
    return sender.send(weights)
