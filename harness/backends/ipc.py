"""``ipc``: the trainer side of vLLM's CUDA IPC weight-transfer engine.

The trainer exports CUDA IPC handles to its tensors (one per tensor, or one per
packed staging buffer) and posts them in ``/update_weights``; the worker opens
them on the same physical GPU, so the trainer must share the server's GPU. The
handles are not JSON: over HTTP they travel pickled and base64-encoded as
``ipc_handles_pickled``, which the worker unpickles only when the server runs
with VLLM_ALLOW_INSECURE_SERIALIZATION=1. ``harness.vllm_api.RecordingClient``
does that conversion, because ``ServerClient`` posts payloads verbatim.

Which vLLM API builds the handles is decided in ``harness.vllm_api``:

* ``factory`` (0.27.1+): ``IPCTrainerInitInfo`` + the trainer factory; the
  engine calls all four routes itself, and ``packed`` rides the init info.
* ``static`` (0.26): ``IPCWeightTransferEngine.trainer_send_weights`` posts
  only ``/update_weights`` (through a callable ``send_mode``, so through our
  client); init, start and finish are ours, and ``packed`` rides each update.
* ``raw`` (neither): one handle per tensor built here with torch; unpacked only.

Unlike NCCL nothing here waits on a peer: each step is an HTTP call bounded by
the client's timeout, so no extra threads are needed.
"""

from __future__ import annotations

from typing import Any

from harness import vllm_api
from harness.backends import cuda_device_of


class IpcSendError(RuntimeError):
    pass


def send(client, weights: list[tuple[str, Any]], *, packed: bool, options: dict) -> dict:
    """Hand ``weights`` (exactly this list) to the server's workers by CUDA IPC.

    Options: ``device``, ``packed_buffer_size_bytes`` (the staging buffer; vLLM's
    default is 1 GiB, allocated on the trainer's GPU when packed).
    """
    import torch

    caps, path = vllm_api.sender_path("ipc", IpcSendError)
    device = cuda_device_of(weights, options, IpcSendError, "CUDA IPC shares CUDA memory")
    # vLLM reads the current device to name the GPU (its UUID) in every handle.
    torch.cuda.set_device(device)
    rc = vllm_api.RecordingClient(client)
    weights = list(weights)
    geometry = ({"packed_buffer_size_bytes": int(options["packed_buffer_size_bytes"])}
                if options.get("packed_buffer_size_bytes") else {})
    api_path = {"factory": _via_factory, "static": _via_static, "raw": _via_raw}[path](
        rc, weights, packed, geometry, device, caps)
    # One update_weights call per packed buffer, or one for all tensors unpacked.
    return vllm_api.sender_stats(weights, chunks=rc.update_calls, api_path=api_path,
                                 client=rc, path=path, device=str(device))


def _via_factory(rc, weights, packed, geometry, device, caps) -> str:
    factory = vllm_api.lookup("WeightTransferTrainerFactory")
    init_cls = vllm_api.lookup("IPCTrainerInitInfo")
    engine = factory.trainer_init(init_cls(rank=0, packed=packed, **geometry), client=rc,
                                  source=vllm_api.weight_source(weights))
    engine.send_weights()  # start, update(s), finish; keeps its handles alive until finish
    return ("vLLM trainer engine: WeightTransferTrainerFactory.trainer_init("
            "IPCTrainerInitInfo) + send_weights")


def _via_static(rc, weights, packed, geometry, device, caps) -> str:
    send_weights = vllm_api.lookup("IPCWeightTransferEngine.trainer_send_weights")
    # 0.26's IPC init info has no fields; the call is still the protocol's first step.
    rc.init_weight_transfer_engine({})
    rc.start_weight_update()
    # send_mode as a callable: vLLM hands us each IPCWeightTransferUpdateInfo and we post
    # it through our client (errors with context, our timeout) instead of its own
    # requests.post. Passing a dict keeps IPCTrainerSendWeightsArgs' fields vLLM's.
    send_weights(iter(weights), {
        "send_mode": lambda info: rc.update_weights(vllm_api.update_info_as_dict(info)),
        "packed": packed, **geometry})
    rc.finish_weight_update()
    return ("vLLM static API: IPCWeightTransferEngine.trainer_send_weights with a callable "
            "send_mode, HTTP routes driven by the harness")


def _via_raw(rc, weights, packed, geometry, device, caps) -> str:
    if packed:
        raise IpcSendError("this vLLM has no IPC trainer API (neither IPCTrainerInitInfo nor "
                           "trainer_send_weights); the harness's raw fallback sends unpacked "
                           "only")
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    # The handles do not keep their storage alive: hold the tensors until finish.
    shared = [t.detach().contiguous() for _, t in weights]
    info = {"names": [n for n, _ in weights],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in shared],
            "shapes": [list(t.shape) for t in shared],
            "ipc_handles": [{uuid: reduce_tensor(t)[1]} for t in shared]}
    if "packed" in (caps.get("ipc_update_info_fields") or []):
        info["packed"] = False
    rc.init_weight_transfer_engine({})
    rc.start_weight_update()
    rc.update_weights(info)
    rc.finish_weight_update()
    del shared
    torch.cuda.ipc_collect()
    return "raw: torch reduce_tensor handles per tensor, HTTP routes driven by the harness"
