"""The flow: what a test, ``harness demo`` and ``harness repro`` all do, written once.

    ref = s.reference()                 # Hugging Face, on the trainer's weights
    before = s.compare(ref)             # dummy weights: gibberish expected
    s.sync()                            # /pause -> the trainer pushes -> /resume
    after = s.compare(ref)              # parity expected

``SyncSession`` is what a caller holds for one case: its server (from the pool), an
HTTP client, the reference, the persistent trainer, and the state of the server's
weights. ``seed_flow`` runs the steps above and reports each one to an optional
``on_step(name, **facts)`` callback: the pytest fixtures stay silent, the demo and
repro commands narrate. No pytest here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from harness import models
from harness.oracles import parity
from harness.oracles.reference import Reference, hf_reference
from harness.run.cases import Case, server_config_for, twin_config
from harness.run.pool import ServerPool
from harness.run.server_weights import State
from harness.run.sync import OnStep, add_note, paused_sync
from harness.trainer.handle import TrainerCodeUnavailable, TrainerSpec, run_trainer
from harness.vllm.client import ControlPlaneError, ServerClient
from harness.vllm.server import ServerConfig, VLLMServer



# Where a test's time goes: each phase is reported as it ends (``on_record("phase",
# {name: seconds})``), and the report adds what is left of the test's duration as
# "other". The seed flow's steps are phases of their own.
PHASES = ("server_wait", "reset", "reference", "before", "sync", "after", "observe",
          "twin_wait", "lock_wait")
# What the report keeps of each sync: the transfer (every sync), and where the sync's
# wall time went besides it, where the trainer said (a trainer's start or a spare taken
# over, its CUDA context, building the sender, the trainers dropped before a fresh one
# and the wait for it to go, the child's whole command).
SYNC_FIELDS = ("sync_seconds", "init_seconds", "load_seconds", "first", "bytes", "tensors",
               "corruption", "api_path")
SYNC_TIMES = ("start_seconds", "spare", "cuda_init_seconds", "sender_seconds",
              "drop_seconds", "close_seconds", "seconds")


def trainer_spec(case: Case, url: str, options: dict | None = None,
                 code: str | None = None) -> TrainerSpec:
    """The trainer of ``case`` against the server at ``url``: the spec the pool
    prepares ahead for a planned server and the one a sync asks for are the same.
    ``code`` overrides the case's trainer code (harness | vllm)."""
    lay = case.layout
    return TrainerSpec.make(url=url, engine=case.backend.engine, packed=case.backend.packed,
                            dtype=case.dtype, device=lay.trainer_device,
                            code=code or case.trainer,
                            options=dict(options or {}, device=lay.trainer_device))


class SyncSession:
    def __init__(self, case: Case, pool: ServerPool, *, fresh: bool = False,
                 sync_timeout: float = 600.0, attention_backend: str | None = None,
                 on_record: Callable[[str, dict], None] | None = None,
                 api_key: str | None = None, user: str = "a test"):
        self.case, self.pool = case, pool
        self.sync_timeout = sync_timeout
        self.on_record = on_record
        self.user = user
        self.metrics: dict[str, Any] = {}
        self.model_path: str = resolve_model_path(case.model)
        self.server_cfg: ServerConfig = server_config_for(case, self.model_path,
                                                          attention_backend=attention_backend,
                                                          api_key=api_key)
        self.current_server: VLLMServer | None = None
        with self.phase("server_wait"):
            self.server = self.use_server(self.server_cfg)
        self.client = self.client_for(self.server)
        self._tokenizer = None
        if fresh:
            self.reset_weights()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` of the current test."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            if self.on_record is not None:
                self.on_record("phase", {name: time.monotonic() - t0})

    # ------------------------------------------------------------------ servers
    def use_server(self, cfg: ServerConfig, *, new_engine: bool = False) -> VLLMServer:
        srv = self.pool.get(cfg, new_engine=new_engine, user=self.user)
        srv.mark_log()
        self.current_server = srv
        return srv

    def client_for(self, srv: VLLMServer) -> ServerClient:
        """A client of ``srv`` whose sleeps and wakes report their waits for the
        GPU-memory lock as phase ``lock_wait``: on one GPU a sleep waits for the other
        servers' starts, and that is not the test's own time."""
        record = self.on_record

        def lock_waited(seconds: float) -> None:
            if record is not None:
                record("phase", {"lock_wait": seconds})

        return ServerClient(srv.url, context=srv.describe_failure, api_key=srv.cfg.api_key,
                            sleep_frees_memory=srv.cfg.enable_sleep_mode,
                            on_lock_wait=lock_waited)

    def twin(self, weights_dir: str | Path, *, mode: str | None = None
             ) -> tuple[VLLMServer, ServerClient]:
        """A second server that loads ``weights_dir`` from disk the normal way, in this
        server's mode unless ``mode`` names another (a self-test's wrong oracle)."""
        with self.phase("twin_wait"):
            srv = self.use_server(twin_config(self.server_cfg, weights_dir, mode=mode))
        return srv, self.client_for(srv)

    # ------------------------------------------------------------------ weights
    def reset_weights(self) -> None:
        """Bring a synced server back to never-synced-equivalent weights, without a
        restart: dummy weights like vLLM's (``models.dummy_copy``) are pushed through
        the trainer whose group the engine holds (so the next variant's first sync is
        still its first, init included), or this case's trainer where there is none.
        A server that never synced is left alone; one whose reset fails is restarted,
        and the restart says why. The seed flow's "gibberish before" then proves what
        it proves on a new server: that the server does not hold the trainer's weights
        before the sync (shown failing against a reset that pushes nothing,
        tests/unit/test_core.py)."""
        cfg = self.server_cfg
        held = self.pool.weights_of(cfg)
        if held.fresh:
            return
        t0 = time.monotonic()
        dummy = str(models.dummy_copy(Path(self.model_path)))
        trainer = (self.pool.live_trainer(cfg)
                   or self.pool.trainer(cfg, self.trainer_spec()))
        self.pool.record_weights(cfg, State.INCOMPLETE, dummy)
        try:
            with self.phase("reset"):
                paused_sync(self.client, lambda: trainer.sync(dummy, timeout=self.sync_timeout))
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.pool.discard(cfg, f"{self.user} needs never-synced weights, and pushing "
                                   f"dummy weights back failed: {why}")
            with self.phase("server_wait"):
                self.server = self.use_server(cfg)
            self.client = self.client_for(self.server)
            return
        self.pool.record_weights(cfg, State.RESET, dummy)
        self.pool.resets.append({"config": cfg.describe(), "for": self.user,
                                 "held": held.state.name.lower(),
                                 "seconds": round(time.monotonic() - t0, 3)})
        self.record(reset_seconds=round(time.monotonic() - t0, 3))

    def perturbed(self, seed: int, scale: float = 0.05) -> Path:
        return models.perturbed_copy(Path(self.model_path), seed, scale)

    def reference(self, weights_dir: str | Path | None = None, **kw: Any) -> Reference:
        with self.phase("reference"):
            return hf_reference(weights_dir or self.model_path, self.case.dtype, **kw)

    def decode(self, token: int) -> str:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer.decode([token])

    # ------------------------------------------------------------------ observe
    def observe(self, ref: Reference, client: ServerClient | None = None, *,
                phase: str = "observe") -> list[parity.Observation]:
        with self.phase(phase):
            return observe(client or self.client, ref)

    def compare(self, ref: Reference, client: ServerClient | None = None) -> parity.ParityReport:
        return parity.compare(self.observe(ref, client), ref, decode=self.decode)

    # ------------------------------------------------------------------ sync
    def trainer_spec(self, options: dict | None = None, code: str | None = None) -> TrainerSpec:
        return trainer_spec(self.case, self.server.url, options, code)

    def sync(self, weights_dir: str | Path | None = None, **kw: Any) -> dict:
        """``_sync``, timed as the test's "sync" phase."""
        with self.phase("sync"):
            return self._sync(weights_dir, **kw)

    def _sync(self, weights_dir: str | Path | None = None, *, corrupt: str | None = None,
              corrupt_target: str | None = None, lie: str | None = None, pause: bool = True,
              pause_mode: str | None = None, options: dict | None = None,
              fresh_trainer: bool = False, trainer_dtype: str | None = None,
              trainer_code: str | None = None, on_step: OnStep | None = None) -> dict:
        """/pause -> the trainer pushes ``weights_dir`` (default: the model) -> /resume.

        The server's persistent trainer for this backend variant does the work (its
        group was opened by its first sync); ``fresh_trainer`` uses a trainer of its
        own instead: a new process and a new group, gone afterwards. ``lie``: the
        update info disagrees with the tensors (``harness.trainer.handle.LIES``).
        ``trainer_dtype``: the trainer holds and sends its weights in this dtype, not
        the server's (fp32 master weights into a bf16 server); a fresh trainer does it.
        ``trainer_code`` pushes with other trainer code than the case's (harness |
        vllm): a trainer of its own, as ``fresh_trainer``. ``on_step`` hears the pause,
        sync and resume steps (``harness.run.sync.paused_sync``).

        When the sync fails, the error raised is the trainer's (a failing /resume
        after it does not hide it), with a note on the state of the server."""
        weights = str(weights_dir or self.model_path)
        spec = self.trainer_spec(options) if trainer_code is None else \
            self.trainer_spec(options, trainer_code)
        # another code than the server's persistent trainers run: a trainer of its own
        fresh_trainer = fresh_trainer or (trainer_code is not None
                                          and trainer_code != self.case.trainer)
        if trainer_dtype is not None and trainer_dtype != spec.dtype:
            spec, fresh_trainer = dataclasses.replace(spec, dtype=trainer_dtype), True
        # Until the trainer reports success the server holds an unknown mix of weights.
        held = self.pool.weights_of(self.server_cfg)
        self.pool.record_weights(self.server_cfg, State.INCOMPLETE, weights)
        lying = {"lie": lie} if lie else {}

        def push() -> dict:
            try:
                if fresh_trainer:
                    # The server's engine has one group: the new trainer's init replaces
                    # the one the persistent trainers opened (their next sync would fail,
                    # or over NCCL wait on a group nobody joins), so they go first.
                    t0 = time.monotonic()
                    self.pool.drop_trainers(self.server_cfg)
                    dropped = time.monotonic() - t0
                    out = run_trainer(spec, weights, corrupt=corrupt,
                                      corrupt_target=corrupt_target, **lying,
                                      timeout=self.sync_timeout, log_dir=self.pool.log_dir,
                                      context=self.server.describe_failure,
                                      api_key=self.server_cfg.api_key,
                                      processes=self.pool.processes)
                    return {**out, "drop_seconds": dropped}
                return self.pool.trainer(self.server_cfg, spec).sync(
                    weights, corrupt=corrupt, corrupt_target=corrupt_target, **lying,
                    timeout=self.sync_timeout)
            except BaseException as e:
                if isinstance(e, TrainerCodeUnavailable):  # refused before any route was called
                    self.pool.record_weights(self.server_cfg, held.state, held.weights)
                add_note(e, self.server_state())
                raise

        run = paused_sync(self.client, push, pause=pause, pause_mode=pause_mode,
                          on_step=on_step)
        result = run.result
        self.pool.record_weights(self.server_cfg, State.SYNCED if corrupt is None and lie is None
                              else State.CORRUPTED, weights)
        self.record(sync_seconds=result.get("sync_seconds"), sync_bytes=result.get("bytes"),
                    sync_tensors=result.get("tensors"), trainer_api=result.get("api_path"),
                    sync_first=result.get("first"), sync_init_seconds=result.get("init_seconds"),
                    server_start_seconds=self.server.start_seconds,
                    vllm_version=self.server.version)
        if self.on_record is not None:
            self.on_record("sync", {**{k: result.get(k) for k in SYNC_FIELDS},
                                    **{k: result[k] for k in SYNC_TIMES if k in result},
                                    "pause_seconds": run.timings.pause_seconds,
                                    "push_seconds": run.timings.push_seconds,
                                    "resume_seconds": run.timings.resume_seconds})
        return result

    def server_state(self) -> str:
        """One line: is the server still there, and does it answer /health?"""
        srv = self.server
        code = srv.exit_code()
        if code is not None:
            return f"server {srv.url}: DIED (exit code {code}); log {srv.log_path}"
        return (f"server {srv.url}: process alive, /health "
                f"{'answers 200' if self.client.health() else 'does NOT answer 200'}")

    @property
    def holds(self) -> str | None:
        """The weights the server holds after a complete, undamaged sync (else None)."""
        h = self.pool.weights_of(self.server_cfg)
        return h.weights if h.state is State.SYNCED else None

    def ensure_holds(self, weights_dir: str | Path | None = None) -> None:
        """Sync ``weights_dir`` (default: the model) unless the server already holds it."""
        if not self.pool.weights_of(self.server_cfg).holds(str(weights_dir or self.model_path)):
            self.sync(weights_dir)

    def leave_healthy(self) -> str | None:
        """After use: a deliberately corrupted update must not reach the next user of
        this server, so the model is pushed again. A sync that did not complete (the
        transport may hang again), or a repair that fails, stops the server instead,
        and the reason is returned (None when nothing had to be stopped)."""
        state = self.pool.weights_of(self.server_cfg).state
        if state in (State.DUMMY, State.RESET, State.SYNCED):
            return None
        why = "a weight sync did not complete"
        code = self.server.exit_code()
        if code is not None:
            why = f"it died (exit code {code}) while its weights were in doubt"
        if state is State.CORRUPTED and code is None:
            try:
                if self.client.is_paused():
                    self.client.resume()
                self.sync()
                return None
            except Exception as e:
                why = f"pushing the model again after a deliberate corruption failed: {e}"
        self.pool.discard(self.server_cfg, f"after {self.user}: {why}")
        return f"server {self.server.url} restarted for the next test: {why}"

    def record(self, **metrics: Any) -> None:
        self.metrics.update(metrics)
        if self.on_record is not None:
            self.on_record("metrics", metrics)


def resolve_model_path(model: str) -> str:
    """A zoo model's directory (built on first use), or the path / hub id as given."""
    _, local = models.resolve_model(model)
    return str(local) if local else model


# ----------------------------------------------------------------------------- observing
# What a server answers, asked as the parity checks need it (harness.oracles.parity compares).

@contextlib.contextmanager
def _nonfinite_as_failure(prompt: str):
    try:
        yield
    except ControlPlaneError as e:
        if e.status != 400 or "Out of range float values" not in e.detail:
            raise
        raise parity.NonFiniteOutput(f"non-finite logprobs (NaN/inf) for prompt {prompt!r}: the server "
                              f"refused to serialise them\n{e}") from None


def observe(client, ref: Reference, *, top_k: int | None = None) -> list[parity.Observation]:
    """Ask the server for the greedy continuation and the teacher-forced scores of
    every reference prompt (prompts are sent as token ids: no tokenizer in between)."""
    out = []
    for pr in ref.prompts:
        k = top_k or max((len(t) for t in pr.top_logprobs if t), default=5)
        with _nonfinite_as_failure(pr.prompt):
            c = client.complete(pr.prompt_ids, max_tokens=len(pr.greedy_ids))
            out.append(parity.Observation(c.token_ids, client.prompt_logprobs(pr.sequence, top_k=k),
                                   c.text))
    return out


def observe_generation(client, ref: Reference) -> list[tuple[list[int], list[float] | None]]:
    """Greedy completions with the logprob of each generated token, for
    ``compare_generation`` (these requests may be served from the prefix cache)."""
    out = []
    for pr in ref.prompts:
        with _nonfinite_as_failure(pr.prompt):
            c = client.complete(pr.prompt_ids, max_tokens=len(pr.greedy_ids), logprobs=0)
        out.append((c.token_ids, c.logprobs))
    return out


# ----------------------------------------------------------------------------- the seed flow

@dataclasses.dataclass
class FlowResult:
    """One seed flow on a never-synced server."""

    reference: Reference
    before: parity.ParityReport      # on the dummy weights
    after: parity.ParityReport       # after pause -> sync -> resume
    sync: dict                       # the trainer's result
    # GET /weight_info before the first update (None where the release has no route)
    weight_version_before: str | None = None


def seed_flow(s: SyncSession, *, weights_dir: str | Path | None = None,
              corrupt: str | None = None, pause_mode: str | None = None,
              options: dict | None = None, on_step: OnStep | None = None,
              max_tokens: int | None = None) -> FlowResult:
    """reference -> before -> pause -> sync -> resume -> after. ``on_step(name, **facts)``
    hears each step as it ends: reference, before, pause, sync, resume, after."""
    say = on_step or (lambda name, **facts: None)
    ref = s.reference(weights_dir, **({"max_tokens": max_tokens} if max_tokens else {}))
    say("reference", reference=ref)
    obs = s.observe(ref, phase="before")
    before = parity.compare(obs, ref, decode=s.decode)
    say("before", report=before, texts=[o.text for o in obs])
    version_before = _weight_version_or_none(s.client)
    result = s.sync(weights_dir, corrupt=corrupt, options=options, pause_mode=pause_mode,
                    on_step=say)  # /pause -> the trainer's push -> /resume
    obs_after = s.observe(ref, phase="after")
    after = parity.compare(obs_after, ref, decode=s.decode)
    say("after", report=after, texts=[o.text for o in obs_after])
    return FlowResult(ref, before, after, result, version_before)


def _weight_version_or_none(client) -> str | None:
    """``GET /weight_info``'s version, or None where the server has no such route
    (vLLM 0.26) or the client is not an HTTP one."""
    try:
        return client.weight_info()
    except (ControlPlaneError, AttributeError):
        return None
