"""``--harness-shard K/N`` in a pytest session: keep this shard's tests, deselect the
others with one summary line, and show every shard in ``--harness-plan``.

The cut itself is ``harness.run.partition`` (pure, shared with the workers of one run);
this module only applies it to collected items. It runs last among the collection
hooks (``trylast``): pytest's ``-k`` and ``-m`` and the harness's own deselection come
first, so every shard is cut from the same final selection, in the run order the
plugin sorted it into.
"""

from __future__ import annotations

from typing import Callable

import pytest

from harness.run import partition

SHARDS = pytest.StashKey[tuple]()   # (bins, needs, settings) of the whole selection


class ShardPlugin:
    """Registered by the plugin's ``pytest_configure`` when ``--harness-shard`` is set."""

    def __init__(self, state, need: Callable, share_out: Callable):
        self.state = state   # the plugin's RunState: settings, the deselection counter
        self.need = need     # harness.pytest.parametrize.need(item, settings, paths)
        # share_out(config, items, needs): the plugin's cut of the shard over its workers
        # (-n), made after this cut, so that the workers share out this shard's tests
        self.share_out = share_out

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list) -> None:
        s = self.state.settings
        k, n = s.harness_shard
        paths: dict[str, str] = {}
        needs = [self.need(it, s, paths) for it in items]
        bins = partition.assign(partition.groups(needs, s.host()), n)
        config.stash[SHARDS] = (bins, needs, s)
        keep = {i for g in bins[k - 1] for i in g.tests}
        dropped = [it for i, it in enumerate(items) if i not in keep]
        if dropped:
            self.state.deselected[f"in other shards of --harness-shard {k}/{n}"] += len(dropped)
            config.hook.pytest_deselected(items=dropped)
            items[:] = [it for i, it in enumerate(items) if i in keep]
        self.share_out(config, items, [needs[i] for i in sorted(keep)])

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """--harness-plan runs nothing, even for a shard none of whose tests takes a
        case (the plugin's plan, which prints the shards, is then not made)."""
        if not self.state.settings.harness_plan:
            return
        session.config.option.collectonly = True
        if not any("case" in getattr(getattr(it, "callspec", None), "params", {})
                   for it in session.items):
            tr = session.config.pluginmanager.get_plugin("terminalreporter")
            for line in plan_lines(session.config) if tr is not None else ():
                tr.write_line(line)


def plan_lines(config: pytest.Config) -> list[str]:
    """Every shard's servers, tests and estimated wall time (nothing without a shard)."""
    got = config.stash.get(SHARDS, None)
    if got is None:
        return []
    bins, needs, s = got
    k, n = s.harness_shard
    return partition.describe(bins, needs, s.host(), max_starting=s.vllm_max_starting,
                              max_alive=s.vllm_max_servers) + [
        f"the plan of shard {k}/{n}, which this run runs with --harness-shard {k}/{n}:"]

