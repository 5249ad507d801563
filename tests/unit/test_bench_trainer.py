"""The trainer as ``harness bench`` drives it, against a stand-in for vLLM's four
weight-transfer routes: prepared without calling the server, then a cold sync (the
group's opening, timed apart) and a warm one, each with the times of its HTTP calls.

A real trainer process (shm backend, CPU) and a sized model whose weights it draws."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness import models

from harness.commands.bench import benchfile
from harness.models import sized
from harness.trainer.handle import Trainer, TrainerSpec


class _Routes(BaseHTTPRequestHandler):
    calls: list[str] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        json.loads(body or b"{}")
        type(self).calls.append(self.path)
        out = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def routes():
    _Routes.calls = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Routes)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Routes.calls
    srv.shutdown()
    srv.server_close()


@pytest.mark.slow_unit  # a trainer process: torch, the weights, the sender
def test_prepare_calls_no_route_and_the_cold_sync_opens_the_group(routes, tmp_path,
                                                                   monkeypatch):
    url, calls = routes
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    weights = sized.sized_model_dir(int(0.004e9), "bfloat16")
    spec = TrainerSpec.make(url=url, engine="shm", packed=False, dtype="bfloat16",
                            device="cpu", timeout=60,
                            options={"bucket_bytes": 1 << 20, "shm_root": str(tmp_path / "shm")})
    t = Trainer(spec, log_dir=tmp_path / "logs")
    try:
        prepared = t.prepare(str(weights), timeout=180)
        assert prepared["ok"] and calls == []  # imports, weights, sender: no HTTP yet

        cold = t.sync(str(weights), timeout=120)
        assert cold["first"] and cold["init_seconds"] >= 0
        assert calls[0] == "/init_weight_transfer_engine"
        assert calls[1] == "/start_weight_update" and calls[-1] == "/finish_weight_update"
        config = json.loads((weights / "config.json").read_text())
        assert cold["bytes"] == 2 * sized.config_params(config)
        assert cold["update_calls"] == calls.count("/update_weights") > 1

        del calls[:]
        warm = t.sync(str(weights), timeout=120)
        assert not warm["first"] and "init_seconds" not in warm
        assert "/init_weight_transfer_engine" not in calls
        routes_timed = [r for r, _, _ in warm["http_spans"]]
        assert routes_timed == calls
        starts = [a for _, a, _ in warm["http_spans"]]
        assert starts == sorted(starts) and 0 <= starts[0] < warm["sync_seconds"]
        ph = benchfile.phases_from_spans(warm["http_spans"])
        assert sum(ph.values()) == pytest.approx(warm["sync_seconds"], abs=0.05)
        assert "trainer_peak_extra_bytes" not in warm  # a CPU trainer has no CUDA memory
    finally:
        t.close()
