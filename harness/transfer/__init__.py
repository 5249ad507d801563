"""Weight-transfer backends: what each engine is, as one object per engine.

A ``Backend`` holds everything the harness knows about one weight-transfer engine
(the name vLLM is started with: ``--weight-transfer-config '{"backend": engine}'``):
its variants (what a test is parametrized over: packed or not, the hardware it
needs), the layouts it runs on, how vLLM's own engine module and trainer API are
named where the engine is vLLM's, whether the server must accept pickled payloads,
whether a trainer survives a failed sync, the init info a trainer of your own gets,
its sender for the harness and for the emitted repro script, and the bench's raw
limit. Each engine's module here (``nccl``, ``ipc``, ``shm``) exports one as
``BACKEND``; ``harness.transfer.registry`` finds them (vLLM's own engines built in,
any other through the ``weight_sync_harness.backends`` entry point, as ``shm`` is).

Each engine's trainer side is a ``Sender`` class: ``init()`` once (the
``/init_weight_transfer_engine`` call, plus the NCCL rendezvous), then ``send()``
for every update (``/start_weight_update``, ``/update_weights``...,
``/finish_weight_update``), then ``close()``. Every ``send`` returns a
``SendResult``.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Callable

from harness.transfer import registry
from harness.transfer.backend import Backend, BackendVariant, ScriptSender

__all__ = ["Backend", "BackendVariant", "ScriptSender", "VARIANTS", "SHORTHANDS", "variant",
           "backend", "SendResult", "sender_class", "cuda_device", "check_on_device",
           "send_result"]


class _Lazy(collections.abc.Mapping):
    """A read-only mapping filled from the registry on first use, so that importing
    this package loads no third-party backend."""

    def __init__(self, build: Callable[[], dict]):
        self._build = build

    def _data(self) -> dict:
        return self._build(registry)

    def __getitem__(self, key):
        return self._data()[key]

    def __iter__(self):
        return iter(self._data())

    def __len__(self) -> int:
        return len(self._data())

    def __repr__(self) -> str:
        return repr(self._data())


# Every variant of every registered backend, by id; and the words the harness commands
# take for a variant besides its id (an engine's name alone means its shorthand variant).
VARIANTS: collections.abc.Mapping[str, BackendVariant] = _Lazy(
    lambda r: {v.id: v for b in r.backends().values() for v in b.variants})
SHORTHANDS: collections.abc.Mapping[str, str] = _Lazy(
    lambda r: {b.engine: b.shorthand for b in r.backends().values()
               if b.shorthand and b.shorthand != b.engine})


def variant(name: str) -> BackendVariant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(VARIANTS)}") from None


def backend(engine: str) -> Backend:
    """The registered backend of ``engine``; ValueError naming the known ones."""
    return registry.backend(engine)


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
    return backend(engine).sender_class()


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
