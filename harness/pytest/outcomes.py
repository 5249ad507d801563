"""What the tests and the session came to: each test's verdict for the capabilities it
covers, the GPU cases that ran, a failing test's server log, the plugin's summary,
and the session's exit status (a shortfall of GPU cases, servers left running)."""

from __future__ import annotations

import pytest

from harness.pytest import coverage, summary
from harness.pytest import selection as _selection
from harness.pytest.run_state import SESSION, STATE, RunState
from harness.run import parallel


class GpuCaseCounter:
    """On the controller of a side-by-side run: the GPU cases, counted from the reports
    the workers send (a worker's own count comes back only if it ends normally)."""

    def __init__(self, state: RunState):
        self.state = state

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "gpu" in report.keywords and (report.when == "call" or report.skipped):
            self.state.gpu_cases[report.nodeid] = report.outcome


class Verdicts:
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
    s = item.stash.get(SESSION, None)
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
            parallel.worker_output(state), selection_lines=summary.selection_lines(config, state), shortfall=state.shortfall,
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
