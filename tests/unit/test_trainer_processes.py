"""The run's spare and retired trainer processes are shared by threads (a test's trainer,
the pool's start threads): each result pipe must be closed exactly once, since a second
close closes whatever file took its number in between (harness.trainer.spares)."""

from __future__ import annotations

import threading
import time

from harness.trainer import spares


class _Exited:
    pid = 0

    def poll(self):
        return 0


def test_retired_trainers_are_reaped_once_when_threads_poll_together(monkeypatch):
    reaped = []

    def slow_reap(proc, results, scratch):  # a kill and a close take a moment
        time.sleep(0.02)
        reaped.append(results)

    monkeypatch.setattr(spares, "reap", slow_reap)
    r = spares.ExitingTrainers(grace=30)
    for fd in range(20):
        r.add(_Exited(), fd, None)
    threads = [threading.Thread(target=r.poll) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(reaped) == list(range(20)), (
        f"result pipes closed {len(reaped)} times for 20 trainers: "
        f"{sorted(fd for fd in set(reaped) if reaped.count(fd) > 1)} more than once")
    r.drain()
    assert len(reaped) == 20


def test_a_spare_taken_over_by_a_trainer_no_longer_closes_its_pipe(monkeypatch):
    reaped = []
    monkeypatch.setattr(spares, "reap", lambda proc, results, scratch: reaped.append(results))
    s = spares.Spare(_Exited(), None, None, 7)
    assert s.hand_over() == 7 and s.hand_over() == -1
    s.discard()
    assert reaped == [], "a spare closed the pipe its trainer now reads"
    other = spares.Spare(_Exited(), None, None, 8)
    threads = [threading.Thread(target=other.discard) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert reaped == [8]
