"""Weight-transfer backend variants, as data.

A variant is what a test is parametrized over: the engine vLLM is started with
(``--weight-transfer-config '{"backend": engine}'``), whether the data plane is
packed, and what hardware it needs. Each engine's trainer side is a class
``Sender`` in its own module here (``shm``, ``nccl``, ``ipc``), which drives that
engine's one sender in ``harness.portable`` (the code the repro scripts copy) with
the life of an RL trainer's transfer group: ``init()`` once (the
``/init_weight_transfer_engine`` call, plus the NCCL rendezvous), then ``send()``
for every update (``/start_weight_update``, ``/update_weights``...,
``/finish_weight_update``), then ``close()``. Every ``send`` returns a
``SendResult``.
"""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class BackendVariant:
    id: str
    engine: str
    packed: bool
    needs_gpu: bool
    trainer_on_server_gpu: bool  # CUDA IPC handles only open on the GPU that made them
    description: str


VARIANTS: dict[str, BackendVariant] = {v.id: v for v in [
    BackendVariant("shm", "shm", False, False, False,
                   "reference backend: safetensors buckets on tmpfs, CPU or GPU"),
    BackendVariant("nccl-packed", "nccl", True, True, False,
                   "NCCL broadcast of packed buffers, trainer on its own GPU"),
    BackendVariant("nccl-unpacked", "nccl", False, True, False,
                   "NCCL broadcast tensor by tensor, trainer on its own GPU"),
    BackendVariant("ipc-packed", "ipc", True, True, True,
                   "CUDA IPC handles to packed buffers, pickled over HTTP"),
    BackendVariant("ipc-unpacked", "ipc", False, True, True,
                   "CUDA IPC handle per tensor, pickled over HTTP"),
]}


# The words the harness commands take for a variant, besides its id: an engine's name
# alone means its packed variant (harness demo and harness repro alike).
SHORTHANDS: dict[str, str] = {"nccl": "nccl-packed", "ipc": "ipc-packed"}


def variant(name: str) -> BackendVariant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(VARIANTS)}") from None


@dataclasses.dataclass
class SendResult:
    """What one update moved and how: the same fields for every backend."""

    tensors: int
    bytes: int
    chunks: int | None          # packed buffers, buckets or update_weights calls
    api_path: str               # which trainer API did the work, in words
    http_calls: list[str] = dataclasses.field(default_factory=list)
    update_calls: int = 0
    extra: dict = dataclasses.field(default_factory=dict)  # backend-specific facts

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {**d.pop("extra"), **d}


def sender_class(engine: str):
    """The trainer-side ``Sender`` for ``engine`` (imported in the trainer process only)."""
    return importlib.import_module(f"harness.transfer.{engine}").Sender


def cuda_device(options: dict, error: type[Exception], why: str):
    """The CUDA device a GPU sender works on (``options['device']``, else the current
    one), refusing a CPU trainer before any route is called."""
    import torch

    name = options.get("device")
    device = torch.device(name) if name else None
    if device is not None and device.type != "cuda":
        raise error(f"{why}; the trainer is on {device}")
    if device is None or device.index is None:
        if not torch.cuda.is_available():
            raise error(f"{why}; the trainer has no CUDA device (it is on cpu)")
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_on_device(weights: list, device, error: type[Exception]) -> None:
    """Refuse tensors that are not all on ``device`` (nothing is sent)."""
    elsewhere = [(n, t.device) for n, t in weights if t.device != device]
    if elsewhere:
        n, d = elsewhere[0]
        raise error(f"{len(elsewhere)} tensor(s) are not on {device}, e.g. {n} on {d}")


def send_result(weights, *, chunks: int | None, api_path: str, client, **extra) -> SendResult:
    """The ``SendResult`` of one update through a GPU sender (``client``: the
    ``harness.vllm.api.RecordingClient`` it sent through)."""
    from harness.vllm.api import vllm_version

    return SendResult(tensors=len(weights),
                      bytes=sum(t.numel() * t.element_size() for _, t in weights),
                      chunks=chunks, api_path=api_path, http_calls=list(client.calls),
                      update_calls=client.update_calls,
                      extra={"vllm_version": vllm_version(), **extra})
