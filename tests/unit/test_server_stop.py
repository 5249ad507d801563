"""VLLMServer.stop from two threads at once (pytest -x: the pool's stop_all stops a
booting server while its start, cut short, stops it too): one stops the process tree,
the other returns, neither raises."""

from __future__ import annotations

import subprocess
import threading
import time

import psutil
import pytest

from harness.vllm.server import ServerConfig, VLLMServer


class _SpyLock:
    """A lock that says when a second caller is waiting for it."""

    def __init__(self, lock):
        self.lock, self.waiting = lock, threading.Event()

    def __enter__(self):
        if not self.lock.acquire(blocking=False):
            self.waiting.set()
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def test_two_threads_stopping_one_server_neither_raises(tmp_path):
    srv = VLLMServer(ServerConfig(model="x"), log_dir=tmp_path)
    srv.proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    pid = srv.proc.pid
    spy = None
    if hasattr(srv, "_stop_lock"):
        spy = srv._stop_lock = _SpyLock(srv._stop_lock)
    errors: list[BaseException] = []
    other_done = threading.Event()

    def other() -> None:
        try:
            srv.stop()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
        finally:
            other_done.set()

    real_tree = srv._tree
    calls = []

    def tree():
        # the first stopper has passed its "is there a process" check: the second
        # stopper runs now, and is either done or waiting for the first
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            threading.Thread(target=other, name="second", daemon=True).start()
            while not (other_done.is_set() or (spy is not None and spy.waiting.is_set())):
                time.sleep(0.01)
        return real_tree()

    srv._tree = tree
    try:
        srv.stop()
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    other_done.wait(60)
    assert other_done.is_set(), "the second stop never returned"
    assert errors == []
    assert srv.proc is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    srv.stop()  # and once more, after both: nothing to do


def test_a_start_that_fails_after_the_server_is_up_leaves_nothing_running(tmp_path, monkeypatch):
    """Seen on 1 x H200: a background start failed with "Bad file descriptor" after
    /version had answered, and the server it had started was left running."""
    import contextlib

    import pytest

    from harness.vllm import server as server_mod

    @contextlib.contextmanager
    def failing_release(*a, **kw):
        yield True
        raise OSError(9, "Bad file descriptor")  # the lock's release

    monkeypatch.setattr(server_mod, "build_command", lambda cfg, port, python: ["sleep", "600"])
    monkeypatch.setattr(server_mod.memory_lock, "held", failing_release)
    monkeypatch.setattr(VLLMServer, "_wait_ready", lambda self, t0: None)
    monkeypatch.setattr(VLLMServer, "_fetch_version", lambda self: "0.0-test")
    srv = VLLMServer(ServerConfig(model="x"), log_dir=tmp_path)
    started = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(server_mod.subprocess, "Popen",
                        lambda *a, **kw: started.append(real_popen(*a, **kw)) or started[-1])
    with pytest.raises(OSError, match="Bad file descriptor"):
        srv.start()
    assert len(started) == 1
    try:
        started[0].wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the start raised, and left its server's process running")
    finally:
        if started[0].poll() is None:
            started[0].kill()


def test_a_server_cancelled_before_its_launch_never_launches(tmp_path, monkeypatch):
    """The pool's end cancels a start still waiting for its turn (a start slot, the
    GPU's lock): when the turn comes, start() fails and no vLLM process is made."""
    from harness.vllm import server as server_mod
    from harness.vllm.server import ServerError

    launched = []
    monkeypatch.setattr(server_mod.subprocess, "Popen",
                        lambda *a, **kw: launched.append(a) or pytest.fail("launched"))
    srv = VLLMServer(ServerConfig(model="x"), log_dir=tmp_path)
    srv.cancel()
    with pytest.raises(ServerError, match="cancelled before its launch"):
        srv.start()
    assert launched == [] and srv.proc is None
