"""The server pool: servers started side by side, shared, and stopped after their last use.

Server start-up, not the data, decides how long a run takes (30-60 s on CPU, 40-80 s
on a GPU, each). The pool is told, in test order, which server configurations the
selected tests need (``plan``) and keeps up to ``max_alive`` servers alive or starting:
while tests run on one server, the next ones start in the background. A server is
stopped once no remaining test needs it (``release``).

Each server has one persistent trainer per backend variant (``trainer``): the group
is opened once and every later sync reuses it, as RL trainers do.

A server that failed to start, or that died after it was handed out, is not started
again: every later ``get`` for its configuration raises ``ServerUnavailable`` with the
original cause (the exit status and the log tail), instead of the tests that follow
failing with connection errors or each paying for a start that may fail the same way.
A server stopped on purpose (``discard``, a test's repair) is started again on demand.

Creating a pool first stops the orphans of earlier runs that were killed outright
(``harness.reaper``); they are listed in ``reaped``.

The pool knows nothing of pytest: failures are exceptions (``ServerUnavailable``,
``NeedsFreshServer``) that each front end presents in its own way.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import enum
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import reaper
from .server import ServerConfig, ServerError, VLLMServer
from .trainer import Trainer, TrainerSpec


class ServerUnavailable(RuntimeError):
    """This configuration's server failed to start earlier, or died; it is not retried."""


class NeedsFreshServer(RuntimeError):
    """A never-synced server is needed, and the attached one cannot be restarted."""


class State(enum.Enum):
    DUMMY = "dummy weights (never synced)"
    SYNCED = "synced"
    CORRUPTED = "deliberately corrupted update"
    INCOMPLETE = "sync did not complete"


@dataclass(frozen=True)
class Holding:
    """What a server's weights are: ``weights`` (a directory) in ``state``."""

    state: State = State.DUMMY
    weights: str | None = None

    def holds(self, weights: str) -> bool:
        return self.state is State.SYNCED and self.weights == weights


class ServerPool:
    def __init__(self, log_dir: Path, *, start_timeout: float, max_alive: int,
                 url: str | None = None, reap: bool = True):
        self.reaped: list[reaper.Orphan] = reaper.reap() if reap else []
        self.log_dir, self.start_timeout, self.url = Path(log_dir), start_timeout, url
        self.max_alive = max(1, max_alive)
        self.servers: dict[ServerConfig, VLLMServer] = {}
        self.holding: dict[ServerConfig, Holding] = {}
        self.poisoned: dict[ServerConfig, str] = {}
        self.started: list[dict] = []         # one record per server start, for reports
        self.trainers: dict[tuple[ServerConfig, TrainerSpec], Trainer] = {}
        self._plan: list[ServerConfig] = []   # configs still to be used, in order
        self._starting: dict[ServerConfig, cf.Future] = {}
        self._booting: dict[ServerConfig, VLLMServer] = {}  # inside start(), for stop_all
        self._lock = threading.RLock()
        self._executor = cf.ThreadPoolExecutor(max_workers=self.max_alive,
                                               thread_name_prefix="server-start")
        atexit.register(self.stop_all)

    # ------------------------------------------------------------------ planning
    def plan(self, configs: list[ServerConfig]) -> None:
        """The configurations the run will use, in order of first use (repeats are
        fine). Servers for the first ``max_alive`` start now, side by side."""
        if self.url:
            return
        with self._lock:
            self._plan = list(dict.fromkeys(configs))
        self._start_ahead()

    def release(self, cfg: ServerConfig) -> None:
        """No later test needs ``cfg``: stop its server, start the next planned one."""
        with self._lock:
            if cfg in self._plan:
                self._plan.remove(cfg)
        if cfg in self.servers and not self.url:
            self._stop(cfg)
        self._start_ahead()

    def _start_ahead(self) -> None:
        with self._lock:
            for cfg in self._plan:
                if len(self.servers) + len(self._starting) >= self.max_alive:
                    break
                if cfg in self.servers or cfg in self._starting or cfg in self.poisoned:
                    continue
                self._starting[cfg] = self._executor.submit(self._start, cfg)

    def _start(self, cfg: ServerConfig) -> VLLMServer:
        srv = VLLMServer(cfg, log_dir=self.log_dir, start_timeout=self.start_timeout)
        t0 = time.monotonic()
        with self._lock:
            self._booting[cfg] = srv
        try:
            srv.start()
        finally:
            with self._lock:
                self._booting.pop(cfg, None)
        with self._lock:
            self.started.append({"config": cfg.describe(), "start_seconds": srv.start_seconds,
                                 "version": srv.version, "log": str(srv.log_path),
                                 "started_at": round(t0, 3),
                                 "ready_at": round(time.monotonic(), 3)})
        return srv

    # ------------------------------------------------------------------ servers
    def get(self, cfg: ServerConfig, *, fresh: bool = False) -> VLLMServer:
        """The server for ``cfg``; ``fresh``: one that has never been synced."""
        if self.url:
            srv = self.servers.get(cfg) or VLLMServer.attach(self.url, cfg)
            if fresh and self.holding.get(cfg, Holding()).state is not State.DUMMY:
                raise NeedsFreshServer("needs a never-synced server; an attached server "
                                       "(--vllm-url) cannot be restarted")
            self.servers[cfg] = srv
            return srv
        if cfg in self.poisoned:
            raise ServerUnavailable(self.poisoned[cfg])
        srv = self.servers.get(cfg)
        if srv is not None and not srv.alive():
            raise ServerUnavailable(self.mark_dead(cfg))
        if srv is not None and fresh and self.holding.get(cfg) is not None \
                and self.holding[cfg].state is not State.DUMMY:
            self._stop(cfg)
            srv = None
        if srv is None:
            srv = self._wait_or_start(cfg)
        with self._lock:  # most recently used goes last
            self.servers[cfg] = self.servers.pop(cfg)
        self._start_ahead()
        return srv

    def _wait_or_start(self, cfg: ServerConfig) -> VLLMServer:
        with self._lock:
            future = self._starting.get(cfg)
            if future is None:
                self._make_room()
                future = self._starting[cfg] = self._executor.submit(self._start, cfg)
        try:
            srv = future.result()
        except ServerError as e:
            self.poisoned[cfg] = (f"the server for this configuration failed to start "
                                  f"earlier; not retried:\n{e}")
            raise
        finally:
            with self._lock:
                self._starting.pop(cfg, None)
        with self._lock:
            self.servers[cfg] = srv
            self.holding[cfg] = Holding()
        return srv

    def _make_room(self) -> None:
        """Stop the least recently used servers until a start fits under max_alive;
        servers still planned are stopped last."""
        while self.servers and len(self.servers) + len(self._starting) >= self.max_alive:
            idle = [c for c in self.servers if c not in self._plan] or list(self.servers)
            self._stop(idle[0])

    def mark_dead(self, cfg: ServerConfig, during: str | None = None) -> str | None:
        """If ``cfg``'s server has died, stop what is left of its process tree and make
        every later ``get`` fail with the cause; returns that cause (None if alive)."""
        srv = self.servers.get(cfg)
        if srv is None or self.url or srv.alive():
            return None
        when = f" during {during}" if during else " after it was last handed out"
        why = (f"the server for this configuration died{when} (exit code "
               f"{srv.exit_code()}); it is not restarted, so every later test that needs "
               f"it fails with this cause:\n{srv.describe_failure()}")
        self.poisoned[cfg] = why
        try:
            self._stop(cfg)  # engine core or workers may outlive the API server
        except ServerError as e:
            self.poisoned[cfg] = why = f"{why}\n{e}"
        return why

    # ------------------------------------------------------------------ weights
    def holding_of(self, cfg: ServerConfig) -> Holding:
        return self.holding.get(cfg, Holding())

    def set_holding(self, cfg: ServerConfig, state: State, weights: str | None) -> None:
        self.holding[cfg] = Holding(state, weights)

    # ------------------------------------------------------------------ trainers
    def trainer(self, cfg: ServerConfig, spec: TrainerSpec) -> Trainer:
        """The persistent trainer of this server for ``spec``; one is created (its
        process starts on its first sync) when there is none."""
        key = (cfg, spec)
        t = self.trainers.get(key)
        if t is None:
            srv = self.servers[cfg]
            t = self.trainers[key] = Trainer(spec, log_dir=self.log_dir,
                                             context=srv.describe_failure, api_key=cfg.api_key)
        return t

    def drop_trainers(self, cfg: ServerConfig) -> None:
        """Close this server's trainers (their groups end with them)."""
        for key in [k for k in self.trainers if k[0] == cfg]:
            self.trainers.pop(key).close()

    # ------------------------------------------------------------------ stop
    def discard(self, cfg: ServerConfig) -> None:
        """Stop a server whose state cannot be trusted; the next user gets a new one."""
        if cfg in self.servers and not self.url:
            self._stop(cfg)

    def _stop(self, cfg: ServerConfig) -> None:
        self.drop_trainers(cfg)
        with self._lock:
            srv = self.servers.pop(cfg, None)
            self.holding.pop(cfg, None)
        if srv is not None:
            srv.stop()

    def stop_all(self) -> None:
        with self._lock:
            self._plan = []
            booting = list(self._booting.values())
            starting = list(self._starting.values())
        errors = []
        for srv in booting:  # a start under way is cut short: its process tree is stopped
            try:
                srv.stop()
            except ServerError as e:
                errors.append(str(e))
        for f in starting:
            try:
                f.result(timeout=60).stop()
            except Exception:  # it failed to start (we stopped it): nothing left to stop
                pass
        for cfg in list(self.servers):
            try:
                self._stop(cfg)
            except ServerError as e:
                errors.append(str(e))
        self._executor.shutdown(wait=False)
        if errors:
            raise ServerError("\n".join(errors))

    # ------------------------------------------------------------------ figures
    def start_figures(self) -> dict:
        """Server starts: how many, their sum, and the wall time during which at least
        one server was starting (less than the sum when they start side by side)."""
        return start_figures(self.started)


def start_figures(started: list[dict]) -> dict:
    total = sum(s["start_seconds"] or 0 for s in started)
    wall, end = 0.0, None
    for a, b in sorted((s["started_at"], s["ready_at"]) for s in started if "ready_at" in s):
        if end is None or a > end:
            wall += b - a
            end = b
        elif b > end:
            wall += b - end
            end = b
    return {"servers_started": len(started), "start_seconds_sum": round(total, 1),
            "start_wall_seconds": round(wall, 1)}
