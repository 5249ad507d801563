"""Tests side by side (harness.run.parallel): the controller's scheduler deals each worker
its own servers' tests and shares the tests without a server out by module; the
partition keeps every server in one bin (its replicas aside)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from harness.run import parallel
from harness.run import partition
from harness.run import plan as P
from harness.run import scheduling
from harness.vllm.server import ServerConfig

HOST = P.Host(gpus=1, cores=16, gpu_memory_gib=139, ram_gib=128)


class FakeNode:
    def __init__(self, wid: str):
        self.gateway = SimpleNamespace(id=wid)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices):
        self.sent += list(indices)

    def shutdown(self):
        self.shutting_down = True


def _scheduler(tmp_path, monkeypatch, ids, bins, n=2):
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    (tmp_path / "partition.json").write_text(json.dumps(dict(zip(ids, bins))))
    config = SimpleNamespace(getoption=lambda name, default=None: ["popen"] * n)
    sched = scheduling.Scheduling(config)
    nodes = [FakeNode(f"gw{k}") for k in range(n)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    return sched, nodes


def _drain(sched, nodes):
    """Complete every test as it is sent, until the scheduler is done."""
    for _ in range(1000):
        busy = [n for n in nodes if sched.node2pending.get(n)]
        if not busy:
            break
        for node in busy:
            sched.mark_test_complete(node, sched.node2pending[node][0])
    return sched


def test_each_worker_runs_its_own_servers_and_a_module_stays_together(tmp_path, monkeypatch):
    ids = ([f"tests/unit/test_a.py::t{i}" for i in range(5)]
           + [f"tests/test_s.py::k{i}" for i in range(3)]
           + [f"tests/test_x.py::srv{i}[c]" for i in range(6)])
    bins = [None] * 8 + [0, 0, 0, 1, 1, 1]
    sched, nodes = _scheduler(tmp_path, monkeypatch, ids, bins)
    _drain(sched, nodes)
    assert sched.tests_finished and all(n.shutting_down for n in nodes)
    ran = sorted(i for n in nodes for i in n.sent)
    assert ran == list(range(len(ids))), "every test exactly once"
    assert {8, 9, 10} <= set(nodes[0].sent) and {11, 12, 13} <= set(nodes[1].sent)
    for module in ("tests/unit/test_a.py", "tests/test_s.py"):
        holders = {k for k, n in enumerate(nodes) for i in n.sent if ids[i].startswith(module)}
        assert len(holders) == 1, f"{module} split over workers {holders}"


def test_a_dead_worker_names_the_test_it_died_in_and_its_tests_go_elsewhere(tmp_path,
                                                                              monkeypatch):
    """Worker 1, which has had all its tests, is shut down already: the dead worker's
    go to the worker xdist starts in its place."""
    ids = [f"tests/test_x.py::srv{i}" for i in range(4)]
    sched, nodes = _scheduler(tmp_path, monkeypatch, ids, [0, 0, 1, 1])
    assert sched.remove_node(nodes[0]) == ids[0]
    assert not sched.tests_finished, "the dead worker's second test is still to run"
    spare = FakeNode("gw2")
    sched.add_node(spare)
    sched.add_node_collection(spare, ids)
    sched.schedule()
    _drain(sched, nodes[1:] + [spare])
    assert sorted(nodes[1].sent) == [2, 3] and spare.sent == [1]
    assert sched.tests_finished


def test_a_collection_that_differs_between_workers_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    sched = scheduling.Scheduling(SimpleNamespace(getoption=lambda n, d=None: ["popen"] * 2))
    a, b = FakeNode("gw0"), FakeNode("gw1")
    sched.add_node(a), sched.add_node(b)
    sched.add_node_collection(a, ["t1", "t2"])
    with pytest.raises(RuntimeError):
        sched.add_node_collection(b, ["t1"])


def _cfg(model, load="dummy"):
    return ServerConfig(model=f"/zoo/{model}", backend="ipc", load_format=load, device_ids=(0,))


def test_the_partition_keeps_a_server_with_its_twin_and_cuts_the_longest():
    big, twin, small = _cfg("big"), _cfg("big", "auto"), _cfg("small")
    needs = ([None, None] + [P.ServerNeed(f"b{i}", big, twin if i % 20 == 0 else None)
                             for i in range(120)]
             + [P.ServerNeed(f"s{i}", small) for i in range(4)])
    p = parallel.make_partition(needs, HOST, 3)
    bins = p.bin_of(needs)
    assert bins[:2] == [None, None]
    small_bins = {bins[i] for i, n in enumerate(needs) if n and n.server == small}
    assert len(small_bins) == 1, "a server in two bins"
    twinned = {bins[i] for i, n in enumerate(needs) if n and n.twin is not None}
    assert len(twinned) == 1, "the twin's tests on two replicas"
    big_bins = {bins[i] for i, n in enumerate(needs) if n and n.server == big}
    assert len(big_bins) == 3, "the longest server is cut into replicas"
    loads = p.loads()
    assert max(loads) <= 1.25 * min(loads), loads
    assert p.critical is not None and p.critical.replicas == 3


def test_groups_join_servers_that_one_test_links():
    a, b, twin_a = _cfg("a"), _cfg("b"), _cfg("a", "auto")
    gs = partition.groups([P.ServerNeed("x", a), P.ServerNeed("y", a, twin_a), P.ServerNeed("z", b), None],
                          HOST)
    assert [set(g.servers) for g in gs] == [set(), {a, twin_a}, {b}]
    assert [g.tests for g in gs] == [(3,), (0, 1), (2,)]


# ----------------------------------------------------------------------------- a run cut short

def _controller(n: int, folder=None):
    if folder is not None:  # the folder is this process's, as the controller's is
        (folder / parallel.OWNER_FILE).write_text(str(os.getpid()))
    config = SimpleNamespace(getoption=lambda name, default=None: n if name == "numprocesses"
                             else default)
    return config, SimpleNamespace(worker_outputs={"gw0": {"started": [{"url": "a"}]}},
                                   gathered=False)


def _record(folder, wid, kind, **extra):
    (folder / parallel.RECORD_FILE.format(wid)).write_text(json.dumps({"record": kind, **extra}))


def test_the_controller_reads_the_records_of_workers_it_did_not_hear_from(tmp_path, monkeypatch):
    """Ctrl-C stops the controller's loop before the workers' records reach it: it reads
    them from the run's folder, the final one where a worker wrote it, else the last
    partial one, and never replaces a record a worker sent."""
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    config, state = _controller(3, tmp_path)
    _record(tmp_path, "gw0", "final", started=[])  # sent already: the sent one stands
    _record(tmp_path, "gw1", "final", started=[{"url": "b"}])
    _record(tmp_path, "gw2", "partial", started=[{"url": "c"}])
    assert parallel.gather_records(config, state, interrupted=True, wait_s=0.3) == ["gw2"]
    assert state.worker_outputs["gw0"] == {"started": [{"url": "a"}]}
    assert state.worker_outputs["gw1"]["started"] == [{"url": "b"}]
    assert state.worker_outputs["gw2"]["record"] == "partial"
    _record(tmp_path, "gw3", "final")
    assert parallel.gather_records(config, state, interrupted=True) == [], "once a run"
    assert "gw3" not in state.worker_outputs


def test_a_pytest_run_inside_a_workers_test_reads_no_record(tmp_path, monkeypatch):
    """The harness's own tests run pytest inside a worker, which inherits the run's
    folder: such a run is not the folder's controller and must not take the outer
    workers' records for its own (it printed their servers as its own once)."""
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    (tmp_path / parallel.OWNER_FILE).write_text("1")  # another process's folder
    config, state = _controller(0)
    _record(tmp_path, "gw1", "final", started=[{"url": "b"}])
    assert parallel.gather_records(config, state, interrupted=False) == []
    assert list(state.worker_outputs) == ["gw0"]


def test_an_interrupted_controller_waits_for_a_final_record(tmp_path, monkeypatch):
    """A worker still stopping its servers writes its final record late: an interrupted
    controller waits for it (up to the bound) rather than taking the partial one."""
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    config, state = _controller(2, tmp_path)
    _record(tmp_path, "gw1", "partial")
    threading.Timer(0.5, lambda: _record(tmp_path, "gw1", "final", started=[{"url": "b"}])).start()
    assert parallel.gather_records(config, state, interrupted=True, wait_s=10) == []
    assert state.worker_outputs["gw1"]["record"] == "final"


def test_an_interrupted_controller_does_not_wait_for_a_worker_that_died(tmp_path,
                                                                        monkeypatch):
    """A worker killed while it stopped its servers (pytest-xdist's kill, the OOM
    killer) never writes its final record: the controller takes its last partial one at
    once instead of waiting out the bound, which a job's time limit may not leave it."""
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    config, state = _controller(2, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(tmp_path, "gw0", "final")
    _record(tmp_path, "gw1", "partial", pid=dead.pid, started=[{"url": "b"}])
    t0 = time.monotonic()
    assert parallel.gather_records(config, state, interrupted=True, wait_s=30) == ["gw1"]
    assert time.monotonic() - t0 < 15, "it waited for the final record of a dead worker"
    assert state.worker_outputs["gw1"]["started"] == [{"url": "b"}]


def test_the_controllers_guard_stops_once_then_waits_for_its_workers(monkeypatch):
    """The first SIGINT stops the run; the next ones are ignored while the workers stop
    their servers, and stop it again once that wait is over or out of time."""
    clock = [100.0]
    monkeypatch.setattr(parallel.time, "monotonic", lambda: clock[0])
    guard = parallel.InterruptGuard(wait_s=60)
    with pytest.raises(KeyboardInterrupt):
        guard(signal.SIGINT, None)

    def ignored():
        try:
            guard(signal.SIGINT, None)
        except KeyboardInterrupt:  # not raised on: pytest would take it as the run's end
            pytest.fail(f"a later SIGINT stopped the run {clock[0] - guard.first:.0f} s "
                        "after the first")

    ignored()                           # timeout(1)'s second SIGINT, to the group
    clock[0] += 30
    ignored()                           # a Ctrl-C while the workers stop their servers
    assert guard.ignored == 2
    clock[0] += 40                      # past the wait and its slack
    with pytest.raises(KeyboardInterrupt):
        guard(signal.SIGINT, None)
    early = parallel.InterruptGuard(wait_s=60)
    with pytest.raises(KeyboardInterrupt):
        early(signal.SIGINT, None)
    early.waiting_over = True           # the workers ended: Ctrl-C is Ctrl-C again
    with pytest.raises(KeyboardInterrupt):
        early(signal.SIGINT, None)


@pytest.mark.slow_unit  # a pytest -n 2 in a child: three interpreters
def test_an_interrupted_parallel_run_reports_every_worker(pytester):
    """End to end, a real ``-n 2`` run interrupted as ci/gpu-run.sh's time limit does it
    (``timeout --signal=INT``: SIGINT to pytest, then to its process group) while a test
    runs, each worker then taking 13 s to end its session as a GPU worker stopping its
    servers does (26 s on 1 x H200). Seen there: pytest-xdist kills a worker 10 s after
    it asks it to exit, the controller then waited 20 s for records that never came, and
    the job's kill 30 s after the interrupt took the controller before its report. Now
    the controller waits for its workers to end before pytest-xdist's kill: every
    worker ends its session, its final record is in the report, and the run is over
    well before a kill 40 s after the interrupt. The second SIGINT comes 2 s after the
    first, as on a loaded CI host where the controller had taken the first before the
    second came: it ended the controller's wait with a second KeyboardInterrupt, and
    both workers were killed (``parallel.InterruptGuard``)."""
    pytester.makeconftest("""
import pathlib, os, time
def pytest_sessionfinish(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    t0 = time.monotonic()
    while time.monotonic() - t0 < 13:   # stopping the servers: a second Ctrl-C waits
        try:
            time.sleep(0.2)
        except KeyboardInterrupt:
            pass
    pathlib.Path(f"done-{worker}").touch()
""")
    for k in range(2):
        pytester.makepyfile(**{f"test_cut{k}": f"""
import pathlib, time
def test_held():
    pathlib.Path("in{k}").touch()
    time.sleep(120)
"""})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HARNESS_", "PYTEST_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
         "--harness-report", "int.json", "-q"], cwd=pytester.path, start_new_session=True,
        env={**env, "HARNESS_REPORT_PROBES": "0"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    killed = False
    try:
        deadline = time.monotonic() + 120
        while not any((pytester.path / f"in{k}").exists() for k in range(2)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.2)
        time.sleep(1.0)   # both workers are in their loops
        os.kill(proc.pid, signal.SIGINT)     # as timeout(1) does: pytest,
        time.sleep(2.0)                      # (a loaded host: pytest has taken the first)
        os.killpg(proc.pid, signal.SIGINT)   # then its whole process group
        try:
            out = proc.communicate(timeout=40)[0]
        except subprocess.TimeoutExpired:    # the job's kill
            killed = True
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not killed, "the run outlived a kill 40 s after its interrupt: " + out[-3000:]
    done = sorted(p.name for p in pytester.path.glob("done-*"))
    assert done == ["done-gw0", "done-gw1"], f"workers killed before their session ended: {done}" + out[-3000:]
    rep = json.loads((pytester.path / "int.json").read_text())
    assert rep["timing"]["workers"] == 2, out[-3000:]
    assert rep["timing"]["workers_partial"] == [], out[-3000:]
    assert sorted(rep["plan"]["workers"]) == ["gw0", "gw1"]


@pytest.mark.slow_unit  # pytest runs in children, one of them -n 2
def test_each_test_says_when_it_began_and_on_which_worker(pytester):
    """The report's timeline: a real ``-n 2`` run of two modules, two tests each; every
    test names its worker (and its torch threads, the cores shared out; the host's CPU
    use covers the run), and one worker's tests follow each other without overlap, in
    seconds on the clock of the servers' ``started_at``. A serial run names no worker."""
    for k in range(2):
        pytester.makepyfile(**{f"test_line{k}": """
import time
def test_a():
    time.sleep(0.6)
def test_b():
    time.sleep(0.6)
"""})
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HARNESS_", "PYTEST_")) and k != "OMP_NUM_THREADS"}
    for extra, name in ((["-n", "2"], "par.json"), ([], "ser.json")):
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *extra,
             "--harness-report", name, "-q"], cwd=pytester.path, timeout=120,
            env={**env, "HARNESS_REPORT_PROBES": "0"}, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # each worker's torch threads: the host's cores shared out, not one a core each
    threads = json.loads((pytester.path / "par.json").read_text())["timing"]
    assert threads["worker_torch_threads"] == {
        w: max(1, P.Host.this().cores // 2) for w in ("gw0", "gw1")}, threads
    # the host's cores over the whole run, as the controller saw them from its start
    cpu, wall = threads["host_cpu"], json.loads((pytester.path / "par.json").read_text())[
        "header"]["wall_seconds"]
    assert cpu["busy_seconds"] > 0, cpu
    assert abs(cpu["available_seconds"] / cpu["cores"] - wall) < 0.25 * wall + 2, (cpu, wall)
    par = json.loads((pytester.path / "par.json").read_text())["tests"]
    ser = json.loads((pytester.path / "ser.json").read_text())["tests"]
    assert {t["worker"] for t in par} <= {"gw0", "gw1"} and len(par) == 4
    assert all(t["worker"] is None for t in ser)
    for tests in ([t for t in par if t["worker"] == w] for w in ("gw0", "gw1")):
        tests.sort(key=lambda t: t["at"])
        for a, b in zip(tests, tests[1:]):
            assert b["at"] >= a["at"] + 0.6, (a, b)
    ser.sort(key=lambda t: t["at"])
    assert 0 <= ser[0]["at"] < 30, ser[0]
    assert all(b["at"] >= a["at"] + 0.6 for a, b in zip(ser, ser[1:])), ser


def test_a_worker_with_nothing_left_is_told_so_while_its_last_tests_run(tmp_path, monkeypatch):
    """pytest runs a test once it knows the next one: a worker that is not told that its
    queue is the last holds its last test until the run ends (on an H100, every worker's
    last test began at 582 s, its servers alive until then). Worker 0's bin is done long
    before worker 1's: it is shut down as soon as it has all it will get."""
    ids = [f"tests/test_x.py::a{i}" for i in range(2)] + [f"tests/test_y.py::b{i}" for i in range(6)]
    sched, nodes = _scheduler(tmp_path, monkeypatch, ids, [0, 0] + [1] * 6)
    assert sorted(nodes[0].sent) == [0, 1]
    sched.mark_test_complete(nodes[0], 0)
    assert nodes[0].shutting_down, "worker 0 still waits for more tests with one left"
    assert sched.node2pending[nodes[1]], "worker 1 has not finished"
    _drain(sched, nodes)
    assert sorted(nodes[0].sent + nodes[1].sent) == list(range(len(ids)))
