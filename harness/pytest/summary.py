"""What the plugin prints: its header lines and its section of pytest's summary."""

from __future__ import annotations

import os
import time

import pytest

from harness.core import environment, measure
from harness.pytest import coverage
from harness.pytest import selection as _selection
from harness.run import parallel
from harness.run import plan as _plan
from harness.run import settings as _settings
from harness.run.start_figures import start_seconds_by_mode


def header_lines(s: _settings.Settings, plan: _plan.Plan | None = None) -> list[str]:
    from harness.models import cache_root

    return [
        f"weight-sync-harness: {environment.summary_line()}, GPUs {s.gpus()}",
        f"  models {list(s.vllm_model)}, dtypes {list(s.vllm_dtype)}, "
        f"backends {list(s.vllm_backend)}, layouts {list(s.vllm_layout)}, "
        f"modes {list(s.vllm_mode)}",
        f"  cache {cache_root()}, server url {s.vllm_url or '(started per config)'}"
        + (f", {len(plan.servers)} servers planned, {plan.max_starting} starting at once, "
           f"{plan.max_alive} alive" if plan else ""),
    ]


def zoo_pinned_line(config: pytest.Config, state) -> str | None:
    """With --vllm-model naming no zoo model (a directory, a hub id): the one line that
    says how many selected tests are pinned to zoo models, which it deselects; None
    otherwise."""
    from harness.models import ZOO

    s = state.settings
    if "vllm_model" not in s.explicit or any(m in ZOO for m in s.vllm_model):
        return None
    keep = _selection.matcher(config)
    pinned = [item.get_closest_marker("models") for _, item in state.dropped if keep(item)]
    zoo = sorted({a for m in pinned if m is not None for a in m.args if a in ZOO})
    n = sum(1 for m in pinned if m is not None and any(a in ZOO for a in m.args))
    if not n:
        return None
    return (f"--vllm-model {','.join(os.path.basename(m) or m for m in s.vllm_model)}: {n} "
            f"test(s) pinned to zoo models ({', '.join(zoo)}) deselected; they run on those "
            "models only")


def selection_lines(config: pytest.Config, state) -> list[str]:
    """What the selection asked for and what can run here, in at most three lines (and
    the zoo-pinned tests an own model leaves out, in one more)."""
    reasons = _selection.selected(state.dropped, _selection.matcher(config))
    lines = _selection.summary(reasons, state.case_count, _selection.asked(config),
                               state.settings.gpus())
    pinned = zoo_pinned_line(config, state)
    if pinned:
        lines.append(pinned)
    if config.option.verbose > 0:
        lines += _selection.detail(reasons)
    return lines


def deselected_nodeids(config: pytest.Config, state) -> list[tuple[str, str]]:
    """(reason, node id) of each test the harness left out that the selection names."""
    keep = _selection.matcher(config)
    return [(reason, item.nodeid) for reason, item in state.dropped if keep(item)]


def uncovered(config: pytest.Config, state) -> list[dict]:
    """``coverage.uncovered`` of this run (a side-by-side run's workers' deselections
    too); [] where no test that takes a case was collected, or nothing ran."""
    cases = (state.items or state.case_count
             or any(o.get("cases") for o in state.worker_outputs.values()))
    if not (cases and state.verdicts):  # no harness test, or none ran (a plan, a collection)
        return []
    deselected = deselected_nodeids(config, state)
    for o in state.worker_outputs.values():
        deselected += [tuple(d) for d in o.get("deselected_nodeids") or []]
    return coverage.uncovered(state.verdicts, dict.fromkeys(deselected))


def terminal_summary(terminalreporter, config: pytest.Config, state) -> None:
    """The plugin's section of pytest's summary: what the selection asked for, the
    shards' cut, the servers started, restarted and reaped (``state``: the plugin's
    ``RunState``, or None when it did not run)."""
    if state is None or not (state.items or state.deselected or state.worker_outputs):
        return
    selection, shortfall = selection_lines(config, state), state.shortfall
    if state.worker_outputs:  # side by side: the workers saw the selection
        first = next(iter(sorted(state.worker_outputs.items())))[1]
        selection = first.get("selection_lines") or []
        shortfall = next((o["shortfall"] for o in state.worker_outputs.values()
                          if o.get("shortfall")), None)
    rows = uncovered(config, state)
    if not (selection or state.pool is not None or state.stop_error or shortfall or rows
            or any(r.startswith("in other shards") for r in state.deselected)
            or any(o.get("started") for o in state.worker_outputs.values())):
        return
    tr = terminalreporter
    tr.section("weight-sync-harness")
    for line in selection:
        tr.write_line(line)
    for reason, n in sorted(state.deselected.items()):  # --harness-shard's cut
        if reason.startswith("in other shards"):
            tr.write_line(f"deselected {n}: {reason}")
    if shortfall:
        tr.write_line(shortfall, red=True)
    pool = state.pool
    planned = len(state.plan.servers) if state.plan else None
    if pool is None and any(o.get("started") for o in state.worker_outputs.values()):
        pool = parallel.MergedPool(state.worker_outputs, state.t0)
        planned = sum(o.get("servers_planned", 0) for o in state.worker_outputs.values())
        tr.write_line(f"side by side: {len(state.worker_outputs)} workers, " + ", ".join(
            f"{w} {o.get('servers_planned', 0)} servers"
            for w, o in sorted(state.worker_outputs.items())))
    if pool is not None:
        f = pool.start_figures()
        of = f" of {planned} planned" if planned is not None else ""
        tr.write_line(f"vLLM servers started: {f['servers_started']}{of}, "
                      f"{f['restarts']} restarts, {len(pool.resets)} resets; start time "
                      f"{f['start_seconds_sum']:.0f}s summed, {f['start_wall_seconds']:.0f}s "
                      f"wall; suite wall time {time.monotonic() - state.t0:.1f}s")
        cpu = measure.cpu_use(state.cpu0, measure.cpu_times())
        if cpu is not None and cpu["available_seconds"] > 0:
            tr.write_line(f"host CPU: {cpu['cores']} cores "
                          f"{100 * cpu['busy_seconds'] / cpu['available_seconds']:.0f}% busy "
                          f"({cpu['busy_seconds']:.0f}s of {cpu['available_seconds']:.0f}s), "
                          f"steal {cpu['steal_seconds']:.0f}s, iowait {cpu['iowait_seconds']:.0f}s")
        by_mode = start_seconds_by_mode(pool.started)
        if len(by_mode) > 1 or set(by_mode) - {"eager"}:
            tr.write_line("start time by serving mode: " + "; ".join(
                f"{m} {v['servers']} servers, mean {v['mean']:.0f}s, max {v['max']:.0f}s"
                for m, v in by_mode.items()))
        for srv in pool.started:
            where = f"  [{srv['worker']}]" if "worker" in srv else ""
            tr.write_line(f"  {srv['start_seconds']:.1f}s  vllm {srv['version']}  "
                          f"{srv['config']}{where}")
        for r in pool.restarts:
            tr.write_line(f"restarted {r['config']}: {r['reason']}")
        for o in pool.reaped:
            tr.write_line(f"reaped an orphan of a run that was killed: "
                          f"{o if isinstance(o, str) else o.describe()}")
    if state.stop_error:
        tr.write_line(f"stopping the servers failed: {state.stop_error}", red=True)
    if rows:
        tr.write_line(f"capabilities no test exercised in this run ({len(rows)} of "
                      f"{len(coverage.CAPABILITIES)}; a known, skipped or deselected test "
                      "says nothing about its capability):", yellow=True)
        for line in coverage.lines(rows):
            tr.write_line(line)
