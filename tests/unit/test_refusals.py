"""``client.assert_refused``: a request the server's state forbids (a weight update while
asleep) must be refused with a 4xx that names the state. Judged here against a stand-in
that answers ``/update_weights`` as a server may: the 500 seen on 1 x H200 with vLLM
0.26.0 (known issue update-while-asleep-answers-500) must fail the check, as must a
200 and a 4xx that names nothing; a 409 naming the state passes. The errors reach the
check the way tests/test_sleep.py gets them: from ``ServerClient`` (a
``ControlPlaneError``) and as a trainer's error that quotes one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.vllm import client
from harness.vllm.client import ControlPlaneError, ServerClient

SEEN_ON_H200 = {"error": {"message": "Call to collective_rpc method failed: CUDA error: "
                          "invalid argument", "type": "InternalServerError", "code": 500}}
ANSWERS = {
    "500": (500, SEEN_ON_H200),
    "409-names-the-state": (409, {"error": {"message": "Cannot update weights while the "
                                             "engine is asleep; call /wake_up first"}}),
    "400-names-nothing": (400, {"error": {"message": "Bad request"}}),
    "200": (200, {"message": "Weights updated"}),
}


class _StandIn(BaseHTTPRequestHandler):
    answer = ANSWERS["500"]

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        code, obj = type(self).answer
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def stand_in():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def update_while_asleep(httpd, answer: str) -> ControlPlaneError | None:
    _StandIn.answer = ANSWERS[answer]
    c = ServerClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=10)
    try:
        c.update_weights({"names": []})
    except ControlPlaneError as e:
        return e
    return None


def judge(error) -> None:
    client.assert_refused(error, what="a sync while asleep (level 1)", names=("sleep", "asleep"))


def test_the_500_seen_on_the_h200_is_no_refusal(stand_in):
    err = update_while_asleep(stand_in, "500")
    with pytest.raises(AssertionError, match=r"/update_weights answered HTTP 500; a request the "
                       r"server's state forbids must be refused") as e:
        judge(err)
    assert "\n" not in str(e.value) and "CUDA error: invalid argument" in str(e.value)


def test_a_500_quoted_by_the_trainer_is_no_refusal_either(stand_in):
    err = update_while_asleep(stand_in, "500")
    quoted = f"trainer (ipc, packed=True, cuda:0) failed: ControlPlaneError: {err}"
    with pytest.raises(AssertionError, match="answered HTTP 500"):
        judge(RuntimeError(quoted))


def test_a_200_is_no_refusal(stand_in):
    assert update_while_asleep(stand_in, "200") is None
    with pytest.raises(AssertionError, match="answered 200; it must be refused"):
        judge(None)


def test_a_4xx_that_names_nothing_fails(stand_in):
    with pytest.raises(AssertionError, match="without naming the state"):
        judge(update_while_asleep(stand_in, "400-names-nothing"))


def test_an_error_without_a_status_fails():
    with pytest.raises(AssertionError, match="without an HTTP status from a route"):
        judge(RuntimeError("trainer (ipc) died with exit code -9"))


def test_a_409_that_names_the_state_passes(stand_in):
    r = judge_ok = client.assert_refused(update_while_asleep(stand_in, "409-names-the-state"),
                                         what="a sync while asleep", names=("sleep", "asleep"))
    assert (r.route, r.status) == ("/update_weights", 409) and judge_ok is r
    quoted = client.refusal_in("x failed: ControlPlaneError: /start_weight_update failed with "
                               "HTTP 409: asleep\nrequest: {}")
    assert quoted == client.Refusal("/start_weight_update", 409, "asleep")
