"""--harness-shard K/N and harness.run.partition: every selected test in exactly one shard,
no server in two shards, the shards' estimated costs close to each other.

The needs are the real ones: a pytest run of this repository plans the GPU selections
for a host it does not have (--harness-plan --harness-plan-host) with --harness-shard,
and hands back the needs the shard plugin cut (harness.pytest.sharding.SHARDS) and the
tests the shard kept (child_pytest). Collection only: no server starts here.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from child_pytest import H200_HOST
from harness.run import durations, partition
from harness.run import plan as P
from harness.vllm.server import ServerConfig

SELECTIONS = {
    "1gpu-ipc": ("ipc and not smollm2", P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128),
                 H200_HOST, (2, 3)),
    "2gpu-nccl-or-ipc": ("nccl or ipc", P.Host(gpus=2, cores=32, gpu_memory_gib=139, ram_gib=256),
                         "gpus=2,cores=32,gpu_memory_gib=139,ram_gib=256", (3, 4)),
}


@pytest.fixture(scope="module", params=list(SELECTIONS))
def selection(request, child_pytest):
    keyword, host, spec, (k, n) = SELECTIONS[request.param]
    r = child_pytest("--harness-plan", "--harness-plan-host", spec, "-k", keyword,
                     "--harness-shard", f"{k}/{n}", "-n", "4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.needs is not None, "the shard plugin kept no needs"
    return {"needs": r.needs, "kept": [nodeid for nodeid, _ in r.items], "host": host, "k": k,
            "n": n, "stdout": r.stdout}


def _cost(b: list[partition.Group]) -> float:
    return sum(g.cost for g in b)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_shards_partition_the_selection_by_whole_servers(selection, n):
    needs, host = selection["needs"], selection["host"]
    assert len(needs) > 250 and sum(x is not None for x in needs) > 200  # the real selection
    bins = partition.assign(partition.groups(needs, host), n)
    assert len(bins) == n
    tests = [i for b in bins for g in b for i in g.tests]
    assert sorted(tests) == list(range(len(needs))), "a test in no shard, or in two"
    for k in range(1, n + 1):
        assert partition.shard(needs, host, k, n) == sorted(i for g in bins[k - 1]
                                                            for i in g.tests)
    servers = [{c for g in b for c in g.servers} for b in bins]
    for a in range(n):
        for b in range(a + 1, n):
            assert not servers[a] & servers[b], f"a server in shards {a + 1} and {b + 1}"
    for b, on in zip(bins, servers):  # every server a shard's tests need is in it
        assert b, "a shard without work"
        for g in b:
            for i in g.tests:
                assert needs[i] is None or set(needs[i].servers) <= on
    loads = sorted(((_cost(b), b) for b in bins), key=lambda x: x[0])
    low, (high, top) = loads[0][0], loads[-1]
    biggest = max(g.cost for b in bins for g in b)
    if len([g for g in top if g.servers]) == 1 and biggest > sum(x for x, _ in loads) / n:
        high = loads[-2][0]  # one group alone outweighs an even share: the others must balance
    assert high - low <= 0.25 * high, [round(x) for x, _ in loads]


def test_the_plugin_keeps_the_shard_partition_computes(selection):
    """The shard the plugin ran is partition.shard of the needs it cut, and the others
    are one summary line."""
    needs, host, k, n = (selection[x] for x in ("needs", "host", "k", "n"))
    mine = partition.shard(needs, host, k, n)
    assert len(selection["kept"]) == len(mine)
    assert ([x for x in selection["kept"] if x in {nd.test for nd in needs if nd}]
            == [needs[i].test for i in mine if needs[i] is not None])
    out = selection["stdout"]
    assert f"deselected {len(needs) - len(mine)}: in other shards of --harness-shard {k}/{n}" in out
    for j in range(1, n + 1):  # --harness-plan shows every shard, then this shard's plan
        assert f"  shard {j}/{n}: " in out
    assert f"the plan of shard {k}/{n}" in out and f"server plan for {host.describe()[:12]}" in out
    # side by side (-n 4), the workers share out this shard's tests, not the selection's
    # (they did, and the plan's per-worker view failed with an IndexError)
    workers = re.findall(r"^  worker \d+: \d+ servers, (\d+) tests", out, re.M)
    assert len(workers) == 4
    assert sum(map(int, workers)) == sum(needs[i] is not None for i in mine)


def _need(name: str, twin: bool = False) -> P.ServerNeed:
    cfg = ServerConfig(model=f"/zoo/{name}", backend="ipc", dtype="float32", device_ids=(0,))
    return P.ServerNeed(f"t::{name}", cfg, ServerConfig(model=f"/zoo/{name}", backend="ipc",
                                                 dtype="float32", load_format="auto",
                                                 device_ids=(0,)) if twin else None)


def test_a_twin_joins_its_servers_into_one_group_and_no_server_tests_are_one():
    host = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)
    a, a_twin = _need("a"), _need("a", twin=True)
    # another server (here: another flag) compared with the same twin joins the group
    unpacked = P.ServerNeed("t::u", dataclasses.replace(a.server, extra_args=("--seed", "1")),
                      a_twin.twin)
    needs = [None, a, a_twin, unpacked, _need("b"), None]
    gs = partition.groups(needs, host)
    assert [g.tests for g in gs] == [(0, 5), (1, 2, 3), (4,)]
    assert gs[0].servers == () and gs[0].cost == pytest.approx(2 * P.NO_SERVER_TEST_SECONDS)
    start, test = P.estimates(host)
    assert gs[1].cost == pytest.approx(3 * start(1) + 3 * test(a))
    assert set(gs[1].servers) == {a.server, a_twin.twin, unpacked.server}


def test_the_no_server_tests_spread_over_every_shard_and_ties_are_deterministic():
    host = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)
    needs = [None] * 7 + [_need(x) for x in "abc"]
    bins = partition.assign(partition.groups(needs, host), 3)
    assert [[g.tests for g in b] for b in bins] == [[(0, 1, 2), (7,)], [(3, 4), (8,)],
                                                   [(5, 6), (9,)]]
    assert partition.assign(partition.groups(needs, host), 3) == bins
    assert [len(b) for b in partition.assign(partition.groups([None] * 2, host), 3)] == [1, 1, 0]
    with pytest.raises(ValueError):
        partition.shard(needs, host, 4, 3)


def test_tests_without_a_server_are_sharded_and_a_plan_of_them_runs_nothing(pytester,
                                                                             monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("HARNESS_SHARD", raising=False)
    pytester.makepyfile(test_plain="".join(f"def test_{i}():\n    pass\n" for i in range(5)))
    r = pytester.runpytest("-q", "-p", "no:cacheprovider", "--harness-shard", "2/2")
    assert r.ret == 0, r.stdout.str()
    r.assert_outcomes(passed=2, deselected=3)
    assert "deselected 3: in other shards of --harness-shard 2/2" in r.stdout.str()
    r = pytester.runpytest("-q", "-p", "no:cacheprovider", "--harness-shard", "1/2",
                           "--harness-plan")
    assert "  shard 2/2: 2 tests (2 without a server) on 0 servers" in r.stdout.str()
    assert "passed" not in r.stdout.str(), r.stdout.str()


# seconds of each function's tests, as harness.run.durations measures them: the pause
# tests (tens of seconds) sit together in run order between quick ones
CLUSTERED = {"test_refused": 0.5, "test_pause_cycles": 50.0, "test_parity": 1.0}


def _clustered_needs() -> list[P.ServerNeed]:
    cfg = ServerConfig(model="/zoo/llama", backend="ipc", dtype="float32", device_ids=(0,))
    names = ["test_refused"] * 20 + ["test_pause_cycles"] * 10 + ["test_parity"] * 30
    return [P.ServerNeed(f"tests/t.py::{name}[{i}]", cfg) for i, name in enumerate(names)]


def _replica_seconds(needs, host) -> list[float]:
    """What each replica of the one server costs by the measured durations."""
    start = P.estimates(host)[0](1)
    gs = partition.split_long(partition.groups(needs, host), 3, needs, host)
    assert len(gs) == 3 and {g.replicas for g in gs} == {3}
    return [start + sum(CLUSTERED[needs[i].test.split("::")[1].split("[")[0]]
                        for i in g.tests) for g in gs]


def test_replicas_are_cut_by_measured_durations_not_by_test_count(monkeypatch):
    """Cut by count (every test 4 s), one replica gets all ten pause tests: 555 s against
    55 and 65. Cut by what the tests take, the three are within a quarter of each other."""
    host = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)
    needs = _clustered_needs()
    monkeypatch.setattr(durations, "table", lambda kind: CLUSTERED)
    measured = _replica_seconds(needs, host)
    assert max(measured) - min(measured) <= 0.25 * max(measured), measured
    monkeypatch.setattr(durations, "table", lambda kind: {})
    uniform = _replica_seconds(needs, host)
    assert max(uniform) - min(uniform) > 0.25 * max(uniform), uniform


def test_the_twins_slow_tests_count_for_the_replica_that_takes_them(monkeypatch):
    """The tests that need the twin all go to the first replica; they are counted at
    their measured seconds, so the first replica takes no more of the others than its
    share leaves (at 4 s each, it took 70 of the 100 quick ones besides: 260 s to 75)."""
    host = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)
    monkeypatch.setattr(durations, "table", lambda kind: CLUSTERED)
    twinned = _need("llama", twin=True)
    needs = ([dataclasses.replace(twinned, test=f"tests/t.py::test_pause_cycles[{i}]")
              for i in range(2)]
             + [dataclasses.replace(twinned, test=f"tests/t.py::test_parity[{i}]", twin=None)
                for i in range(100)])
    first, second = partition.split_long(partition.groups(needs, host), 2, needs, host)
    assert first.tests == (0, 1) and len(second.tests) == 100
    assert (first.cost, second.cost) == (pytest.approx(2 * 45 + 100), pytest.approx(45 + 100))


def test_the_tests_that_sleep_a_cut_server_are_dealt_to_every_replica(monkeypatch):
    """The sleep tests come after a server's other tests (plan.order_key): cut in run
    order, all six fell to the last replica, which then waited alone for the GPU-memory
    lock (the twentieth GPU visit). Dealt, each of the three replicas ends with two of
    them; the tests that may break the server still end the last replica alone."""
    host = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)
    monkeypatch.setattr(durations, "table", lambda kind: {"test_parity": 1.0, "test_sleep": 5.0,
                                                          "test_break": 1.0})
    cfg = ServerConfig(model="/zoo/llama", backend="ipc", dtype="float32", device_ids=(0,))
    needs = ([P.ServerNeed(f"tests/t.py::test_parity[{i}]", cfg) for i in range(90)]
             + [P.ServerNeed(f"tests/t.py::test_sleep[{i}]", cfg, sleeps=True) for i in range(6)]
             + [P.ServerNeed(f"tests/t.py::test_break[{i}]", cfg, breaks=True) for i in range(2)])
    assert sorted(range(len(needs)), key=lambda i: P.order_key(needs[i])) == list(range(98))
    gs = partition.split_long(partition.groups(needs, host), 3, needs, host)
    assert [g.replica for g in gs] == [0, 1, 2]
    sleeping = [[i for i in g.tests if needs[i].sleeps] for g in gs]
    assert [len(s) for s in sleeping] == [2, 2, 2], sleeping
    for g, s in zip(gs, sleeping):  # a replica's sleeps end it (before any break)
        plain = [i for i in g.tests if not needs[i].sleeps and not needs[i].breaks]
        assert plain and max(plain) < min(s), g.tests
    assert [i for g in gs[:2] for i in g.tests if needs[i].breaks] == []
    assert gs[2].tests[-2:] == (96, 97)
    assert sorted(i for g in gs for i in g.tests) == list(range(98))
