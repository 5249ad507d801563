"""One selection cut into parts that keep whole servers: the shards of
``--harness-shard K/N`` (one GPU machine each), and the same cut for the workers of
one run.

A server start costs 40-90 s, a test on a warm server a few seconds, so a part must
never hold half of a server's tests: both halves would start it. The unit of the cut
is therefore a ``Group``: a connected set of servers (a dummy server and the
disk-loaded twin it is compared with, which the other variants of its engine share)
and every test on them. Groups are dealt to the parts longest first, each to the
least loaded part, by the plan's own cost estimate (``harness.plan.estimates``). The
tests that need no server are one group that may be split: they cost a fraction of a
second each and go evenly to every part.

Pure: no pytest, nothing started; the plugin and ``--harness-plan`` call it with the
needs in run order (``harness.plan.order_key``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import plan
from .server import ServerConfig


@dataclass(frozen=True)
class Group:
    """A connected set of servers (a dummy server and its twins) and the tests on them."""

    servers: tuple[ServerConfig, ...]   # in order of first use; () for tests with no server
    tests: tuple[int, ...]              # indices into the needs list, in run order
    cost: float                         # estimated seconds: each server's start + its tests


def groups(needs: list[plan.Need | None], host: plan.Host) -> list[Group]:
    """The groups of ``needs`` (None: a test that needs no server), by first test.

    Union-find over servers: a need links its server and its twin. The tests with no
    server form one group with ``servers=()``."""
    start_seconds, test_seconds = plan.estimates(host)
    parent: dict[ServerConfig, ServerConfig] = {}

    def root(c: ServerConfig) -> ServerConfig:
        parent.setdefault(c, c)
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    for need in needs:
        if need is not None:
            a, b = root(need.server), root(need.twin or need.server)
            if a != b:
                parent[b] = a
    servers: dict[ServerConfig, list[ServerConfig]] = {}   # root -> servers, first use first
    tests: dict[ServerConfig | None, list[int]] = {}        # root (None: no server) -> tests
    seen: set[ServerConfig] = set()
    for i, need in enumerate(needs):
        r = None if need is None else root(need.server)
        tests.setdefault(r, []).append(i)
        for c in () if need is None else need.servers:
            if c not in seen:
                seen.add(c)
                servers.setdefault(r, []).append(c)
    out = []
    for r, idx in tests.items():
        if r is None:
            cost = plan.NO_SERVER_TEST_SECONDS * len(idx)
        else:
            cost = (start_seconds(1) * len(servers[r])
                    + sum(test_seconds(needs[i]) for i in idx))
        out.append(Group(tuple(servers.get(r, ())), tuple(idx), cost))
    return sorted(out, key=lambda g: g.tests[0])


def assign(groups: list[Group], n: int) -> list[list[Group]]:
    """``groups`` dealt to ``n`` bins: longest processing time first (the largest cost to
    the least loaded bin; ties by first test index, then by the lower bin), so the result
    depends on nothing but the input. The group without servers is split evenly (in run
    order) over every bin, so no bin is without work while there is work. Each bin's
    groups are in run order."""
    if n < 1:
        raise ValueError(f"need at least one bin, got {n}")
    bins: list[list[Group]] = [[] for _ in range(n)]
    load = [0.0] * n
    for g in sorted((g for g in groups if g.servers), key=lambda g: (-g.cost, g.tests[0])):
        k = min(range(n), key=lambda b: (load[b], b))
        bins[k].append(g)
        load[k] += g.cost
    for g in (g for g in groups if not g.servers):
        each, (q, r), at = g.cost / len(g.tests), divmod(len(g.tests), n), 0
        for k in range(n):   # the first r bins one test more
            part, at = g.tests[at:at + q + (k < r)], at + q + (k < r)
            if part:
                bins[k].append(Group((), part, each * len(part)))
    return [sorted(b, key=lambda g: g.tests[0]) for b in bins]


def shard(needs: list[plan.Need | None], host: plan.Host, k: int, n: int) -> list[int]:
    """Indices (in run order) of the tests in shard ``k`` of ``n`` (1-based)."""
    if not 1 <= k <= n:
        raise ValueError(f"shard {k} of {n}: expected 1 <= K <= N")
    return sorted(i for g in assign(groups(needs, host), n)[k - 1] for i in g.tests)


def describe(bins: list[list[Group]], needs: list[plan.Need | None], host: plan.Host, *,
             max_starting: int | None = None, max_alive: int | None = None) -> list[str]:
    """Every bin as lines for a terminal: its servers, tests, estimated cost and wall
    time on ``host`` (``harness.plan.simulate`` of that bin's own plan)."""
    out = [f"{len(bins)} shards for {host.describe()}:"]
    for k, b in enumerate(bins, 1):
        idx = sorted(i for g in b for i in g.tests)
        own = [needs[i] for i in idx if needs[i] is not None]
        p = plan.make_plan(own, host, max_starting=max_starting, max_alive=max_alive)
        wall = plan.simulate(p, *plan.estimates(host)).wall_seconds if p.servers else (
            plan.NO_SERVER_TEST_SECONDS * len(idx))
        out.append(f"  shard {k}/{len(bins)}: {len(idx)} tests ({len(idx) - len(own)} without "
                   f"a server) on {len(p.servers)} servers in {sum(1 for g in b if g.servers)} "
                   f"groups; cost {sum(g.cost for g in b):.0f}s, about {wall / 60:.1f} min of "
                   f"wall time")
        out += [f"      {c.describe()}" for g in b for c in g.servers]
    return out
