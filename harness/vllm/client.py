"""HTTP client for one vLLM server: the weight-sync control plane and generation.

Every call has a timeout, and every failure raises ``ControlPlaneError`` naming
the route, the request, the status, the body and (when known) the vLLM version
and the server's log tail. It implements vLLM's ``VLLMWeightSyncClient``
protocol (four methods), so vLLM's own trainer engines can drive it.

The control plane and the parity probes (which need fields only vLLM has) are
plain HTTP. Rollouts, as RL frameworks send them, go through the official
``openai`` SDK: ``openai_sdk()`` and ``async_openai_sdk()`` give clients for this
server that never retry and always time out.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import requests

from harness.core.facts import WaitTimeout, wait_until
from harness.vllm import memory_lock

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import openai

# How long /is_paused may take to follow a /pause or /resume that answered 200.
SLEEP_RACE = "Memory usage increased after sleeping"  # vLLM's GPU worker, on a shared GPU
SLEEP_TRIES = 3
STATE_CONFIRM_S = 30.0  # a hang guard: on 2 shared cores, beside other workers, 10 s was exceeded
# vLLM started without --api-key ignores the key; the SDK refuses to run without one.
SDK_API_KEY = "EMPTY"


class ControlPlaneError(RuntimeError):
    """A route failed. ``headline`` replaces the default first line
    (``<route> failed with HTTP <status>: <detail>``)."""

    def __init__(self, route: str, request: Any, detail: str, status: int | None = None,
                 context: str = "", *, headline: str | None = None):
        self.route, self.status, self.detail = route, status, detail
        req = json.dumps(request, default=str)
        if len(req) > 600:
            req = req[:600] + f"... ({len(req)} chars)"
        head = headline or (f"{route} failed" + (f" with HTTP {status}" if status else "")
                            + f": {detail}")
        msg = f"{head}\nrequest: {req}"
        super().__init__(msg + ("\n" + context if context else ""))


class PauseStateError(ControlPlaneError):
    """``/pause`` or ``/resume`` answered 200, but ``/is_paused`` did not follow within
    seconds: the route claimed a change it did not make (or /is_paused is wrong). Named
    at once, instead of as a request that never comes back minutes later."""


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None


class ServerClient:
    """Talks to ``url``. ``context`` returns text appended to errors (the log tail).
    ``confirm_timeout`` bounds how long ``pause``/``resume`` wait for /is_paused.
    ``api_key``: sent with every request as ``Authorization: Bearer <key>`` (and by the
    SDK clients)."""

    def __init__(self, url: str, *, timeout: float = 300.0, model: str | None = None,
                 context: Callable[[], str] | None = None,
                 confirm_timeout: float = STATE_CONFIRM_S, api_key: str | None = None,
                 sleep_frees_memory: bool | None = None,
                 on_lock_wait: Callable[[float], None] | None = None):
        self.url = url.rstrip("/")
        # told the seconds a sleep or a wake waited for the GPU-memory lock (memory_lock)
        self.on_lock_wait = on_lock_wait
        # False: a server without --enable-sleep-mode, whose /sleep frees nothing (sleep)
        self.sleep_frees_memory = sleep_frees_memory
        self.sleep_retries = 0
        self.timeout = timeout
        self.confirm_timeout = confirm_timeout
        self._model = model
        self._context_of = context or (lambda: "")
        self.session = requests.Session()
        # A new connection per request: uvicorn closes a keep-alive connection after 5 s
        # idle, and a request sent on one it is closing fails with "Connection aborted,
        # RemoteDisconnected" (seen between two syncs on a loaded 2-core host). On
        # loopback a connection costs a fraction of a millisecond.
        self.session.headers["Connection"] = "close"
        self.api_key = api_key
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._sdk: "openai.OpenAI | None" = None
        self._sdk_lock = threading.Lock()

    def context(self) -> str:
        """What to append to an error about this server (its log tail, its version);
        "" when the creator gave nothing."""
        return self._context_of()

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, route: str, *, json_body: Any = None, params: dict | None = None,
              timeout: float | None = None, ok: tuple[int, ...] = (200,)) -> Any:
        try:
            r = self.session.request(method, self.url + route, json=json_body, params=params,
                                     timeout=timeout or self.timeout)
        except requests.Timeout:
            raise ControlPlaneError(route, json_body if json_body is not None else params,
                                    f"no answer within {timeout or self.timeout:.0f}s",
                                    context=self.context()) from None
        except requests.RequestException as e:
            raise ControlPlaneError(route, json_body if json_body is not None else params,
                                    f"{type(e).__name__}: {e}", context=self.context()) from None
        if r.status_code not in ok:
            raise ControlPlaneError(route, json_body if json_body is not None else params,
                                    r.text[:2000], r.status_code, context=self.context())
        try:
            return r.json()
        except ValueError:
            return r.text

    def raw(self, method: str, route: str, **kw) -> requests.Response:
        """Unchecked request, for tests of how the server answers misuse."""
        kw.setdefault("timeout", self.timeout)
        return self.session.request(method, self.url + route, **kw)

    # ------------------------------------------------------------------ server facts
    def health(self) -> bool:
        try:
            return self.session.get(self.url + "/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def version(self) -> str | None:
        return self._call("GET", "/version").get("version")

    def model(self) -> str:
        if self._model is None:
            self._model = self._call("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def routes(self) -> list[str]:
        return sorted(self._call("GET", "/openapi.json").get("paths", {}))

    def openapi(self) -> dict:
        return self._call("GET", "/openapi.json")

    def world_size(self) -> int:
        """``GET /get_world_size``: how many worker ranks the server runs."""
        return int(self._call("GET", "/get_world_size")["world_size"])

    def on_dp_rank(self, rank: int) -> "ServerClient":
        """A clone whose requests all go to data-parallel engine ``rank``: vLLM's API
        server routes a request that carries ``X-data-parallel-rank`` to that engine
        instead of the least loaded one (``_get_data_parallel_rank``, 0.26-0.34)."""
        c = self.clone()
        c.session.headers["X-data-parallel-rank"] = str(int(rank))
        return c

    def clone(self) -> "ServerClient":
        """A client for the same server with its own HTTP session (one per thread)."""
        return ServerClient(self.url, timeout=self.timeout, model=self._model,
                            context=self._context_of, confirm_timeout=self.confirm_timeout,
                            api_key=self.api_key, sleep_frees_memory=self.sleep_frees_memory)

    # ------------------------------------------------------------------ pause / resume
    def pause(self, mode: str | None = None, timeout: float | None = None, *,
              confirm: bool = True, **params: Any) -> Any:
        """``POST /pause`` (``mode`` and any other query parameters). With ``confirm``
        it returns only once /is_paused says true, and raises ``PauseStateError``
        naming /pause if it does not within ``confirm_timeout``. ``confirm=False``
        is for tests that study the route's raw answer (idempotency, bad input)."""
        q = dict(params)
        if mode is not None:
            q["mode"] = mode
        answer = self._call("POST", "/pause", params=q, timeout=timeout)
        if confirm:
            self._confirm_paused("/pause", q, True)
        return answer

    def resume(self, timeout: float | None = None, *, confirm: bool = True) -> Any:
        """``POST /resume``; with ``confirm``, returns only once /is_paused says false
        (else ``PauseStateError`` naming /resume, within ``confirm_timeout``)."""
        answer = self._call("POST", "/resume", timeout=timeout)
        if confirm:
            self._confirm_paused("/resume", None, False)
        return answer

    def is_paused(self, timeout: float | None = None) -> bool:
        return bool(self._call("GET", "/is_paused", timeout=timeout)["is_paused"])

    def _confirm_paused(self, route: str, request: Any, expected: bool) -> None:
        # A /resume that answers 200 and leaves the server paused was once caught only
        # as the next request's "no answer within 300s": name the route that lied.
        said: list[bool] = []

        def follows() -> bool:
            said.append(self.is_paused(timeout=self.confirm_timeout))
            return said[-1] == expected

        try:
            wait_until(follows, timeout=self.confirm_timeout, interval=0.1,
                       what=f"/is_paused to say {str(expected).lower()} after {route}")
        except WaitTimeout as e:
            seen = (f"still says {str(said[-1]).lower()}" if said
                    else f"gave no answer ({e})")
            raise PauseStateError(
                route, request, f"/is_paused {seen}",
                headline=f"{route} returned 200 but /is_paused {seen} after "
                         f"{self.confirm_timeout:g}s",
                context=self.context()) from None

    # ------------------------------------------------------------------ sleep / wake
    def sleep(self, level: int = 1, timeout: float | None = None, **params: Any) -> Any:
        """``POST /sleep?level=N``: 1 offloads the weights to host memory and drops the
        KV cache, 2 drops both (a server started with --enable-sleep-mode; without
        it, or on a CPU, vLLM only pauses scheduling). 0.26 answers an empty 200,
        0.32 ``{"status": "sleeping", "level": N}``. Alone among this run's servers'
        starts, wakes and sleeps on the GPU: vLLM judges a sleep by the device's free
        memory. Level 0 only pauses scheduling (nothing is freed or judged)."""
        gpu = str(level) != "0"
        for attempt in range(1, SLEEP_TRIES + 1):
            with memory_lock.held(True, "POST /sleep", gpu=gpu,
                                  on_wait=self.on_lock_wait) as locked:
                try:
                    return self._call("POST", "/sleep", params={"level": level, **params},
                                      timeout=timeout)
                except ControlPlaneError as e:
                    if not (locked and self.sleep_frees_memory is False
                            and SLEEP_RACE in e.detail and attempt < SLEEP_TRIES):
                        raise
            # A server without sleep mode frees nothing, so vLLM's device-wide check fails
            # when any other process of this run allocates on the GPU meanwhile (the lock
            # holds starts and wakes, not trainers or requests being served). vLLM raised
            # before its executor marked itself asleep (``Executor.sleep``, read in 0.26.0)
            # and its allocator pool is empty: the scheduler is paused (/is_sleeping says
            # true) and a second /sleep does the sleep (3 of 3 on a GPU, 0.26.0:
            # tests/test_sleep.py). A sleep-mode server is never asked twice: its
            # allocator has already moved the weights.
            log.warning("%s: /sleep?level=%s failed with %r while other processes of this run "
                        "share the GPU (try %d of %d); asking again", self.url, level,
                        SLEEP_RACE, attempt, SLEEP_TRIES)
            self.sleep_retries += 1
            time.sleep(0.5 * attempt)
        raise AssertionError("unreachable")  # the last try returned or raised

    def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> Any:
        """``POST /wake_up`` (``?tags=weights``, ``?tags=kv_cache``: part of it;
        scheduling resumes once nothing sleeps). Shared, like a start: a wake maps memory
        that another server's sleep would count against itself, and nothing judges a
        wake by the device's memory (``gpu_worker.wake_up``, read in 0.26.0). Unlike a
        start it does not queue behind a sleep that is still waiting (``queue=False``)."""
        with memory_lock.held(False, "POST /wake_up", queue=False,
                              on_wait=self.on_lock_wait):
            return self._call("POST", "/wake_up",
                              params={"tags": list(tags)} if tags else None, timeout=timeout)

    def alone_on_the_gpu(self, what: str):
        """A block of sleeps and wakes that holds the GPU-memory lock alone throughout
        (``memory_lock``): one wait for the other servers' starts under way, not one per
        sleep. Starts queue behind it, so keep the block to the sleeps and the checks
        between them. Does nothing outside a parallel run on a GPU host."""
        return memory_lock.held(True, what, on_wait=self.on_lock_wait)

    def is_sleeping(self, timeout: float | None = None) -> bool:
        return bool(self._call("GET", "/is_sleeping", timeout=timeout)["is_sleeping"])

    # ------------------------------------------------------------------ VLLMWeightSyncClient
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", json_body={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update", json_body={})

    def update_weights(self, update_info: Any) -> None:
        self._call("POST", "/update_weights", json_body={"update_info": update_info})

    def start_draft_weight_update(self) -> None:
        """``POST /start_draft_weight_update``: like /start_weight_update, but the update
        that follows loads into the speculative-decoding draft model (vLLM #46725)."""
        self._call("POST", "/start_draft_weight_update", json_body={})

    def collective_rpc(self, method: str, *args: str, timeout: float | None = None) -> list:
        """``POST /collective_rpc`` (dev mode): ``method`` of every worker, with string
        arguments; each worker's answer, in rank order."""
        out = self._call("POST", "/collective_rpc", timeout=timeout,
                         json_body={"method": method, "args": list(args)})
        return (out or {}).get("results", []) if isinstance(out, dict) else []

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        self._call("POST", "/finish_weight_update", json_body=body)

    # ------------------------------------------------------------------ what the server holds
    def weight_info(self) -> str | None:
        """``GET /weight_info``: the weight version the server says it serves (set by
        ``/finish_weight_update``'s ``weight_version`` or ``/update_weight_version``)."""
        return self._call("GET", "/weight_info").get("weight_version")

    def update_weight_version(self, new_version: str, timeout: float | None = None) -> Any:
        """``POST /update_weight_version {"new_version": ...}`` (vLLM 0.32+): relabel the
        weights the server serves without moving any tensor; ``/weight_info`` follows."""
        return self._call("POST", "/update_weight_version",
                          json_body={"new_version": new_version}, timeout=timeout)

    def metrics(self, timeout: float | None = None) -> list[tuple[str, dict[str, str], float]]:
        """``GET /metrics``: every Prometheus sample as (name, labels, value)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self._call("GET", "/metrics", timeout=timeout)
        if not isinstance(text, str):
            text = json.dumps(text)
        return [(smp.name, dict(smp.labels), float(smp.value))
                for fam in text_string_to_metric_families(text) for smp in fam.samples]

    def weight_checksums(self, timeout: float | None = None) -> dict[str, str]:
        """``POST /weight_checker {"action": "checksum"}`` (vLLM 0.32+): one digest per
        weight tensor of every worker, keyed ``dp{i}:pp{j}:pcp{k}:tp{r}:<name>``."""
        out = self._call("POST", "/weight_checker", json_body={"action": "checksum"},
                         timeout=timeout)
        if not isinstance(out, dict) or not isinstance(out.get("checksums"), dict):
            raise ControlPlaneError("/weight_checker", {"action": "checksum"},
                                    f"no 'checksums' object in the answer: {str(out)[:300]}",
                                    context=self.context())
        return out["checksums"]

    def weight_checker_compare(self, baseline: dict[str, str],
                               timeout: float | None = None) -> dict[str, Any]:
        """``POST /weight_checker {"action": "compare", "baseline": ...}``: the server's
        own comparison, ``{"match": bool, "mismatches": [key, ...]}``."""
        return self._call("POST", "/weight_checker",
                          json_body={"action": "compare", "baseline": baseline}, timeout=timeout)

    def reset_weights(self, timeout: float | None = None) -> None:
        """``POST /weight_checker {"action": "reset"}``: every weight tensor of every
        worker set to zero (``weight_checksum.zero_weights``)."""
        self._call("POST", "/weight_checker", json_body={"action": "reset"}, timeout=timeout)

    # ------------------------------------------------------------------ generation
    def complete(self, prompt: str | list[int], *, max_tokens: int = 16, timeout: float | None = None,
                 logprobs: int | None = None, **extra: Any) -> Completion:
        """Greedy completion; returns the generated token ids (not re-tokenized text)."""
        body = {"model": self.model(), "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": True, **extra}
        if logprobs is not None:
            body["logprobs"] = logprobs
        out = self._call("POST", "/v1/completions", json_body=body, timeout=timeout)
        ch = out["choices"][0]
        lp = ch.get("logprobs") or {}
        return Completion(token_ids=list(ch.get("token_ids") or []), text=ch["text"],
                          finish_reason=ch.get("finish_reason"),
                          logprobs=lp.get("token_logprobs"))

    def prompt_logprobs(self, token_ids: list[int], top_k: int = 5,
                        timeout: float | None = None) -> list[dict[int, float]]:
        """Teacher-forced scoring: for each position i >= 1, {token_id: logprob} holding
        the actual token ``token_ids[i]`` and the top-k alternatives (position 0 is None)."""
        body = {"model": self.model(), "prompt": token_ids, "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": top_k}
        out = self._call("POST", "/v1/completions", json_body=body, timeout=timeout)
        plp = out["choices"][0].get("prompt_logprobs")
        if plp is None:
            raise ControlPlaneError("/v1/completions", body, "no prompt_logprobs in the answer",
                                    context=self.context())
        return [None if d is None else {int(k): float(v["logprob"]) for k, v in d.items()}
                for d in plp]

    def tokenize(self, text: str) -> list[int]:
        return self._call("POST", "/tokenize",
                          json_body={"model": self.model(), "prompt": text,
                                     "add_special_tokens": False})["tokens"]

    # ------------------------------------------------------------------ the openai SDK
    def openai_sdk(self) -> "openai.OpenAI":
        """The official SDK's client for this server's OpenAI routes, as an RL framework
        holds one: made once, then shared by every thread (it is thread-safe, and making
        one costs tens of milliseconds: too slow to do per request when the request's
        timing is what a check reads). ``max_retries=0`` (a retry would hide a refused
        request); its default timeout is this client's, and callers pass their own."""
        import openai

        with self._sdk_lock:
            if self._sdk is None:
                self._sdk = openai.OpenAI(base_url=self.url + "/v1",
                                          api_key=self.api_key or SDK_API_KEY,
                                          max_retries=0, timeout=self.timeout,
                                          default_headers=self._routing_headers())
            return self._sdk

    def async_openai_sdk(self, *, timeout: float | None = None) -> "openai.AsyncOpenAI":
        """The SDK's asyncio client, configured as ``openai_sdk``; a new one per call,
        since it belongs to the event loop it runs on (close it: ``async with``)."""
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or SDK_API_KEY,
                                  max_retries=0, timeout=timeout or self.timeout,
                                  default_headers=self._routing_headers())

    def _routing_headers(self) -> dict[str, str] | None:
        """The data-parallel pin (``on_dp_rank``) for the SDK's requests too."""
        rank = self.session.headers.get("X-data-parallel-rank")
        return {"X-data-parallel-rank": rank} if rank is not None else None


# ----------------------------------------------------------------------------- refusals

_FAILED_WITH = re.compile(r"(?P<route>/[\w/]+) failed with HTTP (?P<status>\d{3}): ?(?P<detail>.*)",
                          re.S)


@dataclass(frozen=True)
class Refusal:
    """A failed request as an error message tells it: the route, the HTTP status, the
    server's answer (``ControlPlaneError``'s first line, as the trainer reports it too)."""

    route: str
    status: int
    detail: str


def refusal_in(error: BaseException | str) -> Refusal | None:
    """The first ``<route> failed with HTTP <status>: <detail>`` in an error (a
    ``ControlPlaneError``, or a trainer's error that carries one); None without one."""
    if isinstance(error, ControlPlaneError) and error.status is not None:
        return Refusal(error.route, error.status, str(error.detail))
    m = _FAILED_WITH.search(str(error))
    if m is None:
        return None
    return Refusal(m["route"], int(m["status"]), m["detail"].split("\nrequest:")[0].strip())


def assert_refused(error: BaseException | str | None, *, what: str,
                   names: tuple[str, ...]) -> Refusal:
    """A request the server's state forbids must be refused with a 4xx whose answer
    names that state (any of ``names``, case-insensitive). A 200 (``error`` None), an
    error without a route and status, a 5xx or a 4xx that names nothing each fail with
    one line that says which."""
    if error is None:
        raise AssertionError(f"{what}: answered 200; it must be refused with a 4xx that "
                             f"names the state ({' / '.join(names)})")
    r = refusal_in(error)
    first = str(error).splitlines()[0][:400] if str(error) else type(error).__name__
    if r is None:
        raise AssertionError(f"{what}: failed without an HTTP status from a route: {first}")
    if r.status >= 500:
        raise AssertionError(f"{what}: {r.route} answered HTTP {r.status}; a request the "
                             f"server's state forbids must be refused with a 4xx naming "
                             f"it: {r.detail[:400]}")
    if not 400 <= r.status < 500:
        raise AssertionError(f"{what}: {r.route} answered HTTP {r.status}, not a 4xx "
                             f"refusal: {r.detail[:400]}")
    if not any(n.lower() in r.detail.lower() for n in names):
        raise AssertionError(f"{what}: {r.route} refused with HTTP {r.status} without "
                             f"naming the state ({' / '.join(names)}): {r.detail[:400]}")
    return r


def metric_sum(samples: list[tuple[str, dict[str, str], float]], name: str,
               **labels: str) -> float | None:
    """The sum of the samples called ``name`` whose labels include ``labels`` (over
    engines and models); None when the server exposes no such sample."""
    found = [v for n, lab, v in samples
             if n == name and all(lab.get(k) == want for k, want in labels.items())]
    return sum(found) if found else None
