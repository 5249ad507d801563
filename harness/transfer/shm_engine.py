"""Worker side of the ``shm`` backend: runs inside vLLM's worker processes.

Imported lazily by vLLM's engine factory (see ``shm.register``), never by the
harness itself. It follows vLLM's own checkpoint-format engines (IPC): layerwise
reload is initialised in ``start_weight_update`` and finalised in
``finish_weight_update``, and each chunk goes through ``model.load_weights``.
From vLLM 0.34 that lifecycle is ``reload.start_reload`` / ``finish_reload(model,
model_config, device)`` (the ``VLLM_RELOAD_MODE`` it selects, and the process-wide
``weight_update_active()`` flag that replaced 0.33's ``disable_mtp_completeness_check``);
``reload_lifecycle`` (harness/portable/reload.py) takes it where it exists, as 0.34's IPC and NCCL engines do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from harness.portable.reload import mtp_guard, reload_lifecycle  # written into a repro's copy

# A deliberate break, as HARNESS_VLLM_TRAINER_DROP is on the trainer's side: set in the
# server's environment (a server inherits the pytest process's), every update is read
# and checked as usual and then not loaded, and the reload lifecycle around it is not
# run, so the server keeps the weights it had while every route answers 200. It shows
# a run failing against a server whose updates do not land (docs/planning.md, "Time to
# the first failure").
DISCARD_ENV = "HARNESS_SHM_DISCARD_UPDATES"


@dataclass
class ShmWeightTransferInitInfo(WeightTransferInitInfo):
    root: str = ""
    """Directory the trainer writes buckets into; the engine reads nothing outside it."""
    reprocess_tied: bool = False
    """Opt-in workaround for known issue cpu-tied-lm-head-stale (docs/known-issues.md):
    after the reload, re-run weight post-processing on modules that share their weight
    (a tied lm_head). Off by default so that tests see vLLM's own behaviour."""
    retain_updates: bool = False
    """A deliberate leak, for the memory check's self-test: keep a copy of every tensor
    received, on the model's device, until the engine is initialised again."""


@dataclass
class ShmWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    path: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(
                f"shm update: names/dtype_names/shapes lengths differ "
                f"({n}/{len(self.dtype_names)}/{len(self.shapes)})")


def _reprocess_tied_modules(model) -> list[str]:
    """Re-run ``process_weights_after_loading`` on every module whose weight Parameter
    is shared with another module. On CPU, vLLM prepacks GEMM weights at load time;
    a tied lm_head receives no tensor of its own during a layerwise reload, so its
    prepacked copy keeps the weights from before the update."""
    owners: dict[int, list] = {}
    for name, mod in model.named_modules():
        w = getattr(mod, "_parameters", {}).get("weight")
        if w is not None:
            owners.setdefault(id(w), []).append((name, mod))
    done = []
    for mods in owners.values():
        if len(mods) < 2:
            continue
        for name, mod in mods:
            qm = getattr(mod, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(mod)
                done.append(name)
    return done


class ShmWeightTransferEngine(
    WeightTransferEngine[ShmWeightTransferInitInfo, ShmWeightTransferUpdateInfo]
):
    init_info_cls = ShmWeightTransferInitInfo
    update_info_cls = ShmWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.root: Path | None = None
        self.reprocess_tied = False
        self.retained: list | None = None

    def init_transfer_engine(self, init_info: ShmWeightTransferInitInfo) -> None:
        if not init_info.root:
            raise ValueError("shm init_info needs 'root', the directory buckets are written to")
        self.root = Path(init_info.root).resolve()
        self.reprocess_tied = init_info.reprocess_tied
        self.retained = [] if init_info.retain_updates else None

    def start_weight_update(self) -> None:
        if os.environ.get(DISCARD_ENV):
            return
        start, _ = reload_lifecycle()
        start(self.model)

    def finish_weight_update(self) -> None:
        if os.environ.get(DISCARD_ENV):
            return
        _, finish = reload_lifecycle()
        finish(self.model, self.model_config, self.device)
        if self.reprocess_tied:
            _reprocess_tied_modules(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        # vLLM's base class calls torch.accelerator.synchronize() here, which
        # raises on a CPU-only host; synchronise only where there is a device.
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmWeightTransferUpdateInfo) -> None:
        from safetensors import safe_open

        if self.root is None:
            raise RuntimeError("shm: /update_weights before /init_weight_transfer_engine")
        path = Path(update_info.path).resolve()
        if self.root not in path.parents:
            raise ValueError(f"shm: {path} is outside the initialised root {self.root}")
        weights = []
        with safe_open(str(path), framework="pt", device="cpu") as f:
            present = set(f.keys())
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names,
                                               update_info.shapes):
                if name not in present:
                    raise ValueError(f"shm: {name!r} announced but not in {path.name}")
                t = f.get_tensor(name)
                if str(t.dtype).removeprefix("torch.") != dtype_name or list(t.shape) != list(shape):
                    raise ValueError(
                        f"shm: {name!r} announced as {dtype_name}{list(shape)} but the file "
                        f"holds {str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
                weights.append((name, t.to(self.device)))
        if self.retained is not None:
            self.retained.append([t.clone() for _, t in weights])
        if os.environ.get(DISCARD_ENV):
            return
        with mtp_guard():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        self.root = None

    # vLLM 0.26 declares this abstract on the worker engine; the harness's
    # trainer never calls it (harness.transfer.shm.send_weights is the sender).
    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        raise NotImplementedError("use harness.transfer.shm.send_weights")
