"""``SyncSession``: what a test holds for one case. Tests read like the seeds:

    ref = sync.reference()
    before = sync.compare(ref)          # dummy weights
    sync.sync()                         # pause -> trainer pushes weights -> resume
    after = sync.compare(ref)
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any

from . import models, parity
from .client import ServerClient
from .reference import Reference, hf_reference
from .server import ServerConfig, VLLMServer
from .trainer import TrainerSpec, run_trainer


class SyncSession:
    def __init__(self, case, pool, config, *, item=None, fresh: bool = False):
        from .plugin import get_option, server_config_for

        self.case, self.pool, self.config, self.item = case, pool, config, item
        _, local = models.resolve_model(case.model)
        self.model_path: str = str(local) if local else case.model
        self.server_cfg: ServerConfig = server_config_for(case, self.model_path, config)
        self.sync_timeout = float(get_option(config, "vllm_sync_timeout")) if config else 600.0
        self.current_server: VLLMServer | None = None
        self.server = self.use_server(self.server_cfg, fresh=fresh)
        self.client = self.client_for(self.server)
        self.metrics: dict[str, Any] = {}
        self.tainted: str | None = None  # "corrupted" on purpose, or "incomplete"
        self._tokenizer = None

    # ------------------------------------------------------------------ servers
    def use_server(self, cfg: ServerConfig, *, fresh: bool = False) -> VLLMServer:
        srv = self.pool.get(cfg, fresh=fresh)
        srv.mark_log()
        self.current_server = srv
        return srv

    def client_for(self, srv: VLLMServer) -> ServerClient:
        return ServerClient(srv.url, context=srv.describe_failure)

    def twin(self, weights_dir: str | Path) -> tuple[VLLMServer, ServerClient]:
        """A second server that loads ``weights_dir`` from disk the normal way."""
        cfg = dataclasses.replace(self.server_cfg, model=str(weights_dir), load_format="auto")
        srv = self.pool.get(cfg)
        srv.mark_log()
        return srv, self.client_for(srv)

    # ------------------------------------------------------------------ weights
    def perturbed(self, seed: int, scale: float = 0.05) -> Path:
        return models.perturbed_copy(Path(self.model_path), seed, scale)

    def reference(self, weights_dir: str | Path | None = None, **kw: Any) -> Reference:
        return hf_reference(weights_dir or self.model_path, self.case.dtype, **kw)

    def decode(self, token: int) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer.decode([token])

    # ------------------------------------------------------------------ observe
    def observe(self, ref: Reference, client: ServerClient | None = None) -> list[parity.Observation]:
        return parity.observe(client or self.client, ref)

    def compare(self, ref: Reference, client: ServerClient | None = None) -> parity.ParityReport:
        return parity.compare(self.observe(ref, client), ref, decode=self.decode)

    # ------------------------------------------------------------------ sync
    def sync(self, weights_dir: str | Path | None = None, *, corrupt: str | None = None,
             pause: bool = True, pause_mode: str | None = None, options: dict | None = None) -> dict:
        """pause -> the trainer (own process) pushes ``weights_dir`` -> resume."""
        lay = self.case.layout
        weights = str(weights_dir or self.model_path)
        spec = TrainerSpec(url=self.server.url, engine=self.case.backend.engine,
                           packed=self.case.backend.packed, weights_dir=weights,
                           dtype=self.case.dtype,
                           device=lay.trainer_device, corrupt=corrupt,
                           options=dict(options or {}, device=lay.trainer_device))
        # Until the trainer reports success the server holds an unknown mix of weights.
        self.pool.set_holds(self.server_cfg, f"{weights} (sync not completed)")
        self.tainted = "incomplete"
        if pause:
            self.client.pause(pause_mode) if pause_mode else self.client.pause()
        try:
            result = run_trainer(spec, timeout=self.sync_timeout,
                                 context=self.server.describe_failure)
        finally:
            if pause:
                self.client.resume()
        self.tainted = "corrupted" if corrupt is not None else None
        self.pool.set_holds(self.server_cfg,
                            weights if corrupt is None else f"{weights} ({result.get('corruption')})")
        self.record(sync_seconds=result.get("sync_seconds"), sync_bytes=result.get("bytes"),
                    sync_tensors=result.get("tensors"), trainer_api=result.get("api_path"),
                    server_start_seconds=self.server.start_seconds, vllm_version=self.server.version)
        return result

    @property
    def holds(self) -> str | None:
        """The weights the server holds: a path, or None for its dummy weights."""
        return self.pool.holds.get(self.server_cfg)

    def ensure_holds(self, weights_dir: str | Path | None = None) -> None:
        """Sync ``weights_dir`` (default: the model) unless the server already holds it."""
        if self.holds != str(weights_dir or self.model_path):
            self.sync(weights_dir)

    def leave_healthy(self) -> None:
        """Test teardown: a test that corrupted an update on purpose must not hand the
        damage to the next test on this server: push the model's weights again. A sync
        that did not complete (the transport may hang again), or a repair that fails,
        stops the server instead; the next test gets a new one."""
        if not self.tainted:
            return
        why = "a weight sync did not complete"
        if self.tainted == "corrupted":
            try:
                if self.client.is_paused():
                    self.client.resume()
                self.sync()
                return
            except Exception as e:
                why = f"pushing the model again after a deliberate corruption failed: {e}"
        warnings.warn(f"server {self.server.url} restarted for the next test: {why}",
                      stacklevel=2)
        self.pool.discard(self.server_cfg)

    def record(self, **metrics: Any) -> None:
        self.metrics.update(metrics)
        if self.item is not None:
            self.item.user_properties.append(("metrics", metrics))
