"""``ipc``: the trainer side of vLLM's CUDA IPC weight-transfer engine.

The trainer exports CUDA IPC handles to its tensors (one per tensor, or one per
packed staging buffer) and posts them in ``/update_weights``; the worker opens
them on the same physical GPU, so the trainer must share the server's GPU. The
handles are not JSON: over HTTP they travel pickled and base64-encoded as
``ipc_handles_pickled``, which the worker unpickles only when the server runs
with VLLM_ALLOW_INSECURE_SERIALIZATION=1. ``harness.vllm.api.RecordingClient``
does that conversion, because ``ServerClient`` posts payloads verbatim.

Which vLLM API builds the handles is decided in ``harness.vllm.api``:

* ``factory`` (0.27.1+) and ``static`` (0.26): ``harness.portable.send_ipc.IpcSender``,
  the one IPC sender, which the emitted repro scripts copy too;
* ``raw`` (neither): one handle per tensor built here with torch; unpacked only.

Unlike NCCL nothing here waits on a peer: each step is an HTTP call bounded by
the client's timeout, so no extra threads are needed. What persists between
updates is the trainer's CUDA context and, on the factory path, vLLM's trainer
engine; the first update pays for both (seconds), later ones take milliseconds.
"""

from __future__ import annotations

from typing import Any

from harness import transfer
from harness.core.facts import update_info
from harness.portable.send_ipc import IpcSender  # the scripts' own
from harness.transfer import Backend, BackendVariant, ScriptSender, check_on_device, cuda_device
from harness.vllm import api as vllm_api

ENGINE = "ipc"
_MODULE = "vllm.distributed.weight_transfer.ipc_engine"
VLLM_API = vllm_api.EngineApi(
    module=_MODULE, init_info="IPCTrainerInitInfo", update_info="IPCWeightTransferUpdateInfo",
    extra=(("IPCTrainerSendWeightsArgs", _MODULE, "IPCTrainerSendWeightsArgs"),
           ("IPCWeightTransferEngine.trainer_send_weights", _MODULE,
            "IPCWeightTransferEngine.trainer_send_weights")),
    static=("IPCWeightTransferEngine.trainer_send_weights",),
    static_sender="IPCWeightTransferEngine.trainer_send_weights",
    static_words=("IPCWeightTransferEngine.trainer_send_weights(iter(ModuleSource), "
                  "{'send_mode': 'http'}) between HTTPVLLMWeightSyncClient's "
                  "start_weight_update and finish_weight_update"))

BACKEND = Backend(
    engine=ENGINE,
    description="vLLM's CUDA IPC engine: handles to the trainer's tensors on the server's GPU",
    variants=(BackendVariant("ipc-packed", ENGINE, True, True, True,
                             "CUDA IPC handles to packed buffers, pickled over HTTP"),
              BackendVariant("ipc-unpacked", ENGINE, False, True, True,
                             "CUDA IPC handle per tensor, pickled over HTTP")),
    sender="harness.transfer.ipc:Sender",
    layouts=("1gpu-colocated", "2gpu-ipc-gpu1"),
    shorthand="ipc-packed",
    vllm_api=VLLM_API,
    insecure_serialization=True,  # the handles travel pickled in /update_weights
    script=ScriptSender(("send_ipc", "trainer_api")),
    raw_limit="d2d",
    raw_limit_words="device-to-device copy",
)


API_WORDS = {"factory": "trainer engine", "static": "static API"}  # as nccl.py says them


class IpcSendError(RuntimeError):
    pass


class Sender:
    """CUDA IPC from the trainer's GPU, which must be the server's. Options: ``device``,
    ``packed_buffer_size_bytes`` (the staging buffer; vLLM's default is 1 GiB,
    allocated on the trainer's GPU when packed), ``weight_version`` (sent with every
    ``/finish_weight_update``)."""

    def __init__(self, client, *, packed: bool, options: dict):
        import torch

        self.caps, self.path = vllm_api.sender_path(ENGINE, {ENGINE: VLLM_API}, IpcSendError)
        self.device = cuda_device(options, IpcSendError, "CUDA IPC shares CUDA memory")
        # vLLM reads the current device to name the GPU (its UUID) in every handle.
        torch.cuda.set_device(self.device)
        self.rc = vllm_api.RecordingClient(client, options.get("weight_version"))
        self.packed = packed
        geometry = ({"packed_buffer_size_bytes": int(options["packed_buffer_size_bytes"])}
                    if options.get("packed_buffer_size_bytes") else {})
        self.vllm = (None if self.path == "raw" else
                     IpcSender(self.rc, engine=ENGINE, packed=packed, api=self.path,
                               geometry=geometry))

    def init(self) -> None:
        if self.vllm is not None:
            self.vllm.init()
        else:  # raw: the protocol's first step still, with 0.26's empty init info
            self.rc.init_weight_transfer_engine({})

    def send(self, weights: list[tuple[str, Any]]):
        if self.packed and self.path == "raw":
            raise IpcSendError("this vLLM has no IPC trainer API (neither IPCTrainerInitInfo "
                               "nor trainer_send_weights); the harness's raw fallback sends "
                               "unpacked only")
        weights = list(weights)
        check_on_device(weights, self.device, IpcSendError)
        self.rc.reset()
        api_path = (self._via_raw(weights) if self.vllm is None else
                    f"vLLM {API_WORDS[self.path]}: {self.vllm.send(weights)}")
        # One update_weights call per packed buffer, or one for all tensors unpacked.
        return transfer.send_result(weights, chunks=self.rc.update_calls, api_path=api_path,
                                    client=self.rc, path=self.path, device=str(self.device))

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()

    def _via_raw(self, weights) -> str:
        import torch
        from torch.multiprocessing.reductions import reduce_tensor

        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        # The handles do not keep their storage alive: hold the tensors until finish.
        shared = [(n, t.detach().contiguous()) for n, t in weights]
        info = update_info(shared, ipc_handles=[{uuid: reduce_tensor(t)[1]} for _, t in shared])
        if "packed" in (self.caps.get("ipc_update_info_fields") or []):
            info["packed"] = False
        self.rc.start_weight_update()
        self.rc.update_weights(info)
        self.rc.finish_weight_update()
        del shared
        torch.cuda.ipc_collect()
        return "raw: torch reduce_tensor handles per tensor, HTTP routes driven by the harness"
