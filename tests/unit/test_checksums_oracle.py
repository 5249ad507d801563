"""harness.oracles.checksums (vLLM's weight digests compared) and the ServerClient calls behind
it, without a vLLM server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.oracles import checksums
from harness.vllm.client import ControlPlaneError, ServerClient

A = {"dp0:pp0:pcp0:tp0:model.embed_tokens.weight": "a0",
     "dp0:pp0:pcp0:tp0:model.norm.weight": "n0",
     "dp0:pp0:pcp0:tp1:model.embed_tokens.weight": "a1",
     "dp0:pp0:pcp0:tp1:model.norm.weight": "n1"}


def test_keys_split_into_rank_and_name():
    k = checksums.Key.parse("dp0:pp0:pcp0:tp1:model.layers.0.mlp.experts.w13_weight")
    assert (k.rank, k.tp, k.name) == ("dp0:pp0:pcp0:tp1", 1, "model.layers.0.mlp.experts.w13_weight")
    odd = checksums.Key.parse("model.norm.weight")  # a layout of keys nobody promised
    assert (odd.rank, odd.name) == ("?", "model.norm.weight")
    assert checksums.ranks(A) == ["dp0:pp0:pcp0:tp0", "dp0:pp0:pcp0:tp1"]


def test_equal_digests_match():
    d = checksums.assert_match(dict(A), A, what="x")
    assert d.match and d.compared == 4 and d.describe() == "all 4 digests match"


def test_a_difference_names_the_tensor_and_the_rank():
    got = dict(A, **{"dp0:pp0:pcp0:tp1:model.embed_tokens.weight": "zz"})
    d = checksums.diff(got, A)
    assert not d.match and d.by_rank() == {"dp0:pp0:pcp0:tp1": ["model.embed_tokens.weight"]}
    with pytest.raises(AssertionError, match=r"(?s)llama on vLLM 0\.32\.0.*/weight_checker.*"
                                             r"1 of 4 digests differ.*tp1: model\.embed_tokens"):
        checksums.assert_match(got, A, what="llama on vLLM 0.32.0", context="log tail")


def test_keys_on_one_side_only_are_differences():
    got = {k: v for k, v in A.items() if "tp1" not in k}
    d = checksums.diff(got, A)
    assert d.only_want == sorted(k for k in A if "tp1" in k) and not d.match
    assert "2 only on the baseline" in d.describe()
    with pytest.raises(AssertionError, match="answered no digest"):
        checksums.assert_match({}, A, what="x")


class _Handler(BaseHTTPRequestHandler):
    seen: list = []

    def log_message(self, *a):
        pass

    def _answer(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        self._answer(200, {"weight_version": "v7"} if self.path == "/weight_info" else {})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.seen.append((self.path, body))
        action = body.get("action")
        if action == "checksum":
            self._answer(200, {"checksums": A})
        elif action == "compare":
            self._answer(200, {"match": body["baseline"] == A, "mismatches": []})
        elif action == "reset":
            self._answer(200, {"status": "reset"})
        else:
            self._answer(422, {"detail": "bad action"})


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _Handler.seen = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_the_client_asks_the_weight_checker(server):
    c = ServerClient(server, timeout=5)
    assert c.weight_checksums() == A
    assert c.weight_checker_compare(A) == {"match": True, "mismatches": []}
    c.reset_weights()
    assert c.weight_info() == "v7"
    assert [b for _, b in _Handler.seen] == [{"action": "checksum"},
                                             {"action": "compare", "baseline": A},
                                             {"action": "reset"}]
    assert {p for p, _ in _Handler.seen} == {"/weight_checker"}


def test_an_answer_without_checksums_names_the_route(server):
    c = ServerClient(server, timeout=5)
    c._call = lambda *a, **k: {"status": "reset"}  # a server that answers something else
    with pytest.raises(ControlPlaneError, match="^/weight_checker failed: no 'checksums'"):
        c.weight_checksums()
