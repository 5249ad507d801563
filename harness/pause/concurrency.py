"""Concurrency under /pause: many streams through repeated pause -> sync -> resume cycles
(``check_concurrent_pause_cycles``). The single-request checks are in ``checks``."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from harness.pause import failure
from harness.pause.checks import NothingCaught, _set_paused_expect
from harness.pause.driver import (REQ_SLACK, StreamingClients, assert_all_returned,
                                  await_tokens_after)
from harness.pause.openapi import PauseStyle
from harness.vllm.client import ServerClient


def check_concurrent_pause_cycles(client: ServerClient, prompts: Sequence[Sequence[int]],
                                  styles: Sequence[PauseStyle], update: Callable[[int], Any], *,
                                  clients: int = 4, cycles: int = 3, max_tokens: int = 200,
                                  run_seconds: float = 1.0, request_timeout: float = 120.0,
                                  settle_timeout: float = 120.0, lead_seconds: float = 0.1,
                                  tolerate_empty_abort: bool = False) -> dict:
    """``clients`` async rollout workers (``openai.AsyncOpenAI``, one event loop) stream
    requests back to back while this thread runs ``cycles`` of pause (styles in turn)
    -> update(cycle) -> resume, as an RL trainer does next to its async rollouts. No
    request may be lost (each comes back, without an error, with a finish reason),
    nothing may hang (every wait bounded), every worker must complete a request sent
    after the last /resume, and the server must be healthy and unpaused at the end.
    ``tolerate_empty_abort``: see ``assert_all_returned``; such streams are counted."""
    workers = StreamingClients(client, prompts, max_tokens, clients=clients,
                               request_timeout=REQ_SLACK * request_timeout).start()
    t0 = time.monotonic()

    def failed() -> bool:
        return workers.crashed is not None or any(r.error for _, r in workers.finished())

    cycle_log = []
    last_resume = t0
    try:
        deadline = time.monotonic() + request_timeout
        while sum(1 for r in workers.in_flight() if r.chunks) < clients:
            if time.monotonic() > deadline:
                raise failure(f"not every client was generating within {request_timeout:.0f}s: "
                              + "; ".join(r.describe(t0) for r in workers.in_flight()), client)
            if failed():
                break
            time.sleep(0.02)
        for cyc in range(cycles):
            s = styles[cyc % len(styles)]
            time.sleep(run_seconds)
            # Pause just after a worker sent a request (which then reaches the server and
            # starts): the workers may lag far behind the server, so at a random moment
            # the server is often idle and a pause would catch nothing.
            workers.sent.clear()
            workers.sent.wait(request_timeout)
            time.sleep(lead_seconds)
            ta = time.monotonic()
            s.pause(client, timeout=request_timeout)
            tb = time.monotonic()
            update(cyc)
            tc = time.monotonic()
            _set_paused_expect(client, True, f"after the update in cycle {cyc}")
            last_resume = time.monotonic()
            client.resume(timeout=request_timeout)
            await_tokens_after(lambda: workers.in_flight() + [r for _, r in workers.finished()],
                               last_resume, settle_timeout, f"/resume in cycle {cyc} ({s})",
                               client, t0)
            if failed():
                break  # reported below, with every failed request
            cycle_log.append({"cycle": cyc, "style": s.name, "pause_s": round(tb - ta, 3),
                              "update_s": round(tc - tb, 3),
                              "paused_s": round(last_resume - ta, 3),
                              "pause_sent": ta, "resume_sent": last_resume})
        # every worker must complete a request sent after the last /resume
        deadline = time.monotonic() + settle_timeout
        while True:
            fresh = {k for k, r in workers.finished()
                     if r.sent_at > last_resume and r.finish_reason is not None}
            if failed() or len(fresh) == clients:
                break
            if time.monotonic() > deadline:
                raise failure(f"{settle_timeout:.0f}s after the last /resume, clients "
                              f"{sorted(set(range(clients)) - fresh)} had not completed a "
                              "request sent after it:\n  " + "\n  ".join(
                                  r.describe(t0) for r in workers.in_flight()), client)
            time.sleep(0.05)
    finally:
        workers.stop()
        if client.is_paused():
            client.resume(timeout=request_timeout)
    if not workers.join(request_timeout + 10):
        raise failure(f"rollout workers did not end within {request_timeout + 10:.0f}s: "
                      + "; ".join(r.describe(t0) for r in workers.in_flight()), client)
    if workers.crashed is not None:
        raise failure(f"the rollout workers' event loop failed: "
                      f"{type(workers.crashed).__name__}: {workers.crashed}", client
                      ) from workers.crashed
    reqs = [r for _, r in workers.finished()]
    assert_all_returned(reqs, f"{len(reqs)} requests streamed through {cycles} pause/update/"
                        "resume cycles", client, t0, tolerate_empty=tolerate_empty_abort)
    if not client.health():
        raise failure("the server is not healthy after the pause/update/resume cycles", client)
    _set_paused_expect(client, False, "at the end")
    # Which requests the pauses caught: sent before a /pause and back only after its
    # /resume (held across it), or ended by it without completing (aborted). Without
    # any, the cycles ran between requests and proved nothing about them.
    for cl in cycle_log:
        ta, tr = cl.pop("pause_sent"), cl.pop("resume_sent")
        caught = [r for r in reqs if r.sent_at < ta and r.done_at is not None and r.done_at > ta]
        cl["held_across"] = sum(1 for r in caught if r.done_at > tr and r.finish_reason == "length")
        cl["aborted"] = sum(1 for r in caught if r.done_at <= tr and (
            r.finish_reason not in (None, "length") or r.empty_without_finish))
        # informative only: drained by the pause, or simply read late by its client
        cl["completed_while_paused"] = sum(1 for r in caught if r.done_at <= tr
                                           and r.finish_reason == "length")
    if not any(cl["held_across"] + cl["aborted"] for cl in cycle_log):
        raise failure(f"no request was held across or aborted by any of the {cycles} pauses "
                      f"({len(reqs)} requests): the cycles did not exercise requests in "
                      f"flight; longer requests (max_tokens {max_tokens}) or more clients "
                      f"would. Cycles: {cycle_log}", client, NothingCaught)
    by_finish: dict[str, int] = {}
    for r in reqs:
        by_finish[str(r.finish_reason)] = by_finish.get(str(r.finish_reason), 0) + 1
    short = [r for r in reqs if r.finish_reason == "length" and len(r.token_ids) != max_tokens]
    if short:
        raise failure(f"{len(short)} requests finished 'length' with the wrong token count: "
                      + "; ".join(r.describe(t0) for r in short[:5]), client)
    return {"requests": len(reqs), "finish_reasons": by_finish, "cycles": cycle_log,
            "empty_streams_without_finish_reason": sum(r.empty_without_finish for r in reqs),
            "max_request_seconds": round(max(r.done_at - r.sent_at for r in reqs), 3),
            "clients": clients, "sdk": "openai.AsyncOpenAI, streaming"}
