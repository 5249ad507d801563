"""The host's start slots, shared by the workers of a parallel run
(harness.run.start_slots), and the pool starting through them. Fakes only: no server."""

from __future__ import annotations

import logging
import threading
import time

from harness.run import pool as pool_mod
from harness.run.start_slots import StartSlots
from harness.vllm.server import ServerConfig


def test_a_worker_starts_in_its_own_slot_and_borrows_only_what_nobody_needs(tmp_path):
    w0, w1 = (StartSlots(tmp_path, 2, k, 2, wait_s=0.5) for k in (0, 1))
    with w0.held("w0 first") as a:
        assert a["slot"] == 0 and not a["borrowed"], a
        with w0.held("w0 second") as b:   # worker 1 still has starts to make
            assert b["slot"] is None and b["waited"] >= 0.4, b
        w1.idle(True)                     # worker 1 has none left: its slot is free to use
        with w0.held("w0 second, again") as b:
            assert b["slot"] == 1 and b["borrowed"], b
            w1.idle(False)                # a restart of worker 1 waits for the borrower
            with w1.held("w1 restart") as c:
                assert c["slot"] is None, c
        with w1.held("w1 restart, again") as c:
            assert c["slot"] == 1 and not c["borrowed"], c


def test_spare_slots_are_anyones_and_a_worker_beyond_the_slots_takes_any(tmp_path):
    w0 = StartSlots(tmp_path, 3, 0, 2, wait_s=0.5)      # slot 2: no worker's
    with w0.held("a") as a, w0.held("b") as b:
        assert (a["slot"], b["slot"]) == (0, 2), (a, b)
    w2 = StartSlots(tmp_path, 2, 2, 3, wait_s=0.5)      # -n 3 on a host of 2 slots
    with w2.held("w2") as c:
        assert c["slot"] in (0, 1) and c["borrowed"], c


def test_every_wait_is_bounded_and_said(tmp_path, caplog):
    w0 = StartSlots(tmp_path, 1, 0, 1, wait_s=0.3)
    with caplog.at_level(logging.WARNING), w0.held("a"):
        with w0.held("b") as b:
            assert b["slot"] is None
    assert "no start slot free after" in caplog.text


def _pool(tmp_path, monkeypatch, slots, starts: list, hold_s: float):
    class Server:
        def __init__(self, cfg, **kw):
            self.cfg, self.url, self.version, self.log_path = cfg, "", "x", None
            self.start_seconds = hold_s

        def start(self):
            starts.append((self.cfg.model, "begin", time.monotonic()))
            time.sleep(hold_s)
            starts.append((self.cfg.model, "end", time.monotonic()))
            self.url = "http://127.0.0.1:1"

        def alive(self):
            return True

        def stop(self):
            pass

        cancel = stop

    monkeypatch.setattr(pool_mod, "VLLMServer", Server)
    monkeypatch.setattr(pool_mod.models, "ensure_built", lambda model: None)
    return pool_mod.ServerPool(tmp_path / "logs", start_timeout=5, max_alive=4,
                               max_starting=4, reap=False, slots=slots)


def test_a_busy_worker_starts_in_the_slot_an_idle_worker_left(tmp_path, monkeypatch):
    """Worker 0 plans three servers, worker 1 one: once worker 1's start is done, its
    slot carries worker 0's starts too, never more than the host's two at a time."""
    starts: list = []
    folder = tmp_path / "run"
    p0 = _pool(tmp_path, monkeypatch, StartSlots(folder, 2, 0, 2), starts, 0.6)
    p1 = _pool(tmp_path, monkeypatch, StartSlots(folder, 2, 1, 2), starts, 0.6)
    try:
        p1.plan([ServerConfig(model="/w1-a")])
        p0.plan([ServerConfig(model=f"/w0-{x}") for x in "abc"])
        deadline = time.monotonic() + 20
        while sum(1 for s in starts if s[1] == "end") < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        p0._executor.shutdown(wait=True)
    finally:
        for p in (p0, p1):
            p._closed = True
    events = sorted((t, what) for _, what, t in starts)
    at_once, most = 0, 0
    for _, what in events:
        at_once += 1 if what == "begin" else -1
        most = max(most, at_once)
    assert sum(1 for s in starts if s[1] == "end") == 4, starts
    assert most == 2, f"{most} starts at once on a host of 2 slots: {starts}"
    borrowed = [r for r in p0.started if r.get("start_slot", {}).get("borrowed")]
    assert borrowed, f"worker 0 never used worker 1's slot: {p0.started}"


def test_a_pool_without_slots_starts_as_before(tmp_path, monkeypatch):
    starts: list = []
    p = _pool(tmp_path, monkeypatch, None, starts, 0.1)
    p.plan([ServerConfig(model="/a")])
    threading.Event().wait(0.5)
    p._executor.shutdown(wait=True)
    p._closed = True
    assert [s[1] for s in starts] == ["begin", "end"]
    assert "start_slot" not in p.started[0]


def _take_in_turn(slots: StartSlots, line, enter_order: list[int]) -> tuple[list, list]:
    """While the one slot is held, ``line()`` makes tickets and threads ask for the slot
    with them, entering in ``enter_order`` (indices); returns the tickets and the order
    in which they got the slot."""
    got: list[int] = []
    threads = []
    with slots.held("holder") as h:
        assert h["slot"] == 0, h
        tickets = line()
        for i in enter_order:
            def take(t=tickets[i]):
                with slots.held(f"ticket {t}", t):
                    got.append(t)
                    time.sleep(0.05)
            threads.append(threading.Thread(target=take))
            threads[-1].start()
            time.sleep(0.05)   # each is waiting before the next comes
    for t in threads:
        t.join(10)
    return tickets, got


def test_a_workers_starts_take_its_slot_in_the_order_of_their_tickets(tmp_path):
    slots = StartSlots(tmp_path, 1, 0, 1, wait_s=10)
    tickets, got = _take_in_turn(slots, lambda: [slots.ticket() for _ in range(3)], [2, 1, 0])
    assert got == tickets

    def hurried():
        line = [slots.ticket() for _ in range(3)]
        slots.hurry(line[2])        # a test waits for the last one now
        return line
    line, got = _take_in_turn(slots, hurried, [0, 1, 2])
    assert got == [line[2], line[0], line[1]]


def test_a_start_that_never_came_does_not_hold_up_the_line(tmp_path):
    slots = StartSlots(tmp_path, 1, 0, 1, wait_s=10)
    gone, waiting = slots.ticket(), slots.ticket()
    slots.leave(gone)               # its start failed before it asked for a slot
    with slots.held("next", waiting) as s:
        assert s["slot"] == 0 and s["waited"] < 1, s


def test_a_worker_starts_its_planned_servers_in_plan_order(tmp_path, monkeypatch):
    """One slot, three planned servers submitted at once: they start in plan order (a
    CI run on 2 cores, racing for the lock files, started its twin before the server
    of the longest chain of tests)."""
    for attempt in range(3):   # a race would show on one of several tries
        starts: list = []
        p = _pool(tmp_path, monkeypatch, StartSlots(tmp_path / f"run{attempt}", 1, 0, 1),
                  starts, 0.15)
        names = [f"/s{attempt}-{x}" for x in "abc"]
        try:
            p.plan([ServerConfig(model=m) for m in names])
            deadline = time.monotonic() + 20
            while sum(1 for s in starts if s[1] == "end") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            p._executor.shutdown(wait=True)
        finally:
            p._closed = True
        assert [m for m, what, _ in starts if what == "begin"] == names, starts
        assert not p._tickets, p._tickets


def test_a_start_still_waiting_for_its_slot_when_the_run_ends_launches_nothing(
        tmp_path, monkeypatch):
    """Seen on 1 x H200 when a job's time limit cut a run: a start queued for a slot
    had none when the pool stopped, so nothing was stopped; the slot came free as the
    other workers stopped their servers, and the start launched vLLM after the run had
    ended (a server log begun 5 s after the interrupt), while stop_all sat out its
    60 s wait for that start. The pool's end now cuts the wait short."""
    starts: list = []
    folder = tmp_path / "run"
    p = _pool(tmp_path, monkeypatch, StartSlots(folder, 1, 0, 1, wait_s=120), starts, 0.1)
    other = StartSlots(folder, 1, 0, 1, wait_s=5)   # another holder of the one slot
    stopped = threading.Event()
    with other.held("a start of another worker") as h:
        assert h["slot"] == 0, h
        p.plan([ServerConfig(model="/late")])
        deadline = time.monotonic() + 10
        while not p._booting and time.monotonic() < deadline:  # it waits in the line now
            time.sleep(0.02)
        assert p._booting, "the start never reached its slot's wait"
        threading.Thread(target=lambda: (p.stop_all(), stopped.set()), daemon=True).start()
        # while the slot is still taken: the end does not wait for the slot
        assert stopped.wait(30), "stop_all waited for a start that was still in the line"
    time.sleep(1.0)   # the slot is free now: a start that went on would launch here
    assert starts == [], f"a server was launched after the run ended: {starts}"
    assert p.started == []
