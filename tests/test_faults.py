"""Issue 12: faults on a real server. Bad input, protocol misuse, a trainer that dies,
memory over many syncs, what the server listens on; what vLLM does and what the
harness makes of it.

Every request here has a bound (``ANSWER_WITHIN``, ``SYNC_WITHIN``): a hang is a
failure, never a wait. What vLLM answers is recorded (``harness.record``: the report's
metrics); where it answers a client error with 5xx, or cannot recover, the test
asserts the right behaviour last and a strict known issue (harness/known_issues/known_issues.toml)
carries the version's deviation. docs/faults.md lists every fault and what was seen.

One rule holds throughout: after a failed ``/update_weights`` no completion may reach
the server before a complete sync (known issue failed-update-leaves-reload-open: the
engine dies; tests/test_faults_sessions.py shows it on a server of its own), so every
test that provokes one ends with ``repair``. Tests that may leave the server unusable
are marked ``breaks_server`` and run last on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time
from typing import Any, Callable

import pytest

from harness.core.facts import free_port, wait_until
from harness.oracles import parity
from harness.run.server_weights import State
from harness.testing import faults
from harness.trainer.handle import TrainerError
from harness.vllm import client

pytestmark = pytest.mark.faults

ANSWER_WITHIN = 60.0    # seconds: every route answers a bad request within this
SYNC_WITHIN = 180.0     # seconds: a sync that cannot succeed fails within this
REPORTED_WITHIN = 10.0  # seconds: a dead trainer is reported within this of its death
HUGE = 32 << 20         # bytes of JSON: a huge payload, bounded
INIT, START, UPDATE, FINISH = ("/init_weight_transfer_engine", "/start_weight_update",
                               "/update_weights", "/finish_weight_update")


# ----------------------------------------------------------------------------- helpers

def probe(session, method: str, route: str, **kw: Any) -> faults.Answer:
    return faults.probe(session.server.url, method, route, api_key=session.server_cfg.api_key,
                        timeout=ANSWER_WITHIN, **kw)


def unknown_weights(session) -> None:
    """From here until ``repair`` the server's weights are in doubt: a test that stops
    early leaves a server the harness restarts rather than hands on."""
    session.pool.record_weights(session.server_cfg, State.INCOMPLETE, None)


def assert_alive(session, after: str) -> None:
    code = session.server.exit_code()
    assert code is None, (f"the server died after {after} (exit code {code}):\n"
                          f"{session.server.describe_failure()}")
    assert session.client.health(), (f"/health does not answer 200 after {after}:\n"
                                     f"{session.server.describe_failure()}")


def repair(session) -> None:
    """Close an update a fault left open, resume, and push the model again (a second
    time by a new trainer if the engine was initialised by someone else meanwhile)."""
    probe(session, "POST", FINISH, json={})  # refused when no update is open: fine
    if session.client.is_paused():
        session.client.resume()
    try:
        session.sync()
    except TrainerError:  # that trainer is gone; its successor initialises the engine
        session.sync()


def assert_parity(session, ref) -> None:
    r = session.compare(ref)
    session.record(parity_after=r.metrics())
    parity.assert_greedy_equal(r)
    parity.assert_logprobs_close(r, decode=session.decode)


def assert_client_error(a: faults.Answer, what: str) -> None:
    """Last check of a test: a request the client got wrong is answered 4xx. A 5xx
    blames the server for the client's mistake (known issue engine-errors-answer-500)."""
    assert a.status is not None and 400 <= a.status < 500, (
        f"{what}: {a.route} answered HTTP {a.status}; a client error must be answered "
        f"4xx: {a.body[:300]}")


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:400]


# ----------------------------------------------------------------------------- 1. bad input

def _json(obj: Any) -> Callable[[], dict]:
    return lambda: {"json": obj}


def _raw(body: bytes) -> Callable[[], dict]:
    return lambda: {"data": body, "headers": {"Content-Type": "application/json"}}


def _huge(field: str) -> Callable[[], dict]:
    # a field nobody knows, holding HUGE bytes: the server must refuse it, not choke
    return lambda: {"data": json.dumps({field: {"padding": "x" * HUGE}}).encode(),
                    "headers": {"Content-Type": "application/json"}}


@dataclasses.dataclass(frozen=True)
class Bad:
    id: str
    method: str
    route: str
    request: Callable[[], dict] = lambda: {}
    params: tuple = ()
    ignored_ok: bool = False    # the route ignores what is wrong: 2xx is fine too
    opens_update: bool = False  # /start_weight_update first, so the update's own checks run
    valid_for: tuple = ()       # engines for which this request is not bad at all

    def __str__(self) -> str:
        return self.id


TRUNCATED = b'{"init_info": {"root": '
BAD_INPUT = [
    # /init_weight_transfer_engine {"init_info": {...}}
    Bad("init-malformed-json", "POST", INIT, _raw(TRUNCATED)),
    Bad("init-missing-field", "POST", INIT, _json({})),
    Bad("init-not-an-object", "POST", INIT, _json([1, 2])),
    Bad("init-wrong-type", "POST", INIT, _json({"init_info": 5})),
    # IPC's init info has no required field (0.26: none at all; 0.27.1-0.32: `packed`,
    # default false; read from both sources, answered 200 on 0.26 on an H200): for it an
    # empty init info is a valid init, not a missing field.
    Bad("init-info-missing-fields", "POST", INIT, _json({"init_info": {}}), valid_for=("ipc",)),
    Bad("init-info-unknown-field", "POST", INIT, _json({"init_info": {"no_such_field": 1}})),
    Bad("init-huge", "POST", INIT, _huge("init_info")),
    Bad("init-wrong-method", "GET", INIT),
    # /start_weight_update: no body
    Bad("start-malformed-json", "POST", START, _raw(TRUNCATED), ignored_ok=True),
    Bad("start-wrong-method", "GET", START),
    # /update_weights {"update_info": {...}}, with an update open
    Bad("update-malformed-json", "POST", UPDATE, _raw(TRUNCATED), opens_update=True),
    Bad("update-missing-field", "POST", UPDATE, _json({}), opens_update=True),
    Bad("update-wrong-type", "POST", UPDATE, _json({"update_info": "x"}), opens_update=True),
    Bad("update-info-missing-fields", "POST", UPDATE, _json({"update_info": {}}),
        opens_update=True),
    Bad("update-info-unknown-field", "POST", UPDATE,
        _json({"update_info": {"no_such_field": 1}}), opens_update=True),
    Bad("update-huge", "POST", UPDATE, _huge("update_info"), opens_update=True),
    Bad("update-wrong-method", "GET", UPDATE),
    # /finish_weight_update {"weight_version": str} (0.32; 0.26 takes no body, ignores it)
    Bad("finish-malformed-json", "POST", FINISH, _raw(TRUNCATED), opens_update=True,
        ignored_ok=True),
    Bad("finish-wrong-type", "POST", FINISH, _json({"weight_version": 5}), opens_update=True,
        ignored_ok=True),
    Bad("finish-wrong-method", "GET", FINISH),
    # /pause?mode=...&clear_cache=...
    Bad("pause-unknown-mode", "POST", "/pause", params=(("mode", "no_such_mode"),)),
    Bad("pause-wrong-type", "POST", "/pause", params=(("clear_cache", "maybe"),)),
    Bad("pause-unknown-param", "POST", "/pause", params=(("no_such_param", "1"),),
        ignored_ok=True),
    Bad("pause-huge-body", "POST", "/pause", _huge("padding"), ignored_ok=True),
    Bad("pause-wrong-method", "GET", "/pause"),
    # /resume, /is_paused, /get_world_size
    Bad("resume-malformed-json", "POST", "/resume", _raw(TRUNCATED), ignored_ok=True),
    Bad("resume-wrong-method", "GET", "/resume"),
    Bad("is-paused-unknown-param", "GET", "/is_paused", params=(("no_such_param", "1"),),
        ignored_ok=True),
    Bad("is-paused-wrong-method", "POST", "/is_paused"),
    Bad("world-size-wrong-type", "GET", "/get_world_size", params=(("include_dp", "maybe"),)),
    Bad("world-size-wrong-method", "POST", "/get_world_size"),
]
READ_ONLY = ("/is_paused", "/get_world_size")


@pytest.mark.parametrize("bad", BAD_INPUT, ids=str)
def test_bad_input_is_refused(session, bad):
    """Each route is sent one bad request: it must answer (no hang, no crash), stay
    healthy, and answer 4xx (2xx where the route ignores the bad part)."""
    changes_state = bad.route not in READ_ONLY
    if changes_state:
        unknown_weights(session)
    if bad.opens_update:
        opened = probe(session, "POST", START, json={})
        assert opened.status == 200, f"could not open an update first: {opened}"
    a = probe(session, bad.method, bad.route, params=dict(bad.params), **bad.request())
    session.record(bad_input=bad.id, status=a.status, answer=a.as_dict())
    assert a.status is not None, f"{bad.id}: no answer within {ANSWER_WITHIN:.0f}s: {a}"
    assert_alive(session, f"{bad.id} ({a})")
    if changes_state:
        repair(session)
    if session.case.backend.engine in bad.valid_for:
        assert 200 <= a.status < 300, (f"{bad.id} is a valid request for the "
                                       f"{session.case.backend.engine} engine: {a}")
        return
    if bad.ignored_ok and a.status < 300:
        return
    assert_client_error(a, bad.id)


def test_a_correct_sync_restores_parity_after_bad_input(session):
    """After all of the above (tests run in file order on a shared server)."""
    ref = session.reference()
    session.sync()
    assert_parity(session, ref)


# ----------------------------------------------------------------------------- 2. misuse

def _empty_update_info(session) -> dict:
    """An update info this engine parses, describing no tensor."""
    info: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": []}
    if session.case.backend.engine == "shm":
        info["path"] = "/dev/shm/harness-faults-no-such-bucket.safetensors"
    elif session.case.backend.engine == "ipc":
        info["ipc_handles"] = []
    return info


def test_update_before_start_is_refused(session):
    session.ensure_holds()
    unknown_weights(session)
    a = probe(session, "POST", UPDATE, json={"update_info": _empty_update_info(session)})
    session.record(status=a.status, answer=a.as_dict())
    assert a.status is not None and a.status >= 400, f"an update before any start: {a}"
    assert "start_weight_update" in a.body, f"the refusal does not name the missing step: {a}"
    assert_alive(session, "an update before /start_weight_update")
    repair(session)
    assert_client_error(a, "update before start")


def test_finish_without_start_is_refused(session):
    session.ensure_holds()  # its last sync finished its update: none is open
    unknown_weights(session)
    a = probe(session, "POST", FINISH, json={})
    session.record(status=a.status, answer=a.as_dict())
    assert a.status is not None and a.status >= 400, f"a finish without a start: {a}"
    assert "start_weight_update" in a.body, f"the refusal does not name the missing step: {a}"
    assert_alive(session, "/finish_weight_update without a start")
    repair(session)
    assert_client_error(a, "finish without start")


def test_start_twice_is_refused_and_an_empty_update_keeps_the_weights(session):
    session.ensure_holds()
    ref = session.reference()
    unknown_weights(session)
    first = probe(session, "POST", START, json={})
    second = probe(session, "POST", START, json={})
    finish = probe(session, "POST", FINISH, json={})
    session.record(first=first.status, second=second.status, finish=finish.status,
                   answer=second.as_dict())
    assert first.status == 200 and finish.status == 200, (first, finish)
    assert second.status is not None and second.status >= 400, f"a second start: {second}"
    assert "already active" in second.body or "finish" in second.body, second
    assert_alive(session, "a second /start_weight_update")
    # start + finish with nothing in between must leave the weights as they were
    r = session.compare(ref)
    session.record(empty_update=r.metrics())
    parity.assert_logprobs_close(r, decode=session.decode)
    session.pool.record_weights(session.server_cfg, State.SYNCED, session.model_path)
    assert_client_error(second, "start twice")


@pytest.mark.backends("shm")
def test_update_before_init_is_refused(session):
    """An engine that was never initialised (or was shut down: vLLM >= 0.27 has
    /shutdown_weight_transfer_engine) must refuse an update, naming the missing init."""
    if "/shutdown_weight_transfer_engine" not in session.client.routes():
        pytest.skip(f"vLLM {session.server.version} has no /shutdown_weight_transfer_engine: "
                    "an initialised engine cannot be returned to the never-initialised state")
    session.ensure_holds()
    unknown_weights(session)
    shut = probe(session, "POST", "/shutdown_weight_transfer_engine", json={})
    assert shut.status == 200, shut
    session.pool.drop_trainers(session.server_cfg)  # their engine state is gone
    start = probe(session, "POST", START, json={})
    a = probe(session, "POST", UPDATE, json={"update_info": _empty_update_info(session)})
    session.record(start=start.status, status=a.status, answer=a.as_dict())
    assert a.status is not None and a.status >= 400, f"an update before init: {a}"
    assert "init" in a.body.lower(), f"the refusal does not name the missing init: {a}"
    assert_alive(session, "an update before /init_weight_transfer_engine")
    repair(session)
    assert_client_error(a, "update before init")


@pytest.mark.parametrize("lie", ["names", "shapes", "dtypes", "count"])
def test_metadata_that_disagrees_with_the_tensors_is_refused(session, lie):
    """The trainer sends the right tensors with an update info that lies about them
    (harness.trainer.handle.LIES). The server must refuse within a bound, naming what
    disagrees, and not load garbage; a complete sync afterwards restores parity."""
    session.ensure_holds()
    ref = session.reference(session.perturbed(SELFTEST_LIE_SEED))
    session.sync_timeout = SYNC_WITHIN
    t0 = time.monotonic()
    try:
        # perturbed weights: what the server computes after the lie tells whether it
        # loaded them (the lie ignored), garbage, or nothing
        session.sync(session.perturbed(SELFTEST_LIE_SEED), lie=lie)
        refused = None
    except TrainerError as e:
        refused = e
    elapsed = time.monotonic() - t0
    if refused is None:
        loaded = _what_was_loaded(session, ref)
        session.record(lie=lie, refusal=None, loaded=loaded, seconds=round(elapsed, 2))
        repair(session)
        assert_parity(session, session.reference())
        raise AssertionError(f"the server accepted an update info that lies about {lie}; "
                             f"after it the server computed {loaded}")
    session.record(lie=lie, refusal=first_line(refused), seconds=round(elapsed, 2))
    assert elapsed < SYNC_WITHIN + 30
    assert "did not finish within" not in str(refused), (
        f"the server did not refuse an update info that lies about {lie}: the sync hung "
        f"until the harness's bound ({SYNC_WITHIN:.0f}s)")
    assert "/update_weights" in str(refused), f"not refused by /update_weights: {refused}"
    assert_alive(session, f"an update whose info lies about {lie}")
    repair(session)
    assert_parity(session, session.reference())
    # last: the refusal must blame the client (a 5xx is known issue engine-errors-answer-500)
    r = client.refusal_in(refused)
    assert r is not None, f"the refusal of a lie about {lie} carries no HTTP status: {refused}"
    assert_client_error(faults.Answer(route=r.route, status=r.status, seconds=elapsed,
                                      body=r.detail),
                        f"an update info that lies about {lie}")


SELFTEST_LIE_SEED = 401


def _what_was_loaded(session, ref) -> str:
    """After an update that should have been refused: the weights it carried (the lie
    was ignored), or something else (what the lie described, or garbage)."""
    try:
        r = session.compare(ref)
    except parity.NonFiniteOutput as e:
        return f"non-finite logprobs ({first_line(e)})"
    if r.tokens_compared and not r.missing and r.max_abs <= parity.tolerance_for(
            r.dtype).max_abs_logprob:
        return (f"the weights the update carried (max |dlogprob| {r.max_abs:.2g} against "
                "their reference): the lie was ignored")
    return f"something else than the weights the update carried ({r.summary()})"


@pytest.mark.backends("ipc-packed", "ipc-unpacked")
def test_ipc_handles_for_another_gpu_are_refused(session):
    session.ensure_holds()
    ref = session.reference()
    session.sync_timeout = SYNC_WITHIN
    with pytest.raises(TrainerError) as e:
        session.sync(lie="gpu")
    session.record(refusal=first_line(e.value))
    assert "IPC handle" in str(e.value) or "UUID" in str(e.value), e.value
    assert_alive(session, "IPC handles keyed by another GPU")
    repair(session)
    assert_parity(session, ref)


def _until_usable(session, within: float) -> float | None:
    """Seconds until the server answers a completion again (None: not within)."""
    prompt = session.reference().prompts[0].prompt_ids
    t0 = time.monotonic()
    try:
        wait_until(lambda: session.client.complete(prompt, max_tokens=1, timeout=30),
                   timeout=within, interval=5.0, what="a completion")
    except Exception:
        return None
    return time.monotonic() - t0


@pytest.mark.breaks_server
@pytest.mark.backends("nccl-packed", "nccl-unpacked")
def test_nccl_init_with_the_wrong_world_size_is_bounded(session):
    """The trainer opens the rendezvous for one rank more than the server has: both
    sides wait for a rank that never comes. The harness must give up within its bound;
    the record says how long the server stays unusable (the TCPStore timeout)."""
    ws = session.client.world_size()
    session.sync_timeout = SYNC_WITHIN
    unknown_weights(session)
    t0 = time.monotonic()
    with pytest.raises(TrainerError) as e:
        session.sync(fresh_trainer=True, options={"world_size": ws + 2, "step_timeout_s": 60})
    elapsed = time.monotonic() - t0
    back = _until_usable(session, 420)
    session.record(refusal=first_line(e.value), seconds=round(elapsed, 1),
                   usable_again_after=back)
    assert elapsed < SYNC_WITHIN
    assert back is not None, "the server did not generate again within 420s"
    repair(session)


@pytest.mark.breaks_server
@pytest.mark.backends("nccl-packed", "nccl-unpacked")
def test_nccl_init_with_a_rendezvous_nobody_listens_on_is_bounded(session):
    ws = session.client.world_size()
    unknown_weights(session)
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
            "world_size": ws + 1}
    a = faults.probe(session.server.url, "POST", INIT, json={"init_info": init}, timeout=60,
                     api_key=session.server_cfg.api_key)
    back = _until_usable(session, 420)
    session.record(answer=a.as_dict(), usable_again_after=back)
    assert back is not None, f"the server did not generate again within 420s; init: {a}"
    session.pool.drop_trainers(session.server_cfg)
    repair(session)


# Issue 58 (docs/vllm-rl-matrix.md row 64): weight loaders that check dtypes (vllm #51792).
DTYPE_SEEDS = (5841, 5842)


def _other_dtype(dtype: str) -> str:
    return "bfloat16" if dtype == "float32" else "float32"


def test_an_update_in_another_dtype_is_refused_and_keeps_the_weights(session):
    """A trainer that holds its weights in another dtype than the server's and sends
    them as they are, announcing that dtype (bfloat16 into the float32 server, the
    suite's default). The update must be refused with a 4xx that names a tensor, and
    the weights keep their digests (/weight_checker where the release has it, else the
    output of the weights held before); a 5xx is no refusal, a 200 is a silent cast.
    vLLM 0.32.0's loaders copy into the parameter, which casts (known issue
    update-in-another-dtype-is-cast)."""
    s = session
    old, new = (s.perturbed(x) for x in DTYPE_SEEDS)
    s.ensure_holds(old)
    ref_old = s.reference(old)
    checker = "/weight_checker" in s.client.openapi().get("paths", {})
    before = s.client.weight_checksums() if checker else None
    sent = _other_dtype(s.case.dtype)
    s.sync_timeout = SYNC_WITHIN
    error: Exception | None = None
    try:
        s.sync(new, trainer_dtype=sent)
    except TrainerError as e:
        error = e
    unknown_weights(s)
    assert_alive(s, f"an update of {sent} tensors into a {s.case.dtype} server")
    probe(s, "POST", FINISH, json={})   # close an update the refusal left open
    if s.client.is_paused():
        s.client.resume()
    after = s.client.weight_checksums() if checker else None
    changed = sorted(k for k in (after or {}) if after[k] != (before or {}).get(k))
    kept = s.compare(ref_old)
    refusal = client.refusal_in(error) if error is not None else None
    s.record(sent_dtype=sent, server_dtype=s.case.dtype,
             answer=f"HTTP {refusal.status}: {refusal.detail[:300]}" if refusal
             else (first_line(error) if error else "200"),
             digests_changed=len(changed), first_changed=changed[:3],
             vs_weights_held_before=kept.metrics())
    repair(s)
    assert_parity(s, s.reference())
    names = tuple(_tensor_names(s.model_path))
    client.assert_refused(error, what=f"an update of {sent} tensors into a {s.case.dtype} "
                                      "server", names=names)
    assert not changed, (f"a refused update of {sent} tensors changed {len(changed)} weight "
                         f"digest(s), e.g. {changed[:3]}")
    parity.assert_logprobs_close(kept, decode=s.decode)


def _tensor_names(model_dir: str) -> list[str]:
    from pathlib import Path

    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            names += list(st.keys())
    return names


# ----------------------------------------------------------------------------- 3. trainer death

# How each backend holds a trainer with its update open, and the line its log prints
# there: shm after the first of several buckets was loaded; NCCL with /update_weights
# in flight and the worker waiting in the broadcast (the harness-driven path of 0.26 and
# 0.27; on 0.32's trainer engine, after /start_weight_update); IPC after
# /start_weight_update.
HOLD = {"shm": ({"bucket_bytes": 1 << 20, "bucket_delay_s": 120.0}, "bucket(s) acknowledged"),
        "nccl": ({"hold_before_broadcast_s": 120.0}, "holding"),
        "ipc": ({"hold_after_start_s": 120.0}, "/start_weight_update acknowledged, holding")}


def test_a_trainer_killed_mid_update_is_reported_and_recoverable(session):
    """SIGKILL to the persistent trainer while its update is open on the server. The
    harness reports the death within seconds, removes what the trainer left, and says
    whether the server survived; a complete sync must then restore parity."""
    session.ensure_holds()
    ref = session.reference()
    session.sync_timeout = SYNC_WITHIN
    options, marker = HOLD[session.case.backend.engine]
    trainer = session.pool.trainer(session.server_cfg, session.trainer_spec(options))
    outcome: dict[str, Any] = {}

    def sync() -> None:
        try:
            session.sync(options=options)
            outcome["result"] = "completed"
        except BaseException as e:  # surfaced below
            outcome["error"], outcome["at"] = e, time.monotonic()

    t = threading.Thread(target=sync, daemon=True)
    t.start()
    try:
        wait_until(lambda: trainer.pid and marker in trainer.log_tail(400), timeout=SYNC_WITHIN,
                   interval=0.2, what="the trainer to hold with its update open",
                   abort=lambda: "error" in outcome and f"the sync failed first: {outcome}")
    except Exception:
        raise AssertionError(f"the trainer never held its update open: {outcome}\n"
                             f"{trainer.log_tail()}") from None
    pid, scratch = trainer.pid, trainer.scratch
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(SYNC_WITHIN)
    assert not t.is_alive(), f"the harness did not report the trainer's death in {SYNC_WITHIN}s"
    err = outcome.get("error")
    assert isinstance(err, TrainerError), f"expected a TrainerError, got {outcome}"
    reported = outcome["at"] - killed
    notes = "\n".join(getattr(err, "__notes__", []))
    session.record(reported_after=round(reported, 2), error=first_line(err), server=notes)
    assert reported < REPORTED_WITHIN, f"reported {reported:.1f}s after the death"
    assert "killed by signal 9" in str(err), err
    assert notes.startswith("server "), f"the error does not say how the server is: {notes!r}"
    # cleaned up: no trainer process, no scratch directory left
    assert not trainer.alive() and not faults_pid_alive(pid), "the killed trainer lingers"
    assert scratch is not None and not scratch.exists(), f"{scratch} was left behind"
    assert_alive(session, "the trainer's death")  # and the note said so
    assert "process alive" in notes, notes
    # Does a complete sync by a new trainer restore parity? Not on vLLM 0.32 (the dead
    # trainer's update is still open); the harness's way out is /finish, then a sync.
    session.pool.drop_trainers(session.server_cfg)
    try:
        session.sync()
        plain = "restored"
    except TrainerError as e:
        plain = first_line(e)
        closed = probe(session, "POST", FINISH, json={})
        session.record(finish_after_death=closed.status)
        session.sync()
    assert_parity(session, ref)
    session.record(complete_sync_after_death=plain)
    assert plain == "restored", (
        f"after the trainer died mid-update, a complete sync was refused: {plain}; only "
        "/finish_weight_update, then a sync, restored parity")


def faults_pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ----------------------------------------------------------------------------- 5. leaks

ROUNDS = 50
WARMUP = 10
# A model whose syncs are large enough that one leaked copy per sync (what vllm#52950
# did with GPU memory) stands far above the allocators' noise: 128 MB of float32 weights
# (a weightless sized Llama; the trainer draws them), so such a leak grows memory by
# about 35 copies, 4.5 GB, between the judged windows. The zoo llama (5.8 MB a sync)
# leaking one copy per sync grew a GPU server by 232 MB over 40 rounds, under the
# absolute 256 MiB bound this check had before (1 x H200, vLLM 0.26.0).
MEMORY_MODEL = "sized-128mb"
# Bound, for host and GPU memory alike: 64 MiB of slack, plus two copies of what one sync
# moves (a reload may hold one copy while it loads the next). Relative to the sync, so a
# leak of one copy per sync fails whatever the model's size.
SLACK = 64 << 20
COPIES = 2


def _memory_rounds(session, rounds: int, options: dict | None = None) -> dict:
    """``rounds`` syncs; after each, the server tree's RSS and GPU memory."""
    pids = session.server.pids()
    rss, gpu, seconds, moved = [], [], [], 0
    for _ in range(rounds):
        t0 = time.monotonic()
        moved = session.sync(options=options)["bytes"]
        seconds.append(round(time.monotonic() - t0, 3))
        rss.append(faults.tree_rss(pids))
        gpu.append(faults.gpu_memory(pids))
    bound = SLACK + COPIES * moved
    host = faults.growth(rss, bound=bound, warmup=WARMUP)
    dev = faults.growth(gpu, bound=bound, warmup=WARMUP) if all(g is not None for g in gpu) \
        else None
    session.record(rss_per_round=rss, gpu_memory_per_round=gpu, sync_seconds_per_round=seconds,
                   bytes_per_sync=moved, bound=bound, rss_growth=host.growth,
                   gpu_growth=dev.growth if dev else None)
    return {"host": host, "gpu": dev}


@pytest.mark.models(MEMORY_MODEL)
def test_repeated_syncs_do_not_grow_memory(session):
    """50 syncs through the persistent trainer: neither the server's host memory nor its
    GPU memory may grow by more than two copies of one sync (plus slack). The model's
    values are random (a sized model): this test judges memory, not parity."""
    got = _memory_rounds(session, ROUNDS)
    assert got["host"].ok, got["host"].describe("server RSS (whole process tree)")
    if got["gpu"] is not None:
        assert got["gpu"].ok, got["gpu"].describe("server GPU memory")


@pytest.mark.selftest
@pytest.mark.breaks_server
@pytest.mark.backends("shm")
@pytest.mark.models(MEMORY_MODEL)
def test_the_memory_check_fails_on_a_server_that_keeps_every_update(session):
    """The check above, against a server that keeps a copy of every update (the shm
    engine's deliberate leak, on the model's device: host memory on a CPU layout, GPU
    memory on a GPU one): it must fail. The server is stopped afterwards."""
    session.pool.drop_trainers(session.server_cfg)  # the leaking trainer inits anew
    session.pool.record_weights(session.server_cfg, State.CORRUPTED, None)
    try:
        got = _memory_rounds(session, WARMUP + 10, options={"retain_updates": True})
    finally:
        session.pool.discard(session.server_cfg, "the memory self-test left it holding a "
                                                 "copy of every update")
    judged = got["gpu"] if session.case.layout.server_gpus else got["host"]
    session.record(leak_detected=not judged.ok, judged=judged.describe())
    assert not judged.ok, ("a server that keeps a copy of every update passed the memory "
                           f"check: {judged.describe()}")


# ----------------------------------------------------------------------------- 6. exposure

@pytest.mark.backends("shm", "ipc-packed", "ipc-unpacked")
def test_the_server_listens_only_on_loopback(session):
    """The harness starts servers on 127.0.0.1 (an ``--host`` in extra_args would
    override it); nothing in the server's process tree may listen elsewhere. (NCCL
    workers that joined a group also listen where NCCL chooses: recorded by
    test_nccl_rendezvous_listens_where_it_was_told.)"""
    sockets = faults.listeners(session.server.pids())
    session.record(listening=[str(x) for x in sockets],
                   insecure_serialization=session.server_cfg.insecure_serialization)
    assert sockets, "found no listening socket at all (cannot judge)"
    wide = [x for x in sockets if not faults.is_loopback(x.address)]
    if not wide:
        return
    # Say what it is: which process, whether it is the engine's own torch.distributed
    # rendezvous (vLLM logs its distributed_init_method), and what a connection finds.
    # the whole log: vLLM logs its distributed_init_method once, early in the start, and a
    # tail of a long-lived server no longer holds it (missed on 1 x H200, 0.26.0)
    path = session.server.log_path
    log = path.read_text(errors="replace") if path and path.exists() else ""
    found = []
    for x in wide:
        what = ("the port of vLLM's distributed_init_method (torch.distributed TCPStore)"
                if re.search(rf"distributed_init_method=tcp://[^\s:]+:{x.port}\b", log)
                else "not vLLM's logged distributed_init_method")
        found.append(f"{x}: {what}; from loopback it {faults.answers_on(x.port)}")
    session.record(wide=found)
    raise AssertionError("the server listens beyond loopback:\n  " + "\n  ".join(found))


@pytest.mark.backends("nccl-packed", "nccl-unpacked")
def test_nccl_rendezvous_listens_where_it_was_told(session):
    """The trainer's rendezvous (TCPStore) listens on master_address, 127.0.0.1 by
    default; NCCL's own bootstrap sockets are recorded (to be judged on GPU)."""
    session.ensure_holds()
    trainer = session.pool.trainer(session.server_cfg, session.trainer_spec())
    result = session.sync()
    sockets = faults.listening([trainer.pid])
    port = result.get("master_port")
    session.record(trainer_listening=[f"{a}:{p}" for a, p in sockets], master_port=port,
                   server_listening=[f"{a}:{p}" for a, p in
                                     faults.listening(session.server.pids())])
    store = [a for a, p in sockets if p == port]
    assert all(faults.is_loopback(a) for a in store), f"TCPStore listens on {store}"


# ----------------------------------------------------------------------------- may break the server

@pytest.mark.breaks_server
def test_a_second_init_cuts_off_the_first_trainer_cleanly(session):
    """Another trainer initialises the engine again; the first one's next sync must
    fail within its bound (or work), and a new trainer must restore parity."""
    session.ensure_holds()
    ref = session.reference()
    session.sync_timeout = SYNC_WITHIN
    unknown_weights(session)
    session.sync(fresh_trainer=True)          # a second trainer: init again, then gone
    t0 = time.monotonic()
    try:
        session.sync()                        # the first trainer, on its old group or root
        first = "succeeded"
    except TrainerError as e:
        first = first_line(e)
    elapsed = time.monotonic() - t0
    session.record(first_trainer_after_second_init=first, seconds=round(elapsed, 2))
    assert elapsed < SYNC_WITHIN
    assert_alive(session, "a second /init_weight_transfer_engine")
    repair(session)
    assert_parity(session, ref)


@pytest.mark.breaks_server
def test_an_update_the_model_cannot_take_leaves_later_updates_working(session):
    """One tensor of a shape the model does not have, its update info agreeing with
    it (corrupt="narrow"): the update must be refused, and later complete syncs must
    still work. On vLLM 0.32 the refused load leaves the layerwise reload in a state
    where every later update fails (known issue wrong-shape-breaks-later-updates)."""
    session.ensure_holds()
    session.sync_timeout = SYNC_WITHIN
    with pytest.raises(TrainerError) as e:
        session.sync(corrupt="narrow")
    session.record(refusal=first_line(e.value))
    assert_alive(session, "an update of the wrong shape")
    later = []
    for _ in range(3):
        probe(session, "POST", FINISH, json={})
        try:
            session.sync()
            later.append("ok")
        except TrainerError as err:
            later.append(first_line(err))
    session.record(later_syncs=later)
    assert later == ["ok"] * 3, f"complete syncs after the refused update: {later}"
    assert_parity(session, session.reference())
