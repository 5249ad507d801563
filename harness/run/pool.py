"""The server pool: servers started side by side, shared, and stopped after their last use.

Server start-up, not the data, decides how long a run takes (30-60 s on CPU, 40-80 s
on a GPU, each). The pool is told, in order of first use, which server configurations
the selected tests need (``plan``; ``harness.run.plan`` makes that order) and starts them
in that order, ``max_starting`` at a time (starts are CPU-bound), keeping at most
``max_alive`` alive or starting (servers cost memory): while tests run on one server,
the next ones start in the background. A server is stopped once no remaining test
needs it (``release``).

Each server has one persistent trainer at a time (``trainer``): the group is opened
once and every later sync reuses it, as RL trainers do, until a test of another
backend variant or trainer code takes the server over. The first planned trainer is
started and prepared (imports, CUDA context, weights) as soon as its server is up.

Every start of a configuration that was started before is a restart, recorded in
``restarts`` with the reason it was stopped (a test broke it, room was needed, a test
asked for a brand-new engine): a plan that is followed needs none. A test that needs
never-synced weights on a synced server gets them pushed back instead
(``SyncSession.reset_weights``), counted in ``resets``.

A server that failed to start, or that died after it was handed out, is not started
again: every later ``get`` for its configuration raises ``ServerUnavailable`` with the
original cause (the exit status and the log tail), instead of the tests that follow
failing with connection errors or each paying for a start that may fail the same way.
A server stopped on purpose (``discard``, a test's repair) is started again on demand.

Creating a pool first stops the orphans of earlier runs that were killed outright
(``harness.vllm.reaper``); they are listed in ``reaped``.

The pool knows nothing of pytest: failures are exceptions (``ServerUnavailable``,
``NeedsFreshServer``) that each front end presents in its own way.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from harness import models
from harness.core import measure
from harness.trainer.handle import Trainer, TrainerError, TrainerSpec, trainer_env
from harness.run.server_weights import ServerWeights, State
# start_seconds_by_mode: the report reads it through this module
from harness.run.start_figures import start_figures, start_seconds_by_mode  # noqa: F401
from harness.run.start_slots import Abandoned, StartSlots
from harness.trainer.spares import Spares, TrainerProcesses
from harness.vllm import reaper
from harness.vllm import startup
from harness.vllm.server import ServerConfig, ServerError, VLLMServer

log = logging.getLogger(__name__)


SAMPLE_EVERY_S = 5.0


class ServerUnavailable(RuntimeError):
    """This configuration's server failed to start earlier, or died; it is not retried."""


class NeedsFreshServer(RuntimeError):
    """A never-synced server is needed, and the attached one cannot be restarted."""


class ServerPool:
    def __init__(self, log_dir: Path, *, start_timeout: float, max_alive: int,
                 max_starting: int | None = None, url: str | None = None, reap: bool = True,
                 processes: TrainerProcesses | None = None, slots: StartSlots | None = None,
                 announce: Callable[[str], None] | None = None):
        # a line when each server starts and when it is up (the terminal's, even under -q)
        self.announce = announce or (lambda line: None)
        # the run's trainer spares and retired trainers (the pytest session's)
        self.processes = processes or TrainerProcesses()
        # a parallel run's start slots, the host's, shared with the other workers
        self.slots = slots
        self.reaped: list[reaper.Orphan] = reaper.reap() if reap else []
        self.log_dir, self.start_timeout, self.url = Path(log_dir), start_timeout, url
        self.max_alive = max(1, max_alive)
        self.max_starting = max(1, min(max_starting or self.max_alive, self.max_alive))
        self.t0 = time.monotonic()
        self.servers: dict[ServerConfig, VLLMServer] = {}
        self.server_weights: dict[ServerConfig, ServerWeights] = {}
        self.unavailable: dict[ServerConfig, str] = {}
        self.started: list[dict] = []         # one record per server start, for reports
        self.restarts: list[dict] = []        # starts of a configuration started before
        self.resets: list[dict] = []          # dummy-equivalent weights pushed back
        self.trainers: dict[tuple[ServerConfig, TrainerSpec], Trainer] = {}
        self._plan: list[ServerConfig] = []   # configs still to be used, in order
        self._warm: dict[ServerConfig, list[tuple[TrainerSpec, str]]] = {}
        self._starting: dict[ServerConfig, cf.Future] = {}
        self._booting: dict[ServerConfig, VLLMServer] = {}  # inside start(), for stop_all
        self._tickets: dict[ServerConfig, int | None] = {}    # places in the start-slot line
        self._ever: set[ServerConfig] = set()
        self._stopped_why: dict[ServerConfig, str] = {}
        self._closed = False
        self._planned: set[ServerConfig] = set()
        self._sampler: threading.Thread | None = None
        self._sampler_stop = threading.Event()
        self.samples: list[dict] = []         # host load and GPU memory over the run
        self._unplanned: dict[ServerConfig, str] = {}
        self._lock = threading.RLock()
        self._executor = cf.ThreadPoolExecutor(max_workers=self.max_starting,
                                               thread_name_prefix="server-start")
        atexit.register(self.stop_all)

    # ------------------------------------------------------------------ planning
    def plan(self, configs: list[ServerConfig],
             warm: dict[ServerConfig, list[tuple[TrainerSpec, str]]] | None = None) -> None:
        """The configurations the run will use, in order of first use (repeats are
        fine). The first ones start now, ``max_starting`` at a time, up to
        ``max_alive``. ``warm``: per configuration, the trainers (spec without a URL,
        weights) to start and prepare as soon as its server is up (imports, the CUDA
        context and the weights on the device then cost no test any time)."""
        if self.url:
            return
        with self._lock:
            self._plan = list(dict.fromkeys(configs))
            self._planned = set(self._plan)
            self._warm = dict(warm or {})
        if self._plan and self._sampler is None:
            self._sampler = threading.Thread(target=self._sample, name="host-sampler",
                                             daemon=True)
            self._sampler.start()
        self._start_ahead()

    def _sample(self, every: float = SAMPLE_EVERY_S) -> None:
        """The host's load and GPU memory every few seconds, until the pool stops.
        It waits on an event, not ``time.sleep``: a test that stubs ``time.sleep``
        (a retry loop's) made it take 4582 samples in 0.1 s in a CI run."""
        while not self._closed:
            with self._lock:
                starting = len(self._booting)
                alive = len(self.servers)
            self.samples.append({"at": round(time.monotonic() - self.t0, 1),
                                 "starting": starting, "alive": alive,
                                 **measure.host_load()})
            self._sampler_stop.wait(every)

    def release(self, cfg: ServerConfig) -> None:
        """No later test needs ``cfg``: stop its server, start the next planned one."""
        with self._lock:
            if cfg in self._plan:
                self._plan.remove(cfg)
        if cfg in self.servers and not self.url:
            self._stop(cfg, "no later test needs it")
        self._start_ahead()

    def _start_ahead(self) -> None:
        with self._lock:
            for cfg in self._plan:
                if (len(self._starting) >= self.max_starting
                        or len(self.servers) + len(self._starting) >= self.max_alive):
                    break
                if cfg in self.servers or cfg in self._starting or cfg in self.unavailable:
                    continue
                self._submit(cfg)
            idle = not any(c not in self.servers and c not in self.unavailable for c in self._plan)
        if self.slots is not None:
            self.slots.idle(idle)

    def _submit(self, cfg: ServerConfig) -> cf.Future:
        ticket = None
        if self.slots is not None:
            self.slots.idle(False)
            ticket = self.slots.ticket()   # slots go in the order of the plan
        future = self._starting[cfg] = self._executor.submit(self._start_job, cfg, ticket)
        self._tickets[cfg] = ticket
        return future

    def _start_job(self, cfg: ServerConfig, ticket: int | None = None) -> VLLMServer:
        """A start in the background: the server joins ``servers`` once it is up (or
        its configuration is unavailable), and the next planned start may begin."""
        try:
            srv = self._start(cfg, ticket)
        except ServerError as e:
            with self._lock:
                self._starting.pop(cfg, None)
                self.unavailable[cfg] = (f"the server for this configuration failed to start "
                                      f"earlier; not retried:\n{e}")
            self._start_ahead()
            raise
        except BaseException as e:
            # nobody may read this future: the traceback goes to the log, which names
            # the line (an OSError here once said only "Bad file descriptor")
            log.warning("the start of %s in the background failed", cfg.describe(),
                        exc_info=True)
            with self._lock:
                self._starting.pop(cfg, None)
                # the reason goes where a restart looks
                self._stopped_why[cfg] = (f"its start in the background failed: "
                                          f"{type(e).__name__}: {e}".splitlines()[0])
            raise
        with self._lock:
            self._starting.pop(cfg, None)
            self.servers[cfg] = srv
            self.server_weights[cfg] = ServerWeights()
        self._start_ahead()
        return srv

    def _start(self, cfg: ServerConfig, ticket: int | None = None) -> VLLMServer:
        try:
            return self._start_now(cfg, ticket)
        finally:
            if ticket is not None:  # a start that ended before its slot leaves the line
                self.slots.leave(ticket)
            with self._lock:
                if self._tickets.get(cfg) == ticket:
                    self._tickets.pop(cfg, None)

    def _start_now(self, cfg: ServerConfig, ticket: int | None) -> VLLMServer:
        srv = VLLMServer(cfg, log_dir=self.log_dir, start_timeout=self.start_timeout)
        t0 = time.monotonic()
        with self._lock:
            if self._closed:
                raise ServerError(f"not started: the run is ending ({cfg.describe()})")
            self._booting[cfg] = srv
            together = len(self._booting)
            again = cfg in self._ever
            self._ever.add(cfg)
            why = self._stopped_why.pop(cfg, "it was stopped earlier")
        # Its planned trainers' processes start with it and import while it starts
        # (10-20 s on 2 cores, which the server's three processes importing one after
        # another leave room for); each takes its trainer's spec once the server is up.
        early = self._early_trainers(cfg)
        gate = (self.slots.held(cfg.describe(), ticket, abort=lambda: self._closed)
                if self.slots is not None else contextlib.nullcontext(None))
        try:
            with gate as slot:
                if self._closed:  # the run ended while it waited for its slot
                    raise ServerError(f"not started: the run is ending ({cfg.describe()})")
                t_built = time.monotonic()
                self.announce(f"vLLM server starting{' again' if again else ''}: "
                              f"{cfg.describe()}")
                try:  # a zoo model is built in its server's start, beside the other starts
                    models.ensure_built(cfg.model)
                except models.ModelUnavailable as e:
                    raise ServerError(f"cannot start {cfg.describe()}: {e}") from None
                built = time.monotonic() - t_built
                srv.start()
        except BaseException as e:
            for spare in early:
                spare.discard()
            if not isinstance(e, Abandoned):
                self.announce(f"vLLM server failed to start after "
                              f"{time.monotonic() - t0:.0f}s: {cfg.describe()}")
            if isinstance(e, Abandoned):
                raise ServerError(f"not started: the run is ending ({cfg.describe()})") from None
            raise
        finally:
            with self._lock:
                self._booting.pop(cfg, None)
        try:  # its record, and its planned trainers prepared
            record = {"config": cfg.describe(), "mode": cfg.mode,
                      "start_seconds": srv.start_seconds, "version": srv.version,
                      "log": str(srv.log_path),
                      "started_at": round(t0 - self.t0, 3),
                      "ready_at": round(time.monotonic() - self.t0, 3),
                      "starting_together": together, "model_seconds": round(built, 3)}
            if slot is not None:  # the host's start slot it waited for (a parallel run)
                record["start_slot"] = slot
            # where the start's time went (harness.vllm.startup)
            if getattr(srv, "launched_at", None) is not None:
                record["profile"] = startup.profile(srv.log_path, srv.launched_at,
                                                    srv.start_seconds)
            if again:
                record["restart_reason"] = why
            if cfg in self._unplanned:
                record["unplanned"] = f"not in the plan; started for {self._unplanned[cfg]}"
            self.announce(f"vLLM server up in {srv.start_seconds:.0f}s: {cfg.describe()}")
            record.update(self._prepare_trainers(cfg, srv, early))
            with self._lock:
                self.started.append(record)
                if again:
                    self.restarts.append({"config": cfg.describe(), "reason": why,
                                          "at": record["started_at"]})
            return srv
        except BaseException:  # a server nobody will hold is not left running
            srv.stop()
            raise

    def _early_trainers(self, cfg: ServerConfig) -> list:
        """One process per planned trainer of ``cfg``, started now (``Spares.spawn``)."""
        return [Spares.spawn(spec, trainer_env(None, cfg.api_key), self.log_dir)
                for spec, _ in self._warm.get(cfg, [])]

    def _prepare_trainers(self, cfg: ServerConfig, srv: VLLMServer,
                          early: list | None = None) -> dict:
        """The planned trainers of a server that just came up, started (taking over
        ``early``'s processes, one each, in order) and prepared."""
        out: dict = {}
        early = list(early or [])
        try:
            self._prepare_each(cfg, srv, early, out)
        finally:
            for spare in early:  # one the loop did not reach
                spare.discard()
        return out

    def _prepare_each(self, cfg: ServerConfig, srv: VLLMServer, early: list,
                      out: dict) -> None:
        for spec, weights in self._warm.get(cfg, []):
            spec = dataclasses.replace(spec, url=srv.url)
            # off the tests' path: the spares are kept for the fresh trainers tests wait for
            t = Trainer(spec, log_dir=self.log_dir, context=srv.describe_failure,
                        api_key=cfg.api_key, processes=self.processes, spares=False,
                        spare=early.pop(0) if early else None)
            t0 = time.monotonic()
            try:
                t.prepare(weights, timeout=self.start_timeout)
            except TrainerError as e:  # the first sync starts one again and says why
                t.close()
                out["trainer_prepare_error"] = str(e).splitlines()[0]
                continue
            t.spares = True  # a restart (after a failed sync) is on a test's path
            out["trainer_prepare_seconds"] = round(time.monotonic() - t0, 3)
            with self._lock:
                self.trainers.setdefault((cfg, spec), t)

    # ------------------------------------------------------------------ servers
    def get(self, cfg: ServerConfig, *, new_engine: bool = False,
            user: str = "a test") -> VLLMServer:
        """The server for ``cfg``; ``new_engine``: one that has never been synced nor
        had its weight-transfer engine initialised (a restart, where it was). Weights
        alone are brought back without one (``SyncSession.reset_weights``). ``user``
        names who asks, for the reason of a restart."""
        if self.url:
            srv = self.servers.get(cfg) or VLLMServer.attach(self.url, cfg)
            # one server stands for every configuration: its weights are one state
            if new_engine and any(h.state is not State.DUMMY for h in self.server_weights.values()):
                raise NeedsFreshServer("needs a brand-new engine; an attached server "
                                       "(--vllm-url) cannot be restarted")
            self.servers[cfg] = srv
            return srv
        if cfg in self.unavailable:
            raise ServerUnavailable(self.unavailable[cfg])
        srv = self.servers.get(cfg)
        if srv is not None and not srv.alive():
            raise ServerUnavailable(self.mark_dead(cfg))
        if srv is not None and new_engine and self.weights_of(cfg).state is not State.DUMMY:
            self._stop(cfg, f"{user} needs a brand-new engine, and the server held "
                            f"{self.weights_of(cfg).state.value}")
            srv = None
        if srv is None:
            srv = self._wait_or_start(cfg, user)
        with self._lock:  # most recently used goes last
            self.servers[cfg] = self.servers.pop(cfg)
        self._start_ahead()
        return srv

    def _wait_or_start(self, cfg: ServerConfig, user: str) -> VLLMServer:
        with self._lock:
            if cfg in self.servers:
                return self.servers[cfg]
            future = self._starting.get(cfg)
            if future is None:
                if cfg not in self._planned:  # the plan missed it: the report says so
                    self._unplanned.setdefault(cfg, user)
                self._make_room(user)
                future = self._submit(cfg)
            if self.slots is not None and self._tickets.get(cfg) is not None:
                self.slots.hurry(self._tickets[cfg])   # a test waits for it now
        srv = future.result()  # a failed start raises, and its configuration is unavailable
        with self._lock:
            self.servers.setdefault(cfg, srv)
        return srv

    def _make_room(self, user: str) -> None:
        """Stop servers until a start fits under max_alive: those no later test needs
        first, then the one whose first planned use is furthest away."""
        while self.servers and len(self.servers) + len(self._starting) >= self.max_alive:
            idle = [c for c in self.servers if c not in self._plan]
            victim = idle[0] if idle else max(self.servers, key=self._plan.index)
            self._stop(victim, f"stopped to make room for a server {user} needed "
                               f"(at most {self.max_alive} alive)")

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
        self.unavailable[cfg] = why
        try:
            self._stop(cfg, "it died")  # engine core or workers may outlive the API server
        except ServerError as e:
            self.unavailable[cfg] = why = f"{why}\n{e}"
        return why

    # ------------------------------------------------------------------ weights
    def weights_of(self, cfg: ServerConfig) -> ServerWeights:
        return self.server_weights.get(cfg, ServerWeights())

    def record_weights(self, cfg: ServerConfig, state: State, weights: str | None) -> None:
        self.server_weights[cfg] = ServerWeights(state, weights)

    # ------------------------------------------------------------------ trainers
    def trainer(self, cfg: ServerConfig, spec: TrainerSpec) -> Trainer:
        """The persistent trainer of this server for ``spec``; one is created (its
        process starts on its first sync) when there is none. A server's engine holds
        one group, which the newest trainer's init replaces: the variants of one
        configuration take turns on its server, so another spec's trainer is ended
        first (the tests run grouped by spec: ``harness.run.plan.order_key``)."""
        key = (cfg, spec)
        t = self.trainers.get(key)
        if t is None:
            for other in [k for k in self.trainers if k[0] == cfg]:
                self.trainers.pop(other).close_in_background()
            srv = self.servers[cfg]
            t = self.trainers[key] = Trainer(spec, log_dir=self.log_dir,
                                             context=srv.describe_failure, api_key=cfg.api_key,
                                             processes=self.processes)
        return t

    def live_trainer(self, cfg: ServerConfig) -> Trainer | None:
        """The trainer whose group this server's engine holds now, if any."""
        return next((t for (c, _), t in self.trainers.items() if c == cfg), None)

    def drop_trainers(self, cfg: ServerConfig) -> None:
        """End this server's trainers (their groups end with them): retired, where the
        group is the trainer's own, so that the caller does not wait for them to exit."""
        for key in [k for k in self.trainers if k[0] == cfg]:
            self.trainers.pop(key).close_in_background()

    # ------------------------------------------------------------------ stop
    def discard(self, cfg: ServerConfig, why: str = "its state could not be trusted") -> None:
        """Stop a server whose state cannot be trusted; the next user gets a new one,
        and the restart is recorded with ``why``."""
        if cfg in self.servers and not self.url:
            self._stop(cfg, why)

    def _stop(self, cfg: ServerConfig, why: str) -> None:
        self.drop_trainers(cfg)
        with self._lock:
            srv = self.servers.pop(cfg, None)
            self.server_weights.pop(cfg, None)
            self._stopped_why[cfg] = why
        if srv is not None:
            srv.stop()

    def stop_all(self) -> None:
        with self._lock:
            self._closed = True
            self._sampler_stop.set()
            self._plan = []
            booting = list(self._booting.values())
            starting = [f for f in self._starting.values() if not f.cancel()]
        errors = []
        # A start under way is cut short: its process tree is stopped, and one not
        # launched yet (waiting for a slot or the GPU's lock) never launches.
        for srv in booting:
            try:
                srv.cancel()
            except ServerError as e:
                errors.append(str(e))
        for f in starting:
            try:
                f.result(timeout=60).stop()
            except Exception:  # it failed to start (we stopped it): nothing left to stop
                pass
        # Side by side: a GPU server takes seconds to exit, and an interrupted run (a
        # job's time limit) may hold twenty of them with half a minute left to stop.
        cfgs = list(self.servers)
        for cfg in cfgs:
            self.drop_trainers(cfg)

        def stop(cfg: ServerConfig) -> None:
            try:
                self._stop(cfg, "the run ended")
            except ServerError as e:
                errors.append(str(e))
        try:
            if cfgs:
                with cf.ThreadPoolExecutor(max_workers=len(cfgs)) as stopping:
                    list(stopping.map(stop, cfgs))
        except RuntimeError:  # at interpreter exit (atexit) no thread starts: one by one
            for cfg in [c for c in cfgs if c in self.servers]:
                stop(cfg)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.processes.close()  # the spares, and the trainers retired above
        if errors:
            raise ServerError("\n".join(errors))

    # ------------------------------------------------------------------ figures
    def start_figures(self) -> dict:
        """Server starts: how many, their sum, and the wall time during which at least
        one server was starting (less than the sum when they start side by side)."""
        return start_figures(self.started)
