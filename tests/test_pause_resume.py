"""Issue 5: /pause, /resume and /is_paused against a real vLLM server.

Pause modes are discovered from the server's /openapi.json, never assumed; each
check lives in harness/pause/checks.py, where the self-tests
(tests/test_pause_selftest.py) also run it against a misbehaving stand-in. Requests
go through the official openai SDK (harness/pause/driver.py), as RL frameworks send
them; every /pause and /resume is confirmed on /is_paused within seconds.
What differs between vLLM versions is recorded (``harness.record``), and asserted
only where it is a documented contract or must hold on every version.
"""

from __future__ import annotations

import pytest

from harness.oracles import parity
from harness.pause import admission
from harness.pause import checks as pc
from harness.pause import concurrency as pconc
from harness.pause.openapi import PauseAPI, PauseStyle, discover_pause_api

pytestmark = pytest.mark.pause_resume

# Documented ways to call /pause, on some vLLM version or other; a test for a style
# the installed server does not offer is skipped with the styles it does offer.
KNOWN_STYLES = ("abort", "wait", "keep", "wait_for_inflight_requests")
# A prompt longer than a CPU KV block (128 tokens; 16 on GPU), so that a prefix
# computed on the old weights could be reused from the prefix cache after an update.
LONG_PROMPT = " ".join(["The capital of France is Paris, and the quick brown fox jumps over it."] * 12)

REQUEST_TIMEOUT = 120.0


# ----------------------------------------------------------------------------- helpers

_APIS: dict[str, PauseAPI] = {}


def pause_api(session) -> PauseAPI:
    api = _APIS.get(session.server.url)
    if api is None:
        api = _APIS[session.server.url] = discover_pause_api(session.client)
    return api


def style_or_skip(session, name: str) -> PauseStyle:
    api = pause_api(session)
    s = api.style(name)
    if s is None:
        pytest.skip(f"/pause on vLLM {session.server.version} does not offer {name!r} "
                    f"(it offers {[x.name for x in api.styles()]})")
    return s


def with_real_weights(session) -> None:
    """Greedy text is compared token for token; dummy weights give near-uniform
    logits whose argmax numerics may flip. Load the zoo model's weights unless held."""
    session.ensure_holds()


def short_prompt(session) -> list[int]:
    return session.reference().prompts[0].prompt_ids


def long_max_tokens(session, prompt: list[int]) -> int:
    """As long as the context allows: a request must still be generating when /pause lands."""
    return min(480, session.server_cfg.max_model_len - len(prompt) - 8)


def assert_completion_matches(session, ref) -> dict:
    """Each prompt's greedy completion (which, unlike prompt_logprobs, may read the
    prefix cache) against the reference: ids, and logprobs within the dtype's tolerance
    up to the first divergence at a reference near-tie."""
    tol = parity.tolerance_for(ref.dtype).max_abs_logprob
    worst = 0.0
    for pr in ref.prompts:
        c = session.client.complete(pr.prompt_ids, max_tokens=len(pr.greedy_ids), logprobs=1,
                                    timeout=REQUEST_TIMEOUT)
        for j, (got, exp) in enumerate(zip(c.token_ids, pr.greedy_ids)):
            expected = pr.token_logprobs[len(pr.prompt_ids) + j]
            d = abs(c.logprobs[j] - expected)
            worst = max(worst, d)
            assert d <= tol, (
                f"{len(pr.prompt_ids)}-token prompt {pr.prompt[:40]!r}...: generated token {j}: "
                f"vllm logprob {c.logprobs[j]:.7g}, reference {expected:.7g} (|Δ| {d:.3g} > {tol:.3g}); "
                "the completion is not computed with the weights last sent (a stale prefix "
                "cache?)")
            if got != exp:
                top = sorted(pr.top_logprobs[len(pr.prompt_ids) + j].values(), reverse=True)
                assert top[0] - top[1] < 2 * tol, (
                    f"greedy diverges at generated token {j}: vllm {got} vs reference {exp}")
                break
    return {"completion_max_abs_dlogprob": worst}


# ------------------------------------------------------------------ 1. discovery

def test_pause_api_discovered(session):
    api = pause_api(session)
    session.record(vllm_version=session.server.version, pause_api=api.as_dict())
    assert api.styles(), f"/pause offers no way to pause: {api.as_dict()}"
    undocumented = [s.name for s in api.styles() if s.expect is None]
    session.record(undocumented_pause_styles=undocumented)


# ------------------------------------------------------------------ 1. in flight

@pytest.mark.parametrize("style_name", KNOWN_STYLES)
def test_inflight_requests_under_pause(session, style_name):
    style = style_or_skip(session, style_name)
    with_real_weights(session)
    prompt = short_prompt(session)
    # A stream aborted before its first token gets a bare [DONE] from vLLM (pinned by
    # test_abort_of_a_held_request_reports_a_finish_reason): here it only means the
    # request was not yet generating, so the attempt is repeated. So is an attempt whose
    # pause missed the requests: 480 tokens take ~2.5 s on 2 idle CPU cores (20-60 s in a
    # CI run, beside the other tests), and a stream can reach the engine late, or the
    # pause leave late. Under load, 2-3 of 6 single attempts were ambiguous with the old
    # plain-HTTP client and 3-5 with the SDK (more client CPU per streamed event). A
    # violation fails at once; 5 ambiguous attempts fail too.
    obs = pc.check_inflight_under_pause(session.client, style, prompt,
                                        max_tokens=long_max_tokens(session, prompt),
                                        hold_seconds=3.0, settle_seconds=1.0, attempts=5,
                                        timeout=REQUEST_TIMEOUT, tolerate_empty_abort=True)
    session.record(**{f"pause_{style_name}_inflight": obs,
                      f"pause_{style_name}_stream_class": obs["stream"]["class"],
                      f"pause_{style_name}_nonstream_class": obs["non_stream"]["class"],
                      f"pause_{style_name}_finish_reasons": [obs["stream"]["finish_reason"],
                                                            obs["non_stream"]["finish_reason"]],
                      f"pause_{style_name}_seconds": obs["pause_seconds"],
                      f"pause_{style_name}_attempts": obs["attempts"]})


def test_abort_of_a_held_request_reports_a_finish_reason(session):
    """Every request comes back with a finish reason, also one aborted before its
    first token (held by a pause, then /pause?mode=abort)."""
    abort = style_or_skip(session, "abort")
    first = pause_api(session).style("keep") or abort
    # Known issue stream-abort-before-first-token-no-finish-reason (known_issues.toml):
    # strict xfail on affected versions, so a fix shows up as "remove this entry".
    obs = pc.check_abort_reports_finish_reason(session.client, abort, short_prompt(session),
                                               first=first, timeout=REQUEST_TIMEOUT)
    session.record(abort_before_first_token=obs,
                   abort_before_first_token_stream_finish_reason=obs["stream"]["finish_reason"])


def test_inflight_requests_under_undocumented_modes(session):
    """A mode this harness does not know yet: observed and recorded, not judged."""
    styles = [s for s in pause_api(session).styles() if s.expect is None]
    if not styles:
        pytest.skip(f"every /pause mode of vLLM {session.server.version} is documented here")
    with_real_weights(session)
    prompt = short_prompt(session)
    for s in styles:
        obs = pc.check_inflight_under_pause(session.client, s, prompt,
                                            max_tokens=long_max_tokens(session, prompt),
                                            timeout=REQUEST_TIMEOUT, attempts=1,
                                            tolerate_empty_abort=True)
        session.record(**{f"pause_{s.name}_inflight": obs})


# ------------------------------------------------------------------ 2. arriving while paused

@pytest.mark.parametrize("style_name", KNOWN_STYLES)
def test_requests_sent_while_paused_wait_for_resume(session, style_name):
    style = style_or_skip(session, style_name)
    with_real_weights(session)
    if admission.while_paused(session.server.version, style_name) == "refuse":  # vLLM 0.33+
        obs = admission.check_request_refused_while_paused(
            session.client, short_prompt(session), style=style, timeout=REQUEST_TIMEOUT)
        session.record(**{f"pause_{style_name}_refused_request": obs})
        return
    obs = pc.check_request_waits_for_resume(session.client, short_prompt(session), style=style,
                                            hold_seconds=3.0, max_tokens=16,
                                            timeout=REQUEST_TIMEOUT)
    session.record(**{f"pause_{style_name}_held_request": obs,
                      f"pause_{style_name}_added_latency_s": obs["non_stream_added_latency_s"],
                      f"pause_{style_name}_after_resume_s": obs["non_stream_after_resume_s"]})


# ------------------------------------------------------------------ 3. state, idempotency, misuse

def test_pause_resume_idempotent(session):
    api = pause_api(session)
    obs = pc.check_pause_state_machine(session.client, api.styles(), short_prompt(session),
                                       timeout=REQUEST_TIMEOUT)
    session.record(pause_state_machine=obs["steps"])


def test_invalid_pause_parameters_refused(session):
    obs = pc.check_invalid_pause_params(session.client, pause_api(session),
                                        timeout=REQUEST_TIMEOUT)
    # vLLM 0.32 ignores unknown query parameters (and pauses); recorded per version.
    session.record(pause_invalid_params=obs, pause_unknown_param=obs["unknown_parameter"])


# ------------------------------------------------------------------ 4. weight update while held

@pytest.mark.parametrize("style_name,seed", [pytest.param("keep", 11, id="keep"),
                                             pytest.param("wait", 12, id="wait")])
@pytest.mark.trainers("harness", "vllm", "user")  # vLLM's code too (-via-vllm), and yours
def test_weight_update_while_requests_held(session, style_name, seed):
    style = style_or_skip(session, style_name)
    with_real_weights(session)
    prompt = short_prompt(session)
    weights = session.perturbed(seed)
    ref_new = session.reference(weights)
    ref_long = session.reference(weights, prompts=(LONG_PROMPT,))
    long_ids = ref_long.prompts[0].prompt_ids
    assert 128 < len(long_ids) < session.server_cfg.max_model_len - 16, len(long_ids)
    # On the old weights, so a prefix cache would hold the long prompt's first block.
    session.client.complete(long_ids, max_tokens=4, timeout=REQUEST_TIMEOUT)

    obs = pc.check_weight_update_while_held(
        session.client, style, prompt, lambda: session.sync(weights, pause=False),
        max_tokens=long_max_tokens(session, prompt), queued_max_tokens=32,
        timeout=REQUEST_TIMEOUT, update_timeout=session.sync_timeout)
    session.record(**{f"update_under_{style_name}": obs,
                      f"update_under_{style_name}_inflight_text":
                          {k: v["text"] for k, v in obs["in_flight"].items()}})

    # New requests use the new weights: teacher-forced and greedy parity, and the
    # completion path (which may read the prefix cache) on the long prompt.
    r = session.compare(ref_new)
    session.record(**r.metrics())
    parity.assert_greedy_equal(r)
    parity.assert_logprobs_close(r, decode=session.decode)
    session.record(**assert_completion_matches(session, ref_long))


# ------------------------------------------------------------------ 5. concurrency

def test_concurrent_streams_through_pause_sync_resume_cycles(session):
    api = pause_api(session)
    styles = [s for s in api.styles() if s.expect is not None] or api.styles()
    seeds = [21, 22, 23]
    weights = [session.perturbed(s) for s in seeds]
    prompts = [p.prompt_ids for p in session.reference().prompts]
    # On a loaded 2-core host the clients can lag so far behind the server that every
    # pause falls between requests; such a run proves nothing, so it is run again (up to
    # 3 times). Any other failure is final.
    for attempt in range(3):
        try:
            obs = pconc.check_concurrent_pause_cycles(
                session.client, prompts, styles, lambda i: session.sync(weights[i], pause=False),
                clients=4, cycles=len(seeds), max_tokens=400, run_seconds=1.0,
                request_timeout=max(REQUEST_TIMEOUT, session.sync_timeout + 60),
                tolerate_empty_abort=True)  # see test_abort_of_a_held_request_reports_a_finish_reason
            break
        except pc.NothingCaught:
            if attempt == 2:
                raise
    session.record(pause_cycles_attempts=attempt + 1)
    session.record(pause_cycles=obs, pause_cycles_finish_reasons=obs["finish_reasons"],
                   pause_cycles_empty_streams=obs["empty_streams_without_finish_reason"])
    # After the last cycle the server serves the last weights sent.
    r = session.compare(session.reference(weights[-1]))
    parity.assert_greedy_equal(r)
    parity.assert_logprobs_close(r, decode=session.decode)
