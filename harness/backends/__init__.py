"""Weight-transfer backend variants, as data.

A variant is what a test is parametrized over: the engine vLLM is started with
(``--weight-transfer-config '{"backend": engine}'``), whether the data plane is
packed, and what hardware it needs. Each engine's trainer-side sender lives in
its own module here (``shm``, ``nccl``, ``ipc``) and exposes
``send(client, weights, *, packed, options) -> dict``.
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


def variant(name: str) -> BackendVariant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(VARIANTS)}") from None


def sender_module(engine: str):
    """The trainer-side module for ``engine`` (imported in the trainer process only)."""
    return importlib.import_module(f"harness.backends.{engine}")


def cuda_device_of(weights: list, options: dict, error: type[Exception], why: str):
    """The CUDA device a GPU sender works on (``options['device']``, else the first
    tensor's), refusing a CPU trainer or tensors spread over several devices."""
    import torch

    name = options.get("device") or (str(weights[0][1].device) if weights else None)
    device = torch.device(name) if name else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        raise error(f"{why}; the trainer is on {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elsewhere = [n for n, t in weights if t.device != device]
    if elsewhere:
        raise error(f"{len(elsewhere)} tensor(s) are not on {device}, e.g. "
                    f"{elsewhere[0]} on {dict(weights)[elsewhere[0]].device}")
    return device
