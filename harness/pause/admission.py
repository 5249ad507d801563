"""What /pause does to a request that *arrives* while paused, per vLLM release.

Up to 0.32 every mode holds it: it neither fails nor completes until /resume
(``checks.check_request_waits_for_resume``). From vLLM 0.33 on (read from its source,
not run: there is no CPU build), ``abort`` and ``wait`` refuse it instead:
``v1/engine/core.py`` ``EngineCore.pause_generation`` sets ``reject_new_requests``
unless the mode is ``keep``, ``_reject_add_while_paused`` finishes the request with
``RequestError(code="engine_paused", message="Generation is paused. Please retry
after it resumes.", retryable=True)``, the output processor raises it as a
``RetryableRequestError``, and the frontend answers HTTP 503 (a non-streaming
request; a stream gets the error as an event, then ``[DONE]``). ``keep`` still queues.
The ``/pause`` docstring of 0.33 says so too ("new requests are rejected with HTTP 503
until /resume").

The behaviour belongs to the server, so it is keyed by the server's version, not by a
feature probe of the trainer API.
"""

from __future__ import annotations

import time
from typing import Sequence

from harness.pause import PauseCheckFailure, failure
from harness.pause.driver import REQ_SLACK, Rollout, greedy, join_all
from harness.pause.openapi import PauseStyle
from harness.vllm.client import ServerClient

REFUSING_FROM = "0.33.0"
REFUSING_MODES = ("abort", "wait")
PAUSED_MESSAGE = "paused"  # in "Generation is paused. Please retry after it resumes."


def _at_least(version: str | None, floor: str) -> bool:
    from packaging.version import InvalidVersion, Version

    try:
        return Version((version or "").split("+")[0]) >= Version(floor)
    except InvalidVersion:
        return False


def while_paused(version: str | None, style: str | None) -> str:
    """``"refuse"`` or ``"hold"``: what a request sent while paused with ``style``
    (a mode name, a legacy flag name, or None for the default mode) should get."""
    mode = style or "abort"  # the default mode of every release with modes
    if mode in REFUSING_MODES and _at_least(version, REFUSING_FROM):
        return "refuse"
    return "hold"


def _refusal(r: Rollout) -> str | None:
    """Why ``r`` counts as refused for being paused, or None."""
    e = r.error
    if e is None:
        return None
    status = getattr(e, "status_code", None)
    text = str(e)
    if status == 503:
        return f"HTTP 503: {text[:200]}"
    if status is None and PAUSED_MESSAGE in text.lower():  # a stream's error event
        return f"error event: {text[:200]}"
    return None


def check_request_refused_while_paused(client: ServerClient, prompt_ids: Sequence[int], *,
                                       style: PauseStyle, hold_seconds: float = 3.0,
                                       max_tokens: int = 16, timeout: float = 60.0) -> dict:
    """vLLM 0.33+, ``abort``/``wait``: requests sent while paused are refused at once,
    retryably (HTTP 503, or an error event on a stream, saying it is paused), before
    /resume; the same request sent again after /resume completes with the
    uninterrupted greedy text."""
    baseline, _ = greedy(client, prompt_ids, max_tokens, timeout)
    reqs: list[Rollout] = []
    t_pause = time.monotonic()
    style.pause(client, timeout=timeout)
    try:
        reqs = [Rollout(prompt_ids, max_tokens, stream=s, timeout=REQ_SLACK * timeout).start(client)
                for s in (False, True)]
        join_all(reqs, hold_seconds, f"requests sent while paused ({style}), which vLLM "
                 f">= {REFUSING_FROM} refuses at once", client)
    finally:
        t_resume = time.monotonic()
        client.resume(timeout=timeout)
    out = {"style": style.name, "pause_to_resume_s": round(t_resume - t_pause, 3)}
    for r in reqs:
        why = _refusal(r)
        out[r.name] = why or r.describe()
        if why is None:
            raise failure(f"while paused ({style}), a request sent after /pause was not refused "
                          f"as vLLM >= {REFUSING_FROM} refuses it (HTTP 503, retryable, "
                          f"'{PAUSED_MESSAGE}'): {r.describe()}", client, PauseCheckFailure)
        out[f"{r.name}_refused_after_s"] = round(r.done_at - r.sent_at, 3)
    again, _ = greedy(client, prompt_ids, max_tokens, timeout)
    if again != baseline:
        raise failure(f"after /resume, the request refused while paused ({style}) came back "
                      f"with other tokens when sent again: {again} vs {baseline}", client)
    return out
