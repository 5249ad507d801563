"""The trainer side of the ``file`` backend and what the harness knows of it.

``BACKEND`` is registered with the harness through the entry point group
``weight_sync_harness.backends`` (pyproject.toml); the harness then runs every test
that is not pinned to other backends over its variant ``file`` (``pytest -k file``).
``Sender`` is built in the harness's trainer process, with the client it posts the
routes through: ``init()`` once, ``send(weights)`` for every update, ``close()``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from harness.transfer import Backend, BackendVariant, SendResult


class Sender:
    """One update = one safetensors file in ``options['file_dir']`` (default: a fresh
    directory under the system's temporary directory, removed by ``close``), named in
    one ``/update_weights`` and removed once the server has acknowledged it."""

    api_path = "file backend sender over HTTP routes"

    def __init__(self, client, *, packed: bool, options: dict):
        self.client = client  # init_weight_transfer_engine, start/finish_weight_update, update_weights
        self.owns_dir = not options.get("file_dir")
        self.directory = Path(options.get("file_dir") or tempfile.mkdtemp(prefix="file-backend-"))
        self.updates = 0

    def init(self) -> None:
        self.client.init_weight_transfer_engine({"directory": str(self.directory)})

    def send(self, weights: list) -> SendResult:
        from safetensors.torch import save_file

        tensors = {n: t.detach().to("cpu").contiguous() for n, t in weights}
        name = f"update-{os.getpid()}-{self.updates:05d}.safetensors"
        save_file(tensors, str(self.directory / name))
        self.updates += 1
        try:
            self.client.start_weight_update()
            self.client.update_weights({"file": name, "names": list(tensors)})
            self.client.finish_weight_update()
        finally:
            (self.directory / name).unlink(missing_ok=True)
        return SendResult(tensors=len(tensors), chunks=1, api_path=self.api_path,
                          bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
                          update_calls=1, http_calls=["/start_weight_update", "/update_weights",
                                                      "/finish_weight_update"])

    def close(self) -> None:
        if self.owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)


def user_init_info(url: str, timeout: float, api_key: str | None, scratch: str) -> dict:
    """The init info a trainer of your own (--vllm-trainer) gets: a directory of its own."""
    return {"directory": tempfile.mkdtemp(prefix="file-backend-", dir=scratch)}


BACKEND = Backend(
    engine="file",
    description="example out-of-tree backend: one safetensors file per update, on any disk",
    variants=(BackendVariant("file", "file", packed=False, needs_gpu=False,
                             trainer_on_server_gpu=False,
                             description="one safetensors file per update in a directory"),),
    sender="file_backend.backend:Sender",
    layouts=("cpu",),
    vllm_plugin="file_backend",   # its vllm.general_plugins entry point: file_backend:register
    user_init_info=user_init_info,
    raw_limit="host",
    raw_limit_words="host memory copy",
)
