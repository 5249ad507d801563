"""The pytest plugin: its hooks and fixtures, gathered from the modules that hold them,
and the plugin objects a session registers.

The work is done by the engine (``harness.run.cases``, ``harness.run.pool``, ``harness.run.flow``);
settings are resolved and checked once by ``harness.run.settings``. Test ids read
``<backend>-<layout>-<dtype>-<model>`` (``shm-cpu-fp32-llama``,
``ipc-packed-1gpu-colocated-fp32-llama``), so ``pytest -k ipc`` selects by backend.

The plugin stays out of the way of a session that does not use it: nothing is
printed and nothing (GPUs, vLLM) is probed unless a collected test takes a ``case``.

pytest finds hooks and fixtures by name among this module's attributes, so the imports
below are what the plugin is:

* ``options``: options, ini keys, markers, the settings they resolve to;
* ``refusals``: runs refused before they start;
* ``collection``: cases parametrized, deselections, tests ordered, the plan;
* ``side_by_side``: the pytest-xdist hooks and the controller's plugin objects;
* ``servers``: the pool started before the first test and stopped after the last;
* ``fixtures``: ``server_pool``, ``session``, ``synced``, ``harness``;
* ``outcomes``: verdicts, GPU cases, a failing test's server log, the exit status;
* ``terminal``: lines on the terminal while tests run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.pytest import options, refusals, servers, terminal
from harness.pytest.collection import (  # noqa: F401  (hooks)
    pytest_collection_finish, pytest_collection_modifyitems, pytest_generate_tests)
from harness.pytest.fixtures import harness, server_pool, session, synced  # noqa: F401
from harness.pytest.options import (  # noqa: F401  (hooks)
    pytest_addoption, pytest_load_initial_conftests)
from harness.pytest.outcomes import (  # noqa: F401  (hooks)
    GpuCaseCounter, Verdicts, pytest_runtest_makereport, pytest_sessionfinish,
    pytest_terminal_summary)
from harness.pytest.parametrize import need
from harness.pytest.run_state import STATE, RunState
from harness.pytest.servers import pytest_runtest_teardown, pytest_runtestloop  # noqa: F401
from harness.pytest.side_by_side import (  # noqa: F401  (hooks)
    InterruptedRun, WorkerLines, pytest_cmdline_main, pytest_testnodedown,
    pytest_xdist_auto_num_workers, pytest_xdist_make_scheduler, share_out)
from harness.run import parallel


def pytest_configure(config: pytest.Config) -> None:
    options.register_markers(config)
    s = options.resolve_settings(config)
    refusals.refuse_gpu_only_selection(config, s)
    refusals.refuse_unservable_models(config, s)
    state = config.stash[STATE] = RunState(s)
    parallel.share_threads(config)
    config.pluginmanager.register(Verdicts(state), "harness-verdicts")
    if parallel.scheduled_here(config) and not hasattr(config, "workerinput"):
        parallel.controller_dir()  # the workers, started after this, inherit its path
        config.pluginmanager.register(GpuCaseCounter(state), "harness-gpu-cases")
        config.pluginmanager.register(InterruptedRun(), "harness-interrupted-run")
        config.pluginmanager.register(WorkerLines(), "harness-worker-lines")
    if s.harness_shard:  # applied after -k, -m and the harness's deselection
        from harness.pytest.sharding import ShardPlugin

        config.pluginmanager.register(
            ShardPlugin(state, need, lambda c, items, needs: share_out(c, state, items, needs)),
            "harness-shard")
    if s.harness_report:
        from harness.pytest.report import ReportPlugin

        config.pluginmanager.register(ReportPlugin(config, Path(s.harness_report), state,
                                                   worker=hasattr(config, "workerinput")),
                                      "harness-report")


def pytest_unconfigure(config: pytest.Config) -> None:
    terminal.release_terminal(config)
    servers.untrap_sigterm()
    state = config.stash.get(STATE, None)
    if state is not None and hasattr(config, "workeroutput"):  # all of it, sessionfinish done
        parallel.save_record(config, state, final=True)
