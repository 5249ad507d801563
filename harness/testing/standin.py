"""A stand-in for a vLLM server's pause/resume surface, with switchable misbehaviours.

Pure Python (stdlib ``http.server``), on 127.0.0.1, for the self-tests of
harness/pause/: the same check functions run against it well-behaved (they must
pass) and misbehaving (they must fail). It serves ``/pause``, ``/resume``,
``/is_paused``, ``/v1/completions`` (streaming, SSE over chunked encoding, and
not, in the OpenAI schema plus vLLM's ``token_ids``, so the ``openai`` SDK reads
it), ``/v1/models``, ``/health``, ``/version`` and an ``/openapi.json`` that
declares /pause's parameters the way FastAPI does.

Generation: one scheduler thread produces one token per running request every
``step_s`` seconds. Token ``i`` is a hash of the prompt, the tokens so far and
the current "weights" (``update_weights(seed)``), so greedy text is
deterministic, depends on the whole history, and changes with the weights.

Pause semantics (as vLLM documents them): every mode holds new requests until
/resume; ``abort`` finishes all requests with ``abort``; ``wait`` keeps
generating what is in flight and answers once it has drained; ``keep`` freezes
in-flight requests, which continue after /resume.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

# name -> what the stand-in then does wrong
MISBEHAVIOURS: dict[str, str] = {
    "pause_ignores_new": "requests sent while paused are served at once",
    "resume_never_releases": "/resume clears /is_paused but nothing generates again",
    "keep_aborts": "mode=keep aborts in-flight requests",
    "keep_ignored": "mode=keep lets in-flight requests go on generating",
    "keep_loses_history": "a keep-paused request continues without its earlier tokens (other text)",
    "wait_aborts": "mode=wait aborts in-flight requests",
    "wait_returns_early": "mode=wait answers at once and lets requests generate while paused",
    "abort_ignored": "mode=abort lets in-flight requests finish (like wait)",
    "is_paused_lies": "/is_paused always says false",
    "pause_does_nothing": "/pause answers 200 and does nothing: not paused, requests run on",
    "resume_does_nothing": "/resume answers 200 and does nothing: still paused, requests held",
    "double_pause_errors": "/pause while paused answers 409",
    "resume_unpaused_errors": "/resume while not paused answers 500",
    "invalid_mode_accepted": "an unknown mode is accepted (and pauses, as abort)",
    "invalid_mode_unnamed": "an unknown mode gets a 400 that does not name the parameter",
    "drops_held_on_resume": "requests held by a pause lose their connection at /resume",
    "queued_use_old_weights": "requests sent while paused are prefilled at once, on the old weights",
    "pause_spares_dp1": "a request sent to data-parallel engine 1 (X-data-parallel-rank: 1) "
                        "while paused is served at once: that engine ignores the pause",
    "abort_drops_stream_finish": "a stream aborted before its first token ends with a bare [DONE] "
                                 "(no finish_reason), as vLLM 0.26-0.32 do",
    "abort_spares_held": "mode=abort finishes only the requests that were generating: those "
                         "held by an earlier pause wait on, unanswered, until /resume",
}

VOCAB = 512


def next_token(prompt: list[int], generated: list[int], seed: int) -> int:
    h = (seed * 1_000_003 + len(generated) * 7_919) & 0xFFFFFFFF
    for t in prompt[-8:] + generated[-4:]:
        h = (h * 16_777_619 ^ (t + 1)) & 0xFFFFFFFF
    return h % VOCAB


class _Request:
    def __init__(self, prompt: list[int], max_tokens: int, held: bool, dp_rank: int | None = None):
        self.prompt, self.max_tokens, self.dp_rank = prompt, max_tokens, dp_rank
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.held = held              # arrived while paused, not yet released
        self.history_from = 0         # keep_loses_history: tokens before this are forgotten
        self.pending: list[int] = []  # queued_use_old_weights: generated before release
        self.return_token_ids = False
        self.events: "queue.Queue[tuple]" = queue.Queue()

    def emit(self, ids: list[int], finish: str | None = None) -> None:
        self.events.put(("tokens", ids, finish))


class StandinServer:
    """``with StandinServer(misbehave={"keep_ignored"}) as s: ServerClient(s.url)``"""

    def __init__(self, *, misbehave: set[str] | frozenset[str] | tuple = (), step_s: float = 0.004,
                 modes: tuple[str, ...] = ("abort", "wait", "keep"), legacy_wait_flag: bool = False,
                 model: str = "standin", refuse_while_paused: bool = False,
                 arrival_delay_s: float = 0.0):
        unknown = set(misbehave) - set(MISBEHAVIOURS)
        if unknown:
            raise ValueError(f"unknown misbehaviours {sorted(unknown)}; "
                             f"known: {sorted(MISBEHAVIOURS)}")
        self.misbehave = set(misbehave)
        self.step_s, self.modes, self.model = step_s, modes, model
        self.legacy_wait_flag = legacy_wait_flag
        # vLLM 0.33: abort/wait refuse requests sent while paused (HTTP 503), keep queues
        self.refuse_while_paused = refuse_while_paused
        # a loaded API server: a completion reaches the engine this long after it arrives
        # (seen on a GPU beside seven starting servers: over 1.2 s)
        self.arrival_delay_s = arrival_delay_s
        self.seed = 0
        self.pause_mode: str | None = None   # None: running
        self.stuck = False                   # resume_never_releases
        self.requests: list[_Request] = []
        self.cond = threading.Condition()
        self.stopped = threading.Event()
        self.httpd: ThreadingHTTPServer | None = None
        self.url = ""
        self.counts: dict[str, int] = {}
        self.user_agents: set[str] = set()  # of /v1/completions requests

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "StandinServer":
        handler = type("Handler", (_Handler,), {"standin": self})
        self.httpd = _HTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True, name="standin-http").start()
        threading.Thread(target=self._loop, daemon=True, name="standin-engine").start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        with self.cond:
            for r in self.requests:
                r.events.put(("stopped",))
            self.requests.clear()
            self.cond.notify_all()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()

    def __enter__(self) -> "StandinServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def describe(self) -> str:
        return f"stand-in at {self.url}, misbehaving: {sorted(self.misbehave) or 'no'}"

    def update_weights(self, seed: int) -> None:
        with self.cond:
            self.seed = seed

    # ------------------------------------------------------------------ engine
    def _steppable(self, r: _Request) -> bool:
        if self.stuck:
            return False
        if r.held:
            return "pause_ignores_new" in self.misbehave or (
                "pause_spares_dp1" in self.misbehave and r.dp_rank == 1)
        if self.pause_mode == "keep":
            return "keep_ignored" in self.misbehave
        return True  # running, or paused with abort/wait: in-flight requests drain

    def _loop(self) -> None:
        while not self.stopped.is_set():
            with self.cond:
                for r in list(self.requests):
                    if r.finish_reason is None and self._steppable(r):
                        tok = next_token(r.prompt, r.generated[r.history_from:], self.seed)
                        r.generated.append(tok)
                        fin = "length" if len(r.generated) >= r.max_tokens else None
                        r.finish_reason = fin
                        r.emit([tok], fin)
                        if fin:
                            self.requests.remove(r)
                self.cond.notify_all()
            time.sleep(self.step_s)

    def add(self, prompt: list[int], max_tokens: int, dp_rank: int | None = None) -> _Request:
        with self.cond:
            r = _Request(prompt, max_tokens, held=self.pause_mode is not None, dp_rank=dp_rank)
            if r.held and "queued_use_old_weights" in self.misbehave:
                # "prefilled" at once, on the weights of today; emitted once it runs
                r.generated.append(next_token(prompt, [], self.seed))
                r.pending = list(r.generated)
            self.requests.append(r)
            self.cond.notify_all()
            return r

    def pause(self, mode: str) -> None:
        """Like vLLM: abort finishes every request; the latest mode sets the state
        (keep freezes everything, abort/wait hold only new requests); wait answers
        once the requests in flight have drained."""
        with self.cond:
            m = self.misbehave
            if (mode == "abort" and "abort_ignored" not in m) or (mode == "keep" and "keep_aborts" in m) \
                    or (mode == "wait" and "wait_aborts" in m):
                for r in list(self.requests):
                    if r.held and mode == "abort" and "abort_spares_held" in m:
                        continue
                    r.finish_reason = "abort"
                    r.emit([], "abort")
                    self.requests.remove(r)
            if mode == "keep" and "keep_loses_history" in m:
                for r in self.requests:
                    if not r.held:
                        r.history_from = len(r.generated)
            self.pause_mode = mode
            self.cond.notify_all()
            if mode in ("wait", "abort") and "wait_returns_early" not in m:
                deadline = time.monotonic() + 600
                while any(not r.held for r in self.requests) and time.monotonic() < deadline \
                        and not self.stopped.is_set():
                    self.cond.wait(0.05)

    def resume(self) -> None:
        with self.cond:
            self.pause_mode = None
            if "resume_never_releases" in self.misbehave:
                self.stuck = True
            for r in list(self.requests):
                if r.held and "drops_held_on_resume" in self.misbehave:
                    r.events.put(("drop",))
                    self.requests.remove(r)
                    continue
                if r.held and r.pending:
                    r.emit(r.pending)
                    r.pending = []
                r.held = False
            self.cond.notify_all()


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # a bug in the stand-in: show it


class _Handler(BaseHTTPRequestHandler):
    standin: StandinServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *a: Any) -> None:  # quiet
        pass

    def end_headers(self) -> None:
        # Say that the connection closes when the client asked (as uvicorn does): without
        # the header a client may put the socket back in its pool and send the next
        # request on it as it closes ("Remote end closed connection without response").
        if (self.headers.get("Connection") or "").lower() == "close":
            self.send_header("Connection", "close")
        super().end_headers()

    def _json(self, code: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _bad(self, param: str, msg: str) -> None:
        self._json(400, {"error": {"message": msg, "type": "Bad Request", "param": f"query.{param}",
                                   "code": 400}})

    # ------------------------------------------------------------------ GET
    def do_GET(self) -> None:
        s, path = self.standin, urlparse(self.path).path
        s.counts[path] = s.counts.get(path, 0) + 1
        if path == "/health":
            self._json(200, {})
        elif path == "/version":
            self._json(200, {"version": "standin"})
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": s.model, "object": "model"}]})
        elif path == "/is_paused":
            paused = s.pause_mode is not None and "is_paused_lies" not in s.misbehave
            self._json(200, {"is_paused": paused})
        elif path == "/openapi.json":
            self._json(200, self._openapi())
        else:
            self._json(404, {"detail": "Not Found"})

    def _openapi(self) -> dict:
        s = self.standin
        params = []
        if s.modes:
            params.append({"name": "mode", "in": "query", "required": False,
                           "schema": {"enum": list(s.modes), "type": "string",
                                      "default": s.modes[0], "title": "Mode"}})
        if s.legacy_wait_flag:
            params.append({"name": "wait_for_inflight_requests", "in": "query", "required": False,
                           "schema": {"type": "boolean", "default": False}})
        params.append({"name": "clear_cache", "in": "query", "required": False,
                       "schema": {"type": "boolean", "default": True, "title": "Clear Cache"}})
        post = {"post": {"responses": {"200": {"description": "ok"}}}}
        return {"openapi": "3.1.0", "info": {"title": "stand-in", "version": "0"}, "paths": {
            "/pause": {"post": {"parameters": params, "responses": {"200": {"description": "ok"}}}},
            "/resume": post, "/is_paused": {"get": {"responses": {"200": {"description": "ok"}}}},
            "/v1/completions": post, "/v1/models": {"get": {}}, "/health": {"get": {}}}}

    # ------------------------------------------------------------------ POST
    def do_POST(self) -> None:
        s, u = self.standin, urlparse(self.path)
        s.counts[u.path] = s.counts.get(u.path, 0) + 1
        q = {k: v[-1] for k, v in parse_qs(u.query).items()}
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}") if n else {}
        if u.path == "/pause":
            self._pause(q)
        elif u.path == "/resume":
            if s.pause_mode is None and "resume_unpaused_errors" in s.misbehave:
                self._json(500, {"error": "not paused"})
                return
            if "resume_does_nothing" not in s.misbehave:
                s.resume()
            self._json(200, {"status": "resumed"})
        elif u.path == "/_standin/update_weights":
            s.update_weights(int(body.get("seed", 0)))
            self._json(200, {"seed": s.seed})
        elif u.path == "/v1/completions":
            self._completions(body)
        else:
            self._json(404, {"detail": "Not Found"})

    def _pause(self, q: dict[str, str]) -> None:
        s = self.standin
        for name in ("clear_cache",) + (("wait_for_inflight_requests",) if s.legacy_wait_flag else ()):
            if name in q and q[name].lower() not in ("true", "false", "1", "0", "yes", "no"):
                self._bad(name, f"Input should be a valid boolean: {name}={q[name]!r}")
                return
        mode = q.get("mode", s.modes[0] if s.modes else "abort")
        if s.legacy_wait_flag and q.get("wait_for_inflight_requests", "").lower() in ("true", "1", "yes"):
            mode = "wait"
        if s.modes and mode not in s.modes:
            if "invalid_mode_unnamed" in s.misbehave:
                self._json(400, {"error": "bad request"})
                return
            if "invalid_mode_accepted" not in s.misbehave:
                self._bad("mode", f"Input should be one of {list(s.modes)}")
                return
            mode = "abort"
        if s.pause_mode is not None and "double_pause_errors" in s.misbehave:
            self._json(409, {"error": "already paused"})
            return
        if "pause_does_nothing" not in s.misbehave:
            s.pause(mode)
        self._json(200, {"status": "paused"})

    def _completions(self, body: dict) -> None:
        s = self.standin
        prompt = body.get("prompt")
        if not isinstance(prompt, list):
            self._json(400, {"error": {"message": "the stand-in takes token ids only",
                                       "param": "prompt"}})
            return
        s.user_agents.add(self.headers.get("User-Agent", ""))
        if s.refuse_while_paused and s.pause_mode in ("abort", "wait"):
            self._json(503, {"error": {"message": "Generation is paused. Please retry after it "
                                                  "resumes.", "type": "ServiceUnavailableError",
                                       "code": 503}})
            return
        rank = self.headers.get("X-data-parallel-rank")
        if s.arrival_delay_s:
            time.sleep(s.arrival_delay_s)
        r = s.add([int(t) for t in prompt], int(body.get("max_tokens", 16)),
                  dp_rank=int(rank) if rank is not None and rank.isdigit() else None)
        r.return_token_ids = bool(body.get("return_token_ids"))
        if body.get("stream"):
            self._stream(r)
        else:
            ids, finish = [], None
            while finish is None:
                ev = r.events.get(timeout=600)
                if ev[0] != "tokens":
                    self._json(500, {"error": f"request {ev[0]}"})
                    return
                ids += ev[1]
                finish = ev[2]
            self._json(200, self._completion(r, ids, finish))

    def _completion(self, r: _Request, ids: list[int], finish: str | None) -> dict:
        """A completion (or one streamed event of it) as vLLM writes it: the OpenAI
        schema, plus ``token_ids`` when asked for (vLLM's ``return_token_ids``)."""
        choice = {"index": 0, "text": "".join(f" t{t}" for t in ids), "logprobs": None,
                  "finish_reason": finish}
        if r.return_token_ids:
            choice["token_ids"] = ids
        return {"id": f"cmpl-standin-{id(r):x}", "object": "text_completion",
                "created": int(time.time()), "model": self.standin.model, "choices": [choice]}

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _stream(self, r: _Request) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            while True:
                ev = r.events.get(timeout=600)
                if ev[0] != "tokens":  # dropped or stopped: cut the connection, no [DONE]
                    self.close_connection = True
                    return
                _, ids, finish = ev
                sent += len(ids)
                if not sent and finish is not None and "abort_drops_stream_finish" in \
                        self.standin.misbehave:
                    break  # vLLM skips an empty chunk even when it carries the finish reason
                event = self._completion(r, ids, finish)
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
                if finish is not None:
                    break
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
