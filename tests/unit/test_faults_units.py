"""Issue 12 without a server: the reaper, the API key's path, insecure serialization
only where needed, lies about tensors, the memory-growth judgement, a dead server's
cause, and a failed sync that keeps its own error. Each check is also shown to fail
on the broken behaviour it guards (a leaking series, a reused pid, a dead owner)."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import time
import types

import psutil
import pytest

from harness.run import settings
from harness.run.pool import ServerPool, ServerUnavailable
from harness.run.server_weights import ServerWeights, State
from harness.testing import faults
from harness.trainer.damage import LyingClient, corrupt_weights, lie_about
from harness.trainer.handle import (API_KEY_ENV, FAKE_GPU_UUID, LIES, Trainer, TrainerError,
                                    TrainerSpec)
from harness.vllm import reaper
from harness.vllm.client import ServerClient
from harness.vllm.server import ServerConfig, build_command, build_env

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


def _spawn(env: dict, argv=SLEEP) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _gone(p: subprocess.Popen, within: float = 10.0) -> bool:
    try:
        p.wait(within)
        return True
    except subprocess.TimeoutExpired:
        return False


# ----------------------------------------------------------------------------- reaper

def test_the_reaper_stops_the_orphans_of_a_dead_run_and_nothing_else():
    base = {k: v for k, v in os.environ.items() if k != reaper.OWNER_ENV}
    owner = _spawn(base)                       # stands in for a pytest run
    dead_tag = reaper.owner_tag(owner.pid)
    # an orphan-to-be whose child renames itself (no tag left in its environment, as
    # vLLM's engine core): found through the process group the harness created
    orphan = _spawn({**base, reaper.OWNER_ENV: dead_tag}, [sys.executable, "-c", (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], env={}); "
        "time.sleep(120)")])
    untagged = _spawn(base)
    live = _spawn(reaper.tagged(base))          # owned by this (live) process
    try:
        wait = time.monotonic() + 10
        while not psutil.Process(orphan.pid).children() and time.monotonic() < wait:
            time.sleep(0.05)
        grandchild = psutil.Process(orphan.pid).children()[0]
        assert not reaper.find_orphans() or orphan.pid not in {o.pid for o in reaper.find_orphans()}
        owner.kill()
        owner.wait()
        found = {o.pid for o in reaper.find_orphans()}
        assert orphan.pid in found and untagged.pid not in found and live.pid not in found
        reaper.reap([o for o in reaper.find_orphans() if o.pid == orphan.pid])
        assert _gone(orphan)
        assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
        assert untagged.poll() is None and live.poll() is None, "the reaper stopped a stranger"
    finally:
        for p in (owner, orphan, untagged, live):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_owner_is_alive_only_while_its_pid_has_its_start_time():
    me = reaper.owner_tag()
    assert reaper.owner_alive(me)
    pid, _, t = me.partition(":")
    assert not reaper.owner_alive(f"{pid}:{float(t) - 100:.2f}")  # a reused pid
    assert not reaper.owner_alive("999999999:1.00")               # no such process
    assert reaper.owner_alive("not a tag")  # never judged dead, so never reaped


def test_scratch_of_a_dead_run_is_removed_and_a_live_run_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(reaper, "scratch_base", lambda: str(tmp_path))
    mine = reaper.make_scratch("trainer-shm")
    dead = tmp_path / f"{reaper.SCRATCH_PREFIX}999999999-1.00-trainer-shm-x"
    dead.mkdir()
    assert reaper.remove_orphan_scratch() == [dead]
    assert mine.exists() and not dead.exists()


# ----------------------------------------------------------------------------- the API key

def test_the_api_key_option_reads_cli_and_harness_env_never_vllm_api_key():
    cli = lambda name: "k1" if name == "vllm_api_key" else None
    s = settings.resolve(cli, lambda name: None, environ={})
    assert s.vllm_api_key == "k1" and "k1" not in repr(s)
    assert s.as_dict()["vllm_api_key"] == "(set)"
    s = settings.resolve(lambda n: None, lambda n: None, environ={"HARNESS_API_KEY": "k2"})
    assert s.vllm_api_key == "k2"
    # VLLM_API_KEY is vLLM's own variable: not a harness setting, not a legacy name
    s = settings.resolve(lambda n: None, lambda n: None, environ={"VLLM_API_KEY": "k3"})
    assert s.vllm_api_key is None
    assert settings.BY_NAME["vllm_api_key"].legacy_env is None


def test_the_key_reaches_the_server_by_environment_and_every_client_by_header():
    cfg = ServerConfig(model="/m", api_key="s3cret")
    assert "s3cret" not in " ".join(build_command(cfg, 8000)) and "s3cret" not in repr(cfg)
    assert "api-key" in cfg.describe() and "s3cret" not in cfg.describe()
    assert build_env(cfg)["VLLM_API_KEY"] == "s3cret"
    os.environ["VLLM_API_KEY"] = "ambient"
    try:
        assert "VLLM_API_KEY" not in build_env(ServerConfig(model="/m"))
    finally:
        del os.environ["VLLM_API_KEY"]
    c = ServerClient("http://127.0.0.1:1", api_key="s3cret")
    assert c.session.headers["Authorization"] == "Bearer s3cret"
    assert c.clone().session.headers["Authorization"] == "Bearer s3cret"
    assert "Authorization" not in ServerClient("http://127.0.0.1:1").session.headers


def test_a_trainer_gets_the_key_in_its_environment_and_loses_its_scratch_when_killed(tmp_path):
    spec = TrainerSpec.make(url="http://127.0.0.1:1", engine="shm", packed=False)
    t = Trainer(spec, log_dir=tmp_path, api_key="s3cret")
    t._start()
    try:
        p = psutil.Process(t.pid)
        deadline = time.monotonic() + 10  # until exec has replaced the forked parent
        while "harness.trainer.child" not in " ".join(p.cmdline()) and time.monotonic() < deadline:
            time.sleep(0.02)
        env = p.environ()
        assert env[API_KEY_ENV] == "s3cret" and "s3cret" not in " ".join(p.cmdline())
        assert reaper.owner_alive(env[reaper.OWNER_ENV])
        assert env[reaper.OWNER_ENV].startswith(f"{os.getpid()}:")
        scratch = t.scratch
        assert scratch.is_dir() and scratch.name.startswith(reaper.SCRATCH_PREFIX)
        (scratch / "half-written-bucket").write_bytes(b"x")
    finally:
        t.kill()
    assert not scratch.exists() and t.pid is None


def test_insecure_serialization_only_for_the_backend_that_needs_it(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # from the caller: dropped
    from harness import transfer

    def config(engine):  # as harness.run.cases builds it, from the engine's backend
        return ServerConfig(model="/m", backend=engine, insecure_serialization=transfer.backend(
            engine).insecure_serialization)

    for backend in ("shm", "nccl"):
        cfg = config(backend)
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in build_env(cfg)
        assert "INSECURE" not in cfg.describe()
    ipc = config("ipc")
    assert build_env(ipc)["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert "INSECURE-SERIALIZATION" in ipc.describe()
    argv = build_command(ipc, 8000)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


# ----------------------------------------------------------------------------- lies

def _info():
    return {"names": ["a.weight", "b.weight"], "dtype_names": ["float32", "float32"],
            "shapes": [[4, 2], [3]], "path": "/x"}


def test_each_lie_disagrees_with_the_tensors_in_one_way():
    info = _info()
    names, _ = lie_about(info, "names")
    assert names["names"][0] not in info["names"] and names["shapes"] == info["shapes"]
    shapes, _ = lie_about(info, "shapes")
    assert shapes["shapes"][0] == [5, 2] and shapes["names"] == info["names"]
    dtypes, _ = lie_about(info, "dtypes")
    assert dtypes["dtype_names"][0] == "bfloat16"
    count, _ = lie_about(info, "count")
    assert len(count["shapes"]) == len(info["names"]) - 1
    assert info == _info(), "the original update info was changed"
    handles = [{"GPU-real": ("args", 1)}, {"GPU-real": ("args", 2)}]
    pickled = {**info, "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}
    gpu, _ = lie_about(pickled, "gpu")
    moved = pickle.loads(base64.b64decode(gpu["ipc_handles_pickled"]))
    assert [list(h) for h in moved] == [[FAKE_GPU_UUID]] * 2 and [h[FAKE_GPU_UUID] for h in moved] \
        == [("args", 1), ("args", 2)]
    with pytest.raises(ValueError, match="unknown lie"):
        lie_about(info, "colour")
    assert set(LIES) == {"names", "shapes", "dtypes", "count", "gpu", "rank0-only"}


def test_a_lying_client_lies_only_in_update_weights():
    seen = []
    inner = types.SimpleNamespace(update_weights=seen.append, start_weight_update=lambda: "start")
    liar = LyingClient(inner, "shapes")
    assert liar.start_weight_update() == "start"
    liar.update_weights(_info())
    assert seen[0]["shapes"][0] == [5, 2] and "announced a.weight" in liar.told[0]


def test_rank0_only_sends_the_update_to_global_worker_rank_0_alone():
    """The data- and pipeline-parallel self-tests' damage: vLLM's list form of
    update_info, the real entry for rank 0, an entry of no tensor for every other rank
    of every engine (counted by GET /get_world_size)."""
    seen = []
    inner = types.SimpleNamespace(update_weights=seen.append, world_size=lambda: 2)
    liar = LyingClient(inner, "rank0-only")
    liar.update_weights({**_info(), "path": "/dev/shm/b.safetensors"})
    assert seen[0][0] == {**_info(), "path": "/dev/shm/b.safetensors"}
    assert seen[0][1] == {"names": [], "dtype_names": [], "shapes": [],
                          "path": "/dev/shm/b.safetensors"}
    assert len(seen[0]) == 2 and "rank 0 only" in liar.told[0]
    with pytest.raises(ValueError, match="lie about the ranks"):
        lie_about(_info(), "rank0-only")


def test_the_trainers_client_lies_for_one_sync_and_can_hold_an_update_open(capsys):
    from harness.trainer.child import _SwitchableClient

    seen = []
    inner = types.SimpleNamespace(update_weights=seen.append, start_weight_update=lambda: "ok")
    c = _SwitchableClient(inner, hold_after_start_s=0.2)
    liar = c.lie("count")
    t0 = time.monotonic()
    assert c.start_weight_update() == "ok" and time.monotonic() - t0 >= 0.2
    assert "/start_weight_update acknowledged, holding 0.2s" in capsys.readouterr().out
    c.update_weights(_info())
    c.lie(None)
    c.update_weights(_info())
    assert len(seen[0]["shapes"]) == 1 and seen[1] == _info() and liar.told


def test_narrow_sends_a_shape_the_model_does_not_have():
    import torch

    w = [("a.weight", torch.ones(4, 3)), ("b.weight", torch.ones(4, 3)), ("n", torch.ones(3))]
    out, what = corrupt_weights(w, "narrow", "b.weight")
    assert dict(out)["b.weight"].shape == (4, 2) and dict(out)["a.weight"].shape == (4, 3)
    assert "[4, 2]" in what and "[4, 3]" in what


# ----------------------------------------------------------------------------- growth

MIB = 1 << 20


def test_memory_growth_is_judged_on_medians_after_warm_up():
    flat = [1000 * MIB + (i % 3) * MIB for i in range(50)]
    flat[30] += 200 * MIB  # one transient spike
    assert faults.growth(flat, bound=64 * MIB).ok
    warm = [500 * MIB + i * 20 * MIB for i in range(10)] + [700 * MIB] * 40  # grows, then settles
    assert faults.growth(warm, bound=64 * MIB).ok
    leak = [1000 * MIB + i * 6 * MIB for i in range(50)]  # one 6 MB copy kept per sync
    g = faults.growth(leak, bound=64 * MIB)
    assert not g.ok and "growth +210.0 MiB" in g.describe() and "bound 64 MiB" in g.describe()
    with pytest.raises(ValueError, match="need at least 20"):
        faults.growth(flat[:19], bound=MIB)


def test_probe_reports_no_answer_without_raising():
    from harness.core.facts import free_port

    a = faults.probe(f"http://127.0.0.1:{free_port()}", "GET", "/health", timeout=5)
    assert a.status is None and a.kind == "no answer" and "ConnectionError" in a.error
    assert faults.is_loopback("127.0.0.1") and faults.is_loopback("::1")
    assert not faults.is_loopback("0.0.0.0") and not faults.is_loopback("10.0.0.1")


def test_a_process_tree_is_measured_and_its_sockets_listed():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert ("127.0.0.1", s.getsockname()[1]) in faults.listening([os.getpid()])
    assert faults.tree_rss([os.getpid()]) > 10 * MIB
    assert faults.tree_rss([999999999]) == 0


# ----------------------------------------------------------------------------- a dead server

class _DeadServer:
    url = "http://127.0.0.1:1"

    def __init__(self):
        self.stopped = False

    def alive(self):
        return False

    def exit_code(self):
        return -9

    def describe_failure(self):
        return "server: http://127.0.0.1:1 (x)\n--- last 60 log lines ---\nKilled"

    def stop(self):
        self.stopped = True


def test_a_server_that_died_fails_every_later_request_with_its_cause(tmp_path):
    pool = ServerPool(tmp_path, start_timeout=1, max_alive=1, reap=False)
    cfg = ServerConfig(model="/m")
    dead = pool.servers[cfg] = _DeadServer()
    why = pool.mark_dead(cfg, during="tests/x.py::test_kill")
    assert "died during tests/x.py::test_kill (exit code -9)" in why and "Killed" in why
    assert dead.stopped and cfg not in pool.servers
    for _ in range(2):  # every later test: the same cause, no restart
        with pytest.raises(ServerUnavailable, match="died during tests/x.py::test_kill"):
            pool.get(cfg)
    # found dead by a later get (nobody saw it die): the same, without a test's name
    other = ServerConfig(model="/other")
    pool.servers[other] = _DeadServer()
    with pytest.raises(ServerUnavailable, match="died after it was last handed out"):
        pool.get(other)
    pool.stop_all()


def test_a_failed_sync_keeps_its_own_error_and_says_how_the_server_is(tmp_path):
    from harness.run.flow import SyncSession
    from harness.vllm.client import ControlPlaneError

    s = SyncSession.__new__(SyncSession)
    s.on_record, s.user = None, "test_x"
    calls = []

    class Pool:
        log_dir = tmp_path

        def weights_of(self, cfg):
            return ServerWeights()

        def record_weights(self, cfg, state, weights):
            calls.append(state)

        def trainer(self, cfg, spec):
            return types.SimpleNamespace(sync=lambda *a, **k: (_ for _ in ()).throw(
                TrainerError("trainer (shm) was killed by signal 9")))

    class Client:
        def pause(self, *a):
            pass

        def resume(self):
            raise ControlPlaneError("/resume", None, "ConnectionError: refused")

        def health(self):
            return False

    s.pool, s.client, s.server_cfg, s.model_path = Pool(), Client(), "cfg", "/m"
    s.server = types.SimpleNamespace(url="http://127.0.0.1:1", exit_code=lambda: None,
                                     log_path="/l")
    s.trainer_spec = lambda options=None: "spec"
    s.sync_timeout = 1
    with pytest.raises(TrainerError, match="killed by signal 9") as e:
        s.sync()
    notes = "\n".join(getattr(e.value, "__notes__", []))
    if sys.version_info >= (3, 11):
        assert "does NOT answer 200" in notes and "/resume after the failed sync failed" in notes
    assert calls == [State.INCOMPLETE]


# ----------------------------------------------------------------------------- ordering

BREAKERS = """
import pytest

@pytest.mark.breaks_server
def test_breaker(session):
    pass

def test_plain(session):
    pass

@pytest.mark.fresh_server
def test_fresh(session):
    pass
"""  # on a server (the session fixture); collected only, so none is started


def test_tests_that_may_break_their_server_run_last_on_it(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for opt in settings.OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
    pytester.makepyfile(test_order=BREAKERS)
    r = pytester.runpytest("--collect-only", "-q", "--vllm-backend", "shm", "--vllm-layout", "cpu")
    order = [line.split("::")[1].split("[")[0] for line in r.outlines if "::" in line]
    assert order == ["test_fresh", "test_plain", "test_breaker"], r.outlines
