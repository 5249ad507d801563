"""What one weight-transfer engine is, as data: ``Backend`` and its variants.

Each engine's module in this package exports one ``Backend`` as ``BACKEND``; a
backend of yours does the same in your package (docs/backends.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from harness.vllm.api import EngineApi  # how vLLM names one of its own engines


@dataclasses.dataclass(frozen=True)
class BackendVariant:
    id: str
    engine: str
    packed: bool
    needs_gpu: bool
    trainer_on_server_gpu: bool  # CUDA IPC handles only open on the GPU that made them
    description: str


@dataclasses.dataclass(frozen=True)
class ScriptSender:
    """What ``harness repro --emit`` copies for this engine: the portable modules the
    script holds (``harness/portable/<name>.py``, the send module first) and whether
    the script comes with the engine's worker-side file (an engine vLLM loads as a
    plugin)."""

    modules: tuple[str, ...]
    engine_file: bool = False


@dataclasses.dataclass(frozen=True)
class Backend:
    """One weight-transfer engine, all of it (see the module docstring)."""

    engine: str
    description: str
    variants: tuple[BackendVariant, ...]
    sender: str                                  # "module:Class", imported in the trainer only
    layouts: tuple[str, ...]                     # the layouts it runs on; the first is its default
    shorthand: str | None = None                 # the variant id the engine's name alone means
    vllm_api: EngineApi | None = None            # vLLM's own engine; None: a plugin's
    vllm_plugin: str | None = None               # the module of a plugin's vllm.general_plugins entry point
    trainer_init_info: str = ""                  # a plugin's trainer init-info class, in words
    insecure_serialization: bool = False         # payloads pickled over HTTP (IPC handles)
    recovers_in_place: bool = True               # a trainer survives a failed sync
    twin_engine: str | None = None               # the engine its disk-loaded twin starts with
    user_init_info: Callable[[Any], dict] | None = None  # TrainerSpec -> init info, yours
    script: ScriptSender | None = None           # None: `harness repro --emit` cannot write it
    raw_limit: str = "host"                      # the bench's raw limit: host, d2d or nccl
    raw_limit_words: str = ""                    # that limit, as the bench's plot names it
    workarounds: tuple[str, ...] = ()            # the opt-in workarounds its sender takes

    @property
    def default_layout(self) -> str:
        return self.layouts[0]

    @property
    def needs_gpu(self) -> bool:
        return all(v.needs_gpu for v in self.variants)

    def sender_class(self) -> type:
        module, _, name = self.sender.partition(":")
        return getattr(importlib.import_module(module), name)
