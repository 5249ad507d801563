"""The lock between GPU server starts and sleeps (harness.vllm.memory_lock), across processes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.vllm import memory_lock

HOLD = """
import sys
from pathlib import Path
from harness.vllm import memory_lock
with memory_lock.held({exclusive}, "test", path=Path(sys.argv[1])) as got:
    print("held" if got else "not held", flush=True)
    sys.stdin.read()   # until the test lets go
"""

BOUND_S = 10.0   # beyond every bounded wait here, however busy the host
LET_GO_S = 2.0   # a sleep asked beside a start waits at least this long for it


@contextlib.contextmanager
def _held_elsewhere(path, exclusive: bool):
    """Another process holds the lock until the block ends, it is let go (the callable
    yielded) or BOUND_S have passed: a test waits out no longer a hold than it needs,
    and a wait without a bound still ends, and fails, at BOUND_S."""
    p = subprocess.Popen([sys.executable, "-c", HOLD.format(exclusive=exclusive), str(path)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    deadline = threading.Timer(BOUND_S, p.stdin.close)  # unbuffered: closed once, from any thread
    try:
        assert p.stdout.readline().strip() == b"held"
        deadline.start()
        yield p.stdin.close
    finally:
        deadline.cancel()
        p.stdin.close()
        p.wait(timeout=60)


def test_starts_share_the_lock_and_a_sleep_waits_for_them(tmp_path):
    path = tmp_path / "gpu-memory.lock"
    with _held_elsewhere(path, exclusive=False) as let_go:   # a server start elsewhere
        with memory_lock.held(False, "another start", path=path, wait_s=BOUND_S / 2) as got:
            assert got, "a start waited for another start"
        t0 = time.monotonic()
        threading.Timer(LET_GO_S, let_go).start()
        with memory_lock.held(True, "a sleep", path=path, wait_s=60) as got:
            waited = time.monotonic() - t0
        assert got and waited > 1.0, f"a sleep went ahead beside a start ({waited:.2f} s)"


def test_a_start_waits_for_a_sleep_and_every_wait_is_bounded(tmp_path, caplog):
    path = tmp_path / "gpu-memory.lock"
    with _held_elsewhere(path, exclusive=True):   # a sleep elsewhere
        t0 = time.monotonic()
        with memory_lock.held(False, "a start", path=path, wait_s=0.5) as got:
            waited = time.monotonic() - t0
        assert not got and 0.4 < waited < BOUND_S, (got, waited)
        assert "going ahead without it" in caplog.text


def test_nothing_is_locked_for_a_cpu_server_or_outside_a_parallel_run(tmp_path, monkeypatch):
    with memory_lock.held(True, "cpu", gpu=False, path=tmp_path / "l") as got:
        assert not got
    monkeypatch.delenv(memory_lock.DIR_ENV, raising=False)
    with memory_lock.held(True, "serial run") as got:
        assert not got


def test_a_run_inside_a_test_leaves_the_outer_runs_folder(monkeypatch):
    """The lock lives in the controller's folder. A pytest run inside a test of the same
    run inherits the folder's path; at its end it must not remove it (it did, on 1 x H200:
    every later start and sleep of the run failed with FileNotFoundError). Only the
    process that made the folder removes it."""
    from harness.run import parallel

    monkeypatch.delenv(parallel.DIR_ENV, raising=False)
    d = Path(parallel.controller_dir())
    try:
        inner = subprocess.run([sys.executable, "-c",
                                "from harness.run import parallel; parallel.remove_controller_dir()"],
                               timeout=120, capture_output=True, text=True)
        assert inner.returncode == 0, inner.stderr
        assert d.is_dir(), "a run of another process removed the controller's folder"
        lock = d / "gpu-memory.lock"
        with memory_lock.held(True, "a sleep", path=lock) as got:
            assert got
    finally:
        parallel.remove_controller_dir()
    assert not d.exists() and parallel.DIR_ENV not in os.environ


def test_a_lock_whose_folder_went_is_made_again(tmp_path):
    path = tmp_path / "gone" / "gpu-memory.lock"
    with memory_lock.held(False, "a start", path=path) as got:
        assert got and path.exists()


def test_a_wake_shares_the_lock_with_starts_and_only_a_real_sleep_waits(tmp_path, monkeypatch):
    """What the client takes: a wake maps memory like a start (shared: it does not wait
    for starts, which a 5-cycle test on a busy GPU would pay for at every wake), a sleep
    at level 1 waits for them, a sleep at level 0 frees nothing and takes nothing."""
    from harness.vllm.client import ServerClient

    path = tmp_path / "gpu-memory.lock"
    monkeypatch.setattr(memory_lock, "_path", lambda: path)
    monkeypatch.setattr(ServerClient, "_call", lambda self, *a, **kw: {})
    client = ServerClient("http://127.0.0.1:9", timeout=1.0)
    monkeypatch.setattr(memory_lock, "WAIT_S", 1.0)
    with _held_elsewhere(path, exclusive=False):   # a server start elsewhere
        waits = {}
        for what, call in (("wake", lambda: client.wake_up()),
                           ("sleep level 0", lambda: client.sleep(level=0)),
                           ("sleep level 1", lambda: client.sleep(level=1))):
            t0 = time.monotonic()
            call()
            waits[what] = time.monotonic() - t0
        assert waits["wake"] < 0.5 and waits["sleep level 0"] < 0.5, waits
        assert waits["sleep level 1"] >= 0.9, f"a sleep went ahead beside a start: {waits}"


def test_a_sleep_is_not_starved_by_starts_that_keep_overlapping(tmp_path):
    """Starts that overlap one another without a gap (eight workers on one GPU) kept a
    sleep waiting until they were all done: 435-559 s on 1 x H200. A sleep now waits
    only for the starts under way when it asks; later ones wait for it."""
    import threading

    path = tmp_path / "gpu-memory.lock"
    stop = threading.Event()

    def start_after_start():
        while not stop.is_set():
            with memory_lock.held(False, "a start", path=path, wait_s=30):
                time.sleep(0.6)

    starts = [threading.Thread(target=start_after_start, daemon=True) for _ in range(3)]
    for i, t in enumerate(starts):
        t.start()
        time.sleep(0.2)   # staggered: at every moment some start is under way
    try:
        time.sleep(1.0)
        t0 = time.monotonic()
        with memory_lock.held(True, "a sleep", path=path, wait_s=8) as got:
            waited = time.monotonic() - t0
        assert got and waited < 3.0, f"the sleep waited {waited:.1f} s beside overlapping starts"
    finally:
        stop.set()
        for t in starts:
            t.join(timeout=30)


def test_a_tests_sleep_reports_its_wait_for_the_lock_as_a_phase(tmp_path, monkeypatch):
    """On one GPU a sleep waits for the other servers' starts (minutes on an H100 with
    eight workers): the client of a test's session reports each wait as phase
    ``lock_wait``, so the report shows it and the plan's durations leave it out."""
    from types import SimpleNamespace

    from harness.run.flow import SyncSession
    from harness.vllm.client import ServerClient

    path = tmp_path / "gpu-memory.lock"
    monkeypatch.setattr(memory_lock, "_path", lambda: path)
    monkeypatch.setattr(ServerClient, "_call", lambda self, *a, **kw: {})
    records = []
    session = SimpleNamespace(on_record=lambda name, value: records.append((name, value)))
    srv = SimpleNamespace(url="http://127.0.0.1:9", describe_failure=lambda: "",
                          cfg=SimpleNamespace(api_key=None, enable_sleep_mode=True))
    client = SyncSession.client_for(session, srv)
    with _held_elsewhere(path, exclusive=False) as let_go:   # a server start elsewhere
        threading.Timer(LET_GO_S, let_go).start()
        client.sleep(level=1)
    client.wake_up()
    waits = [v["lock_wait"] for name, v in records if name == "phase" and "lock_wait" in v]
    assert len(waits) == 2, records
    assert waits[0] > 1.0 and waits[1] < 0.5, waits


def test_a_wake_does_not_queue_behind_a_sleep_that_waits_for_starts(tmp_path):
    """A sleep waiting for a start under way keeps the turnstile shut: a new start waits
    for the sleep, but a wake, milliseconds of mapping, goes ahead beside the start (on
    an H100 a /wake_up queued behind such sleeps took 227 s, the engine's wake 0.004 s)."""
    path = tmp_path / "gpu-memory.lock"
    with _held_elsewhere(path, exclusive=False) as let_go:   # a server start elsewhere
        slept = []

        def sleep():
            with memory_lock.held(True, "a sleep", path=path, wait_s=BOUND_S) as got:
                slept.append(got)

        sleeping = threading.Thread(target=sleep, daemon=True)
        sleeping.start()
        time.sleep(0.5)                                       # the sleep is waiting now
        t0 = time.monotonic()
        with memory_lock.held(False, "a wake", path=path, queue=False, wait_s=3) as got:
            waited = time.monotonic() - t0
        assert got and waited < 1.0, f"the wake waited {waited:.2f} s behind the sleep"
        with memory_lock.held(False, "a new start", path=path, wait_s=0.5) as got:
            assert not got, "a start went ahead of a sleep that was waiting"
        let_go()
        sleeping.join(timeout=BOUND_S)
        assert slept == [True], "the sleep did not get the lock once the start was done"


def test_a_thread_holding_the_lock_alone_sleeps_and_wakes_inside_it_at_once(tmp_path):
    """A test that sleeps several times holds the lock alone across them
    (``ServerClient.alone_on_the_gpu``): its own sleeps and wakes go ahead at once,
    while a start in another thread of the same process, or in another process, waits
    until the block ends."""
    path = tmp_path / "gpu-memory.lock"
    waits: list[float] = []
    with memory_lock.held(True, "three sleep/wake cycles", path=path, wait_s=BOUND_S) as got:
        assert got
        for _ in range(3):
            for exclusive, queue in ((True, True), (False, False)):   # a sleep, a wake
                t0 = time.monotonic()
                with memory_lock.held(exclusive, "inside", path=path, wait_s=BOUND_S,
                                      on_wait=waits.append) as inner:
                    waited = time.monotonic() - t0
                assert inner and waited < LET_GO_S, (
                    f"a sleep or a wake inside its own thread's hold waited {waited:.2f} s")
        started = threading.Event()

        def start():
            with memory_lock.held(False, "a start", path=path, wait_s=BOUND_S):
                started.set()

        threading.Thread(target=start, daemon=True).start()
        assert not started.wait(LET_GO_S), "a start of another thread went ahead inside the hold"
    assert started.wait(BOUND_S), "the start never went ahead after the hold ended"
    assert waits == [0.0] * 6
    with memory_lock.held(False, "a start after it", path=path, wait_s=0.5) as got:
        assert got, "the hold was not let go"
