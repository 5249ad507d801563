"""``shm``: the reference weight-transfer backend, with a shared-memory data plane.

It runs wherever vLLM runs (CPU or GPU), so the HTTP control plane, the
engine-core RPCs and the model's ``load_weights`` / layerwise reload are
exercised on every commit, not only on GPU machines. Only the data plane differs
from NCCL and IPC: the trainer writes each bucket of tensors as a safetensors
file under a directory on tmpfs (``/dev/shm`` where it exists) and
``/update_weights`` carries the file's path plus the names, dtypes and shapes
it holds. The worker checks that metadata against the file before loading, so
a disagreement fails loudly instead of loading garbage.

The worker-side engine is registered with vLLM's ``WeightTransferEngineFactory``
by ``register()``, which vLLM calls in every one of its processes through the
``vllm.general_plugins`` entry point declared in pyproject.toml. ``register()`` also
registers the trainer side, ``shm_trainer_engine.ShmTrainerWeightTransferEngine``,
with vLLM's ``WeightTransferTrainerFactory`` where the release has one that takes
registrations, so that trainer code written for vLLM's own engines (the factory,
``HTTPVLLMWeightSyncClient``, ``ModuleSource``) runs unchanged over shm:

    from harness.transfer import shm
    from harness.transfer.shm_trainer_engine import ShmTrainerInitInfo
    shm.register()        # or vllm.plugins.load_general_plugins()
    engine = WeightTransferTrainerFactory.trainer_init(
        ShmTrainerInitInfo(rank=0, packed=False),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights()

Keep this module's top level free of vLLM imports: the trainer and the test process
import it too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

# one sender for the harness and the repro scripts: the bucket loop is the scripts' own
from harness.portable.send_shm import DEFAULT_BUCKET_BYTES, send_buckets
from harness.transfer import Backend, BackendVariant, ScriptSender

BACKEND_NAME = "shm"
ENGINE_CLASS = "ShmWeightTransferEngine"
TRAINER_ENGINE_MODULE = "harness.transfer.shm_trainer_engine"
TRAINER_ENGINE_CLASS = "ShmTrainerWeightTransferEngine"


def register() -> None:
    """vLLM general plugin: make ``--weight-transfer-config '{"backend": "shm"}'`` work,
    and the trainer factory's ``ShmTrainerInitInfo`` where the release allows it."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without weight transfer: nothing to register
        return
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, "harness.transfer.shm_engine",
                                                    ENGINE_CLASS)
    register_trainer()


def register_trainer() -> tuple[bool, str]:
    """Register the trainer-side engine with vLLM's ``WeightTransferTrainerFactory``.
    Returns (registered, why): a release without that factory, or whose factory has no
    ``register_engine``, cannot take it, and the reason says so. Lazy, as vLLM's own
    registrations: the engine module (which imports vLLM and torch) loads on first use."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError as e:
        return False, (f"this vLLM has no WeightTransferTrainerFactory "
                       f"(vllm.distributed.weight_transfer.factory: {e})")
    registry = getattr(WeightTransferTrainerFactory, "_registry", None)
    if not callable(getattr(WeightTransferTrainerFactory, "register_engine", None)) \
            or registry is None:
        return False, "this vLLM's WeightTransferTrainerFactory takes no registrations"
    if BACKEND_NAME not in registry:
        WeightTransferTrainerFactory.register_engine(BACKEND_NAME, TRAINER_ENGINE_MODULE,
                                                     TRAINER_ENGINE_CLASS)
    return True, (f"{TRAINER_ENGINE_MODULE}.{TRAINER_ENGINE_CLASS} registered with "
                  "WeightTransferTrainerFactory as 'shm'")


def user_init_info(url: str, timeout: float, api_key: str | None, scratch: str) -> dict:
    """A trainer of your own gets a fresh directory for its buckets, in its scratch."""
    return {"root": tempfile.mkdtemp(prefix="shm-", dir=scratch)}


# Registered through the entry point group weight_sync_harness.backends (pyproject.toml),
# as a backend of yours would be.
BACKEND = Backend(
    engine=BACKEND_NAME,
    description="the harness's reference engine: safetensors buckets on tmpfs, CPU or GPU",
    variants=(BackendVariant("shm", BACKEND_NAME, False, False, False,
                             "reference backend: safetensors buckets on tmpfs, CPU or GPU"),),
    sender="harness.transfer.shm:Sender",
    layouts=("cpu", "1gpu-colocated", "2gpu-split", "3gpu-tp2", "cpu-tp2", "cpu-dp2",
             "cpu-pp2", "2gpu-dp2", "2gpu-pp2"),
    vllm_plugin="harness.transfer.shm",
    trainer_init_info="ShmTrainerInitInfo",
    user_init_info=user_init_info,
    script=ScriptSender(("send_shm", "bucketing"), engine_file=True),
    raw_limit="host",
    raw_limit_words="host memory copy",
    workarounds=("reprocess_tied",),
)


def default_root() -> Path:
    """A fresh directory on tmpfs, inside the trainer's scratch directory when it has
    one (its parent removes that even after a SIGKILL: ``harness.trainer.handle``)."""
    base = os.environ.get("HARNESS_TRAINER_SCRATCH") or (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)
    return Path(tempfile.mkdtemp(prefix="harness-shm-", dir=base))


# --------------------------------------------------------------------------- trainer side

class Sender:
    """The reference backend's trainer side: ``packed`` sends one bucket per update,
    otherwise buckets of ``options['bucket_bytes']`` (default 16 MiB). Options:
    ``shm_root`` (default: a fresh directory on tmpfs, removed by ``close``),
    ``reprocess_tied`` (the opt-in workaround, sent in the init info),
    ``retain_updates`` (a deliberately leaking server, for the memory check's self-test),
    ``bucket_delay_s`` (a pause after each acknowledged bucket, for fault tests),
    ``weight_version`` (sent with every ``/finish_weight_update``)."""

    api_path = "harness shm sender over HTTP routes"

    def __init__(self, client, *, packed: bool, options: dict):
        self.client, self.packed = client, packed
        self.owns_root = not options.get("shm_root")
        self.root = Path(options["shm_root"]) if options.get("shm_root") else default_root()
        self.bucket_bytes = None if packed else int(options.get("bucket_bytes")
                                                          or DEFAULT_BUCKET_BYTES)
        self.reprocess_tied = bool(options.get("reprocess_tied"))
        self.retain_updates = bool(options.get("retain_updates"))
        self.bucket_delay_s = float(options.get("bucket_delay_s") or 0.0)
        self.weight_version = options.get("weight_version")

    def init(self) -> None:
        info: dict[str, Any] = {"root": str(self.root)}
        if self.reprocess_tied:  # workaround, opt-in and named: see shm_engine.py
            info["reprocess_tied"] = True
        if self.retain_updates:  # a deliberate leak: the memory check's self-test
            info["retain_updates"] = True
        self.client.init_weight_transfer_engine(info)

    def send(self, weights: list[tuple[str, Any]]):
        from harness.transfer import SendResult

        sent = send_buckets(self.client, weights, self.root, self.bucket_bytes,
                            bucket_delay_s=self.bucket_delay_s, weight_version=self.weight_version)
        return SendResult(tensors=sent["tensors"], bytes=sent["bytes"], chunks=sent["buckets"],
                          api_path=self.api_path, update_calls=sent["buckets"],
                          http_calls=["/start_weight_update"]
                          + ["/update_weights"] * sent["buckets"] + ["/finish_weight_update"])

    def close(self) -> None:
        if self.owns_root:
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)
