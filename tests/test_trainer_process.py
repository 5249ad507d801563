"""The persistent trainer's process protocol, against a stand-in for vLLM's four
weight-sync routes (stdlib HTTP, recording what arrives): one process and one
/init_weight_transfer_engine for many syncs; a failure closes the group and the next
sync opens a new one (in the same process for shm and IPC, in a new one where the
trainer cannot recover in place); a hung sync is killed within its bound, naming it. The data
plane is the real shm sender; what a real server does with it is tests/test_sync.py's.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness import models
from harness.trainer.handle import Trainer, TrainerError, TrainerSpec, run_trainer
from harness.trainer.spares import Spares, TrainerProcesses


class _Routes(BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        srv = self.server
        srv.calls.append(self.path)
        if self.path == "/update_weights":
            srv.names += body["update_info"]["names"]
            if srv.hang.is_set():
                srv.hang_release.wait(30)
        status = 500 if self.path in srv.fail else 200
        out = b'{"error": "boom"}' if status == 500 else b"{}"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def _serve_routes():
    """The stand-in, serving on a free port, and its stop."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Routes)
    srv.calls, srv.names, srv.fail = [], [], set()
    srv.hang, srv.hang_release = threading.Event(), threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def stop():
        srv.hang_release.set()
        srv.shutdown()
        srv.server_close()
    return srv, stop


@pytest.fixture
def routes():
    srv, stop = _serve_routes()
    yield srv
    stop()


@pytest.fixture(scope="module")
def model():
    return str(models.model_dir("llama"))


def _spec(srv, **kw):
    return TrainerSpec.make(url=f"http://127.0.0.1:{srv.server_address[1]}", engine="shm",
                            packed=True, timeout=10, **kw)


def test_one_process_and_one_init_for_many_syncs(routes, model, tmp_path):
    t = Trainer(_spec(routes), log_dir=tmp_path)
    try:
        first = t.sync(model, timeout=120)
        pid = t.proc.pid
        later = [t.sync(model, timeout=60) for _ in range(3)]
        assert t.proc.pid == pid and t.syncs == 4
    finally:
        t.close()
    assert first["first"] and first["init_seconds"] is not None
    assert not any(r["first"] for r in later) and all("init_seconds" not in r for r in later)
    assert routes.calls.count("/init_weight_transfer_engine") == 1
    assert routes.calls.count("/start_weight_update") == 4
    assert routes.calls.count("/finish_weight_update") == 4
    assert t.proc is None  # closed


def test_a_failed_sync_closes_the_group_and_the_next_opens_a_new_one(routes, model, tmp_path):
    """shm (as IPC): the trainer survives its failed sync and the next sync opens a new
    group in the same process; an NCCL trainer would be ended (Backend.recovers_in_place)."""
    t = Trainer(_spec(routes), log_dir=tmp_path)
    try:
        t.sync(model, timeout=120)
        pid = t.pid
        routes.fail.add("/update_weights")
        with pytest.raises(TrainerError, match=r"/update_weights failed with HTTP 500"):
            t.sync(model, timeout=60)
        assert t.alive() and t.pid == pid
        routes.fail.clear()
        again = t.sync(model, timeout=120)
        assert again["first"] and t.pid == pid
    finally:
        t.close()
    assert routes.calls.count("/init_weight_transfer_engine") == 2


def test_a_trainer_that_cannot_recover_in_place_is_ended(routes, model, tmp_path):
    """The other path of a failed sync: a trainer of an engine that does not recover in
    place (NCCL) is ended, and the next sync starts a new process."""
    t = Trainer(_spec(routes, options={"recover_in_place": False}), log_dir=tmp_path)
    try:
        t.sync(model, timeout=120)
        pid = t.pid
        routes.fail.add("/update_weights")
        with pytest.raises(TrainerError, match=r"/update_weights failed with HTTP 500"):
            t.sync(model, timeout=60)
        assert not t.alive()
        routes.fail.clear()
        again = t.sync(model, timeout=120)
        assert again["first"] and t.pid != pid
    finally:
        t.close()


def test_a_hung_sync_is_killed_within_its_bound(routes, model, tmp_path):
    t = Trainer(_spec(routes), log_dir=tmp_path)
    try:
        t.sync(model, timeout=120)
        routes.hang.set()
        t0 = time.monotonic()
        with pytest.raises(TrainerError, match="did not finish within 3s"):
            t.sync(model, timeout=3)
        assert time.monotonic() - t0 < 15
        assert not t.alive()
    finally:
        t.close()


def test_a_corruption_travels_with_the_sync_command(routes, model, tmp_path):
    r = run_trainer(_spec(routes), model, corrupt="drop", timeout=120, log_dir=tmp_path)
    assert r["corruption"].startswith("dropped ")
    dropped = r["corruption"].split()[1]
    assert dropped not in routes.names and len(routes.names) == r["tensors"]


@pytest.fixture
def second_routes():
    srv, stop = _serve_routes()
    yield srv
    stop()


def test_a_spare_started_ahead_becomes_the_next_trainer(routes, second_routes, model,
                                                        tmp_path, monkeypatch):
    """The first trainer starts a spare; the next trainer (another server, another
    spec) takes that process over, is told its spec, and syncs to its own server; at
    the end of the run no spare is left."""
    run = TrainerProcesses(1, tmp_path)  # this test's spares only
    SPARES = run.spares
    a = Trainer(_spec(routes), log_dir=tmp_path, processes=run)
    b = Trainer(_spec(second_routes, options={"recover_in_place": False}), log_dir=tmp_path,
                processes=run)
    try:
        a.sync(model, timeout=120)
        spare = SPARES._idle[next(iter(SPARES._idle))][0].proc.pid
        taken = SPARES.taken
        b.sync(model, timeout=120)
        assert b.pid == spare and SPARES.taken == taken + 1
        assert "became the shm trainer of " + b.spec.url in b.log_tail()
        assert second_routes.calls.count("/init_weight_transfer_engine") == 1
        assert routes.calls.count("/init_weight_transfer_engine") == 1  # a's only
        second_routes.fail.add("/update_weights")  # b's own options came with its spec
        with pytest.raises(TrainerError, match=r"/update_weights failed with HTTP 500"):
            b.sync(model, timeout=60)
        assert not b.alive()
        waiting = [s.proc for idle in SPARES._idle.values() for s in idle]
        assert waiting and all(p.poll() is None for p in waiting)
    finally:
        a.close()
        b.close()
        SPARES.close()
    assert all(p.poll() is not None for p in waiting)
    assert not SPARES._idle


def test_closing_the_spares_twice_is_harmless(routes, model, tmp_path, monkeypatch):
    """The end of a run closes the spares, and an interpreter exit closes them again
    (a run interrupted in its teardown does both): the second close finds nothing."""
    run = TrainerProcesses(1, tmp_path)  # this test's spares only
    SPARES = run.spares
    t = Trainer(_spec(routes), log_dir=tmp_path, processes=run)
    try:
        t.sync(model, timeout=120)
    finally:
        t.close()
    spare = SPARES._idle[next(iter(SPARES._idle))][0]
    SPARES.close()
    spare.discard()  # what a second close of the same spare would do
    SPARES.close()
    assert spare.proc.poll() is not None and not SPARES._idle


def test_a_retired_trainer_exits_by_itself_and_is_reaped(routes, model, tmp_path,
                                                        monkeypatch):
    """``close_in_background`` asks the child to exit and does not wait: the trainer lets go of the
    process at once, ``EXITING`` holds it, and the end of the run finds it exited by
    itself (code 0, not killed) and removes its scratch directory. A fresh trainer's
    result says how it started and how long its caller waited for it to go."""
    run = TrainerProcesses()  # this test's trainers only
    EXITING = run.exiting
    t = Trainer(_spec(routes), log_dir=tmp_path, processes=run)
    first = t.sync(model, timeout=120)
    proc, scratch = t.proc, t.scratch
    t.close_in_background()
    assert t.proc is None and len(EXITING) == 1
    EXITING.drain()
    assert proc.returncode == 0 and not scratch.exists() and len(EXITING) == 0
    assert first["spare"] is False and first["start_seconds"] >= 0
    assert first["cuda_init_seconds"] >= 0
    fresh = run_trainer(_spec(routes), model, timeout=120, log_dir=tmp_path, processes=run)
    assert fresh["close_seconds"] >= 0 and len(EXITING) == 1
    EXITING.drain()


def test_a_retired_trainer_that_will_not_exit_is_killed_after_its_grace(routes, model,
                                                                       tmp_path, monkeypatch):
    """A retired child that cannot exit (stopped here with SIGSTOP) is killed once its
    grace has passed, and what it owned is removed all the same."""
    import signal

    run = TrainerProcesses()
    EXITING = run.exiting
    EXITING.grace = 1.0
    t = Trainer(_spec(routes), log_dir=tmp_path, processes=run)
    t.sync(model, timeout=120)
    proc, scratch = t.proc, t.scratch
    proc.send_signal(signal.SIGSTOP)
    t.close_in_background()
    EXITING.poll()  # within its grace: kept
    assert len(EXITING) == 1 and proc.poll() is None
    EXITING.drain()
    assert proc.returncode == -signal.SIGKILL and not scratch.exists()


def test_a_spare_serves_a_trainer_of_another_test(routes, second_routes, model, tmp_path,
                                                  monkeypatch):
    """pytest names the running test in the environment (PYTEST_CURRENT_TEST): a spare
    started during one test must serve the next test's trainer; a prepare that says
    ``spares=False`` (the pool's, off the tests' path) neither takes one nor starts one."""
    run = TrainerProcesses(1, tmp_path)
    SPARES = run.spares
    a = Trainer(_spec(routes), log_dir=tmp_path, processes=run)
    try:
        a.sync(model, timeout=120)
        [spare] = [s.proc.pid for idle in SPARES._idle.values() for s in idle]
        aside = Trainer(_spec(second_routes), log_dir=tmp_path, processes=run, spares=False)
        aside.sync(model, timeout=120)
        assert aside.pid != spare and len([s for i in SPARES._idle.values() for s in i]) == 1
        aside.close()
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_other.py::test_next (call)")
        b = Trainer(_spec(second_routes), log_dir=tmp_path, processes=run)
        result = b.sync(model, timeout=120)
        assert b.pid == spare and result["spare"] is True
        b.close()
    finally:
        a.close()
        SPARES.close()


def test_spares_are_kept_for_a_few_keys_only(tmp_path, monkeypatch):
    """Each spare holds a process (on a GPU a CUDA context): once more than MAX_KEYS
    engine/code/device/environment keys have spares, the least recently replenished
    key's spares are stopped."""
    import subprocess
    import sys

    SPARES = Spares(1)
    started = []

    def spawn(args, env, log_dir, what):  # a process that waits, no trainer imports
        p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE, start_new_session=True)
        started.append(p)
        r, w = __import__("os").pipe()
        __import__("os").close(w)
        return p, tmp_path / f"{len(started)}.log", tmp_path / f"s{len(started)}", r

    monkeypatch.setattr("harness.trainer.spares.spawn_child", spawn)
    try:
        for i in range(SPARES.MAX_KEYS + 2):
            SPARES.replenish({"K": str(i)}, TrainerSpec.make(url="u", engine="shm", packed=True),
                             tmp_path)
        assert len(SPARES._idle) == SPARES.MAX_KEYS and len(started) == SPARES.MAX_KEYS + 2
        assert started[0].poll() is not None and started[1].poll() is not None  # stopped
        assert all(p.poll() is None for p in started[2:])
    finally:
        SPARES.close()
    assert all(p.poll() is not None for p in started)


def test_the_end_of_a_run_tells_every_spare_at_once(tmp_path, monkeypatch):
    """SPARES.close tells all spares to go before it waits for any: each stand-in spare
    here exits by itself (code 0) only once every one has been told; told one after
    another, the first would be killed at the end of its wait."""
    import os
    import subprocess
    import sys

    SPARES = Spares(3)
    code = ("import os, sys, time; sys.stdin.read(); open(os.path.join(sys.argv[1], "
            "str(os.getpid())), 'w').close(); t = time.time() + 10\n"
            "while len(os.listdir(sys.argv[1])) < 3 and time.time() < t: time.sleep(0.05)\n"
            "sys.exit(0 if len(os.listdir(sys.argv[1])) == 3 else 3)")
    told = tmp_path / "told"
    told.mkdir()
    started = []

    def spawn(args, env, log_dir, what):
        p = subprocess.Popen([sys.executable, "-c", code, str(told)], stdin=subprocess.PIPE,
                             start_new_session=True)
        started.append(p)
        r, w = os.pipe()
        os.close(w)
        return p, tmp_path / f"{len(started)}.log", tmp_path / f"s{len(started)}", r

    monkeypatch.setattr("harness.trainer.spares.spawn_child", spawn)
    SPARES.replenish({}, TrainerSpec.make(url="u", engine="shm", packed=True), tmp_path)
    SPARES.close()
    assert len(started) == 3 and [p.returncode for p in started] == [0, 0, 0]
