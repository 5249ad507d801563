"""Tests side by side: pytest-xdist workers, each running whole servers.

pytest-xdist (``-n N``) gives the processes, the report stream, ``-x`` and crash
handling. Its ``--dist loadgroup`` cannot serve as it is, for two reasons measured
against this suite (docs/planning.md, "Tests side by side"): it appends ``@group`` to
every grouped test's id, so reports, known-issue ids and ``harness diff`` against a
serial run no longer match; and it hands groups out as workers ask, so a worker learns
which servers it needs only when their first test arrives, while server starts are
what a run waits for and the pool starts them ahead. So this module schedules instead:

* every worker collects the whole selection and makes the same partition of it
  (``harness.run.partition``: server groups, the longest cut into replicas, spread over
  the workers by estimated cost); worker K plans and starts only the servers of bin K,
  from its first second;
* worker gw0 writes the partition (test id -> bin) where the controller reads it;
* the controller's scheduler (``harness.run.scheduling``) gives each worker the tests
  that need no server first, a module at a time as it asks for them, then its own
  bin's tests in plan order, all at once;
* each worker sends what the report and the summary need of its pool (servers
  started, restarts, resets, plan) back when it ends (``worker_output``), and the
  controller merges them into one report (``MergedPool``).

It takes over ``-n N`` (xdist's ``--dist load``, the default of ``-n``); another
``--dist`` is left to xdist, without any partition.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from harness.run import partition
from harness.run import plan as _plan
from harness.run.start_figures import start_figures
from harness.run.start_slots import StartSlots

DIR_ENV = "HARNESS_XDIST_DIR"   # set by the controller: where gw0 writes the partition
MAX_WORKERS = 8


# ----------------------------------------------------------------------------- both sides

def auto_workers(host: _plan.Host) -> int:
    """``-n auto``: as many workers as servers may start at once (two cores a start,
    ``Host.max_starting``), at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, host.max_starting()))


def plan_workers(asked, host: _plan.Host) -> int:
    """The workers a ``--harness-plan`` run plans for: ``-n N``, or ``-n auto`` on the
    host planned for (``--harness-plan-host``)."""
    if asked in ("auto", "logical"):
        return auto_workers(host)
    return int(asked or 0)


def scheduled_here(config) -> bool:
    """This run is scheduled here: xdist is on with its default distribution."""
    return (config.getoption("dist", "no") == "load" and bool(config.getoption("tx", None))
            or DIR_ENV in os.environ and hasattr(config, "workerinput"))


def worker(config) -> tuple[int, int] | None:
    """(this worker's index, worker count) in a run scheduled here; None elsewhere."""
    wi = getattr(config, "workerinput", None)
    if wi is None or DIR_ENV not in os.environ:
        return None
    return int(str(wi["workerid"]).lstrip("gw")), int(wi["workercount"])


def start_slots(config, host: Callable[[], _plan.Host]) -> StartSlots | None:
    """This worker's view of the host's start slots (``harness.run.start_slots``), in a
    run scheduled here with two workers or more; None elsewhere. ``host`` is asked only
    then: describing this host probes its GPUs, which a run of one process (a project
    that does not use the harness, say) must not pay for."""
    this_worker = worker(config)
    if this_worker is None or this_worker[1] < 2:
        return None
    return StartSlots(os.environ[DIR_ENV], host().max_starting(), *this_worker)


def share_threads(config) -> int | None:
    """A worker's torch threads (intra-op), set at its configure: the host's cores shared
    out over the workers, at least one. torch gives every process one thread a core, so
    eight workers on 16 cores ran 128 threads beside the servers' starts, each worker
    computing its HF references on the CPU; the 1-minute load of a GPU host reached 39.
    That the cap shortens a GPU run is not shown: in one the references took 18.8 s
    with it and 18.4 s without (docs/planning.md). A user's ``OMP_NUM_THREADS`` is left
    to torch. Returns the count set, or None where nothing was set (no worker, one
    worker, OMP_NUM_THREADS given)."""
    this_worker = worker(config)
    if this_worker is None or this_worker[1] < 2 or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    n = max(1, _plan.Host.this().cores // this_worker[1])
    torch.set_num_threads(n)
    return n


def worker_bounds(host: _plan.Host, configs, n: int) -> tuple[int, int]:
    """(servers starting at once, servers alive) for one of ``n`` workers: the host's
    bounds shared out, but at least one start and the three servers one test may hold
    (a server, its twin and a twin in the other mode)."""
    return (max(1, host.max_starting() // n),
            max(3, host.max_alive(list(configs)) // n))


@dataclasses.dataclass
class Partition:
    """The bins of a run: ``bins[k]`` the groups of worker (or shard) k."""

    bins: list[list[partition.Group]]
    critical: partition.Group | None

    def bin_of(self, needs: Sequence[_plan.ServerNeed | None]) -> list[int | None]:
        """Per test: its bin, or None for a test that needs no server."""
        out: list[int | None] = [None] * len(needs)
        for k, b in enumerate(self.bins):
            for g in b:
                if g.servers:
                    for i in g.tests:
                        out[i] = k
        return out

    def loads(self) -> list[float]:
        return [sum(g.cost for g in b if g.servers) for b in self.bins]


def make_partition(needs: Sequence[_plan.ServerNeed | None], host: _plan.Host, n: int) -> Partition:
    gs = partition.groups(needs, host)
    servers = [g for g in gs if g.servers]
    if n > 1:
        servers = partition.split_long(servers, n, needs, host)
    return Partition(partition.assign(servers, n), partition.critical_path(servers))


def describe(p: Partition, needs: Sequence[_plan.ServerNeed | None], host: _plan.Host,
             free_tests: int) -> list[str]:
    """The partition as lines for ``--harness-plan``: per worker its servers, tests and
    estimated wall time, and the critical path."""
    n = len(p.bins)
    start, test = _plan.estimates(host)
    free = free_tests * _plan.NO_SERVER_TEST_SECONDS / n
    walls = []
    out = []
    for k, b in enumerate(p.bins):
        idx = sorted(i for g in b for i in g.tests)
        sub = [needs[i] for i in idx]
        wall = 0.0
        if sub:
            starting, alive = worker_bounds(host, (c for g in b for c in g.servers), n)
            pl = _plan.make_plan(sub, host, max_starting=starting, max_alive=alive)
            # the other workers start theirs at the same time: a start is as slow as
            # all workers' starts together make it
            width = n * pl.max_starting
            wall = _plan.simulate(pl, lambda m: start(m * width // max(1, pl.max_starting)),
                                  test).wall_seconds
        walls.append(wall + free)
        servers = sum(len(g.servers) for g in b)
        out.append(f"  worker {k}: {servers} servers, {len(idx)} tests, about "
                   f"{(wall + free) / 60:.1f} min")
        out += [f"      {g.describe()}" for g in b]
    starts = sum(len(g.servers) for b in p.bins for g in b)
    cut = sum(1 for b in p.bins for g in b if g.replicas > 1 and g.replica == 0)
    head = [f"with {n} workers (-n {n}): {starts} server starts ({cut} configuration(s) cut "
            f"into replicas), about {max(walls, default=0) / 60:.1f} min of wall "
            f"time expected, the slowest worker's; {free_tests} tests without a server are "
            f"shared out as workers ask"]
    if p.critical is not None:
        c = p.critical
        head.append(f"critical path: {c.describe()} (the longest chain of tests on one server;"
                    f" no worker count makes the run shorter)")
    return head + out


# ----------------------------------------------------------------------------- worker side

def worker_output(state: Any) -> dict:
    """What the controller needs of a worker's pool, JSON-safe."""
    pool = state.pool
    torch = sys.modules.get("torch")  # not imported for it
    out: dict[str, Any] = {"pid": os.getpid(), "deselected": dict(state.deselected),
                           "torch_threads": torch.get_num_threads() if torch else None,
                           "gpu_cases": dict(state.gpu_cases), "stop_error": state.stop_error,
                           "plan": state.plan.as_dict(state.schedule) if state.plan else None,
                           "servers_planned": len(state.plan.servers) if state.plan else 0}
    if pool is not None:
        out.update(t0=pool.t0, started=list(pool.started), restarts=list(pool.restarts),
                   resets=list(pool.resets), samples=list(pool.samples),
                   reaped=[o.describe() for o in pool.reaped])
    return out


RECORD_FILE = "worker-{}.json"  # in the folder: a worker's record, for a run cut short
GATHER_WAIT_S = 20.0             # an interrupted run's wait for the workers' last records
STOP_WAIT_S = 60.0               # an interrupted run's wait for the workers to stop servers
GUARD_SLACK_S = 5.0              # InterruptGuard's too: the controller's way into that wait


def save_record(config, state: Any, final: bool) -> None:
    """A worker's record, also written to the run's folder. xdist hands it to the
    controller only when the worker ends; a run cut short (Ctrl-C, a job's time limit)
    stops the controller's loop first, and its report lost every server and start. So a
    worker writes its record after each test that changed its pool (``final`` False) and
    all of it, the report's part included, once it has ended (``final`` True)."""
    d, wi = os.environ.get(DIR_ENV), getattr(config, "workerinput", None)
    if not d or wi is None or not Path(d).is_dir():
        return
    out = dict(config.workeroutput.get("harness", {})) if final else worker_output(state)
    out["record"] = "final" if final else "partial"
    path = Path(d) / RECORD_FILE.format(wi["workerid"])
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(out, default=str))
        tmp.replace(path)
    except OSError:  # the controller's folder went: the run is over
        pass


def pool_mark(state: Any) -> tuple[int, ...]:
    """What a worker's partial record would change with: its pool's records counted."""
    pool = state.pool
    return () if pool is None else (len(pool.started), len(pool.restarts), len(pool.resets),
                                    len(pool.reaped))


def _ended(rec: dict | None) -> bool:
    """A worker's record says it is over: final, or its process is gone (killed)."""
    if rec is None:
        return False
    if rec.get("record") == "final":
        return True
    import psutil

    try:
        return psutil.Process(int(rec["pid"])).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except (KeyError, TypeError, ValueError, psutil.Error):  # no pid: it may be going
        return False


def await_workers(config, wait_s: float = STOP_WAIT_S) -> list[str]:
    """The controller of an interrupted run (Ctrl-C, a job's time limit), at the start
    of its end: waits up to ``wait_s`` for every worker to end its session, which stops
    its servers; returns the workers still going. pytest-xdist ends the workers next,
    and kills one 10 s after asking it to exit. In a GPU run the workers took 26 s to
    stop their servers, and the controller, waiting 20 s more for their records, was
    killed by the job's limit 30 s after the interrupt, before it wrote its report
    (reports/gpu/README.md). Every worker writes a record (with
    its pid) before its first test, so a worker that died is not waited for."""
    d = os.environ.get(DIR_ENV)
    n = config.getoption("numprocesses", None)
    if not d or not _owned(d) or not isinstance(n, int):
        return []
    folder, deadline = Path(d), time.monotonic() + wait_s
    pending = {f"gw{k}" for k in range(n)}
    while True:
        pending = {w for w in pending if not _ended(_read(folder, w))}
        if not pending or time.monotonic() >= deadline:
            return sorted(pending)
        time.sleep(0.2)


class InterruptGuard:
    """The SIGINT handler of a parallel run's controller. The first SIGINT stops the run
    (KeyboardInterrupt, as Python's own handler); the ones after it are ignored while
    the workers stop their servers (``await_workers``, at most ``wait_s`` after the
    first). ``timeout --signal=INT`` (ci/gpu-run.sh's time limit) signals pytest and
    then its whole process group, so the controller gets SIGINT twice; when the second
    one came after the first had been handled, it ended the wait with a second
    KeyboardInterrupt, and pytest-xdist killed the workers while they were still
    stopping their servers (seen in a CPU CI run)."""

    def __init__(self, wait_s: float = STOP_WAIT_S):
        self.wait_s = wait_s
        self.first: float | None = None  # monotonic time of the first SIGINT
        self.waiting_over = False
        self.ignored = 0

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            raise KeyboardInterrupt
        if not self.waiting_over and now - self.first < self.wait_s + GUARD_SLACK_S:
            self.ignored += 1
            return
        raise KeyboardInterrupt

    @classmethod
    def install(cls, wait_s: float = STOP_WAIT_S) -> "InterruptGuard | None":
        """Installs the guard where Python's own SIGINT handler is (or SIGINT is
        ignored, as in a background job); a handler of the user's is left alone."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return None
        if signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_IGN):
            return None
        guard = cls(wait_s)
        signal.signal(signal.SIGINT, guard)
        return guard


def _read(folder: Path, wid: str) -> dict | None:
    try:
        return json.loads((folder / RECORD_FILE.format(wid)).read_text())
    except (OSError, ValueError):
        return None


def gather_records(config, state: Any, interrupted: bool,
                   wait_s: float = GATHER_WAIT_S) -> list[str]:
    """The controller, at its end: the records of the workers it did not hear from, read
    from the run's folder into ``state.worker_outputs``. An interrupted run waits up to
    ``wait_s`` for each worker's final record (its servers are being stopped), then takes
    its last partial one. Returns the workers whose record is partial. Once a run."""
    d = os.environ.get(DIR_ENV)
    if (hasattr(config, "workerinput") or not d or getattr(state, "gathered", False)
            or not _owned(d)):  # a pytest run inside a worker's test: the folder is not its
        return []
    state.gathered = True
    n = config.getoption("numprocesses", None)
    expected = {f"gw{k}" for k in range(n)} if isinstance(n, int) else set()
    folder = Path(d)

    def missing() -> list[str]:
        head, tail = RECORD_FILE.split("{}")
        found = {p.name[len(head):-len(tail)] for p in folder.glob(RECORD_FILE.format("*"))}
        return sorted((expected | found) - set(state.worker_outputs))

    deadline = time.monotonic() + (wait_s if interrupted else 0.0)
    while True:
        records = {w: _read(folder, w) for w in missing()}
        if all(_ended(r) for r in records.values()) \
                or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    partial = []
    for wid, rec in records.items():
        if rec is None:
            continue
        state.worker_outputs[wid] = rec
        if rec.get("record") != "final":
            partial.append(wid)
    return partial


# ----------------------------------------------------------------------------- controller side

class MergedPool:
    """The workers' pools, seen as one for the report and the summary: records from
    each worker with its times moved onto the controller's clock (monotonic, shared by
    every process of the host) and the worker named."""

    def __init__(self, outputs: dict[str, dict], t0: float):
        self.t0 = t0
        self.started, self.restarts, self.resets, self.samples = [], [], [], []
        self.reaped: list[str] = []
        self.servers: dict = {}
        for wid, o in sorted(outputs.items()):
            shift = o.get("t0", t0) - t0
            for s in o.get("started", []):
                s = dict(s, worker=wid)
                for k in ("started_at", "ready_at"):
                    if k in s:
                        s[k] = round(s[k] + shift, 3)
                self.started.append(s)
            self.restarts += [dict(r, worker=wid, at=round(r.get("at", 0) + shift, 3))
                              for r in o.get("restarts", [])]
            self.resets += [dict(r, worker=wid) for r in o.get("resets", [])]
            self.samples += [dict(s, worker=wid, at=round(s["at"] + shift, 1))
                             for s in o.get("samples", [])]
            self.reaped += o.get("reaped", [])
        self.started.sort(key=lambda s: s.get("started_at", 0))

    def start_figures(self) -> dict:
        return start_figures(self.started)


# ----------------------------------------------------------------------------- lines

LINES_FILE = "lines-{}.txt"   # a worker's lines for the terminal, in the run's folder


def announcer(config, write: Callable[[str], None]) -> Callable[[str], None]:
    """How a pool says that a server starts or is up: ``write`` (the terminal), or on a
    worker of a side-by-side run a line in the run's folder that the controller prints
    (``LineTail``): pytest-xdist shows nothing a worker prints."""
    d, wi = os.environ.get(DIR_ENV), getattr(config, "workerinput", None)
    if wi is None:
        return write
    if not d or not Path(d).is_dir():
        return lambda line: None
    path = Path(d) / LINES_FILE.format(wi["workerid"])

    def say(line: str) -> None:
        try:
            with open(path, "a") as f:
                f.write(f"[{wi['workerid']}] {line}\n")
        except OSError:  # the controller's folder went: the run is over
            pass
    return say


class LineTail:
    """On the controller: the workers' lines (``announcer``), printed as they come by a
    thread that reads the run's folder every ``every_s`` seconds."""

    def __init__(self, folder: str, write: Callable[[str], None], every_s: float = 1.0):
        self.folder, self.write, self.every_s = Path(folder), write, every_s
        self._read: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="harness-worker-lines",
                                        daemon=True)

    def start(self) -> "LineTail":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def poll(self) -> None:
        for path in sorted(self.folder.glob(LINES_FILE.format("*"))):
            try:
                with open(path) as f:
                    f.seek(self._read.get(path, 0))
                    text = f.read()
            except OSError:
                continue
            done = text[:text.rfind("\n") + 1]  # whole lines only
            self._read[path] = self._read.get(path, 0) + len(done.encode())
            for line in done.splitlines():
                self.write(line)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()


OWNER_FILE = "controller.pid"  # in the folder: the process that made it, and removes it


def remove_controller_dir() -> None:
    """The end of the controller's run: its folder goes, and only its own. A pytest run
    inside a test of this run (the harness's own tests make them) inherits the path and
    must leave it: the workers' GPU-memory lock lives there (it removed it once, and
    every later start and sleep of that run failed)."""
    d = os.environ.get(DIR_ENV)
    if not d or not _owned(d):
        return
    os.environ.pop(DIR_ENV, None)
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def _owned(d: str) -> bool:
    """The folder is this process's: it is the run's controller."""
    try:
        return int((Path(d) / OWNER_FILE).read_text()) == os.getpid()
    except (OSError, ValueError):
        return False


def controller_dir() -> str:
    """A fresh directory for gw0's partition; its path goes to the workers through the
    environment they inherit."""
    d = tempfile.mkdtemp(prefix="harness-xdist-")
    (Path(d) / OWNER_FILE).write_text(str(os.getpid()))
    os.environ[DIR_ENV] = d
    return d
