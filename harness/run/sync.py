"""/pause -> the trainer's push -> /resume, written once.

Every caller that syncs weights into a serving vLLM goes through ``paused_sync``:
``SyncSession.sync`` (the tests, ``harness demo``, ``harness repro`` through the seed
flow) and ``harness bench``. It times each step itself (``SyncTimings``), reports each
step to an optional ``on_step(name, **facts)`` callback (pause, sync, resume), and,
when the push fails, raises the push's error: a ``/resume`` that fails after it is
attached to that error as a note instead of replacing it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

OnStep = Callable[..., None]


@dataclasses.dataclass
class SyncTimings:
    """Seconds of each step of one paused sync (None: the step was not taken)."""

    pause_seconds: float | None = None
    push_seconds: float | None = None
    resume_seconds: float | None = None
    pause_to_resume_seconds: float | None = None


@dataclasses.dataclass
class PausedSync:
    result: Any              # what ``push`` returned (a trainer's result dict)
    timings: SyncTimings


def add_note(e: BaseException, note: str) -> None:
    """``note`` under ``e``'s traceback (Python >= 3.11; older ones go without)."""
    if hasattr(e, "add_note"):
        e.add_note(note)


def paused_sync(client, push: Callable[[], Any], *, pause: bool = True,
                pause_mode: str | None = None, on_step: OnStep | None = None) -> PausedSync:
    """``client.pause(pause_mode)`` -> ``push()`` -> ``client.resume()``.

    ``on_step`` hears "pause" (``mode``, and ``paused``: what /is_paused says), "sync"
    (``result``) and "resume" (``paused``), each as it ends; /is_paused is only asked
    when someone listens. Without ``pause`` the push runs alone (a caller that pauses
    some other way, or tests what a push does on a serving engine).

    The first error wins: when ``push`` (or a step's listener) fails, the server is
    resumed and that error is raised, with a note saying so when /resume failed too.
    A /resume that fails after a successful push raises its own error."""
    t = SyncTimings()
    t0 = time.monotonic()
    if pause:
        client.pause(pause_mode) if pause_mode else client.pause()
        t.pause_seconds = time.monotonic() - t0
    t1 = time.monotonic()
    try:
        if pause and on_step is not None:
            on_step("pause", mode=pause_mode, paused=client.is_paused(), timings=t)
        try:
            result = push()
        finally:
            t.push_seconds = time.monotonic() - t1
        if on_step is not None:
            on_step("sync", result=result, timings=t)
    except BaseException as e:
        if pause:
            try:
                client.resume()
            except Exception as r:
                first = str(r).splitlines()[0] if str(r) else type(r).__name__
                add_note(e, f"/resume after the failed sync failed too: {first}")
        raise
    if pause:
        t2 = time.monotonic()
        client.resume()
        t3 = time.monotonic()
        t.resume_seconds, t.pause_to_resume_seconds = t3 - t2, t3 - t0
        if on_step is not None:
            on_step("resume", paused=client.is_paused(), timings=t)
    return PausedSync(result, t)
