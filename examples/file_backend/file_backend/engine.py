"""The worker side of the ``file`` backend: runs inside vLLM's worker processes.

``/init_weight_transfer_engine`` names the directory the trainer writes into; each
``/update_weights`` names one safetensors file in it and the tensor names it holds.
The file is checked against those names before anything is loaded, so a disagreement
fails the route instead of loading part of an update. Around the update the engine
runs vLLM's layerwise reload, as vLLM's own checkpoint-format engines (IPC) do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

# vLLM's reload calls by release (0.26-0.34); a server without the harness installed
# takes a copy of harness/portable/reload.py, which imports nothing else of it
from harness.portable.reload import reload_lifecycle

from file_backend import BREAK_ENV


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    directory: str = ""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    file: str            # a file name inside the directory given at init
    names: list[str]     # the tensors it holds


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.directory: Path | None = None
        self.broken = os.environ.get(BREAK_ENV, "")

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        if not init_info.directory or not Path(init_info.directory).is_dir():
            raise ValueError(f"file backend: init needs an existing 'directory', "
                             f"got {init_info.directory!r}")
        self.directory = Path(init_info.directory).resolve()

    def start_weight_update(self) -> None:
        if self.broken != "stale":
            reload_lifecycle()[0](self.model)

    def update_weights(self, update_info: dict) -> None:
        # vLLM's base class ends with torch.accelerator.synchronize(), which raises on a
        # CPU-only host: loading here is synchronous, so there is nothing to wait for.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        if self.directory is None:
            raise RuntimeError("file backend: /update_weights before /init_weight_transfer_engine")
        path = (self.directory / update_info.file).resolve()
        if path.parent != self.directory:
            raise ValueError(f"file backend: {update_info.file!r} is not a file of {self.directory}")
        tensors = load_file(str(path), device="cpu")
        if sorted(tensors) != sorted(update_info.names):
            raise ValueError(f"file backend: {path.name} holds {len(tensors)} tensor(s), "
                             f"the update names {len(update_info.names)}; they differ in "
                             f"{sorted(set(tensors) ^ set(update_info.names))[:3]}")
        if self.broken == "stale":
            return
        if self.broken == "drop":
            del tensors[max(tensors, key=lambda n: tensors[n].numel())]
        self.model.load_weights([(n, t.to(self.device)) for n, t in tensors.items()])

    def finish_weight_update(self) -> None:
        if self.broken != "stale":
            reload_lifecycle()[1](self.model, self.model_config, self.device)

    def shutdown(self) -> None:
        self.directory = None

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        # abstract on some vLLM releases; the trainer side is file_backend.backend.Sender
        raise NotImplementedError("use file_backend.backend.Sender")
