"""CUDA IPC: handles to the trainer's tensors go in /update_weights; each names the trainer's
current CUDA device, and the workers open them on the same physical GPU (matched by UUID).
One sender for the harness (harness/transfer/ipc.py wraps it) and the repro scripts."""

from __future__ import annotations

import base64
import dataclasses
import pickle
from typing import Any

from harness.portable.trainer_api import engine_module, factory_for, weight_source


class IpcSender:
    """vLLM's CUDA IPC trainer side of one group: ``init()`` once, ``send(weights)`` per update.
    ``api``: ``factory`` (0.27.1+: vLLM's trainer engine calls the routes on ``client``) or
    ``static`` (0.26: each update info goes to a callable that posts it through ``client``)."""

    def __init__(self, client: Any, *, engine: str, packed: bool, api: str,
                 geometry: dict | None = None):
        self.engine_name, self.client, self.packed, self.api = engine, client, packed, api
        self.geometry = dict(geometry or {})
        self.engine: Any = None  # the factory's trainer engine, kept across updates

    def init(self) -> None:
        getattr(self, f"_init_{self.api}")()

    def send(self, weights: list) -> str:
        """One update of exactly ``weights``; returns which vLLM API did it, in words."""
        return getattr(self, f"_send_{self.api}")(weights)

    def close(self) -> None:
        self.engine = None
    # [region factory]

    def _init_factory(self) -> None:  # calls /init_weight_transfer_engine; packed rides the info
        module = engine_module(self.engine_name)
        info = module.IPCTrainerInitInfo(rank=0, packed=self.packed, **self.geometry)
        self.engine = factory_for(self.engine_name).trainer_init(info, client=self.client,
                                                                 source=weight_source([]))

    def _send_factory(self, weights: list) -> str:
        self.engine.source = weight_source(weights)
        self.engine.send_weights()  # /start_weight_update, /update_weights..., /finish
        return "WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo) + send_weights"
    # [end]
    # [region static]

    def _init_static(self) -> None:
        self.client.init_weight_transfer_engine({})  # 0.26's IPC init info has no fields

    def _send_static(self, weights: list) -> str:
        client = self.client
        client.start_weight_update()
        # a callable send_mode: each update posted through ``client`` (its errors and
        # timeout), not vLLM's own requests.post; packed and the geometry ride each update
        engine_module(self.engine_name).IPCWeightTransferEngine.trainer_send_weights(iter(weights), {
            "send_mode": lambda info: client.update_weights(update_info_as_dict(info)),
            "packed": self.packed, **self.geometry})
        client.finish_weight_update()
        return ("IPCWeightTransferEngine.trainer_send_weights with a callable send_mode, "
                "start and finish called by the sender")
    # [end]


def send_ipc(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """The script's sync: one group, one update (``timeout``: the client's, per route)."""
    sender = IpcSender(client, engine=sc["engine"], packed=sc["packed"], api=sc["trainer_api"])
    sender.init()
    return sender.send(weights)
# [region static]


def update_info_as_dict(info: Any) -> Any:
    """A vLLM update-info dataclass as a dict, without ``asdict``'s deep copy (the IPC
    handles inside are large tuples that need no copying); a dict unchanged."""
    if not dataclasses.is_dataclass(info):
        return info
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
# [end]


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
