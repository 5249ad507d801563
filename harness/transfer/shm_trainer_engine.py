"""Trainer side of the ``shm`` backend as a vLLM trainer engine.

vLLM's trainer code builds its engine through ``WeightTransferTrainerFactory.trainer_init``
with a client (``HTTPVLLMWeightSyncClient``) and a ``WeightSource`` (``ModuleSource``
over the live model), and calls ``send_weights()`` once per update. ``shm.register()``
registers this class under the name ``shm``, so that the same code runs on a CPU host
against a server started with ``--weight-transfer-config '{"backend": "shm"}'``.

What it must implement, as vLLM's IPC trainer engine does (``ipc_engine.py``,
``IPCTrainerWeightTransferEngine``): a ``TrainerInitInfo`` subclass whose class-level
``backend`` names the registry key (0.32 dispatches on it); a classmethod
``trainer_init`` that builds the engine, sends the worker-side init info through the
client (the sender only) and returns the engine; ``send_weights()``, one full round
(start, every bucket, finish) over the source; ``shutdown()``. The data plane is the
harness's (``harness.portable.send_shm.send_buckets``: safetensors buckets under a directory on tmpfs, the
worker checks each against its metadata). Two factory conventions exist and both are
taken: 0.32 calls ``trainer_init(init_info=, client=, source=)``; 0.26 calls
``trainer_init(config=, init_info=, client=, source=)`` and its base class's
constructor takes the config first, so this class sets its own attributes instead of
calling it.

Imported by vLLM's trainer factory on first use (lazy, like its own engines); it
imports vLLM at module level, so the harness imports it only in a trainer process.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from harness.portable.send_shm import send_buckets
from harness.transfer import shm


@dataclasses.dataclass
class ShmTrainerInitInfo(TrainerInitInfo):
    """``packed``: one bucket per update; otherwise buckets of at most ``bucket_bytes``.
    ``root``: where the buckets are written (default: a fresh directory on tmpfs,
    removed by ``shutdown``). ``reprocess_tied``: the opt-in workaround for known issue
    cpu-tied-lm-head-stale-after-reload, sent in the worker's init info."""

    backend: ClassVar[str] = shm.BACKEND_NAME
    packed: bool = False
    bucket_bytes: int = shm.DEFAULT_BUCKET_BYTES
    root: str = ""
    reprocess_tied: bool = False


class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    init_info_cls = ShmTrainerInitInfo
    config_cls = None  # 0.26 declares one per engine; shm has no trainer config

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True,
                 root: Path, owns_root: bool, bucket_bytes: int | None) -> None:
        # Not the base constructor: 0.26's takes a config first, 0.32's does not.
        self.config = None
        self.client, self.source, self.is_sender = client, source, is_sender
        self.root, self.owns_root, self.bucket_bytes = root, owns_root, bucket_bytes
        self.last: dict | None = None  # what the last round sent (send_buckets)

    @classmethod
    def trainer_init(cls, init_info: ShmTrainerInitInfo | None = None, *, client: Any,
                     source: Any = None, config: Any = None) -> "ShmTrainerWeightTransferEngine":
        if init_info is None:
            raise ValueError("the shm trainer engine needs a ShmTrainerInitInfo")
        if source is None:
            raise ValueError("shm trainer weight transfer requires a WeightSource (it resends "
                             "the whole model every round)")
        root = Path(init_info.root) if init_info.root else shm.default_root()
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, root=root,
                     owns_root=not init_info.root,
                     bucket_bytes=None if init_info.packed else int(init_info.bucket_bytes))
        if engine.is_sender:
            info: dict[str, Any] = {"root": str(root)}
            if init_info.reprocess_tied:
                info["reprocess_tied"] = True
            client.init_weight_transfer_engine(info)
        return engine

    def send_weights(self) -> None:
        if self.source is None:
            raise ValueError("send_weights() without a source")
        if not self.is_sender:  # one writer; other ranks still materialize (collectives)
            for _ in self.source:
                pass
            return
        self.last = send_buckets(self.client, iter(self.source), self.root, self.bucket_bytes)

    def shutdown(self) -> None:
        if self.owns_root:
            shutil.rmtree(self.root, ignore_errors=True)
