"""The server plan (harness.run.plan) and the pool that follows it: each configuration
starts once, the variants of one engine take turns on its one server (each seed flow
after a planned reset of the weights), and a restart is never planned; when one
happens anyway the pool says why. The -k ipc plan for one GPU and the -k "nccl or ipc" plan for two are checked on
this host, whatever it has (--harness-plan-host)."""

from __future__ import annotations

import re
import threading

import pytest

from child_pytest import CPU_HOST, H200_HOST, NO_GPU
from harness.core import reportfile
from harness.run import plan as P
from harness.run.pool import ServerPool
from harness.run.server_weights import State
from harness.vllm.server import ServerConfig

HOST = P.Host(gpus=1, cores=16, gpu_memory_gib=141, ram_gib=128)
# a whole GPU run whose tests' timings say which waited for the GPU-memory lock
GPU_SLEEP_REPORT = "reports/gpu/h200-vllm-0.26.0-k-ipc-complete-786s.json.gz"


def _cfg(model="llama", dtype="float32", load="dummy"):
    return ServerConfig(model=f"/zoo/{model}", backend="ipc", dtype=dtype, load_format=load,
                        device_ids=(0,))


# ----------------------------------------------------------------------------- the real selection

@pytest.mark.parametrize("host,selection", [
    (H200_HOST, "ipc and not smollm2"),
    ("gpus=2,cores=32,ram_gib=256", "nccl or ipc"),
], ids=["1gpu-k-ipc", "2gpu-k-nccl-or-ipc"])
def test_the_gpu_selections_plan_no_restart(child_pytest, host, selection):
    plan = child_pytest.plan(host, "-k", selection)
    configs = [s["config"] for s in plan["servers"]]
    assert len(configs) == len(set(configs)) == plan["starts"], "a configuration planned twice"
    # one server per configuration: the variants share it, the seed flows after the
    # first on reset weights
    assert not any("for=" in c for c in configs), "a server per trainer variant"
    dummies = [c for c in configs if "load=dummy" in c]
    twins = [c for c in configs if "load=auto" in c]
    assert twins and plan["resets"], "the variants' seed flows share a server"
    if selection == "ipc and not smollm2":  # the GPU CI selection
        # 28 for the selection of issue 31 (one server per configuration), plus the
        # servers of scenarios added since: each model runner, sleep with CUDA graphs,
        # the hybrid model, LoRA
        extra = [c for c in configs if " mrv" in c or ("mode=graphs" in c and "sleep" in c)
                 or c.startswith("nemotron-h") or " lora" in c]
        assert len(configs) - len(extra) <= 30, (len(configs), extra)
    # the GPU 1 mirror (IPC handles matched by device identity) runs the default model's
    # plain engine only; GPU 0 runs the other architectures, modes, features and twins
    mirror = [c for c in configs if " gpu1 " in c]
    assert bool(mirror) == ("nccl" in selection)
    assert all(re.match(r"llama-[0-9a-f]{12} \S+ backend=ipc load=dummy gpu1 tp=1 INSECURE", c)
               for c in mirror), mirror
    # rollout servers as RL teams run them: vLLM's default mode for every variant, with
    # a disk-loaded twin in that mode; an fp8 server and its fp8 twin
    for engine in ("ipc",) + (("nccl",) if "nccl" in selection else ()):
        assert any(f"backend={engine}" in c and "mode=graphs" in c for c in dummies), engine
        assert any(f"backend={engine}" in c and "quant=fp8" in c for c in dummies), engine
    assert any("mode=graphs" in c for c in twins) and any("quant=fp8" in c for c in twins)
    assert any("sleep-mode" in c for c in dummies) and any("api-servers=2" in c for c in dummies)
    assert plan["host"]["gpus"] == int(host.split(",")[0].split("=")[1])
    assert plan["expected"]["wall_seconds"] > 0 and sum(plan["expected"]["waves"]) == len(configs)


# ----------------------------------------------------------------------------- the plan itself

def test_each_trainers_tests_together_fresh_first_twins_then_breaking_tests_last():
    """A test that needs the disk-loaded twin comes after the server's other tests (the
    server's chain starts while its twin still starts), a test that may break the server
    after all."""
    cfg, twin = _cfg(), _cfg(load="auto")
    needs = [P.ServerNeed("t_break", cfg, breaks=True, trainer="ipc-packed"),
             P.ServerNeed("t_plain_u", cfg, trainer="ipc-unpacked"),
             P.ServerNeed("t_twin", cfg, twin, trainer="ipc-packed"),
             P.ServerNeed("t_fresh_u", cfg, fresh=True, trainer="ipc-unpacked"),
             P.ServerNeed("t_fresh", cfg, fresh=True, trainer="ipc-packed")]
    ordered = sorted(needs, key=P.order_key)
    assert [n.test for n in ordered] == ["t_fresh", "t_fresh_u", "t_plain_u", "t_twin",
                                         "t_break"]
    plan = P.make_plan(ordered, HOST)
    assert plan.starts() == 2
    assert [p.config for p in plan.servers] == [cfg, twin]
    assert plan.last_use() == {"t_break": [cfg], "t_twin": [twin]}
    assert plan.resets == []


def test_tests_that_sleep_their_server_come_after_its_other_tests_before_breaking_ones():
    """A sleep or a wake waits for the GPU-memory lock, that is for every start under way
    on the GPU: on the nineteenth GPU visit (H200) the sleep tests in the middle of a chain
    waited 376 s while the servers started, and 0-5 s each after the last start. So a
    server's sleeping tests run after its other tests (twins' included), and a test
    that may break the server still last."""
    cfg, twin = _cfg(), _cfg(load="auto")
    needs = [P.ServerNeed("t_break", cfg, breaks=True, trainer="ipc-packed"),
             P.ServerNeed("t_sleep_u", cfg, sleeps=True, trainer="ipc-unpacked"),
             P.ServerNeed("t_sleep", cfg, sleeps=True, trainer="ipc-packed"),
             P.ServerNeed("t_twin_u", cfg, twin, trainer="ipc-unpacked"),
             P.ServerNeed("t_plain_u", cfg, trainer="ipc-unpacked"),
             P.ServerNeed("t_fresh", cfg, fresh=True, trainer="ipc-packed")]
    ordered = sorted(needs, key=P.order_key)
    assert [n.test for n in ordered] == ["t_fresh", "t_plain_u", "t_twin_u", "t_sleep",
                                         "t_sleep_u", "t_break"]
    plan = P.make_plan(ordered, HOST)
    assert plan.resets == [] and plan.starts() == 2


def test_every_test_that_waited_for_the_gpu_memory_lock_is_marked_sleeps():
    """The order above needs the ``sleeps`` marker on every test that sleeps or wakes a
    pool server. The committed GPU run's report says which waited for the lock (a
    ``lock_wait`` in its timing); each such function must carry the marker, on itself
    or on its module."""
    import ast
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    report = json.loads(reportfile.read_text(root / GPU_SLEEP_REPORT))
    waited = {t["nodeid"].split("[")[0] for t in report["tests"]
              if "lock_wait" in (t.get("timing") or {})}
    assert len(waited) >= 20, waited

    def sleeps(node) -> bool:
        return any(ast.unparse(d).startswith("pytest.mark.sleeps")
                   for d in (node.elts if isinstance(node, ast.List) else [node]))

    marked = set()
    for path in sorted((root / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module = any(isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "pytestmark"
                     and sleeps(n.value) for n in tree.body)
        marked |= {f"tests/{path.name}::{n.name}" for n in tree.body
                   if isinstance(n, ast.FunctionDef)
                   and (module or any(sleeps(d) for d in n.decorator_list))}
    assert sorted(waited - marked) == []


def test_a_fresh_test_after_a_sync_is_a_planned_reset_not_a_restart():
    """Run after another variant synced, a seed flow needs never-synced weights: the
    plan counts a reset of the weights (SyncSession.reset_weights), never a restart."""
    shared = _cfg()
    needs = [P.ServerNeed("a_fresh", shared, fresh=True), P.ServerNeed("a_plain", shared),
             P.ServerNeed("b_fresh", shared, fresh=True)]
    plan = P.make_plan(needs, HOST)
    assert plan.starts() == 1 and len(plan.resets) == 1
    assert "b_fresh needs never-synced weights after a_plain synced them" in plan.resets[0][1]


def test_a_second_breaking_test_is_a_contingent_restart():
    cfg = _cfg()
    plan = P.make_plan([P.ServerNeed("x", cfg, breaks=True), P.ServerNeed("y", cfg, breaks=True)], HOST)
    assert len(plan.contingent) == 1
    assert "x may break it; y runs on it later" in plan.contingent[0][1]


def test_the_expected_waves_follow_the_bounds():
    cfgs = [_cfg(model=f"m{i}") for i in range(5)]
    needs = [P.ServerNeed(f"t{i}", c) for i, c in enumerate(cfgs)]
    plan = P.make_plan(needs, HOST, max_starting=2, max_alive=3)
    sched = P.simulate(plan, lambda n: 10.0 * n, lambda need: 1.0)
    assert [len(w) for w in sched.waves][:1] == [2]
    assert all(len(w) <= 2 for w in sched.waves) and sum(map(len, sched.waves)) == 5
    # never more than 3 alive or starting: each start waits for a release
    for k in range(5):
        alive = sum(1 for j in range(5) if sched.start_at[j] <= sched.start_at[k]
                    and plan.servers[j].last >= plan.servers[k].first - 1 and j <= k)
        assert alive <= 3
    assert sched.wall_seconds >= sched.ready_at[-1] + 1.0


def test_host_bounds():
    assert HOST.max_starting() == 8 and P.Host(0, 2, 0, 24).max_starting() == 2 and P.Host(0, 1, 0, 24).max_starting() == 1
    gpu = [_cfg(model=f"m{i}") for i in range(40)]
    assert HOST.max_alive(gpu) == int(141 * 5 / 6 // P.Host.GPU_SERVER_GIB)
    cpu = [ServerConfig(model="/m")]
    assert P.Host(0, 2, 0, 24).max_alive(cpu) == int(24 * 5 / 6 // P.Host.CPU_SERVER_GIB)
    two = P.Host.parse("gpus=2,cores=32", P.Host(0, 2, 0.0, 24))
    assert (two.gpus, two.cores, two.gpu_memory_gib, two.measured) == (2, 32, 141.0, False)
    for bad in ("gpus", "gpus=x", "cores=0", "nonsense=1"):
        with pytest.raises(ValueError):
            P.Host.parse(bad, HOST)


# ----------------------------------------------------------------------------- the pool follows it

class _FakeServer:
    def __init__(self, cfg, *, log_dir, start_timeout):
        self.cfg, self.url, self.version, self.log_path = cfg, "http://127.0.0.1:9", "x", None
        self.start_seconds = None

    def start(self):
        _FakeServer.gate.wait(10)
        self.start_seconds = 0.0
        return self

    def alive(self):
        return True

    def stop(self):
        pass

    def cancel(self):  # a start not launched yet: the real one also never launches it
        self.stop()

    def describe_failure(self):
        return ""


@pytest.fixture
def fake_pool(monkeypatch, tmp_path):
    import harness.run.pool as pool_module

    _FakeServer.gate = threading.Event()
    _FakeServer.gate.set()
    monkeypatch.setattr(pool_module, "VLLMServer", _FakeServer)
    monkeypatch.setattr(pool_module.models, "ensure_built", lambda path: None)
    pools = []

    def make(**kw):
        p = ServerPool(tmp_path, start_timeout=5, reap=False, **kw)
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.stop_all()


def test_the_pool_starts_the_plan_in_order_within_its_bounds(fake_pool):
    cfgs = [_cfg(model=f"m{i}") for i in range(4)]
    _FakeServer.gate.clear()            # starts hang until released
    pool = fake_pool(max_alive=3, max_starting=2)
    pool.plan(cfgs)
    assert list(pool._starting) == cfgs[:2]
    _FakeServer.gate.set()
    for c in cfgs[:3]:
        pool.get(c, user="t")
    assert len(pool.servers) == 3 and cfgs[3] not in pool.servers
    pool.release(cfgs[0])
    pool.get(cfgs[3])
    assert sorted(r["config"] for r in pool.started) == sorted(c.describe() for c in cfgs)
    assert pool.restarts == [] and pool.start_figures()["restarts"] == 0


def test_every_restart_is_recorded_with_its_reason(fake_pool):
    cfg, other = _cfg(), _cfg(model="unplanned")
    pool = fake_pool(max_alive=2)
    pool.plan([cfg])
    pool.get(cfg, user="t1")
    pool.record_weights(cfg, State.SYNCED, "/w")
    pool.get(cfg, new_engine=True, user="t2")   # a test that needs a brand-new engine
    pool.discard(cfg, "after t3: a weight sync did not complete")
    pool.get(cfg, user="t4")
    pool.get(other, user="t5")
    reasons = [r["reason"] for r in pool.restarts]
    assert len(reasons) == 2 and pool.start_figures()["restarts"] == 2
    assert "t2 needs a brand-new engine, and the server held synced" in reasons[0]
    assert reasons[1] == "after t3: a weight sync did not complete"
    assert pool.started[-1]["unplanned"] == "not in the plan; started for t5"


def test_a_host_without_gpus_plans_the_quick_depth_unless_told(child_pytest):
    """On CPU the default selection runs llama in every dimension, another
    architecture only where a test is pinned to it (float32, no twin), and no
    graph-mode server; --harness-depth full brings back the whole sweep. (The CPU CI
    budget rests on this.)"""
    quick = [s["config"] for s in child_pytest.plan(CPU_HOST, env=NO_GPU)["servers"]]
    full = [s["config"] for s in child_pytest.plan(CPU_HOST, "--harness-depth", "full",
                                                   env=NO_GPU)["servers"]]
    assert not any("mode=graphs" in c for c in quick)
    assert any("mode=graphs" in c for c in full)
    others = [c for c in quick if not c.startswith(("llama-", "sized-"))
              or c.startswith("llama-tied")]
    assert others and all("float32" in c and "load=dummy" in c for c in others), others
    assert not any(c.startswith(("gpt2-", "qwen3-")) for c in quick), quick
    assert any(c.startswith("gpt2-") for c in full) and any(c.startswith("qwen3-") for c in full)
    assert any(c.startswith("opt-") and "bfloat16" in c for c in full)
    assert set(quick) < set(full)
    # what the user names is run: a model named on the command line is swept again
    named = [s["config"] for s in child_pytest.plan(CPU_HOST, "--vllm-model", "opt",
                                                    "tests/test_parity.py", env=NO_GPU)["servers"]]
    assert any("bfloat16" in c for c in named)


def test_a_test_that_takes_only_the_case_plans_no_server(pytester, monkeypatch):
    """A test of the case itself (it takes ``case``, no server fixture) needs no server:
    the plan starts none for it. One that takes ``session`` gets one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HARNESS_REPORT_PROBES", "0")
    pytester.makepyfile(test_only_case="def test_a(case):\n    assert case.dtype\n")
    pytester.makepyfile(test_on_server="def test_b(session):\n    pass\n")
    args = ("-p", "no:cacheprovider", "--harness-plan", "--vllm-backend", "shm",
            "--vllm-layout", "cpu", "--vllm-model", "llama")
    alone = pytester.runpytest(*args, "test_only_case.py")
    assert any("0 servers planned" in line for line in alone.outlines), alone.outlines
    both = pytester.runpytest(*args)
    assert any("1 servers planned" in line for line in both.outlines), both.outlines


def test_a_run_without_servers_leaves_the_outer_runs_spares_alone(pytester, monkeypatch):
    """A pytest run inside a test (the harness's own tests make them) that plans no
    server starts no pool, so it neither makes nor stops trainer spares and retiring
    trainers. (When they were process-wide, each such run closed the outer run's spares
    and set their count to its own: in the CPU suite report of 2026-12-01 the two such
    tests took 107 s and 110 s, 0.2 s each alone. Now each run's pool holds its own.)"""
    from harness.trainer import spares

    made: list[int] = []
    closed: list[str] = []
    original = spares.TrainerProcesses.__init__

    def init(self, *a, **kw):
        made.append(1)
        original(self, *a, **kw)

    monkeypatch.setattr(spares.TrainerProcesses, "__init__", init)
    monkeypatch.setattr(spares.TrainerProcesses, "close", lambda self: closed.append("run"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HARNESS_REPORT_PROBES", "0")
    pytester.makepyfile(test_only_case="def test_a(case):\n    assert case.dtype\n")
    r = pytester.runpytest("-p", "no:cacheprovider", "--vllm-backend", "shm",
                           "--vllm-layout", "cpu", "--vllm-model", "llama")
    r.assert_outcomes(passed=1)
    assert (made, closed) == ([], [])


def test_the_end_of_a_run_stops_its_servers_side_by_side(fake_pool, monkeypatch):
    """stop_all stops every live server at once, not one after another: an interrupted
    GPU run has about 20 servers and half a minute before it is killed. Each fake
    server's stop waits until all have begun stopping (or 10 s): stops made one at a time
    would find the others not begun."""
    cfgs = [_cfg(model=f"m{i}") for i in range(4)]
    pool = fake_pool(max_alive=4, max_starting=4)
    pool.plan(cfgs)
    for c in cfgs:
        pool.get(c, user="t")
    all_begun, together = threading.Barrier(len(cfgs), timeout=10), []

    def stop(self):
        try:
            all_begun.wait()
            together.append(True)
        except threading.BrokenBarrierError:
            together.append(False)

    monkeypatch.setattr(_FakeServer, "stop", stop)
    pool.stop_all()
    assert not pool.servers and len(together) == len(cfgs) and all(together)


def test_the_end_of_a_run_stops_its_servers_at_interpreter_exit_too(fake_pool, monkeypatch):
    """stop_all is also the atexit safety net, when no thread may start any more: then
    it stops the servers one by one instead of failing."""
    import concurrent.futures as cf

    cfgs = [_cfg(model=f"m{i}") for i in range(3)]
    pool = fake_pool(max_alive=3, max_starting=3)
    pool.plan(cfgs)
    for c in cfgs:
        pool.get(c, user="t")
    stopped = []
    monkeypatch.setattr(_FakeServer, "stop", lambda self: stopped.append(self))

    def refuse(self, *a, **kw):
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(cf.ThreadPoolExecutor, "submit", refuse)
    pool.stop_all()
    assert not pool.servers and len(stopped) == 3


def test_the_host_sampler_keeps_its_pace_when_a_test_stubs_time_sleep(fake_pool, monkeypatch):
    """A CI run's report held 4582 host samples taken in 0.1 s: a unit test stubbed
    ``time.sleep`` (a retry loop's) while the worker's pool sampled the host."""
    import time as time_module
    pool = fake_pool(max_alive=1, max_starting=1)
    pool.plan([_cfg(model="m0")])
    monkeypatch.setattr(time_module, "sleep", lambda s: None)
    threading.Event().wait(0.3)
    assert len(pool.samples) <= 2, f"{len(pool.samples)} samples in 0.3 s"
    pool.stop_all()
    pool._sampler.join(timeout=5)
    assert not pool._sampler.is_alive(), "the sampler outlived its pool"


def test_the_smoke_selection_is_the_seed_flow_on_one_server(child_pytest):
    """`pytest -m smoke` ("is it working?"): the seed flow (gibberish, sync, parity) and a
    request held by /pause until /resume, on one server: the default CPU run's llama
    float32 shm server, no twin. `-k "llama and sync"` took 18 min on 5 servers."""
    from child_pytest import CPU_HOST, NO_GPU

    plan = child_pytest.plan(CPU_HOST, "-m", "smoke", env=NO_GPU)
    configs = [s["config"] for s in plan["servers"]]
    assert len(configs) == 1 and plan["starts"] == 1, configs
    assert re.match(r"llama-[0-9a-f]{12} float32 backend=shm load=dummy cpu tp=1", configs[0])
    tests = child_pytest("--harness-plan", "--harness-plan-host", CPU_HOST, "-m", "smoke",
                         env=NO_GPU).nodeids()
    assert plan["servers"][0]["tests"] == len(tests) and all(
        t.startswith("tests/test_sync.py::") for t in tests), tests
    for name in ("test_gibberish_before_sync[shm-cpu-fp32-llama]",
                 "test_parity_after_sync[shm-cpu-fp32-llama]",
                 "test_request_while_paused_waits_for_resume[shm-cpu-fp32-llama]"):
        assert any(t.endswith(name) for t in tests), (name, tests)
    default = child_pytest.plan(CPU_HOST, env=NO_GPU)  # the same server as the default run's
    assert configs[0] in [s["config"] for s in default["servers"]]


def test_the_plan_says_how_its_counts_relate(child_pytest):
    """The plan printed three counts (299 tests on 28 servers, 315 run here, 368
    collected) without saying how they relate; one line now adds them up."""
    from child_pytest import CPU_HOST, NO_GPU

    r = child_pytest("--harness-plan", "--harness-plan-host", CPU_HOST, "-m", "smoke or faults",
                     env=NO_GPU)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("counts: ")), None)
    assert line is not None, r.stdout[-3000:]
    m = re.match(r"counts: of the (\d+) tests selected, (\d+) run on the (\d+) servers planned; "
                 r"(\d+) more take a case but no server, or skip here saying why; (\d+) take no "
                 r"case \(no server, no GPU\); the summary's \"(\d+) run here\" counts the cases "
                 r"\((\d+) \+ (\d+)\)$", line)
    assert m, line
    selected, on_servers, servers, more, no_case, cases, a, b = map(int, m.groups())
    plan = r.report["plan"]
    assert selected == len(r.items) and on_servers == plan["tests"] == a
    assert servers == len(plan["servers"]) and more == b and cases == a + b
    assert selected == on_servers + more + no_case
    assert f"{cases} run here" in r.stdout
