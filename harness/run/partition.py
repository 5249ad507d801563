"""Whole servers with their tests, spread over N bins: pytest-xdist workers, or the
shards of ``--harness-shard K/N`` (one CI machine each).

A run's cost is its servers' starts and the tests on them, and a server started in two
bins is paid twice; so the unit of partitioning is a *group*: the servers one test
links (its case's server and the disk-loaded twin), closed over every test, with all
their tests in run order. Tests that need no server form one group of their own,
which may be split freely.

* ``groups`` finds them (union-find over the servers each ``plan.ServerNeed`` names);
* ``split_long`` cuts a group that alone would outlast the run's fair share into
  replicas: the same configuration started in two bins, its tests divided between
  them (the twin's tests stay together, with the first replica), so that no one
  server is the critical path;
* ``assign`` puts groups into N bins, longest first onto the least loaded bin (the
  tests without a server split evenly); ``shard`` is one bin of that, for a machine;
* ``critical_path`` is the costliest group: however many bins, the run takes at least
  that long.

Costs are estimates (``harness.run.plan.estimates``): a start per server plus each
test's measured duration (its function's, ``harness.run.durations``; a fixed time where
none is measured), so a replica that gets the slow tests gets fewer of them. Nothing
here imports pytest or starts anything.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from harness.run import plan as _plan
from harness.vllm.server import ServerConfig


@dataclasses.dataclass(frozen=True)
class Group:
    """A connected set of servers (a dummy server and its twins) and the tests on
    them: indices into the needs list, in run order; ``cost`` in estimated seconds,
    each server's start plus its tests."""

    servers: tuple[ServerConfig, ...]
    tests: tuple[int, ...]
    cost: float
    replica: int = 0         # the k-th of the replicas a long group was cut into
    replicas: int = 1

    @property
    def first(self) -> int:
        return self.tests[0]

    def describe(self) -> str:
        if not self.servers:
            return f"{len(self.tests)} tests without a server"
        main = self.servers[0].describe()
        more = f" (+{len(self.servers) - 1} twin)" if len(self.servers) > 1 else ""
        rep = f", replica {self.replica + 1}/{self.replicas}" if self.replicas > 1 else ""
        return f"{main}{more}{rep}: {len(self.tests)} tests, ~{self.cost:.0f}s"


def _costs(host: _plan.Host):
    start, test = _plan.estimates(host)
    return start(1), test


def _cost(needs: Sequence[_plan.ServerNeed | None], tests: Sequence[int],
          servers: Sequence[ServerConfig], host: _plan.Host) -> float:
    start, test = _costs(host)
    return start * len(servers) + sum(test(needs[i]) for i in tests)


def groups(needs: Sequence[_plan.ServerNeed | None], host: _plan.Host) -> list[Group]:
    """The groups of ``needs`` (None: a test that needs no server), in order of their
    first test; the tests without a server, if any, come first, as one group."""
    parent: dict[ServerConfig, ServerConfig] = {}

    def find(c: ServerConfig) -> ServerConfig:
        parent.setdefault(c, c)
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for n in needs:
        if n is not None:
            root = find(n.server)
            for other in n.servers[1:]:
                parent[find(other)] = root
    members: dict[ServerConfig, list[int]] = {}
    servers: dict[ServerConfig, list[ServerConfig]] = {}
    free = []
    for i, n in enumerate(needs):
        if n is None:
            free.append(i)
            continue
        root = find(n.server)
        members.setdefault(root, []).append(i)
        for c in n.servers:
            if c not in servers.setdefault(root, []):
                servers[root].append(c)
    out = [Group((), tuple(free), _cost(needs, free, (), host))] if free else []
    for root, tests in sorted(members.items(), key=lambda kv: kv[1][0]):
        out.append(Group(tuple(servers[root]), tuple(tests),
                         _cost(needs, tests, servers[root], host)))
    return out


def split_long(gs: Sequence[Group], n: int, needs: Sequence[_plan.ServerNeed | None],
               host: _plan.Host) -> list[Group]:
    """Cut each server group that costs more than the fair share of ``n`` bins into
    replicas of about that share (at most ``n``). A replica keeps the order of its
    tests; the tests that need a twin all go to the first replica (one twin start),
    the tests that sleep the server are dealt out in turn, one replica after another,
    and the others are divided in run order, which keeps each trainer's tests together.

    Dealt, not cut: a sleep waits for the GPU-memory lock, that is for every start
    under way on the GPU (``harness.vllm.memory_lock``). Cut in run order, where they
    come after the server's other tests (``plan.order_key``), all of them fell to the
    last replica: in a GPU run its worker waited 131 s for the lock and ended the run
    73 s after the next (reports/gpu/README.md). Dealt, each
    replica ends with its share of them, and their waits overlap (a hypothesis until
    a GPU run shows it)."""
    total = sum(g.cost for g in gs)
    if n <= 1 or not total:
        return list(gs)
    share = total / n
    out: list[Group] = []
    for g in gs:
        k = min(n, math.ceil(g.cost / share)) if g.servers else 1
        if k <= 1 or len(g.tests) < 2 * k:
            out.append(g)
            continue
        twinned = [i for i in g.tests if needs[i].twin is not None]
        sleeping = [i for i in g.tests if needs[i].twin is None and needs[i].sleeps
                    and not needs[i].breaks]
        dealt = set(twinned) | set(sleeping)
        rest = [i for i in g.tests if i not in dealt]
        start, test = _costs(host)
        chunks: list[list[int]] = [list(twinned)] + [[] for _ in range(k - 1)]
        loads = ([start * (1 + bool(twinned)) + sum(test(needs[i]) for i in twinned)]
                 + [start] * (k - 1))
        for j, i in enumerate(sleeping):  # in turn, from the last replica backwards
            chunks[k - 1 - j % k].append(i)
            loads[k - 1 - j % k] += test(needs[i])
        # fill each replica up to the run's fair share, counting the starts the cut
        # adds; the last takes what is left, and a smaller group can join its bin
        per = max((sum(loads) + sum(test(needs[i]) for i in rest)) / k,
                  (total + start * (k - 1)) / n)
        b = 0
        for i in rest:  # fill replica b up to the share, then the next
            cost = test(needs[i])
            # a test goes where more of it falls within the share: one slow test (a
            # minute, against a second for most) must not push a replica past it
            if chunks[b] and loads[b] + cost / 2 > per and b < k - 1:
                b += 1
            chunks[b].append(i)
            loads[b] += cost
        chunks = [sorted(c) for c in chunks if c]
        for r, c in enumerate(chunks):
            cfgs = [g.servers[0]] + ([s for s in g.servers[1:]] if any(
                needs[i].twin is not None for i in c) else [])
            out.append(Group(tuple(cfgs), tuple(c), _cost(needs, c, cfgs, host),
                             replica=r, replicas=len(chunks)))
    return out


def assign(gs: Sequence[Group], n: int) -> list[list[Group]]:
    """``n`` bins: the costliest server group first, each onto the bin least loaded so
    far (ties: the first test, then the lower bin), so the result depends on nothing
    but the input. A group without servers is split evenly, in run order, over every
    bin. Within a bin, groups in run order (by first test)."""
    if n < 1:
        raise ValueError(f"need at least one bin, got {n}")
    bins: list[list[Group]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for g in sorted((g for g in gs if g.servers), key=lambda g: (-g.cost, g.first)):
        k = min(range(n), key=lambda b: (loads[b], b))
        bins[k].append(g)
        loads[k] += g.cost
    for g in (g for g in gs if not g.servers):
        each, (q, r), at = g.cost / len(g.tests), divmod(len(g.tests), n), 0
        for k in range(n):   # the first r bins one test more
            part, at = g.tests[at:at + q + (k < r)], at + q + (k < r)
            if part:
                bins[k].append(Group((), part, each * len(part)))
    return [sorted(b, key=lambda g: g.first) for b in bins]


def shard(needs: Sequence[_plan.ServerNeed | None], host: _plan.Host, k: int, n: int) -> list[int]:
    """Indices (in run order) of the tests in shard ``k`` of ``n`` (1-based): whole
    groups, no replicas (a replica would start a server on two machines)."""
    if not 1 <= k <= n:
        raise ValueError(f"shard {k} of {n}: expected 1 <= K <= N")
    return sorted(i for g in assign(groups(needs, host), n)[k - 1] for i in g.tests)


def describe(bins: list[list[Group]], needs: Sequence[_plan.ServerNeed | None], host: _plan.Host,
             *, max_starting: int | None = None, max_alive: int | None = None) -> list[str]:
    """Every shard as lines for a terminal: its servers, tests, estimated cost and wall
    time on ``host`` (``harness.run.plan.simulate`` of that shard's own plan)."""
    out = [f"{len(bins)} shards for {host.describe()}:"]
    for k, b in enumerate(bins, 1):
        idx = sorted(i for g in b for i in g.tests)
        own = [needs[i] for i in idx if needs[i] is not None]
        p = _plan.make_plan(own, host, max_starting=max_starting, max_alive=max_alive)
        wall = _plan.simulate(p, *_plan.estimates(host)).wall_seconds if p.servers else (
            _plan.NO_SERVER_TEST_SECONDS * len(idx))
        out.append(f"  shard {k}/{len(bins)}: {len(idx)} tests ({len(idx) - len(own)} without "
                   f"a server) on {len(p.servers)} servers in {sum(1 for g in b if g.servers)} "
                   f"groups; cost {sum(g.cost for g in b):.0f}s, about {wall / 60:.1f} min of "
                   f"wall time")
        out += [f"      {c.describe()}" for g in b for c in g.servers]
    return out


def critical_path(gs: Sequence[Group]) -> Group | None:
    """The costliest server group: no split of the run finishes before it does."""
    with_servers = [g for g in gs if g.servers]
    return max(with_servers, key=lambda g: g.cost) if with_servers else None
