"""A request's fate over one pause, and how it reads under a documented mode.

What a documented mode does to requests already generating is classified per
request:

- ``aborted``: came back before ``/resume`` with a finish reason other than
  ``length`` and fewer tokens than asked (vLLM: ``abort``);
- ``drained``: came back before ``/resume``, complete (``length``, all tokens);
- ``frozen``: produced nothing while paused, then continued after ``/resume``
  and came back complete;
- ``finished-before-pause``, ``aborted-unstarted`` (aborted with no token),
  ``held-unstarted`` (streamed nothing before /resume): it was not generating when
  the pause landed, which proves nothing about the mode (the scenario is retried);
- ``empty-no-finish``: a stream that ended with no token and no finish_reason (a
  bare ``[DONE]``: vLLM's answer to an abort before the first token; see
  ``check_abort_reports_finish_reason``); a failure unless explicitly tolerated;
- ``other`` / ``error`` / ``no-finish``: anything else.

Whether a request was in flight is decided from the server's answers, not from
when the client saw a token: on a loaded machine a whole stream can arrive in one
burst after generation ended. An abort with at least one token, or a stream with
tokens before the pause and after /resume, was in flight.
"""

from __future__ import annotations

from typing import Sequence

from harness.pause.driver import Rollout


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def classify(r: Rollout, t_pause_sent: float, t_resume_sent: float) -> str:
    """The request's fate over one pause (see the module docstring). Classes ending in
    ``-unstarted`` or ``finished-before-pause`` mean it was not generating when the
    pause landed, as far as the server's own answers show."""
    if r.error is not None:
        return "error"
    if r.finish_reason is None:
        return "empty-no-finish" if r.empty_without_finish else "no-finish"
    n, complete = len(r.token_ids), r.finish_reason == "length" and len(r.token_ids) == r.max_tokens
    if r.stream and r.tokens_before(t_pause_sent) >= r.max_tokens:
        return "finished-before-pause"
    if r.done_at is not None and r.done_at <= t_pause_sent:
        return "finished-before-pause"
    if r.done_at is not None and r.done_at < t_resume_sent:
        if complete:
            return "drained"
        if r.finish_reason != "length" and n < r.max_tokens:
            return "aborted" if n else "aborted-unstarted"
        return "other"
    if complete:
        if not r.stream:
            return "frozen"
        if not r.tokens_before(t_resume_sent):
            return "held-unstarted"  # nothing before the pause: it had not started
        if r.tokens_between(t_resume_sent):
            return "frozen"
    return "other"


def summary(r: Rollout, t_pause_sent: float, t_pause_ret: float, settle: float,
             t_resume_sent: float, baseline: Sequence[int] | None = None) -> dict:
    ids = r.token_ids
    d = {"class": classify(r, t_pause_sent, t_resume_sent), "finish_reason": r.finish_reason,
         "tokens": len(ids), "error": None if r.error is None else str(r.error).splitlines()[0],
         "done_after_resume_s": None if r.done_at is None else round(r.done_at - t_resume_sent, 3)}
    if r.stream:
        d.update(tokens_before_pause=r.tokens_before(t_pause_sent),
                 tokens_while_paused=r.tokens_between(t_pause_ret + settle, t_resume_sent),
                 tokens_after_resume=r.tokens_between(t_resume_sent))
    if baseline is not None:
        d["matches_uninterrupted_prefix"] = common_prefix(ids, baseline)
        d["identical_to_uninterrupted"] = list(ids) == list(baseline)
    return d



# Per documented class, how a request's observed class reads: "ok" (the mode did what
# it says), "ambiguous" (the request was not generating when the pause landed, or the
# client cannot tell: try again), anything else is a violation. A stream's aborted or
# frozen class proves it was in flight; a non-streaming request shows less: under
# abort, "frozen" may be one that reached the server after /pause (held, then run);
# under wait, likewise; under keep, "drained" may have finished before /pause landed.
def _readings(expect: str, stream: bool) -> dict[str, str]:
    r = {"finished-before-pause": "ambiguous", "held-unstarted": "ambiguous", expect: "ok"}
    if expect == "aborted":
        r["aborted-unstarted"] = "ambiguous"  # aborted before its first token
        r["empty-no-finish"] = "ambiguous"    # the same, by a stream, where tolerated
    if expect in ("aborted", "frozen"):
        r["drained"] = "ambiguous"  # the server may have finished before /pause landed
    if not stream and expect in ("aborted", "drained"):
        r["frozen"] = "ambiguous"   # may have reached the server after /pause
    return r


_READING = {(e, s): _readings(e, s)
            for e in ("aborted", "drained", "frozen") for s in (True, False)}


def reading(expect: str, stream: bool, cls: str) -> str:
    return _READING[(expect, stream)].get(cls, "violation")

