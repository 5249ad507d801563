"""pytest wiring, and nothing else: options, markers, fixtures, hooks.

The work is done by the engine (``harness.run.cases``, ``harness.run.pool``, ``harness.run.flow``);
settings are resolved and checked once by ``harness.run.settings``. Test ids read
``<backend>-<layout>-<dtype>-<model>`` (``shm-cpu-fp32-llama``,
``ipc-packed-1gpu-colocated-fp32-llama``), so ``pytest -k ipc`` selects by backend.

The plugin stays out of the way of a session that does not use it: nothing is
printed and nothing (GPUs, vLLM) is probed unless a collected test takes a ``case``.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import sys
import threading
import time
import unittest
import warnings
from pathlib import Path
from typing import Callable

import pytest

from harness.core import facts, measure
from harness.models import ModelUnavailable
from harness.pytest import selection as _selection
from harness.pytest import coverage, parametrize, summary
from harness.pytest.parametrize import case_of, need
from harness.run import parallel
from harness.run import plan as _plan
from harness.run import settings as _settings
from harness.run.cases import Case
from harness.run.flow import FlowResult, SyncSession, seed_flow, trainer_spec
from harness.run.pool import NeedsFreshServer, ServerPool, ServerUnavailable
from harness.trainer.spares import TrainerProcesses
from harness.vllm.server import ServerConfig, ServerError

MARKERS = (
    "models(*names): zoo models / paths this test runs on; --vllm-model narrows them",
    "dtypes(*names): dtypes this test runs on; --vllm-dtype narrows them",
    "backends(*ids): backend variants this test runs on; --vllm-backend narrows them",
    "layouts(*names): layouts this test runs on; --vllm-layout narrows them",
    "modes(*names): serving modes (eager, graphs) this test runs on; --vllm-mode narrows them",
    "trainers(*names): trainer code (harness, vllm; user: the trainers of your own "
    "--vllm-trainer names) this test runs with; --vllm-trainer "
    "narrows them",
    "features(*names): server features (harness.run.cases.FEATURES: fp8, sleep, 2api, lora) every "
    "case of this test carries; not narrowed, -k selects them by id",
    "fresh_server: the test needs a server that has never been synced (dummy weights)",
    "twin: the test also needs a second server that loads the model from disk (in the "
    "case's mode; twin(mode='eager') names another)",
    "parity: compares vLLM with the Hugging Face reference after a sync",
    "pause_resume: checks /pause, /resume and /is_paused semantics",
    "gpu: runs on a GPU layout (set on every case whose layout uses a GPU)",
    "smoke: the seed flow on one server (gibberish, sync, parity, a request held by /pause "
    "until /resume): `pytest -m smoke`, is it working?",
    "selftest: shows that a check fails when the behaviour it checks is broken",
    "faults: bad input, protocol misuse, dying processes and leaks",
    "breaks_server: the test may leave its server unusable; it runs after every other "
    "test on that server, which is then stopped or restarted",
    "sleeps: the test sleeps or wakes its server, a turn of the GPU-memory lock that waits "
    "out other servers' starts on the GPU; it runs after the server's other tests",
    "bench: runs harness bench against real servers (timings, not parity)",
    "harness_deselect(reason): set by the harness on cases this run cannot or must not run",
)


@dataclasses.dataclass
class RunState:
    """What the plugin keeps for one pytest session."""

    settings: _settings.Settings
    t0: float = dataclasses.field(default_factory=time.monotonic)
    cpu0: dict | None = dataclasses.field(default_factory=measure.cpu_times)  # the host's
    pool: ServerPool | None = None
    deselected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dropped: list = dataclasses.field(default_factory=list)  # (reason, item) the harness deselected
    shortfall: str | None = None  # a selection of GPU cases none of which could run
    case_count: int = 0           # the cases the selection kept (every worker's)
    items: list = dataclasses.field(default_factory=list)   # items that take a case
    outcomes: dict[str, FlowResult | BaseException] = dataclasses.field(default_factory=dict)
    plan: _plan.Plan | None = None
    schedule: _plan.Schedule | None = None
    last_use: dict[str, list[ServerConfig]] = dataclasses.field(default_factory=dict)
    gpu_cases: dict[str, str] = dataclasses.field(default_factory=dict)  # nodeid -> outcome
    verdicts: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # coverage
    stop_error: str | None = None
    # side by side (harness.run.parallel): this worker's tests, and on the controller what
    # each worker sent back when it ended
    own: set[str] | None = None
    partition: parallel.Partition | None = None
    worker_outputs: dict[str, dict] = dataclasses.field(default_factory=dict)
    gathered: bool = False              # the controller read the records left in the run's folder
    record_mark: tuple = ()             # a worker: its pool as its last record saw it


STATE = pytest.StashKey[RunState]()
_SESSION = pytest.StashKey[SyncSession]()


# ----------------------------------------------------------------------------- options

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("weight-sync-harness")
    for opt in _settings.OPTIONS:
        where = f"default {opt.default_text()}; env {opt.env}; ini {opt.name}".replace("%", "%%")
        if isinstance(opt.default, bool):
            group.addoption(opt.flag, action="store_true", default=None,
                            help=f"{opt.help} ({where})")
            parser.addini(opt.name, opt.help, type="bool", default=None)
        elif opt.multiple:
            group.addoption(opt.flag, action="append", default=None,
                            help=f"{opt.help} (repeatable, or comma-separated; {where})")
            parser.addini(opt.name, opt.help, type="linelist", default=[])
        else:
            group.addoption(opt.flag, default=None, help=f"{opt.help} ({where})")
            parser.addini(opt.name, opt.help, default=None)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
    """An option value that is a path outside the project must not move the rootdir."""
    from harness.pytest.rootdir import anchor

    anchor(early_config, args)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            s = _settings.resolve(config.getoption, config.getini)
        except _settings.SettingsError as e:
            raise pytest.UsageError(str(e)) from None
    for w in caught:  # said once, where a user sees it
        kind = (pytest.PytestDeprecationWarning if issubclass(w.category, DeprecationWarning)
                else pytest.PytestConfigWarning)
        config.issue_config_time_warning(kind(str(w.message)), stacklevel=2)
    if s.harness_require_gpu and s.gpus() == 0:
        raise pytest.UsageError("--harness-require-gpu: no GPU is visible to this run")
    _refuse_gpu_only_selection(config, s)
    _refuse_unservable_models(config, s)
    state = config.stash[STATE] = RunState(s)
    parallel.share_threads(config)
    config.pluginmanager.register(_Verdicts(state), "harness-verdicts")
    if parallel.ours(config) and not hasattr(config, "workerinput"):
        parallel.controller_dir()  # the workers, started after this, inherit its path
        config.pluginmanager.register(_GpuCaseCounter(state), "harness-gpu-cases")
        config.pluginmanager.register(_InterruptedRun(), "harness-interrupted-run")
        config.pluginmanager.register(_WorkerLines(), "harness-worker-lines")
    if s.harness_shard:  # applied after -k, -m and the harness's deselection
        from harness.pytest.sharding import ShardPlugin

        config.pluginmanager.register(
            ShardPlugin(state, need, lambda c, items, needs: _share_out(c, state, items, needs)),
            "harness-shard")
    if s.harness_report:
        from harness.pytest.report import ReportPlugin

        config.pluginmanager.register(ReportPlugin(config, Path(s.harness_report), state,
                                                   worker=hasattr(config, "workerinput")),
                                      "harness-report")


def _refuses(config: pytest.Config, s: _settings.Settings) -> bool:
    """Does a selection of GPU cases none of which can run here end this run before it
    starts? Not when it only collects or plans, or when --harness-allow-no-gpu is set."""
    return not (s.harness_allow_no_gpu or s.harness_plan or config.option.collectonly)


def _refuse_gpu_only_selection(config: pytest.Config, s: _settings.Settings) -> None:
    """Before collection (10-25 s of imports): a selection that the options and -k
    certainly confine to GPU cases this host cannot run (``--vllm-backend ipc-packed``,
    ``-k ipc`` on a host without GPUs) is one usage error, exit 4, before any test runs.
    Selections this cannot judge are refused at the end of collection instead."""
    if not _refuses(config, s):
        return
    from harness.run import layouts
    from harness.transfer import VARIANTS

    if not any(VARIANTS[b].needs_gpu for b in s.vllm_backend) and not any(
            layouts.LAYOUTS[n].gpus_needed for n in s.vllm_layout):
        return  # nothing selected needs a GPU: no probe
    keyword = getattr(config.option, "keyword", "") or ""
    marks = getattr(config.option, "markexpr", "") or ""
    if not (keyword.strip() or marks.strip() or {"vllm_backend", "vllm_layout"} & s.explicit):
        return  # nothing narrowed: the CPU cases are in it, so no probe (and none in a
        # project that does not use the harness)
    gpus = s.gpus()
    tails = [f"{facts.short_dtype(d)}-{Path(m).name}" for d in s.vllm_dtype for m in s.vllm_model]

    def ids(names, here: bool) -> list[str]:
        return [f"{b}-{n}-{t}" for b in s.vllm_backend for n in names for t in tails
                if layouts.runs_on(VARIANTS[b], layouts.LAYOUTS[n])
                and (layouts.LAYOUTS[n].gpus_needed <= gpus) == here]
    named = _selection.names_only_gpu_cases(
        keyword, marks, ids(s.vllm_layout, False), ids(layouts.LAYOUTS, True),
        _selection.case_vocabulary(VARIANTS, {v.engine for v in VARIANTS.values()},
                                   layouts.LAYOUTS))
    if not named:
        return
    who = " ".join([f"{o.flag} {','.join(getattr(s, o.name))}" for o in _settings.OPTIONS
                    if o.name in ("vllm_backend", "vllm_layout") and o.name in s.explicit]
                   + ([_selection.asked(config)] if _selection.asked(config) else []))
    need = sorted({(layouts.LAYOUTS[n].gpus_needed, n) for n in s.vllm_layout
                   if any(f"-{n}-" in i for i in named)})
    raise pytest.UsageError(
        f"{who or 'the selection'} selects only GPU cases (on "
        + ", ".join(f"{n}, {k} GPU{'s' if k > 1 else ''}" for k, n in need)
        + f") and this host has {gpus} GPU(s): nothing was run; the cases that run here "
        "are shm's, and --harness-allow-no-gpu runs the rest of the selection")


def _refuse_unservable_models(config: pytest.Config, s: _settings.Settings) -> None:
    """A model directory of the user's that no server could serve or the checks use
    (no tokenizer, too few positions, a head size a CPU server refuses) is one line per
    problem, exit 4, before any server starts (``harness.models.requirements``)."""
    from harness import models
    from harness.models import requirements
    from harness.run import layouts

    paths = [v for kind, v in (models.classify_model(m) for m in s.vllm_model) if kind == "path"]
    if not paths or s.harness_plan or config.option.collectonly:
        return
    cpu = any(not layouts.LAYOUTS[n].server_gpus for n in s.vllm_layout) and (
        "vllm_layout" in s.explicit or s.gpus() == 0)
    said = [f"--vllm-model: {p}" for path in paths
            for p in requirements.problems(path, cpu_server=cpu)]
    if said:
        raise pytest.UsageError("\n".join(said))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """--harness-plan prints a plan and runs nothing: no workers either (the plan
    shows how it would split over them)."""
    if config.getoption("harness_plan", None) or os.environ.get("HARNESS_PLAN", "") in (
            "1", "true", "yes"):
        if getattr(config.option, "numprocesses", None):
            config.option.plan_workers = config.option.numprocesses
        for name, value in (("numprocesses", 0), ("dist", "no"), ("tx", [])):
            if hasattr(config.option, name):
                setattr(config.option, name, value)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: as many workers as this host starts servers at once (for
    ``--harness-plan``, the host planned for)."""
    host = _plan.Host.this()
    if config.getoption("harness_plan", None) and config.getoption("harness_plan_host", None):
        try:
            host = _settings.resolve(config.getoption, config.getini).host()
        except _settings.SettingsError as e:
            raise pytest.UsageError(str(e)) from None
    return parallel.auto_workers(host)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``-n N``: whole servers per worker (harness.run.parallel says why not loadgroup)."""
    return parallel.Scheduling(config, log) if parallel.ours(config) else None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    state = node.config.stash.get(STATE, None)
    out = getattr(node, "workeroutput", None) or {}
    if state is not None and "harness" in out:
        state.worker_outputs[str(node.gateway.id)] = out["harness"]


def settings_of(config: pytest.Config) -> _settings.Settings:
    return config.stash[STATE].settings


# ----------------------------------------------------------------------------- cases

def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        parametrize.parametrize_cases(metafunc, settings_of(metafunc.config))


@pytest.hookimpl(trylast=True)  # after -k and -m: the partition is of what runs
def pytest_collection_modifyitems(session, config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[STATE]
    keep, dropped = [], []
    for item in items:
        m = item.get_closest_marker("harness_deselect")
        if m is not None:
            state.deselected[m.kwargs["reason"]] += 1
            state.dropped.append((m.kwargs["reason"], item))
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    state.items = [it for it in items if case_of(it) is not None]
    if state.dropped and _refuses(config, state.settings):
        short = _selection.gpu_shortfall(
            _selection.selected(state.dropped, _selection.matcher(config)),
            len(state.items), state.settings.gpus(), _selection.asked(config))
        if short and not hasattr(config, "workerinput"):
            raise pytest.UsageError(short)
        if short:  # a worker runs nothing; the controller says why (pytest_sessionfinish)
            config.hook.pytest_deselected(items=list(items))
            items[:] = state.items = []
            return
    from harness import known_issues

    in_use = (state.items or state.settings.explicit or os.environ.get(known_issues.ENV_PATH)
              or known_issues.names_any(items))
    if not in_use:  # a project that does not use the harness: leave its tests alone
        _share_out(config, state, items, [None] * len(items))
        return
    known_issues.mark_known_issues(config, items, state.settings.vllm_url)
    # Tests grouped by the server they need, in the order harness.run.plan makes them: each
    # server starts once and stops after its last test.
    paths: dict[str, str] = {}
    needs = {id(it): need(it, state.settings, paths) for it in items}
    keys = {id(it): (_plan.order_key(needs[id(it)]), i) for i, it in enumerate(items)}
    items.sort(key=lambda it: keys[id(it)])
    if not state.settings.harness_shard:  # else the shard's cut, made after this, shares out
        _share_out(config, state, items, [needs[id(it)] for it in items])


def _share_out(config: pytest.Config, state: RunState, items: list, needs: list) -> None:
    """Side by side (or planning for it): the partition of the selection over the
    workers (harness.run.parallel); worker gw0 writes it for the controller, always, even
    when no test needs a server."""
    workers = parallel.worker(config) or (
        (0, parallel.plan_workers(getattr(config.option, "plan_workers", 0),
                                  state.settings.host()))
        if state.settings.harness_plan else None)
    if not workers:
        return
    bins: list = [None] * len(items)
    if workers[1] > 1 and any(n is not None for n in needs):
        state.partition = parallel.make_partition(needs, state.settings.host(), workers[1])
        bins = state.partition.bin_of(needs)
    if parallel.worker(config):
        state.own = {it.nodeid for it, b in zip(items, bins) if b == workers[0]}
        if workers[0] == 0:
            parallel.write_partition(bins, [it.nodeid for it in items])


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """The plan, from the tests that will run (-k, -m and every other deselection have
    happened): printed with --harness-plan, which then runs nothing."""
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    # every case the selection kept, then (a worker side by side) the ones it runs
    state.case_count = sum(1 for it in session.items if case_of(it) is not None)
    state.items = [it for it in session.items if case_of(it) is not None
                   and (state.own is None or it.nodeid in state.own)]
    s = state.settings
    if s.harness_plan:
        session.config.option.collectonly = True  # the plan is all this run does, always
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    pinned = summary.zoo_pinned_line(session.config, state)
    if pinned and tr is not None and not hasattr(session.config, "workerinput"):
        tr.write_line(pinned)  # said before the tests run, and again in the summary
    if not state.items:
        if s.harness_plan and tr is not None:
            tr.write_line("weight-sync-harness plan: no server is planned (no selected test "
                          "takes a case that can run here)")
        return
    paths: dict[str, str] = {}
    needs = [n for n in (need(it, s, paths) for it in state.items) if n is not None]
    share = parallel.worker(session.config)
    n = share[1] if share else 1
    host = s.host()
    starting, alive = (parallel.worker_bounds(host, (x.server for x in needs), n) if n > 1
                       else (None, None))
    state.plan = _plan.make_plan(needs, host, max_starting=s.vllm_max_starting or starting,
                                 max_alive=s.vllm_max_servers or alive)
    state.schedule = _plan.simulate(state.plan, *_plan.estimates(state.plan.host))
    state.last_use = state.plan.last_use()
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        for line in summary.header_lines(s, state.plan):
            tr.write_line(line)
    if s.harness_plan:
        if tr is not None:
            from harness.pytest.sharding import plan_lines

            for line in plan_lines(session.config) + _plan.describe(
                    state.plan, state.schedule, verbose=session.config.option.verbose > 0):
                tr.write_line(line)
            if state.partition is not None:
                paths = {}
                every = [need(it, s, paths) for it in session.items]
                for line in parallel.describe(state.partition, every, host,
                                              sum(1 for x in every if x is None)):
                    tr.write_line(line)
            tr.write_line(_plan_counts(len(session.items), state.case_count, len(needs),
                                       len(state.plan.servers)))


_TERMINAL = threading.Lock()
_TERMINAL_FD = pytest.StashKey[int]()


def _keep_terminal(config: pytest.Config) -> None:
    """Keep a descriptor of the terminal, taken while pytest's capture is off (between
    tests): during a test, pytest captures file descriptor 1, and a line written there
    would land in that test's captured output, shown only if it fails."""
    if _TERMINAL_FD in config.stash:
        return
    try:
        config.stash[_TERMINAL_FD] = os.dup(sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no real stdout: the reporter's writes
        pass


def _terminal_line(config: pytest.Config) -> Callable[[str], None]:
    """A line on the terminal from any thread (server starts run in threads), whatever
    the verbosity and whatever test is running: a run that starts servers is silent for
    minutes otherwise."""
    def write(line: str) -> None:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is None:
            return
        fd = config.stash.get(_TERMINAL_FD, None)
        with _TERMINAL:
            if fd is None:
                tr.write_line(f"weight-sync-harness: {line}")
                tr.flush()  # a CI log (a pipe, a file) shows it now, not at the next test
                return
            tr.flush()
            tw = getattr(tr, "_tw", None)
            # a new line unless the reporter's line is empty, or is where our last one ended
            mark = (id(tw), getattr(tw, "width_of_current_line", 0))
            lead = "\n" if mark[1] and mark != last[0] else ""
            try:
                os.write(fd, f"{lead}weight-sync-harness: {line}\n".encode())
            except OSError:
                pass
            last[0] = mark
    last: list = [None]
    return write


class _WorkerLines:
    """The controller of a side-by-side run prints its workers' server starts
    (``parallel.LineTail``) while the run goes."""

    def __init__(self) -> None:
        self.tail: parallel.LineTail | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        folder = os.environ.get(parallel.DIR_ENV)
        if folder:
            _keep_terminal(session.config)
            self.tail = parallel.LineTail(folder, _terminal_line(session.config)).start()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.tail is not None:
            self.tail.stop()
            self.tail = None


def _plan_counts(selected: int, cases: int, on_servers: int, servers: int) -> str:
    """How the plan's counts relate: pytest's tests selected, the tests on the planned
    servers, and the cases the summary says run here."""
    return (f"counts: of the {selected} tests selected, {on_servers} run on the {servers} "
            f"servers planned; {cases - on_servers} more take a case but no server, or skip "
            f"here saying why; {selected - cases} take no case (no server, no GPU); the "
            f"summary's \"{cases} run here\" counts the cases ({on_servers} + "
            f"{cases - on_servers})")


class _InterruptedRun:
    """The controller of an interrupted parallel run lets its workers stop their
    servers before pytest-xdist ends them (``parallel.await_workers``); a second SIGINT
    does not cut that wait short (``parallel.InterruptGuard``)."""

    def __init__(self) -> None:
        self.guard: parallel.InterruptGuard | None = None
        self.previous: object = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        import signal

        self.previous = signal.getsignal(signal.SIGINT)
        self.guard = parallel.InterruptGuard.install()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus != pytest.ExitCode.INTERRUPTED:
            return
        left = parallel.await_workers(session.config)
        if self.guard is not None:
            self.guard.waiting_over = True
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None and left:
            tr.write_line(f"interrupted: {', '.join(left)} still stopping their servers after "
                          f"{parallel.STOP_WAIT_S:.0f} s; pytest-xdist ends them now", red=True)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        import signal

        if self.guard is not None and signal.getsignal(signal.SIGINT) is self.guard:
            signal.signal(signal.SIGINT, self.previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session: pytest.Session):
    """Servers start before the first test runs (while the tests that need none run)
    and are all stopped when the last one is done."""
    state = session.config.stash.get(STATE, None)
    runs = not session.config.option.collectonly and not (
        session.testsfailed and not session.config.option.continue_on_collection_errors)
    # A plan without servers starts no pool: the process-wide spares and retiring
    # trainers stay the business of the run that has servers (a pytest run inside a
    # test, as the harness's own tests make, must not stop the outer run's spares).
    if state is not None and state.case_count and runs:
        _terminable()
    if state is not None and state.plan is not None and state.plan.servers and runs:
        _keep_terminal(session.config)
        _start_pool(session.config, state)
    elif (state is not None and runs
          and (slots := parallel.start_slots(session.config, state.settings.host)) is not None):
        slots.idle(True)  # a worker without servers: its start slot is the others' to use
    if state is not None and runs and hasattr(session.config, "workerinput"):
        parallel.save_record(session.config, state, final=False)  # its pid, for an interrupt
    try:
        yield
    finally:
        if state is not None and state.pool is not None:
            # every start is known now; stopping GPU servers can outlast the wait of an
            # interrupted controller, which then reads this record
            parallel.save_record(session.config, state, final=False)
            try:
                state.pool.stop_all()
            except ServerError as e:
                state.stop_error = str(e)
            finally:
                state.pool.processes.close()


def _interruptible() -> None:
    """A process started in the background by a non-interactive shell (``cmd &``, a CI
    step, ``nohup``) begins with SIGINT ignored, so Ctrl-C and ci/gpu-run.sh's time limit
    (SIGINT) would do nothing, and the kill that follows leaves servers running. A run
    that starts servers takes SIGINT back, as Python's own handler."""
    import signal
    import threading

    if (signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _on_sigterm(signum, frame) -> None:
    """SIGTERM ends the run as Ctrl-C does: fixtures are torn down, servers and
    trainers stopped (a second SIGTERM kills at once, as before)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt("SIGTERM")


def _terminable() -> None:
    """CI runners and ``timeout`` end a job with SIGTERM, whose default kills pytest
    where it stands: no fixture teardown, so what a test started in a session of its own
    was left running (two orphans of tests/test_faults_sessions.py). A run of harness
    cases takes SIGTERM as an interrupt, unless someone else handles it already."""
    import signal

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _start_pool(config: pytest.Config, state: RunState) -> ServerPool:
    _interruptible()
    s = state.settings
    log_dir = Path(s.vllm_log_dir)
    if not log_dir.is_absolute():
        log_dir = Path(config.rootpath) / log_dir
    plan = state.plan
    share = parallel.worker(config)
    spares = s.trainer_spares()
    if share and s.harness_trainer_spares is None:  # the default is the host's, shared
        spares = min(spares, 1)
    processes = TrainerProcesses(spares, log_dir)
    atexit.register(processes.close)  # a run cut short still stops its spares
    slots = parallel.start_slots(config, s.host)
    # side by side, the host's slots bound the starts: a worker may start as many of its
    # own servers at once as it keeps alive, in slots the other workers do not need
    max_starting = plan.max_starting if plan else 1
    if slots is not None and not s.vllm_max_starting:
        max_starting = plan.max_alive if plan else 1
    pool = state.pool = ServerPool(log_dir, start_timeout=s.vllm_start_timeout,
                                   processes=processes,
                                   max_alive=plan.max_alive if plan else 2,
                                   max_starting=max_starting, url=s.vllm_url, slots=slots,
                                   announce=parallel.announcer(config, _terminal_line(config)))
    if plan is not None:
        # every planned server's trainer: started and prepared as soon as it is up
        paths: dict[str, str] = {}
        needs = {it.nodeid: need(it, s, paths) for it in state.items}
        # the trainer of each server's first test (the engine holds one group at a time)
        warm: dict = {}
        for it in state.items:
            if needs[it.nodeid] is not None:
                warm.setdefault(needs[it.nodeid].server,
                                [(trainer_spec(case_of(it), url=""), needs[it.nodeid].server.model)])
        pool.plan(plan.configs(), warm)
    return pool


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest) -> ServerPool:
    """The session's servers: planned from the selected tests and started before the
    first test (``pytest_runtestloop``), each stopped after the last test that needs it."""
    state = request.config.stash[STATE]
    return state.pool or _start_pool(request.config, state)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    yield
    state = item.config.stash.get(STATE, None)
    if state is not None and state.pool is not None:
        for cfg in state.last_use.get(item.nodeid, []):
            state.pool.release(cfg)
    if state is not None and hasattr(item.config, "workerinput"):
        mark = parallel.pool_mark(state)
        if mark != state.record_mark:  # a record the controller reads if the run is cut short
            parallel.save_record(item.config, state, final=False)
            state.record_mark = mark


def _session(request: pytest.FixtureRequest, case: Case, pool: ServerPool, *,
             fresh: bool) -> SyncSession:
    s = settings_of(request.config)
    node = request.node
    node.user_properties.append(("case", case.as_dict()))
    t0 = time.monotonic()
    try:
        sess = SyncSession(case, pool, fresh=fresh, sync_timeout=s.vllm_sync_timeout,
                           attention_backend=s.vllm_attention_backend, api_key=s.vllm_api_key,
                           on_record=lambda kind, data: node.user_properties.append((kind, data)),
                           user=node.nodeid)
    except (NeedsFreshServer, ModelUnavailable) as e:
        pytest.skip(str(e).splitlines()[0])
    except (ServerUnavailable, ServerError) as e:
        pytest.fail(str(e), pytrace=False)
    sess.record(server_wait_seconds=round(time.monotonic() - t0, 3))
    node.stash[_SESSION] = sess
    return sess


@pytest.fixture
def session(request: pytest.FixtureRequest, case: Case, server_pool: ServerPool):
    """A ``SyncSession`` for this test's case: server, client, reference, sync()."""
    sess = _session(request, case, server_pool,
                    fresh=request.node.get_closest_marker("fresh_server") is not None)
    yield sess
    if sess.client.sleep_retries:  # a sleep raced another process's allocation (client.sleep)
        sess.record(sleep_retries=sess.client.sleep_retries)
    restarted = sess.leave_healthy()
    if restarted:
        warnings.warn(restarted, stacklevel=2)
    # A server that died during this test is not restarted: later tests on it fail
    # with this cause and its log tail, not with connection errors.
    died = sess.pool.mark_dead(sess.server_cfg, during=request.node.nodeid)
    if died:
        warnings.warn(died.splitlines()[0], stacklevel=2)


@pytest.fixture
def harness(session: SyncSession) -> SyncSession:
    """Deprecated: the same ``SyncSession`` as ``session``, under the name it had
    before, which inside a test hides the ``harness`` package. Use ``session``."""
    return session


@dataclasses.dataclass
class SyncOutcome:
    """The seed flow of one case, shared by the tests that assert on it."""

    case: Case
    flow: FlowResult
    session: SyncSession

    @property
    def reference(self):
        return self.flow.reference

    @property
    def before(self):
        return self.flow.before

    @property
    def after(self):
        return self.flow.after

    @property
    def trainer(self) -> dict:
        return self.flow.sync


@pytest.fixture
def synced(request: pytest.FixtureRequest, case: Case, server_pool: ServerPool) -> SyncOutcome:
    """The seed flow, run once per case on a never-synced server and shared."""
    outcomes = request.config.stash[STATE].outcomes
    got = outcomes.get(case.id)
    if isinstance(got, unittest.SkipTest):  # e.g. trainer code this release cannot run
        pytest.skip(str(got).splitlines()[0])
    if isinstance(got, BaseException):
        pytest.fail(f"the shared sync for {case.id} failed earlier: {got}", pytrace=False)
    if got is None:
        sess = _session(request, case, server_pool, fresh=True)
        try:
            got = outcomes[case.id] = SyncOutcome(case, seed_flow(sess), sess)
        except BaseException as e:
            outcomes[case.id] = e
            raise
    else:
        request.node.user_properties.append(("case", case.as_dict()))
        request.node.user_properties.append(("metrics", dict(got.session.metrics)))
        got.session.on_record = (lambda kind, data, node=request.node:
                                 node.user_properties.append((kind, data)))
        got.session.user = request.node.nodeid
        request.node.stash[_SESSION] = got.session
    return got


# ----------------------------------------------------------------------------- reporting

class _GpuCaseCounter:
    """On the controller of a side-by-side run: the GPU cases, counted from the reports
    the workers send (a worker's own count comes back only if it ends normally)."""

    def __init__(self, state: RunState):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "gpu" in report.keywords and (report.when == "call" or report.skipped):
            self.state.gpu_cases[report.nodeid] = report.outcome


class _Verdicts:
    """Each test's verdict for the capabilities it covers (``harness.pytest.coverage``),
    from the reports: in process, and on the controller of a side-by-side run."""

    def __init__(self, state: RunState):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        known = next((v for k, v in report.user_properties if k == "known_issue"), None)
        if report.when == "call" or report.failed or report.skipped:
            if hasattr(report, "wasxfail") and report.skipped:
                outcome = "xfailed"
            elif report.skipped:
                outcome = "skipped"
            else:
                outcome = report.outcome
            reason = getattr(report, "wasxfail", None)
            if reason is None and report.skipped and isinstance(report.longrepr, tuple):
                reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            if report.when == "teardown" and report.nodeid in self.state.verdicts:
                return  # a teardown's error does not undo what the test showed
            self.state.verdicts[report.nodeid] = coverage.verdict_of(outcome, known, reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    state = item.config.stash.get(STATE, None)
    if state is not None and item.get_closest_marker("gpu") and (rep.when == "call"
                                                                 or rep.skipped):
        state.gpu_cases[item.nodeid] = rep.outcome
    s = item.stash.get(_SESSION, None)
    if s is None or rep.passed or call.when == "setup" and rep.skipped:
        return
    srv = s.current_server
    if srv is not None and not srv.attached:
        text = srv.log_since_mark()
        if text:
            lines = text.splitlines()
            rep.sections.append((f"vllm server log ({srv.url}, {len(lines)} lines this test; "
                                 f"full log {srv.log_path})", "\n".join(lines[-200:])))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    summary.terminal_summary(terminalreporter, config, config.stash.get(STATE, None))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    state = session.config.stash.get(STATE, None)
    if state is None:
        return
    config = session.config
    if state.dropped and not config.option.collectonly and not state.settings.harness_allow_no_gpu:
        state.shortfall = _selection.gpu_shortfall(
            _selection.selected(state.dropped, _selection.matcher(config)),
            state.case_count, state.settings.gpus(), _selection.asked(config))
    if hasattr(config, "workeroutput"):  # a worker: what the controller reports
        config.workeroutput.setdefault("harness", {}).update(
            parallel.worker_output(state), said=summary.said_lines(config, state), shortfall=state.shortfall,
            deselected_nodeids=summary.deselected_nodeids(config, state), cases=state.case_count)
    else:
        parallel.gather_records(config, state, exitstatus == pytest.ExitCode.INTERRUPTED)
        parallel.remove_controller_dir()
    for o in state.worker_outputs.values():  # the controller: what the workers saw
        state.gpu_cases.update(o.get("gpu_cases") or {})
        state.shortfall = state.shortfall or o.get("shortfall")
        if o.get("stop_error"):
            state.stop_error = "\n".join(filter(None, (state.stop_error, o["stop_error"])))
    if state.stop_error:  # processes may be left: the run failed
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if state.shortfall and session.exitstatus in (pytest.ExitCode.OK,
                                                  pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not state.settings.harness_require_gpu:
        return
    ran = [o for o in state.gpu_cases.values() if o != "skipped"]
    if not ran:
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"--harness-require-gpu: {len(state.gpu_cases)} GPU case(s) selected, "
                          "none ran", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    import signal

    fd = config.stash.get(_TERMINAL_FD, None)
    if fd is not None:
        os.close(fd)
        del config.stash[_TERMINAL_FD]

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a pytest run inside a test
    state = config.stash.get(STATE, None)
    if state is not None and hasattr(config, "workeroutput"):  # all of it, sessionfinish done
        parallel.save_record(config, state, final=True)
