"""The harness's own logic: comparisons, case naming, server command lines and the
server lifecycle on failure. No vLLM server needed, except where one must crash."""

import json
import types

import pytest

from harness.oracles import parity
from harness.oracles.reference import PromptReference, Reference
from harness.run import flow
from harness.run import layouts
from harness.run.cases import Case, server_config_for
from harness.trainer.damage import corrupt_weights
from harness.transfer import VARIANTS
from harness.vllm.server import ServerConfig, ServerError, VLLMServer, build_command


def _ref(dtype="float32"):
    # one prompt of 2 tokens + 3 generated; position i has logprob -(i / 10)
    seq = [5, 6, 7, 8, 9]
    top = [None] + [{t: -(i / 10), 99: -5.0} for i, t in enumerate(seq[1:], start=1)]
    lps = [None] + [-(i / 10) for i in range(1, 5)]
    return Reference("m", dtype, [PromptReference("p", seq[:2], seq[2:], lps, top, "x")])


def _obs(ref, delta_at=None, delta=0.0, greedy=None):
    pr = ref.prompts[0]
    rows = [None if t is None else dict(t) for t in pr.top_logprobs]
    if delta_at is not None:
        tok = pr.sequence[delta_at]
        rows[delta_at][tok] += delta
    return [parity.Observation(greedy if greedy is not None else list(pr.greedy_ids), rows)]


def test_parity_passes_identical_and_names_worst_position_when_not():
    ref = _ref()
    ok = parity.compare(_obs(ref), ref)
    parity.assert_logprobs_close(ok)
    parity.assert_greedy_equal(ok)
    bad = parity.compare(_obs(ref, delta_at=3, delta=2e-4), ref)
    with pytest.raises(AssertionError) as e:
        parity.assert_logprobs_close(bad)
    msg = str(e.value)
    assert "position 3" in msg and "vllm logprob" in msg and "hf logprob" in msg
    assert bad.worst.position == 3 and bad.worst.generated_index == 1


def test_greedy_divergence_is_a_failure_unless_reference_is_a_near_tie():
    ref = _ref()
    diverged = parity.compare(_obs(ref, greedy=[7, 42, 9]), ref)
    with pytest.raises(AssertionError, match="greedy diverges at generated token 1"):
        parity.assert_greedy_equal(diverged)
    # make the reference's top-2 at that position a near-tie: reported, not failed
    ref.prompts[0].top_logprobs[3] = {8: -0.3, 42: -0.30001}
    tie = parity.compare(_obs(ref, greedy=[7, 42, 9]), ref)
    parity.assert_greedy_equal(tie)
    assert tie.greedy_ties and not tie.greedy_divergence


def test_gibberish_check_rejects_a_server_that_already_matches():
    ref = _ref()
    with pytest.raises(AssertionError, match="already matches"):
        parity.assert_gibberish(parity.compare(_obs(ref), ref))


def test_nonfinite_and_missing_logprobs_fail():
    ref = _ref()
    obs = _obs(ref)
    obs[0].prompt_logprobs[2][7] = float("nan")
    del obs[0].prompt_logprobs[4][9]
    with pytest.raises(AssertionError, match="non-finite.*|.*had no vllm logprob"):
        parity.assert_logprobs_close(parity.compare(obs, ref))


def test_every_dtype_has_a_tolerance_with_a_reason():
    for dtype, tol in parity.TOLERANCES.items():
        assert tol.max_abs_logprob > 0 and len(tol.reason) > 20, dtype
    assert parity.TOLERANCES["float32"].max_abs_logprob <= 1e-4


def test_case_ids_name_backend_layout_dtype_model():
    c = Case(VARIANTS["ipc-packed"], layouts.LAYOUTS["1gpu-colocated"], "float32", "llama")
    assert c.id == "ipc-packed-1gpu-colocated-fp32-llama"
    assert Case(VARIANTS["shm"], layouts.LAYOUTS["cpu"], "bfloat16", "opt").id == "shm-cpu-bf16-opt"


def test_layouts_count_the_gpus_they_need():
    assert layouts.LAYOUTS["cpu"].gpus_needed == 0
    assert layouts.LAYOUTS["1gpu-colocated"].gpus_needed == 1
    assert layouts.LAYOUTS["2gpu-ipc-gpu1"].gpus_needed == 2
    assert layouts.LAYOUTS["3gpu-tp2"].gpus_needed == 3
    assert layouts.LAYOUTS["3gpu-tp2"].tensor_parallel_size == 2


def test_server_command_carries_weight_transfer_flags():
    case = Case(VARIANTS["nccl-packed"], layouts.LAYOUTS["3gpu-tp2"], "float32", "llama")
    cfg = server_config_for(case, "/m")
    argv = build_command(cfg, 8123)
    joined = " ".join(argv)
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    assert "--load-format dummy" in joined and "--tensor-parallel-size 2" in joined
    assert "--attention-backend FLEX_ATTENTION" in joined  # float32 on GPU
    assert "--host 127.0.0.1 --port 8123" in joined
    assert cfg.device_ids == (0, 1)


def test_corruptions_change_what_is_sent():
    import torch

    w = [("a.weight", torch.ones(2, 2)), ("b.weight", torch.zeros(2, 2)), ("n", torch.ones(3))]
    dropped, what = corrupt_weights(w, "drop")
    assert len(dropped) == 2 and "dropped" in what
    scaled, _ = corrupt_weights(w, "scale", "a.weight")
    assert torch.allclose(dict(scaled)["a.weight"], torch.full((2, 2), 1.01))
    swapped, _ = corrupt_weights(w, "swap")
    assert torch.equal(dict(swapped)["a.weight"], torch.zeros(2, 2))
    assert corrupt_weights(w, "nothing")[0] == []
    nan, what = corrupt_weights(w, "nan", "b.weight")
    assert dict(nan)["b.weight"].isnan().all() and dict(nan)["a.weight"].eq(1).all()
    assert what == "set b.weight to NaN"
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt_weights(w, "bogus")


def test_a_taken_port_is_refused(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerError, match="already in use"):
            VLLMServer(ServerConfig(model="x"), log_dir=tmp_path, port=port).start()


class _FakeClient:
    """Answers like vLLM when the model computes NaN: HTTP 400 from its JSON encoder."""

    def __init__(self, detail):
        self.detail = detail

    def complete(self, *a, **kw):
        from harness.vllm.client import ControlPlaneError

        raise ControlPlaneError("/v1/completions", {"prompt": [1]}, self.detail, 400)


def test_nonfinite_server_output_is_a_parity_failure_other_400s_are_not():
    from harness.vllm.client import ControlPlaneError

    ref = _ref()
    nan = '{"error":{"message":"Out of range float values are not JSON compliant"}}'
    with pytest.raises(parity.NonFiniteOutput, match="non-finite logprobs .* prompt 'p'"):
        flow.observe(_FakeClient(nan), ref)
    with pytest.raises(parity.NonFiniteOutput):
        flow.observe_generation(_FakeClient(nan), ref)
    with pytest.raises(ControlPlaneError, match="max_tokens"):
        flow.observe(_FakeClient('{"error":{"message":"max_tokens too large"}}'), ref)


class _FakeTrainer:
    def __init__(self, error=None):
        self.error, self.calls = error, []

    def sync(self, weights_dir, **kw):
        self.calls.append((weights_dir, kw))
        if self.error:
            raise self.error
        return {"sync_seconds": 0.01, "first": len(self.calls) == 1, "corruption": "none"}


def _session(sync_error=None):
    """A SyncSession over a real ServerPool whose server and trainer are fakes: only the
    bookkeeping of what the server holds is under test."""
    from harness.run.flow import SyncSession
    from harness.run.pool import ServerPool

    pool = ServerPool("/tmp", start_timeout=1, max_alive=1)
    cfg = ServerConfig(model="/m")
    pool.servers[cfg] = types.SimpleNamespace(url="http://127.0.0.1:1", start_seconds=0, stop=lambda: None,
                                              version="x", describe_failure=lambda: "",
                                              exit_code=lambda: None, log_path=None)
    pool.discarded = []
    pool.discard = lambda c, why="": pool.discarded.append(c)
    trainer = _FakeTrainer(sync_error)
    pool.trainer = lambda c, spec: trainer
    s = SyncSession.__new__(SyncSession)
    s.case = Case(VARIANTS["shm"], layouts.LAYOUTS["cpu"], "float32", "llama")
    s.pool, s.server_cfg, s.model_path, s.server = pool, cfg, "/m", pool.servers[cfg]
    s.sync_timeout, s.on_record, s.metrics, s.user = 5, None, {}, "test_x"

    class Client:
        def pause(self, *a, **k):
            pass

        resume = pause

        def is_paused(self):
            return False

        def health(self):
            return True

    s.client, s.trainer_calls = Client(), trainer.calls
    return s


def test_a_server_is_resynced_only_when_it_does_not_hold_the_asked_weights():
    from harness.run.server_weights import State

    s = _session()
    assert s.holds is None                 # dummy weights
    s.ensure_holds()
    s.ensure_holds()
    assert [w for w, _ in s.trainer_calls] == ["/m"] and s.holds == "/m"
    s.sync(corrupt="drop")                 # the same directory, but damaged
    assert s.pool.weights_of(s.server_cfg).state is State.CORRUPTED and s.holds is None
    s.ensure_holds()
    assert len(s.trainer_calls) == 3 and s.holds == "/m"


def test_a_corrupted_server_is_repaired_or_stopped_before_the_next_user():
    from harness.run.server_weights import State

    s = _session()
    assert s.leave_healthy() is None and s.trainer_calls == []  # nothing to repair
    s.sync(corrupt="nan")
    assert s.leave_healthy() is None                             # repaired by a full sync
    assert s.trainer_calls[-1] == ("/m", {"corrupt": None, "corrupt_target": None,
                                          "timeout": 5})
    assert s.pool.discarded == [] and s.holds == "/m"
    broken = _session(sync_error=RuntimeError("trainer timed out"))
    broken.pool.record_weights(broken.server_cfg, State.CORRUPTED, "/m")
    why = broken.leave_healthy()
    assert "restarted" in why and "failed: trainer timed out" in why
    assert broken.pool.discarded == [broken.server_cfg]
    # a sync that never completed is not retried (it could hang again): restart
    hung = _session(sync_error=RuntimeError("no answer"))
    with pytest.raises(RuntimeError):
        hung.sync()
    assert hung.pool.weights_of(hung.server_cfg).state is State.INCOMPLETE
    calls = len(hung.trainer_calls)
    assert "a weight sync did not complete" in hung.leave_healthy()
    assert len(hung.trainer_calls) == calls and hung.pool.discarded == [hung.server_cfg]


def test_a_failing_resume_does_not_replace_the_trainers_error_in_the_seed_flow(monkeypatch):
    """The seed flow (demo, repro, the seed fixtures) pauses, syncs and resumes through
    the one paused sync: when the trainer fails and /resume then fails too, the error
    raised is still the trainer's, and it says that /resume failed."""
    import sys

    from harness.vllm.client import ControlPlaneError

    s = _session(sync_error=RuntimeError("trainer: NCCL watchdog timeout"))
    steps, resumes = [], []

    def resume():
        resumes.append(1)
        raise ControlPlaneError("/resume", None, "ConnectionError: refused")

    s.client.resume = resume
    s.reference = lambda weights_dir=None, **kw: "ref"
    s.observe = lambda ref, client=None, phase="observe": []
    s.decode = str
    monkeypatch.setattr(flow.parity, "compare", lambda obs, ref, decode=None: "report")
    with pytest.raises(RuntimeError, match="NCCL watchdog timeout") as e:
        flow.seed_flow(s, on_step=lambda name, **facts: steps.append(name))
    assert resumes == [1]                       # resumed once, after the failed push
    assert steps == ["reference", "before", "pause"]
    if sys.version_info >= (3, 11):
        notes = "\n".join(e.value.__notes__)
        assert "/resume after the failed sync failed too" in notes and "refused" in notes


def test_the_paused_sync_times_its_steps_and_reports_them():
    from harness.run.sync import paused_sync

    calls = []

    class Client:
        def pause(self, mode=None):
            calls.append(("pause", mode))

        def resume(self):
            calls.append(("resume",))

        def is_paused(self):
            return calls[-1][0] == "pause"

    heard = []
    run = paused_sync(Client(), lambda: calls.append(("push",)) or {"bytes": 1},
                      pause_mode="keep", on_step=lambda name, **f: heard.append(
                          (name, f.get("paused"))))
    assert calls == [("pause", "keep"), ("push",), ("resume",)]
    assert heard == [("pause", True), ("sync", None), ("resume", False)]
    assert run.result == {"bytes": 1}
    t = run.timings
    assert t.pause_to_resume_seconds >= t.push_seconds >= 0 and t.resume_seconds >= 0
    calls.clear()
    alone = paused_sync(Client(), lambda: "done", pause=False)
    assert calls == [] and alone.result == "done" and alone.timings.pause_seconds is None


def test_swap_swaps_the_pair_it_names():
    import torch

    w = [("a", torch.zeros(2, 2)), ("b", torch.ones(2, 2)), ("c", torch.full((2, 2), 2.0)),
         ("v", torch.ones(3))]
    swapped, what = corrupt_weights(w, "swap", "c")
    got = dict(swapped)
    assert what == "swapped c and a"
    assert got["c"].eq(0).all() and got["a"].eq(2).all() and got["b"].eq(1).all()
    with pytest.raises(ValueError, match="no other tensor has the shape of v"):
        corrupt_weights(w, "swap", "v")
    with pytest.raises(ValueError, match="not a tensor of the model"):
        corrupt_weights(w, "drop", "nope")


def test_start_wall_time_counts_overlapping_starts_once():
    from harness.run.pool import start_figures

    started = [{"start_seconds": 50, "started_at": 0, "ready_at": 50},
               {"start_seconds": 40, "started_at": 10, "ready_at": 50},   # side by side
               {"start_seconds": 30, "started_at": 100, "ready_at": 130}]  # later, alone
    assert start_figures(started) == {"servers_started": 3, "restarts": 0, "start_seconds_sum": 120,
                                      "start_wall_seconds": 80}


def test_a_fresh_trainer_retires_the_servers_persistent_trainers():
    """A new trainer's /init_weight_transfer_engine replaces the group the persistent
    trainer opened: that trainer must not be used again (it once failed the next test
    with 'outside the initialised root', and over NCCL it would wait on a dead group)."""
    import harness.run.flow as flow

    s = _session()
    dropped = []
    s.pool.drop_trainers = lambda cfg: dropped.append(cfg)
    ran = []
    real = flow.run_trainer
    flow.run_trainer = lambda spec, weights, **kw: ran.append(weights) or {"first": True}
    try:
        s.sync(fresh_trainer=True)
    finally:
        flow.run_trainer = real
    assert ran == ["/m"] and dropped == [s.server_cfg]


def test_cpu_ranks_get_cores_of_their_own(monkeypatch):
    import os

    from harness.vllm.server import ServerError, cpu_binding

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_binding(2) == "0|1"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_binding(2) == "0-3|4-7"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 4, 6})
    assert cpu_binding(2) == "0,2|4,6"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ServerError, match="2 parallel CPU ranks need 2 cores, 1 available"):
        cpu_binding(2)


def test_the_host_facts_name_the_cpu_model_and_the_torch_threads_setting(monkeypatch):
    """Two GPU runs on the same card, half each other's pace, could be told apart only by
    the kernel's build string: the report header now names the CPU model, and the
    OMP_NUM_THREADS that a side-by-side worker's torch threads defer to."""
    import re
    from pathlib import Path

    from harness.core import environment

    m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    assert environment.host()["cpu_model"] == (m.group(1).strip() if m else None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert environment.env_vars()["OMP_NUM_THREADS"] == "3"


def test_the_hosts_cpu_use_is_read_per_kind_and_adds_up(tmp_path):
    """A report says whether a run waited on CPU: /proc/stat's ticks become seconds of
    busy (user, nice, system, irq, softirq), idle, iowait and steal, and a run's use is
    the difference of two readings; without /proc/stat there is no figure."""
    import os

    from harness.core import measure

    hz = os.sysconf("SC_CLK_TCK")

    def stat(*ticks):
        #           user nice system idle iowait irq softirq steal guest guest_nice
        p = tmp_path / f"stat{ticks[0]}"
        p.write_text(f"cpu  {' '.join(str(t * hz) for t in ticks)} 0 0\n"
                     "cpu0 1 2 3 4 5 6 7 8 0 0\ncpu1 1 2 3 4 5 6 7 8 0 0\nintr 5 0\n")
        return measure.cpu_times(str(p))

    a = stat(10, 1, 5, 100, 3, 1, 2, 4)
    assert a == {"cores": 2, "busy": 19, "idle": 100, "iowait": 3, "steal": 4}
    b = stat(40, 1, 15, 120, 4, 1, 7, 10)
    assert measure.cpu_use(a, b) == {"cores": 2, "busy_seconds": 45, "idle_seconds": 20,
                                     "iowait_seconds": 1, "steal_seconds": 6,
                                     "available_seconds": 72}
    assert measure.cpu_times(str(tmp_path / "none")) is None
    assert measure.cpu_use(None, b) is None
