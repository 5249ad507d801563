"""Completions sent the way RL frameworks send them, recording what arrived and when.

Generation goes through the official ``openai`` SDK, so the checks see what SDK
users see: ``openai.OpenAI`` on a thread per request (``Rollout.start``), and
``openai.AsyncOpenAI`` for rollout workers on an event loop (``StreamingClients``),
streamed and not. vLLM-only fields travel in ``extra_body`` (``return_token_ids``,
``ignore_eos``) and come back as the SDK objects' extra fields (``token_ids``).
Every SDK call carries its own timeout, and the clients never retry: a retried
request would hide a refused one.

Every wait is bounded: a request that does not come back in time fails a check with
its own story and the server's log tail, never a hang. A request's ``timeout``
bounds the connection and each gap between streamed events (and a whole non-streamed
request, which sends nothing until it is done).

Whether a stream ended with ``[DONE]`` the SDK does not say. A stream cut off
mid-body raises (``APIConnectionError``), so a stream that ended without an error
ended as SDK users see a bare ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import openai

from harness.pause import failure
from harness.vllm.client import ServerClient

# A request's own timeout is this many times the check's: the check's bounded waits
# (which name the hang and show the log) fire first, the request's only as a backstop.
REQ_SLACK = 3.0
# Greedy, and always max_tokens long: a pause's effect is read from token counts.
VLLM_FIELDS = {"return_token_ids": True, "ignore_eos": True}


@dataclasses.dataclass
class Chunk:
    """What one streamed event (or a whole non-streamed answer) carried."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    at: float  # time.monotonic() when it arrived


def _first_line(e: BaseException) -> str:
    line = (str(e).splitlines() or [""])[0]
    cause = e.__cause__ or e.__context__
    if cause is not None and isinstance(e, openai.APIConnectionError):
        line += f" ({type(cause).__name__}: {(str(cause).splitlines() or [''])[0]})"
    return f"{type(e).__name__}: {line}"


class Rollout:
    """One greedy completion as its SDK client saw it: every chunk and when it came,
    the finish reason, the error. Run it on a thread of its own (``start``), on this
    thread (``run``) or on an event loop (``run_async``)."""

    def __init__(self, prompt_ids: Sequence[int], max_tokens: int, *, stream: bool,
                 timeout: float, name: str = ""):
        self.prompt_ids, self.max_tokens, self.stream = list(prompt_ids), max_tokens, stream
        self.timeout, self.name = timeout, name or ("stream" if stream else "non-stream")
        self.sent_at: float | None = None
        self.done_at: float | None = None
        self.chunks: list[Chunk] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.first_token = threading.Event()
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    # ---------------------------------------------------------------- sending
    def request(self, model: str) -> dict[str, Any]:
        """The arguments of ``completions.create``."""
        return {"model": model, "prompt": list(self.prompt_ids), "max_tokens": self.max_tokens,
                "temperature": 0.0, "stream": self.stream, "extra_body": dict(VLLM_FIELDS),
                # the connection bounded apart: a server that is not there says so early
                "timeout": openai.Timeout(self.timeout, connect=min(self.timeout, 30.0))}

    def start(self, client: ServerClient) -> "Rollout":
        """Send it with ``openai.OpenAI`` on a daemon thread; ``wait`` is bounded."""
        # on this thread: the model lookup uses the client's HTTP session, which is not
        # for sharing, and the SDK client is made once, outside the request's timing
        model, sdk = client.model(), client.openai_sdk()
        self.thread = threading.Thread(target=self._run, args=(sdk, model), daemon=True,
                                       name=f"rollout-{self.name}")
        self.sent_at = time.monotonic()
        self.thread.start()
        return self

    def run(self, client: ServerClient) -> "Rollout":
        """Send it with ``openai.OpenAI`` and wait for it, on this thread."""
        model, sdk = client.model(), client.openai_sdk()
        self.sent_at = time.monotonic()
        self._run(sdk, model)
        return self

    def _run(self, sdk: openai.OpenAI, model: str) -> None:
        try:
            answer = sdk.completions.create(**self.request(model))
            if self.stream:
                with answer:
                    for event in answer:
                        self._take(event.choices)
            else:
                self._take(answer.choices)
        except BaseException as e:  # reported by the checks
            self.error = e
        finally:
            self._end()

    async def run_async(self, sdk: openai.AsyncOpenAI, model: str) -> "Rollout":
        """Send it with ``openai.AsyncOpenAI`` on the running event loop."""
        self.sent_at = time.monotonic()
        try:
            answer = await sdk.completions.create(**self.request(model))
            if self.stream:
                async with answer:
                    async for event in answer:
                        self._take(event.choices)
            else:
                self._take(answer.choices)
        except asyncio.CancelledError:
            self.error = TimeoutError(f"cancelled {time.monotonic() - self.sent_at:.0f}s after "
                                      "it was sent, still without an answer")
            raise
        except Exception as e:  # reported by the checks
            self.error = e
        finally:
            self._end()
        return self

    def _take(self, choices: Any) -> None:
        now = time.monotonic()
        for ch in choices or []:
            # vLLM's token ids: not in the SDK's schema, so one of the object's extra fields
            ids = list((ch.model_extra or {}).get("token_ids") or [])
            self.chunks.append(Chunk(ids, ch.text or "", ch.finish_reason, now))
            if ids:
                self.first_token.set()
            if ch.finish_reason is not None:
                self.finish_reason = ch.finish_reason

    def _end(self) -> None:
        self.done_at = time.monotonic()
        self.first_token.set()
        self.done.set()

    # ---------------------------------------------------------------- reading
    @property
    def token_ids(self) -> list[int]:
        return [t for ch in list(self.chunks) for t in ch.token_ids]

    @property
    def empty_without_finish(self) -> bool:
        """A stream that ended without an error, with no token and no finish_reason:
        what vLLM sends for a request aborted before its first token (a bare [DONE])."""
        return (self.stream and self.done.is_set() and self.error is None
                and self.finish_reason is None and not self.token_ids)

    def tokens_between(self, start: float, end: float = float("inf")) -> int:
        return sum(len(ch.token_ids) for ch in list(self.chunks) if start < ch.at <= end)

    def tokens_before(self, t: float) -> int:
        return sum(len(ch.token_ids) for ch in list(self.chunks) if ch.at <= t)

    def wait(self, timeout: float) -> bool:
        return self.done.wait(max(0.0, timeout))

    def describe(self, t0: float | None = None) -> str:
        t0 = self.sent_at if t0 is None else t0
        rel = (lambda t: "never" if t is None or t0 is None else f"{t - t0:+.2f}s")
        last = self.chunks[-1].at if self.chunks else None
        err = f", error {_first_line(self.error)}" if self.error else ""
        return (f"{self.name} request (max_tokens {self.max_tokens}): sent {rel(self.sent_at)}, "
                f"{len(self.token_ids)} tokens, last chunk {rel(last)}, done {rel(self.done_at)}, "
                f"finish_reason {self.finish_reason!r}{err}")


# ----------------------------------------------------------------------------- helpers

def greedy(client: ServerClient, prompt_ids: Sequence[int], max_tokens: int,
           timeout: float) -> tuple[list[int], float]:
    """An uninterrupted greedy completion: (token ids, seconds)."""
    r = Rollout(prompt_ids, max_tokens, stream=False, timeout=timeout,
                name="uninterrupted").run(client)
    if r.error is not None:
        raise failure(f"an uninterrupted request failed: {r.describe()}", client) from r.error
    if r.finish_reason != "length" or len(r.token_ids) != max_tokens:
        raise failure(f"an uninterrupted request came back with {len(r.token_ids)} of "
                      f"{max_tokens} tokens, finish_reason {r.finish_reason!r}", client)
    return r.token_ids, r.done_at - r.sent_at


def start_pair(client: ServerClient, prompt_ids: Sequence[int], max_tokens: int,
               timeout: float, pause_after: float = 0.3) -> tuple[Rollout, Rollout]:
    """A non-streamed and a streamed request, sent together. Returns once the stream
    has delivered a token, or ``pause_after`` seconds after sending, whichever comes
    first: on a loaded machine the API server or this client may be starved and a
    whole stream arrive in one burst when generation ends, so a token seen is no sign
    of a request in flight. Whether each was is read afterwards from the server's
    answers."""
    ns = Rollout(prompt_ids, max_tokens, stream=False, timeout=REQ_SLACK * timeout)
    st = Rollout(prompt_ids, max_tokens, stream=True, timeout=REQ_SLACK * timeout)
    ns.start(client)
    st.start(client)
    st.first_token.wait(max(0.0, ns.sent_at + pause_after - time.monotonic()))
    if st.error is not None:
        raise failure(f"the streaming request failed before the pause: {st.describe()}", client)
    return ns, st


def join_all(reqs: Sequence[Rollout], timeout: float, what: str,
             client: ServerClient | None = None, t0: float | None = None) -> None:
    """Wait (bounded) for every request; a request still out fails with its story."""
    deadline = time.monotonic() + timeout
    stuck = [r for r in reqs if not r.wait(deadline - time.monotonic())]
    if stuck:
        raise failure(f"{what}: {len(stuck)} of {len(reqs)} requests still had no answer "
                      f"{timeout:.0f}s later (a hang, or a request lost):\n  "
                      + "\n  ".join(r.describe(t0) for r in stuck), client)


def assert_all_returned(reqs: Sequence[Rollout], what: str, client: ServerClient | None = None,
                        t0: float | None = None, tolerate_empty: bool = False) -> None:
    """Every request came back, without an error, with a finish reason. With
    ``tolerate_empty``, a stream that ended with no token and no finish_reason (vLLM's
    answer to an abort before the first token; see
    ``checks.check_abort_reports_finish_reason``) passes: the caller counts those."""
    bad = [r for r in reqs if r.error is not None or (
        r.finish_reason is None and not (tolerate_empty and r.empty_without_finish))]
    if bad:
        raise failure(f"{what}: {len(bad)} of {len(reqs)} requests failed or came back "
                      "without a finish reason:\n  " + "\n  ".join(r.describe(t0) for r in bad)
                      + "".join(f"\n  {r.name}: {r.error}" for r in bad if r.error), client)


def await_tokens_after(reqs: Callable[[], Sequence[Rollout | None]], t: float, timeout: float,
                       what: str, client: ServerClient, t0: float) -> None:
    """Some request streams a token (or finishes) after ``t``, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        live = [r for r in reqs() if r is not None]
        if any(r.tokens_between(t) or (r.done_at or 0) > t or r.error is not None for r in live):
            return
        if time.monotonic() > deadline:
            raise failure(f"after {what}, no request received a token within {timeout:.0f}s "
                          "(resume did not release generation):\n  "
                          + "\n  ".join(r.describe(t0) for r in live[-8:]), client)
        time.sleep(0.02)


# ----------------------------------------------------------------------------- async workers

class StreamingClients:
    """``clients`` rollout workers on one event loop of their own thread, each streaming
    completions back to back through one ``openai.AsyncOpenAI``, as an RL framework's
    async rollouts do, until ``stop()``. A worker whose request fails, or is still out
    ``request_timeout`` + 10 s after it was sent, stops there (the check reports it).

    ``current[k]`` is worker k's request in flight (None between requests), ``log``
    every finished one as ``(k, rollout)``, and ``sent`` is set whenever a worker sends.
    """

    def __init__(self, client: ServerClient, prompts: Sequence[Sequence[int]], max_tokens: int,
                 *, clients: int, request_timeout: float):
        self.client, self.prompts, self.max_tokens = client, list(prompts), max_tokens
        self.clients, self.request_timeout = clients, request_timeout
        self.current: dict[int, Rollout | None] = {k: None for k in range(clients)}
        self.log: list[tuple[int, Rollout]] = []
        self.lock = threading.Lock()
        self.sent = threading.Event()
        self.crashed: BaseException | None = None  # the event loop itself failed
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> "StreamingClients":
        model = self.client.model()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main(model)),
                                       daemon=True, name="pause-rollout-workers")
        self.thread.start()
        return self

    def stop(self) -> None:
        """No worker sends another request; those out run to their end."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """True once the workers have all ended, waiting at most ``timeout``."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def finished(self) -> list[tuple[int, Rollout]]:
        with self.lock:
            return list(self.log)

    def in_flight(self) -> list[Rollout]:
        return [r for r in list(self.current.values()) if r is not None]

    async def _main(self, model: str) -> None:
        try:
            async with self.client.async_openai_sdk(timeout=self.request_timeout) as sdk:
                await asyncio.gather(*(self._worker(k, sdk, model) for k in range(self.clients)))
        except BaseException as e:  # a bug here must not pass for "no request failed"
            self.crashed = e

    async def _worker(self, k: int, sdk: openai.AsyncOpenAI, model: str) -> None:
        i = 0
        while not self._stop.is_set():
            r = Rollout(self.prompts[(k + i) % len(self.prompts)], self.max_tokens, stream=True,
                        timeout=self.request_timeout, name=f"client {k} request {i}")
            self.current[k] = r
            self.sent.set()
            try:
                await asyncio.wait_for(r.run_async(sdk, model), self.request_timeout + 10)
            except TimeoutError:
                pass  # the rollout recorded it
            self.current[k] = None
            with self.lock:
                self.log.append((k, r))
            if r.error is not None:
                return
            i += 1
