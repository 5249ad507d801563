"""The hooks of a run side by side with pytest-xdist (``harness.run.parallel`` does the
work): ``-n auto``'s worker count, the scheduler, the partition of the selection over
the workers, the workers' records and server lines on the controller, and an
interrupted run that lets its workers stop their servers."""

from __future__ import annotations

import os

import pytest

from harness.pytest.run_state import STATE, RunState
from harness.pytest.terminal import keep_terminal, terminal_line
from harness.run import parallel
from harness.run import plan as _plan
from harness.run import scheduling
from harness.run import settings as _settings


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
    return scheduling.Scheduling(config) if parallel.scheduled_here(config) else None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    state = node.config.stash.get(STATE, None)
    out = getattr(node, "workeroutput", None) or {}
    if state is not None and "harness" in out:
        state.worker_outputs[str(node.gateway.id)] = out["harness"]


def share_out(config: pytest.Config, state: RunState, items: list, needs: list) -> None:
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
        state.worker_tests = {it.nodeid for it, b in zip(items, bins) if b == workers[0]}
        if workers[0] == 0:
            scheduling.write_partition(bins, [it.nodeid for it in items])


class WorkerLines:
    """The controller of a side-by-side run prints its workers' server starts
    (``parallel.LineTail``) while the run goes."""

    def __init__(self) -> None:
        self.tail: parallel.LineTail | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        folder = os.environ.get(parallel.DIR_ENV)
        if folder:
            keep_terminal(session.config)
            self.tail = parallel.LineTail(folder, terminal_line(session.config)).start()

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.tail is not None:
            self.tail.stop()
            self.tail = None


class InterruptedRun:
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
