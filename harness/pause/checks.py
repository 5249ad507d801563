"""The checks of /pause, /resume and /is_paused, as functions of a ``ServerClient``.

Every check raises ``PauseCheckFailure`` (an ``AssertionError``) naming what went
wrong, and returns a dict of what it observed, for the report. Every wait is
bounded (see ``driver``). ``ServerClient.pause``/``resume`` confirm each state
change on /is_paused within seconds and name the route that lied
(``harness.vllm.client.PauseStateError``); the checks that study the routes' raw answers
(idempotency, bad input) call them unconfirmed.

What a documented mode does to requests already generating is classified per
request (``harness.pause.fates``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from harness.pause import PauseCheckFailure, failure, fates
from harness.pause.driver import (REQ_SLACK, Rollout, assert_all_returned, greedy, join_all,
                                  start_pair)
from harness.pause.openapi import PauseAPI, PauseStyle
from harness.vllm.client import ServerClient


class NothingCaught(PauseCheckFailure):
    """The pauses fell between requests: the run proved nothing either way (timing on a
    loaded host), so a caller may run it again."""


class MissingFinishReason(PauseCheckFailure):
    """A request came back (cleanly) without any finish_reason."""


def _set_paused_expect(client: ServerClient, expected: bool, when: str) -> None:
    got = client.is_paused()
    if got != expected:
        raise failure(f"/is_paused says {got} {when}; expected {expected}", client)


def check_inflight_under_pause(client: ServerClient, style: PauseStyle, prompt_ids: Sequence[int],
                               *, max_tokens: int = 480, hold_seconds: float = 3.0,
                               settle_seconds: float = 1.0, timeout: float = 120.0,
                               attempts: int = 3, tolerate_empty_abort: bool = False) -> dict:
    """What ``style`` does to a streaming and a non-streaming request already generating.

    Always: /pause answers 2xx; /is_paused is true while paused and false after
    /resume; every request comes back, with a finish reason, within ``timeout`` of
    /resume. For a documented mode: no streamed token arrives later than
    ``settle_seconds`` after /pause returned and before /resume; each request lands
    in the documented class (abort: aborted, wait: drained, keep: frozen); an aborted
    request's tokens are a prefix of the uninterrupted greedy text, a drained or
    frozen one is that text exactly. An attempt whose requests were not generating
    when the pause landed (or where the client cannot tell) proves nothing and is
    repeated, ``attempts`` in all; a class the mode rules out fails at once.
    ``tolerate_empty_abort``: see ``assert_all_returned``.
    """
    if hold_seconds <= settle_seconds:
        raise ValueError("hold_seconds must exceed settle_seconds")
    baseline, base_s = greedy(client, prompt_ids, max_tokens, timeout)
    _set_paused_expect(client, False, "before the check")
    tries: list[dict] = []
    verdict = "ambiguous"
    for attempt in range(1, attempts + 1):
        ns, st = start_pair(client, prompt_ids, max_tokens, timeout)
        t_pause_sent = time.monotonic()
        try:
            answer = style.pause(client, timeout=timeout)
            t_pause_ret = time.monotonic()
            time.sleep(hold_seconds)
            _set_paused_expect(client, True, f"{hold_seconds:.1f}s into the pause ({style})")
        finally:
            t_resume_sent = time.monotonic()
            client.resume(timeout=timeout)
        join_all([ns, st], timeout, f"after /resume ({style})", client, t_pause_sent)
        obs = {"attempt": attempt, "pause_answer": answer,
               "pause_sent_after_s": round(t_pause_sent - ns.sent_at, 3),
               "pause_seconds": round(t_pause_ret - t_pause_sent, 3),
               "stream": fates.summary(st, t_pause_sent, t_pause_ret, settle_seconds, t_resume_sent,
                                  baseline),
               "non_stream": fates.summary(ns, t_pause_sent, t_pause_ret, settle_seconds,
                                      t_resume_sent, baseline)}
        tries.append(obs)
        assert_all_returned([ns, st], f"in-flight requests under /pause ({style})", client,
                            t_pause_sent, tolerate_empty=tolerate_empty_abort)
        if style.expect is None:
            break
        late = obs["stream"]["tokens_while_paused"]
        if late:
            raise failure(f"/pause ({style}): {late} streamed tokens arrived more than "
                          f"{settle_seconds:.1f}s after /pause returned and before /resume: the "
                          f"server kept generating while paused\n  {st.describe(t_pause_sent)}",
                          client)
        readings = {fates.reading(style.expect, r.stream, obs[k]["class"])
                    for k, r in (("stream", st), ("non_stream", ns))}
        verdict = "violation" if "violation" in readings else \
            "ambiguous" if "ambiguous" in readings else "ok"
        if verdict != "ambiguous":
            break
    result = {"style": style.name, "params": dict(style.params), "expected": style.expect,
              "uninterrupted_seconds": round(base_s, 3), "max_tokens": max_tokens,
              "attempts": len(tries), **tries[-1], "tries": tries}
    if style.expect is None:
        return result
    problems = []
    for key in ("stream", "non_stream"):
        s = result[key]
        if s["class"] != style.expect:
            problems.append(f"{key} request: {s['class']} (finish_reason {s['finish_reason']!r}, "
                            f"{s['tokens']} of {max_tokens} tokens, came back "
                            f"{s['done_after_resume_s']:+.2f}s after /resume), expected "
                            f"{style.expect}")
        elif style.expect == "aborted" and s["matches_uninterrupted_prefix"] != s["tokens"]:
            problems.append(f"{key} request: aborted, but its {s['tokens']} tokens are not a "
                            f"prefix of the uninterrupted greedy text (they agree for "
                            f"{s['matches_uninterrupted_prefix']})")
        elif style.expect in ("drained", "frozen") and not s["identical_to_uninterrupted"]:
            problems.append(f"{key} request: {s['class']}, but its text is not the "
                            f"uninterrupted greedy text (same for the first "
                            f"{s['matches_uninterrupted_prefix']} of {max_tokens} tokens)")
    if problems:
        seen = [(t["stream"]["class"], t["non_stream"]["class"], t["pause_sent_after_s"],
                 t["pause_seconds"]) for t in tries]
        why = ("no attempt had its requests generating when the pause landed, as far as the "
               "server's answers show; " if verdict == "ambiguous" else "")
        raise failure(f"/pause ({style}) on requests in flight: {why}{len(tries)} attempt(s), "
                      f"(stream, non-stream, /pause sent s after the requests, /pause seconds) "
                      f"per attempt: {seen}:\n  " + "\n  ".join(problems), client)
    return result


def check_request_waits_for_resume(client: ServerClient, prompt_ids: Sequence[int], *,
                                   style: PauseStyle | None = None, hold_seconds: float = 3.0,
                                   max_tokens: int = 16, timeout: float = 60.0) -> dict:
    """Requests sent while paused neither fail nor complete (nor stream a token) until
    /resume, then complete normally with the uninterrupted greedy text. Returns the
    latencies: after /resume, and added over an uninterrupted request."""
    baseline, base_s = greedy(client, prompt_ids, max_tokens, timeout)
    _set_paused_expect(client, False, "before the check")
    name = style.name if style else "default"
    t_pause = time.monotonic()
    if style is None:
        client.pause(timeout=timeout)
    else:
        style.pause(client, timeout=timeout)
    reqs: list[Rollout] = []
    t_resume = None
    try:
        reqs = [Rollout(prompt_ids, max_tokens, stream=s, timeout=REQ_SLACK * timeout).start(client)
                for s in (False, True)]
        deadline = time.monotonic() + hold_seconds
        while time.monotonic() < deadline and not any(r.done.is_set() for r in reqs):
            time.sleep(0.05)
        early = [r for r in reqs if r.done.is_set() or r.chunks]
        if early:
            raise failure(f"while paused ({name}), requests sent after /pause did not wait for "
                          f"/resume: /pause does not hold new requests\n  "
                          + "\n  ".join(r.describe() for r in early), client)
        _set_paused_expect(client, True, f"{hold_seconds:.1f}s into the pause ({name})")
    finally:
        t_resume = time.monotonic()
        client.resume(timeout=timeout)
    join_all(reqs, timeout, f"requests held by /pause ({name}), after /resume (resume did not "
             "release them)", client)
    assert_all_returned(reqs, f"requests held by /pause ({name})", client)
    for r in reqs:
        if r.finish_reason != "length" or r.token_ids != baseline:
            raise failure(f"a request held by /pause ({name}) came back wrong after /resume: "
                          f"{r.describe()}; expected {max_tokens} tokens, the uninterrupted greedy "
                          f"text (same for the first {fates.common_prefix(r.token_ids, baseline)})",
                          client)
    out = {"style": name, "hold_seconds": hold_seconds, "max_tokens": max_tokens,
           "uninterrupted_seconds": round(base_s, 3),
           "pause_to_resume_s": round(t_resume - t_pause, 3)}
    for r in reqs:
        k = "stream" if r.stream else "non_stream"
        out[f"{k}_after_resume_s"] = round(r.done_at - t_resume, 3)
        out[f"{k}_added_latency_s"] = round((r.done_at - r.sent_at) - base_s, 3)
        if r.stream:
            out["stream_first_token_after_resume_s"] = round(r.chunks[0].at - t_resume, 3)
    return out


def check_abort_reports_finish_reason(client: ServerClient, abort: PauseStyle,
                                      prompt_ids: Sequence[int], *, first: PauseStyle | None = None,
                                      hold_seconds: float = 1.0, max_tokens: int = 8,
                                      timeout: float = 60.0, attempts: int = 3,
                                      answer_seconds: float = 10.0) -> dict:
    """A request aborted before its first token still gets a finish reason.

    Pause (``first``; default: ``abort`` itself), send a streaming and a
    non-streaming request (held: no token yet), then /pause with ``abort``: both must
    come back before /resume, each with a finish reason. A stream that ends with a
    bare ``[DONE]`` raises ``MissingFinishReason``; anything else wrong raises
    ``PauseCheckFailure``.

    vLLM's abort finishes the requests its engine holds; one still on its way there
    (the API server not yet done with it: seen on a GPU beside seven starting
    servers, 1.2 s after it was sent) arrives after the abort and is held until
    /resume, as a request sent while paused should be. So a request unanswered
    ``answer_seconds`` after the abort makes the attempt ambiguous: resume, let it
    finish, and try again holding twice as long. An abort that leaves held requests
    waiting does so in every attempt, and fails."""
    first = first or abort
    late: list[dict] = []
    for attempt in range(attempts):
        hold = hold_seconds * 2 ** attempt
        reqs, stuck = _abort_held(client, abort, first, prompt_ids, hold, max_tokens,
                                  timeout, answer_seconds)
        if not stuck:
            break
        late.append({"hold_seconds": hold, "requests": stuck})
    else:
        raise failure(
            f"requests held by /pause ({first}) had no answer {answer_seconds:g}s after /pause "
            f"({abort}) in each of {attempts} attempts, held {hold_seconds:g}s, doubling, before "
            f"the abort (an abort that leaves held requests waiting until /resume, or "
            f"requests that never reach the engine):\n  "
            + "\n  ".join(f"held {a['hold_seconds']:g}s: " + "; ".join(a["requests"])
                          for a in late), client)
    out = {r.name: {"finish_reason": r.finish_reason, "tokens": len(r.token_ids),
                    "stream_events": len(r.chunks) if r.stream else None,
                    "error": None if r.error is None else str(r.error).splitlines()[0]}
           for r in reqs}
    out["first"], out["abort"] = first.name, abort.name
    out["late_attempts"] = late
    errors = [r for r in reqs if r.error is not None]
    if errors:
        raise failure(f"requests aborted by /pause ({abort}) before their first token failed:\n  "
                      + "\n  ".join(r.describe() for r in errors), client)
    empty = [r for r in reqs if r.empty_without_finish]
    if empty:
        raise failure(
            f"a streaming request held by /pause ({first}) and aborted by /pause ({abort}) "
            f"before its first token got a stream with {len(empty[0].chunks)} events and no "
            f"finish_reason (a bare [DONE]); the non-streaming one got finish_reason "
            f"{next((r.finish_reason for r in reqs if not r.stream), None)!r}. Observed: {out}",
            client, MissingFinishReason)
    missing = [r for r in reqs if r.finish_reason is None]
    if missing:
        raise failure("requests came back without a finish reason:\n  "
                      + "\n  ".join(r.describe() for r in missing), client)
    return out


def _abort_held(client: ServerClient, abort: PauseStyle, first: PauseStyle,
                prompt_ids: Sequence[int], hold: float, max_tokens: int, timeout: float,
                answer_seconds: float) -> tuple[list[Rollout], list[str]]:
    """One attempt of ``check_abort_reports_finish_reason``: (the requests, the story
    of each left unanswered ``answer_seconds`` after the abort, times from the abort).
    Unanswered ones are released by the /resume and waited for: none is left behind."""
    _set_paused_expect(client, False, "before the check")
    reqs: list[Rollout] = []
    stuck: list[str] = []
    try:
        first.pause(client, timeout=timeout)
        reqs = [Rollout(prompt_ids, max_tokens, stream=s, timeout=REQ_SLACK * timeout).start(client)
                for s in (False, True)]
        time.sleep(hold)
        early = [r for r in reqs if r.done.is_set() or r.chunks]
        if early:
            raise failure(f"requests sent while paused ({first}) did not wait:\n  "
                          + "\n  ".join(r.describe() for r in early), client)
        t_abort = time.monotonic()
        abort.pause(client, timeout=timeout)
        deadline = t_abort + answer_seconds
        stuck = [r.describe(t_abort) for r in reqs if not r.wait(deadline - time.monotonic())]
    finally:
        client.resume(timeout=timeout)
    if stuck:
        join_all(reqs, timeout, f"requests held by /pause ({first}), unanswered after /pause "
                 f"({abort}), after /resume", client)
    return reqs, stuck


def check_pause_state_machine(client: ServerClient, styles: Sequence[PauseStyle],
                              prompt_ids: Sequence[int], *, max_tokens: int = 8,
                              timeout: float = 60.0) -> dict:
    """/is_paused at every step of: resume without pause; for each style pause, pause,
    resume, resume; every style's pause in a row, then one resume. Every call 2xx, the
    state as expected after each, and generation unchanged at the end."""
    baseline, _ = greedy(client, prompt_ids, max_tokens, timeout)
    transcript: list[tuple[str, int, bool]] = []

    def step(label: str, route: str, params: dict, expect_paused: bool) -> None:
        try:
            r = client.raw("POST", route, params=params, timeout=timeout)
        except Exception as e:  # requests errors: no answer
            raise failure(f"{label}: no answer: {type(e).__name__}: {e}", client) from None
        paused = client.is_paused()
        transcript.append((label, r.status_code, paused))
        if not 200 <= r.status_code < 300:
            raise failure(f"{label} answered HTTP {r.status_code}: {r.text[:500]}\n"
                          f"steps so far: {transcript}", client)
        if paused != expect_paused:
            raise failure(f"after {label}, /is_paused says {paused}, expected {expect_paused}\n"
                          f"steps so far: {transcript}", client)

    _set_paused_expect(client, False, "before the check")
    step("resume without a pause", "/resume", {}, False)
    for s in styles:
        step(f"pause ({s})", "/pause", dict(s.params), True)
        step(f"pause ({s}) again", "/pause", dict(s.params), True)
        step("resume", "/resume", {}, False)
        step("resume again", "/resume", {}, False)
    for s in styles:
        step(f"pause ({s}) in a row", "/pause", dict(s.params), True)
    step("one resume after them", "/resume", {}, False)
    after = Rollout(prompt_ids, max_tokens, stream=False, timeout=timeout, name="after").run(client)
    if after.token_ids != baseline or after.finish_reason != "length" or after.error:
        raise failure(f"after the pause/resume sequence generation changed: {after.describe()}: "
                      f"{after.token_ids} vs {baseline} before", client)
    return {"steps": [f"{a}: HTTP {c}, paused={p}" for a, c, p in transcript]}


def check_invalid_pause_params(client: ServerClient, api: PauseAPI, *,
                               timeout: float = 60.0) -> dict:
    """An invalid ``mode`` value, or a non-boolean for a boolean parameter, gets a 4xx
    whose body names the parameter, and leaves /is_paused as it was, both unpaused and
    paused. An unknown parameter's fate (ignored or refused) is recorded."""
    bad: list[tuple[str, dict]] = []
    if "mode" in api.params:
        bad.append(("mode", {"mode": "no-such-mode"}))
    bad += [(n, {n: "not-a-boolean"}) for n in api.bool_params]
    if not bad:
        raise failure(f"/pause declares no parameter to misuse: {api.as_dict()}", client)
    seen: dict[str, Any] = {}
    styles = api.styles()
    _set_paused_expect(client, False, "before the check")
    try:
        for paused in (False, True):
            if paused:
                styles[0].pause(client, timeout=timeout)
            for name, q in bad:
                r = client.raw("POST", "/pause", params=q, timeout=timeout)
                state = client.is_paused()
                seen[f"{name}={q[name]} ({'paused' if paused else 'unpaused'})"] = r.status_code
                if not 400 <= r.status_code < 500:
                    raise failure(f"/pause?{name}={q[name]} while {'paused' if paused else 'unpaused'}"
                                  f" answered HTTP {r.status_code}, expected a 4xx: {r.text[:500]}",
                                  client)
                if name not in r.text:
                    raise failure(f"/pause?{name}={q[name]} answered HTTP {r.status_code} without "
                                  f"naming the parameter {name!r}: {r.text[:500]}", client)
                if state != paused:
                    raise failure(f"a refused /pause?{name}={q[name]} changed the state: /is_paused "
                                  f"{state}, was {paused}", client)
    finally:
        client.resume(timeout=timeout)
    # Not a requirement, a fact per version: is an unknown parameter refused or ignored?
    r = client.raw("POST", "/pause", params={"no_such_parameter": "1"}, timeout=timeout)
    unknown = {"status": r.status_code, "paused": client.is_paused()}
    client.resume(timeout=timeout)
    return {"refused": seen, "unknown_parameter": unknown}


def check_weight_update_while_held(client: ServerClient, style: PauseStyle,
                                   prompt_ids: Sequence[int], update: Callable[[], Any], *,
                                   max_tokens: int = 480, queued_max_tokens: int = 64,
                                   timeout: float = 120.0, update_timeout: float = 600.0,
                                   attempts: int = 3, settle_seconds: float = 1.0) -> dict:
    """Requests in flight at /pause and requests sent while paused, then ``update()``
    (a weight update), then /resume. Must hold: every request comes back with a finish
    reason; requests sent while paused come back complete with the NEW weights' greedy
    text (they never ran on the old ones). Recorded, not asserted: what the in-flight
    requests produced (old weights' text, new weights' text, or a mix).

    For a style that freezes requests (keep), the weights are sent only once the
    stream is seen frozen mid-generation (tokens delivered, not finished,
    ``settle_seconds`` into the pause); otherwise the pause is undone and the scenario
    repeated (``attempts`` in all) before the update goes ahead regardless."""
    old, _ = greedy(client, prompt_ids, max_tokens, timeout)
    old_short = old[:queued_max_tokens]
    queued: list[Rollout] = []
    stale: list[Rollout] = []  # requests of attempts that were not in flight: must still return
    frozen_seen = None
    try:
        for attempt in range(1, attempts + 1):
            ns, st = start_pair(client, prompt_ids, max_tokens, timeout)
            t_pause_sent = time.monotonic()
            style.pause(client, timeout=timeout)
            t_pause_ret = time.monotonic()
            if style.expect != "frozen":
                break
            time.sleep(settle_seconds)
            frozen_seen = bool(st.token_ids) and not st.done.is_set()
            if frozen_seen or attempt == attempts:
                break
            client.resume(timeout=timeout)
            stale += [ns, st]
            join_all([ns, st], timeout, f"after /resume ({style}), attempt {attempt}", client)
        queued = [Rollout(prompt_ids, queued_max_tokens, stream=s,
                          timeout=REQ_SLACK * timeout + update_timeout,
                          name=f"queued {'stream' if s else 'non-stream'}").start(client)
                  for s in (False, True)]
        time.sleep(1.0)
        early = [r for r in queued if r.done.is_set() or r.chunks]
        if early:
            raise failure(f"requests sent while paused ({style}) did not wait:\n  "
                          + "\n  ".join(r.describe() for r in early), client)
        t_update = time.monotonic()
        update()
        update_s = time.monotonic() - t_update
        if update_s > update_timeout:
            raise failure(f"the weight update took {update_s:.0f}s > {update_timeout:.0f}s", client)
        _set_paused_expect(client, True, f"after the weight update ({style})")
    finally:
        t_resume_sent = time.monotonic()
        client.resume(timeout=timeout)
    everyone = [ns, st, *queued, *stale]
    join_all(everyone, timeout, f"after the weight update and /resume ({style})", client,
             t_pause_sent)
    assert_all_returned(everyone, f"requests held over a weight update ({style})", client,
                        t_pause_sent)
    new, _ = greedy(client, prompt_ids, max_tokens, timeout)
    new_short, _ = greedy(client, prompt_ids, queued_max_tokens, timeout)

    def relation(ids: list[int], o: list[int], n: list[int]) -> str:
        if ids == n and ids != o:
            return "new weights"
        if ids == o and ids != n:
            return "old weights"
        if ids == o == n:
            return "old = new (the update did not change this text)"
        return (f"mixed: first {fates.common_prefix(ids, o)} tokens as the old weights, first "
                f"{fates.common_prefix(ids, n)} as the new")

    held = {}
    for r in (ns, st):
        s = fates.summary(r, t_pause_sent, t_pause_ret, 0.0, t_resume_sent)
        s["text"] = relation(r.token_ids, old[:len(r.token_ids)], new[:len(r.token_ids)])
        held["stream" if r.stream else "non_stream"] = s
    out = {"style": style.name, "update_seconds": round(update_s, 3), "attempts": attempt,
           "frozen_mid_generation_before_update": frozen_seen,
           "update_changed_greedy": old != new, "in_flight": held,
           "queued": {r.name: relation(r.token_ids, old_short, new_short) for r in queued}}
    wrong = [r for r in queued if r.finish_reason != "length" or r.token_ids != new_short]
    if wrong:
        raise failure(f"requests sent while paused ({style}) must run on the weights sent during "
                      f"the pause, but came back with: "
                      + "; ".join(f"{r.describe()} -> {out['queued'][r.name]}" for r in wrong)
                      + f"\n(in-flight requests: {held})", client)
    return out


def check_every_engine_held_until_resume(client: ServerClient, engines: dict[str, ServerClient],
                                         prompt_ids: Sequence[int], *,
                                         style: PauseStyle | None = None,
                                         hold_seconds: float = 3.0, max_tokens: int = 8,
                                         timeout: float = 60.0) -> dict:
    """A data-parallel server: ``engines`` maps a name to a client pinned to that engine
    (``ServerClient.on_dp_rank``). After one /pause (through ``client``), a request to
    each engine must be held, none served, and /resume must release every one, each
    with that engine's uninterrupted greedy text; every wait is bounded by
    ``timeout``. Returns when each came back after /resume."""
    baseline = {n: greedy(c, prompt_ids, max_tokens, timeout)[0] for n, c in engines.items()}
    _set_paused_expect(client, False, "before the check")
    name = style.name if style else "default"
    if style is None:
        client.pause(timeout=timeout)
    else:
        style.pause(client, timeout=timeout)
    reqs: dict[str, Rollout] = {}
    try:
        reqs = {n: Rollout(prompt_ids, max_tokens, stream=False, timeout=REQ_SLACK * timeout,
                           name=f"engine {n}").start(c) for n, c in engines.items()}
        deadline = time.monotonic() + hold_seconds
        while time.monotonic() < deadline and not any(r.done.is_set() for r in reqs.values()):
            time.sleep(0.05)
        early = [n for n, r in reqs.items() if r.done.is_set()]
        if early:
            raise failure(f"while paused ({name}), data-parallel engine {', '.join(early)} "
                          f"served a request sent after /pause: /pause does not hold every "
                          f"engine\n  " + "\n  ".join(reqs[n].describe() for n in early),
                          client)
        _set_paused_expect(client, True, f"{hold_seconds:.1f}s into the pause ({name})")
    finally:
        t_resume = time.monotonic()
        client.resume(timeout=timeout)
    join_all(list(reqs.values()), timeout, f"requests held by /pause ({name}) on each "
             "data-parallel engine, after /resume (resume did not release every engine)",
             client)
    assert_all_returned(list(reqs.values()), f"requests held by /pause ({name}) on each engine",
                        client)
    wrong = [f"engine {n}: {r.describe()}; expected {baseline[n]}" for n, r in reqs.items()
             if r.token_ids != baseline[n]]
    if wrong:
        raise failure("a request held by /pause came back with other text after /resume:\n  "
                      + "\n  ".join(wrong), client)
    return {"style": name, "engines": sorted(reqs),
            "after_resume_s": {n: round(r.done_at - t_resume, 3) for n, r in reqs.items()}}
