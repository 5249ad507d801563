"""The session's servers: the pool started as planned before the first test, each
server released after its last test, all stopped at the end; a run that starts them
takes SIGINT and SIGTERM as interrupts, so that they are stopped."""

from __future__ import annotations

import atexit
import threading
from pathlib import Path

import pytest

from harness.pytest.parametrize import case_of, need
from harness.pytest.run_state import STATE, RunState
from harness.pytest.terminal import keep_terminal, terminal_line
from harness.run import parallel
from harness.run.flow import trainer_spec
from harness.run.pool import ServerPool
from harness.trainer.spares import TrainerProcesses
from harness.vllm.server import ServerError


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
        terminable()
    if state is not None and state.plan is not None and state.plan.servers and runs:
        keep_terminal(session.config)
        start_pool(session.config, state)
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


def interruptible() -> None:
    """A process started in the background by a non-interactive shell (``cmd &``, a CI
    step, ``nohup``) begins with SIGINT ignored, so Ctrl-C and ci/gpu-run.sh's time limit
    (SIGINT) would do nothing, and the kill that follows leaves servers running. A run
    that starts servers takes SIGINT back, as Python's own handler."""
    import signal
    import threading

    if (signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            and threading.current_thread() is threading.main_thread()):
        signal.signal(signal.SIGINT, signal.default_int_handler)


def on_sigterm(signum, frame) -> None:
    """SIGTERM ends the run as Ctrl-C does: fixtures are torn down, servers and
    trainers stopped (a second SIGTERM kills at once, as before)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt("SIGTERM")


def terminable() -> None:
    """CI runners and ``timeout`` end a job with SIGTERM, whose default kills pytest
    where it stands: no fixture teardown, so what a test started in a session of its own
    was left running (two orphans of tests/test_faults_sessions.py). A run of harness
    cases takes SIGTERM as an interrupt, unless someone else handles it already."""
    import signal

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, on_sigterm)


def start_pool(config: pytest.Config, state: RunState) -> ServerPool:
    interruptible()
    s = state.settings
    log_dir = Path(s.vllm_log_dir)
    if not log_dir.is_absolute():
        log_dir = Path(config.rootpath) / log_dir
    plan = state.plan
    this_worker = parallel.worker(config)
    spares = s.trainer_spares()
    if this_worker and s.harness_trainer_spares is None:  # the default is the host's, shared
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
                                   announce=parallel.announcer(config, terminal_line(config)))
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


def untrap_sigterm() -> None:
    """SIGTERM back to its default, where ``terminable`` took it (a pytest run inside a
    test ends before the run around it)."""
    import signal

    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a pytest run inside a test
