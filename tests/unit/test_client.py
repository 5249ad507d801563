"""``ServerClient``'s public surface, without a vLLM server; and that no module reaches
into its private members (issue 9: nccl.py called ``client._call``, the pause checks
``client._context()``)."""

from __future__ import annotations

import ast
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import harness
from harness.vllm.client import ControlPlaneError, ServerClient


class _Handler(BaseHTTPRequestHandler):
    routes = {"/get_world_size": (200, {"world_size": 2}),
              "/is_paused": (500, {"error": "engine dead"})}

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        self._json(*self.routes.get(self.path, (404, {"detail": "Not Found"})))

    def _json(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET  # POST routes answer from the same table


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_world_size_and_context(server):
    c = ServerClient(server, timeout=5, context=lambda: "log tail: boom")
    assert c.world_size() == 2
    assert c.context() == "log tail: boom" and c.clone().context() == "log tail: boom"
    assert ServerClient(server).context() == ""
    with pytest.raises(ControlPlaneError, match="(?s)/is_paused failed with HTTP 500.*log tail"):
        c.is_paused()


def test_a_route_that_fails_is_not_blamed_on_is_paused(server):
    """/pause answering 404 is the route's own error, raised before any confirmation."""
    c = ServerClient(server, timeout=5, confirm_timeout=1)
    with pytest.raises(ControlPlaneError, match="^/pause failed with HTTP 404"):
        c.pause(mode="abort")


def test_an_unanswered_confirmation_names_the_route(server):
    """/resume answers 200 but /is_paused only errors: the route is named, with the
    last error /is_paused gave."""
    _Handler.routes["/resume"] = (200, {})
    try:
        c = ServerClient(server, timeout=5, confirm_timeout=1)
        with pytest.raises(ControlPlaneError, match="(?s)^/resume returned 200 but /is_paused "
                                                    "gave no answer .*HTTP 500.* after 1s"):
            c.resume()
    finally:
        del _Handler.routes["/resume"]


def test_sdk_clients_never_retry_and_always_time_out(server):
    """A retry would hide a refused request; an unbounded wait would hang a check."""
    c = ServerClient(server, timeout=7)
    for sdk in (c.openai_sdk(), c.async_openai_sdk(), c.async_openai_sdk(timeout=3)):
        assert sdk.max_retries == 0 and sdk.timeout in (7, 3)
        assert str(sdk.base_url).rstrip("/") == server + "/v1"
    assert c.openai_sdk() is c.openai_sdk(), "made once, shared by the request threads"
    assert c.clone().openai_sdk() is not c.openai_sdk()


def test_no_module_uses_a_private_member_of_a_client():
    offenders = []
    for path in sorted(Path(harness.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in ("client", "rc", "c")):
                offenders.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offenders, offenders


class _SleepRace(_Handler):
    """``/sleep`` fails ``fails`` times with vLLM's "Memory usage increased" 500, then 200."""
    fails = 0
    asked = 0

    def do_POST(self):  # noqa: N802
        cls = type(self)
        cls.asked += 1
        if cls.asked <= cls.fails:
            self._json(500, {"error": {"message": "Call to sleep method failed: Memory usage "
                                                  "increased after sleeping.", "code": 500}})
        else:
            self._json(200, {"status": "sleeping", "level": 1})


@pytest.mark.parametrize("frees, parallel, fails, asked, ok", [
    (False, True, 1, 2, True),    # no sleep mode, GPU shared by the run: asked again
    (False, True, 5, 3, False),   # a race every time: the third answer is raised
    (True, True, 1, 1, False),    # sleep mode: its weights moved already, never asked twice
    (None, True, 1, 1, False),    # a server the client knows nothing about: never
    (False, False, 1, 1, False),  # outside a parallel GPU run nothing else allocates: a fault
])
def test_a_sleep_that_raced_another_allocation_is_asked_again_only_where_it_is_safe(
        tmp_path, monkeypatch, frees, parallel, fails, asked, ok):
    from harness.vllm import client as client_mod
    from harness.vllm import memory_lock

    _SleepRace.fails, _SleepRace.asked = fails, 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SleepRace)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setattr(memory_lock, "_gpu_host", lambda: True)
    monkeypatch.setattr(client_mod.time, "sleep", lambda s: None)
    if parallel:
        monkeypatch.setenv(memory_lock.DIR_ENV, str(tmp_path))
    else:
        monkeypatch.delenv(memory_lock.DIR_ENV, raising=False)
    try:
        c = ServerClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=5,
                         sleep_frees_memory=frees)
        if ok:
            assert c.sleep(level=1) == {"status": "sleeping", "level": 1}
        else:
            with pytest.raises(ControlPlaneError, match="Memory usage increased after sleeping"):
                c.sleep(level=1)
        assert (_SleepRace.asked, c.sleep_retries) == (asked, asked - 1)
        assert c.clone().sleep_frees_memory is frees
    finally:
        httpd.shutdown()
        httpd.server_close()
