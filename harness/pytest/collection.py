"""Collection: the cases parametrized, the harness's deselections, the tests ordered by
the server they need, and the plan made from what will run (printed, and nothing run,
with ``--harness-plan``)."""

from __future__ import annotations

import os

import pytest

from harness.pytest import parametrize, summary
from harness.pytest import selection as _selection
from harness.pytest.parametrize import case_of, need
from harness.pytest.refusals import refuses
from harness.pytest.run_state import STATE, settings_of
from harness.pytest.side_by_side import share_out
from harness.run import parallel
from harness.run import plan as _plan


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
    if state.dropped and refuses(config, state.settings):
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
        share_out(config, state, items, [None] * len(items))
        return
    known_issues.mark_known_issues(config, items, state.settings.vllm_url)
    # Tests grouped by the server they need, in the order harness.run.plan makes them: each
    # server starts once and stops after its last test.
    paths: dict[str, str] = {}
    needs = {id(it): need(it, state.settings, paths) for it in items}
    keys = {id(it): (_plan.order_key(needs[id(it)]), i) for i, it in enumerate(items)}
    items.sort(key=lambda it: keys[id(it)])
    if not state.settings.harness_shard:  # else the shard's cut, made after this, shares out
        share_out(config, state, items, [needs[id(it)] for it in items])


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
                   and (state.worker_tests is None or it.nodeid in state.worker_tests)]
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
    this_worker = parallel.worker(session.config)
    n = this_worker[1] if this_worker else 1
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
            tr.write_line(plan_counts(len(session.items), state.case_count, len(needs),
                                       len(state.plan.servers)))


def plan_counts(selected: int, cases: int, on_servers: int, servers: int) -> str:
    """How the plan's counts relate: pytest's tests selected, the tests on the planned
    servers, and the cases the summary says run here."""
    return (f"counts: of the {selected} tests selected, {on_servers} run on the {servers} "
            f"servers planned; {cases - on_servers} more take a case but no server, or skip "
            f"here saying why; {selected - cases} take no case (no server, no GPU); the "
            f"summary's \"{cases} run here\" counts the cases ({on_servers} + "
            f"{cases - on_servers})")
