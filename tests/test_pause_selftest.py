"""Self-tests of harness/pause/: every check passes against a well-behaved stand-in
server and fails against one that breaks exactly the behaviour it checks; so do the
/is_paused confirmations of ``ServerClient.pause``/``resume``.

The stand-in (harness/testing/standin.py) is a pure-Python HTTP server on 127.0.0.1; no
vLLM is involved, so these run in seconds and on any machine. Requests go through
the openai SDK, as against a real server.
"""

from __future__ import annotations

import re
import time

import pytest

from harness.pause import PauseCheckFailure
from harness.pause import checks as pc
from harness.pause import concurrency as pconc
from harness.pause.openapi import discover_pause_api, pause_capabilities, read_pause_api
from harness.testing.standin import MISBEHAVIOURS, StandinServer
from harness.vllm.client import STATE_CONFIRM_S, PauseStateError, ServerClient

pytestmark = pytest.mark.selftest

PROMPT = [5, 6, 7, 8, 9]
OTHER_PROMPTS = [PROMPT, [11, 12, 13], [42, 1, 99, 7]]
STEP_S = 0.004      # per token: 300 tokens take ~1.2 s, long against settle_seconds
CONFIRM_S = 2.0     # /is_paused must follow /pause and /resume within this (here)
# Timeouts are generous: on a loaded machine the stand-in itself slows down. Checks
# that must detect a hang get their own short bounds (the *_hang entries below).
INFLIGHT = dict(max_tokens=300, hold_seconds=1.5, settle_seconds=0.6, timeout=10.0, attempts=3)


def _slow_update(standin: StandinServer, seed: int) -> None:
    time.sleep(0.3)  # long enough for clients to send requests while paused
    standin.update_weights(seed)


# check name -> runner(client, api, standin); each returns what the check observed
CHECKS = {
    "inflight_abort": lambda c, api, s: pc.check_inflight_under_pause(c, api.style("abort"), PROMPT,
                                                                      **INFLIGHT),
    "inflight_wait": lambda c, api, s: pc.check_inflight_under_pause(c, api.style("wait"), PROMPT,
                                                                     **INFLIGHT),
    "inflight_keep": lambda c, api, s: pc.check_inflight_under_pause(c, api.style("keep"), PROMPT,
                                                                     **INFLIGHT),
    "waits_for_resume": lambda c, api, s: pc.check_request_waits_for_resume(
        c, PROMPT, hold_seconds=1.0, max_tokens=16, timeout=8.0),
    "waits_for_resume_keep": lambda c, api, s: pc.check_request_waits_for_resume(
        c, PROMPT, style=api.style("keep"), hold_seconds=1.0, max_tokens=16, timeout=8.0),
    "state_machine": lambda c, api, s: pc.check_pause_state_machine(c, api.styles(), PROMPT,
                                                                    timeout=10.0),
    "invalid_params": lambda c, api, s: pc.check_invalid_pause_params(c, api, timeout=10.0),
    "weight_update_keep": lambda c, api, s: pc.check_weight_update_while_held(
        c, api.style("keep"), PROMPT, lambda: _slow_update(s, 7), max_tokens=250,
        queued_max_tokens=32, timeout=10.0, update_timeout=10.0),
    "weight_update_wait": lambda c, api, s: pc.check_weight_update_while_held(
        c, api.style("wait"), PROMPT, lambda: _slow_update(s, 8), max_tokens=250,
        queued_max_tokens=32, timeout=10.0, update_timeout=10.0),
    "concurrency": lambda c, api, s: pconc.check_concurrent_pause_cycles(
        c, OTHER_PROMPTS, api.styles(), lambda i: _slow_update(s, 20 + i), clients=4, cycles=3,
        max_tokens=60, run_seconds=0.3, request_timeout=8.0, settle_timeout=8.0),
    # as the real-server tests run it: a bare [DONE] after an early abort is counted, not failed
    "concurrency_tolerant": lambda c, api, s: pconc.check_concurrent_pause_cycles(
        c, OTHER_PROMPTS, api.styles(), lambda i: _slow_update(s, 20 + i), clients=4, cycles=3,
        max_tokens=60, run_seconds=0.3, request_timeout=8.0, settle_timeout=8.0,
        tolerate_empty_abort=True),
    # For misbehaviours that hang: nothing arrives whatever the bound, so a short one.
    "waits_for_resume_hang": lambda c, api, s: pc.check_request_waits_for_resume(
        c, PROMPT, hold_seconds=1.0, max_tokens=16, timeout=3.0),
    "concurrency_hang": lambda c, api, s: pconc.check_concurrent_pause_cycles(
        c, OTHER_PROMPTS, api.styles(), lambda i: _slow_update(s, 20 + i), clients=4, cycles=3,
        max_tokens=60, run_seconds=0.3, request_timeout=8.0, settle_timeout=3.0,
        tolerate_empty_abort=True),
    # two data-parallel engines, each addressed on its own (X-data-parallel-rank)
    "every_engine_held": lambda c, api, s: pc.check_every_engine_held_until_resume(
        c, {"dp0": c.on_dp_rank(0), "dp1": c.on_dp_rank(1)}, PROMPT, style=api.style("keep"),
        hold_seconds=1.0, max_tokens=16, timeout=8.0),
    "every_engine_held_hang": lambda c, api, s: pc.check_every_engine_held_until_resume(
        c, {"dp0": c.on_dp_rank(0), "dp1": c.on_dp_rank(1)}, PROMPT, style=api.style("keep"),
        hold_seconds=1.0, max_tokens=16, timeout=3.0),
    "abort_reports_finish": lambda c, api, s: pc.check_abort_reports_finish_reason(
        c, api.style("abort"), PROMPT, first=api.style("keep"), hold_seconds=0.5, timeout=10.0,
        answer_seconds=2.0),
}

# misbehaviour -> (check that must catch it, what its failure must say); a check
# failure is a PauseCheckFailure, a route that lied about the state a PauseStateError
LIED = "returned 200 but /is_paused still says"
BROKEN = [
    ("pause_ignores_new", "waits_for_resume", "did not wait for /resume"),
    ("pause_ignores_new", "waits_for_resume_keep", "did not wait for /resume"),
    ("pause_ignores_new", "weight_update_keep", "did not wait"),
    ("resume_never_releases", "waits_for_resume_hang", "resume did not release them"),
    ("resume_never_releases", "concurrency_hang", "resume did not release generation"),
    ("pause_spares_dp1", "every_engine_held", r"data-parallel engine dp1 served a request"),
    ("pause_ignores_new", "every_engine_held", r"data-parallel engine dp\d.* served a request"),
    ("resume_never_releases", "every_engine_held_hang", "resume did not release every engine"),
    ("keep_aborts", "inflight_keep", r"aborted .*expected frozen"),
    ("keep_ignored", "inflight_keep", r"kept generating while paused|drained .*expected frozen"),
    ("keep_loses_history", "inflight_keep", "not the uninterrupted greedy text"),
    ("wait_aborts", "inflight_wait", r"aborted .*expected drained"),
    ("wait_returns_early", "inflight_wait", "kept generating while paused"),
    ("abort_ignored", "inflight_abort", r"drained .*expected aborted"),
    ("is_paused_lies", "state_machine", "/is_paused says False"),
    ("is_paused_lies", "waits_for_resume", f"^/pause {LIED} false"),
    ("pause_does_nothing", "waits_for_resume", f"^/pause {LIED} false after {CONFIRM_S:g}s"),
    ("pause_does_nothing", "inflight_keep", f"^/pause {LIED} false"),
    ("pause_does_nothing", "weight_update_wait", f"^/pause {LIED} false"),
    ("pause_does_nothing", "state_machine", r"after pause \(abort\), /is_paused says False"),
    ("resume_does_nothing", "waits_for_resume", f"^/resume {LIED} true after {CONFIRM_S:g}s"),
    ("resume_does_nothing", "inflight_abort", f"^/resume {LIED} true"),
    ("resume_does_nothing", "concurrency", f"^/resume {LIED} true"),
    ("resume_does_nothing", "state_machine", r"after resume, /is_paused says True"),
    ("double_pause_errors", "state_machine", r"again answered HTTP 409"),
    ("resume_unpaused_errors", "state_machine", r"resume without a pause answered HTTP 500"),
    ("invalid_mode_accepted", "invalid_params", "expected a 4xx"),
    ("invalid_mode_unnamed", "invalid_params", "without naming the parameter 'mode'"),
    ("drops_held_on_resume", "waits_for_resume", "failed or came back without a finish reason"),
    ("drops_held_on_resume", "concurrency", "failed or came back without a finish reason"),
    # the tolerance for vLLM's bare [DONE] does not hide a cut-off stream or a hang
    ("drops_held_on_resume", "concurrency_tolerant", "failed or came back without a finish reason"),
    ("abort_drops_stream_finish", "abort_reports_finish", r"no finish_reason \(a bare \[DONE\]\)"),
    ("abort_spares_held", "abort_reports_finish", r"no answer 2s after /pause \(abort\) in each of 3"),
    ("queued_use_old_weights", "weight_update_keep", "must run on the weights sent during the pause"),
    ("queued_use_old_weights", "weight_update_wait", "must run on the weights sent during the pause"),
]


def _client(s: StandinServer, **kw) -> ServerClient:
    return ServerClient(s.url, **{"timeout": 10.0, "context": s.describe,
                                  "confirm_timeout": CONFIRM_S, **kw})


def _run(check: str, misbehave: set[str], **standin_kw):
    with StandinServer(misbehave=misbehave, step_s=STEP_S, **standin_kw) as s:
        c = _client(s)
        return CHECKS[check](c, discover_pause_api(c), s)


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_check_passes_on_a_correct_standin(check):
    """Without this, a failure below could be the check's own fault."""
    _run(check, set())


@pytest.mark.parametrize("misbehaviour,check,message", BROKEN,
                         ids=[f"{m}-{c}" for m, c, _ in BROKEN])
def test_check_fails_on_a_broken_standin(misbehaviour, check, message):
    expected = PauseStateError if LIED in message else PauseCheckFailure
    with pytest.raises(expected, match=message) as e:
        _run(check, {misbehaviour})
    assert "stand-in at http://127.0.0.1" in str(e.value), "the failure lacks the server context"


def test_requests_go_through_the_openai_sdk_sync_and_async():
    """What SDK users see is what the checks see: the in-flight requests through
    ``openai.OpenAI``, the concurrent rollouts through ``openai.AsyncOpenAI``; vLLM's
    token ids only because the driver asks for them (``extra_body``)."""
    with StandinServer(step_s=STEP_S) as s:
        c = _client(s)
        api = discover_pause_api(c)
        CHECKS["inflight_keep"](c, api, s)
        CHECKS["concurrency"](c, api, s)
        kinds = {ua.split("/")[0] for ua in s.user_agents}
    assert kinds == {"OpenAI", "AsyncOpenAI"}, s.user_agents


def test_every_misbehaviour_is_caught():
    assert {m for m, _, _ in BROKEN} == set(MISBEHAVIOURS)


def test_missing_finish_reason_is_told_apart():
    """The real-server test turns exactly this failure into an xfail (a known vLLM
    defect); any other failure of the check must stay a failure."""
    with pytest.raises(pc.MissingFinishReason):
        _run("abort_reports_finish", {"abort_drops_stream_finish"})
    with pytest.raises(PauseCheckFailure) as e:
        _run("abort_reports_finish", {"pause_ignores_new"})
    assert not isinstance(e.value, pc.MissingFinishReason)


def test_a_request_that_reaches_the_engine_after_the_abort_is_tried_again():
    """A loaded API server hands a request to the engine after the abort (seen on
    1 x H200: the check hung 120 s, then failed): the attempt is ambiguous, not a
    defect, and the check tries again holding longer. The stand-in delays each
    request 0.8 s: the first attempt (held 0.5 s) is late, the second (1 s) passes."""
    with StandinServer(step_s=STEP_S, arrival_delay_s=0.8) as s:
        c = _client(s)
        obs = CHECKS["abort_reports_finish"](c, discover_pause_api(c), s)
    assert [a["hold_seconds"] for a in obs["late_attempts"]] == [0.5], obs
    assert {obs[n]["finish_reason"] for n in ("stream", "non-stream")} == {"abort"}, obs


def test_undocumented_behaviour_is_recorded_not_judged():
    """A mode the harness does not know: observed, classified, no verdict."""
    with StandinServer(step_s=STEP_S, modes=("abort", "wait", "keep", "sometime")) as s:
        c = _client(s)
        api = discover_pause_api(c)
        sometime = api.style("sometime")
        assert sometime is not None and sometime.expect is None
        obs = pc.check_inflight_under_pause(c, sometime, PROMPT, **{**INFLIGHT, "attempts": 1})
        assert obs["expected"] is None and obs["stream"]["class"]


def test_legacy_pause_flags_discovered():
    """Older vLLM: no ``mode``; ``wait_for_inflight_requests=true`` asks for a drain."""
    with StandinServer(step_s=STEP_S, modes=(), legacy_wait_flag=True) as s:
        c = _client(s)
        api = discover_pause_api(c)
        assert [x.name for x in api.styles()] == ["default", "wait_for_inflight_requests"]
        assert set(api.bool_params) == {"wait_for_inflight_requests", "clear_cache"}
        obs = pc.check_inflight_under_pause(c, api.style("wait_for_inflight_requests"), PROMPT,
                                            **INFLIGHT)
        assert obs["stream"]["class"] == "drained"
        pc.check_invalid_pause_params(c, api, timeout=10.0)


def test_discovery_reads_refs_and_anyof():
    """FastAPI writes an enum inline, through $ref (a default may sit next to it), or
    in anyOf (Optional[...]); the run report's capability probe reads the same."""
    spec = {"paths": {"/resume": {}, "/is_paused": {}, "/pause": {"post": {"parameters": [
        {"name": "mode", "in": "query", "schema": {"anyOf": [
            {"$ref": "#/components/schemas/PauseMode"}, {"type": "null"}], "default": "abort"}},
        {"name": "clear_cache", "in": "query", "schema": {"anyOf": [{"type": "boolean"},
                                                                    {"type": "null"}]}},
    ]}}}, "components": {"schemas": {"PauseMode": {"enum": ["abort", "wait", "keep"],
                                                   "type": "string"}}}}
    api = read_pause_api(spec)
    assert api.modes == ["abort", "wait", "keep"] and api.default_mode == "abort"
    assert api.bool_params == ["clear_cache"]
    assert pause_capabilities(spec) == {"route": True, "modes": api.modes, "default": "abort",
                                        "params": ["clear_cache", "mode"]}
    mode = spec["paths"]["/pause"]["post"]["parameters"][0]
    mode["schema"] = {"$ref": "#/components/schemas/PauseMode", "default": "keep"}
    assert read_pause_api(spec).default_mode == "keep"
    with pytest.raises(PauseCheckFailure, match="not in the server's /openapi.json"):
        read_pause_api({"paths": {"/pause": {}}})
    assert pause_capabilities({"paths": {"/pause": {}}})["route"] is False


# ----------------------------------------------------------------------------- confirmations

def test_pause_and_resume_are_confirmed_on_is_paused():
    """On a correct server each call returns once /is_paused agrees; ``confirm=False``
    sends the route alone (for tests of its raw answer)."""
    with StandinServer(step_s=STEP_S) as s:
        c = _client(s)
        c.pause(mode="keep")
        assert s.pause_mode == "keep" and s.counts["/is_paused"] == 1
        c.resume()
        assert s.pause_mode is None and s.counts["/is_paused"] == 2
        c.pause(mode="abort", confirm=False)
        c.resume(confirm=False)
        assert s.counts["/is_paused"] == 2


@pytest.mark.parametrize("misbehaviour,route,still", [("resume_does_nothing", "/resume", "true"),
                                                      ("pause_does_nothing", "/pause", "false")])
def test_a_route_that_lies_is_named_within_seconds(misbehaviour, route, still):
    """Issue 12 item 7. A build of vLLM whose /resume did nothing was caught only as
    "/v1/completions: no answer within 300s", five minutes later. With the request
    bounds of a real run (300 s), the check now fails within the confirmation bound
    (10 s) and names the route that lied."""
    with StandinServer(misbehave={misbehaviour}, step_s=STEP_S) as s:
        c = ServerClient(s.url, timeout=300.0, context=s.describe)
        t = time.monotonic()
        with pytest.raises(PauseStateError) as e:
            pc.check_request_waits_for_resume(c, PROMPT, hold_seconds=1.0, max_tokens=16,
                                              timeout=300.0)
        took = time.monotonic() - t
    assert re.match(f"{re.escape(route)} returned 200 but /is_paused still says {still} after "
                    f"{STATE_CONFIRM_S:g}s", str(e.value)), str(e.value)
    assert e.value.route == route and "no answer within" not in str(e.value)
    assert STATE_CONFIRM_S <= took < STATE_CONFIRM_S + 15, took


def test_unconfirmed_calls_leave_the_lie_to_the_caller():
    with StandinServer(misbehave={"resume_does_nothing"}, step_s=STEP_S) as s:
        c = _client(s)
        c.pause(mode="abort")
        c.resume(confirm=False)
        assert c.is_paused()
