"""harness demo's progress ticker: at most one line every 15 s, and none once the
wait it narrates is over (it said "still computing the reference..." inside steps 3-7,
long after the reference was computed, and 19 times "still starting server...")."""

from __future__ import annotations

import inspect
import threading
import time
from types import SimpleNamespace

from harness.commands import demo


def test_the_ticker_speaks_every_15_seconds_at_most():
    assert inspect.signature(demo.progress).parameters["every"].default >= 15


def test_the_ticker_is_silent_once_its_wait_is_done():
    said: list[str] = []
    with demo.progress("computing the reference", every=0.01, out=said.append) as ticker:
        deadline = time.monotonic() + 30
        while len(said) < 2 and time.monotonic() < deadline:  # the label, then a tick
            time.sleep(0.01)
        ticker.done()
        n = len(said)
        assert not ticker.thread.is_alive()
        time.sleep(0.05)
        assert len(said) == n
    assert said[0] == "  .. computing the reference"


def test_the_narrator_ends_the_reference_wait_when_the_reference_is_there():
    done = threading.Event()
    steps = demo.Steps()
    ref = SimpleNamespace(prompts=[1, 2])
    narrator = demo._Narrator(steps, SimpleNamespace(max_tokens=4),
                              ticker=SimpleNamespace(done=done.set))
    narrator("reference", reference=ref)
    assert done.is_set()
