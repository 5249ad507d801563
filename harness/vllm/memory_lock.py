"""Sleep beside other servers on one GPU: a lock between starts, wakes and sleeps.

vLLM's GPU worker reads the device's free memory before and after it sleeps, and fails
the sleep with "Memory usage increased after sleeping." when the free memory fell in
between (``v1/worker/gpu_worker.py`` ``sleep``, read in 0.32.0). The figure is
device-wide: a server that starts meanwhile on the same GPU, mapping its weights and
KV cache, makes another server's sleep fail. Seen on one GPU (vLLM 0.26.0) with eight
workers side by side: a 5-cycle sleep test got HTTP 500 from /sleep.

So, in a parallel run on a GPU host, a server start holds this lock shared until it is
healthy, a wake holds it shared while it maps memory back, and a sleep (level 1 or 2)
holds it alone. A wake is not judged by the device's memory (``wake_up``, read in
0.26.0), so starts and wakes may overlap each other; only a sleep waits for them. One run, one lock file, in the run's
shared folder (``HARNESS_XDIST_DIR``); elsewhere the lock does nothing. Every wait is
bounded: past ``WAIT_S`` the call goes ahead without the lock and says so in the log.

The lock cannot hold what a trainer or a server answering requests allocates. A server
without --enable-sleep-mode frees nothing when it sleeps, so even a small allocation
elsewhere fails its sleep: seen on a GPU (known issue sleep-judged-by-device-free-memory), and asked again by
``ServerClient.sleep`` (never for a sleep-mode server, whose weights have already moved).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

DIR_ENV = "HARNESS_XDIST_DIR"   # the parallel run's shared folder (harness.run.parallel)
WAIT_S = 900.0                  # a start's own limit is about this long
log = logging.getLogger(__name__)
_mine = threading.local()       # .path: the lock this thread holds alone, if any


def _path() -> Path | None:
    d = os.environ.get(DIR_ENV)
    if not d or not _gpu_host():
        return None
    return Path(d) / "gpu-memory.lock"


def _gpu_host() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


@contextlib.contextmanager
def held(exclusive: bool, what: str, *, gpu: bool = True, path: Path | None = None,
         wait_s: float | None = None, queue: bool = True,
         on_wait: Callable[[float], None] | None = None) -> Iterator[bool]:
    """Hold the lock (``exclusive`` for a sleep, shared for a start or a wake) while
    the block runs; yields whether it is held. ``gpu=False`` (a CPU server) holds
    nothing; ``path`` overrides the run's lock file. ``on_wait`` is told how many
    seconds went by before the lock was taken (or given up), where there is a lock.

    A sleep goes first: every holder passes a turnstile (``<path>.turn``) on its way
    in, and a sleep keeps it shut while it waits, so starts that begin after the
    sleep asked wait for it. Without the turnstile a sleep waited for a moment with no
    start under way, and with eight workers on one GPU, whose 37 starts overlapped for
    13 minutes, sleep tests waited 435-559 s (reports/gpu/README.md).

    ``queue=False`` (a wake) skips the turnstile: it waits only for a sleep that holds
    the lock, not for one still waiting for starts. A wake maps memory in milliseconds,
    so it cannot starve a sleep. Behind the turnstile a ``/wake_up`` took 227 s with
    eight workers on one GPU while the engine's wake took 0.004 s (reports/gpu/README.md):
    read from those timings, it waited out the sleeps queued before it, and
    each of those the starts under way. That skipping the turnstile shortens a GPU run
    is not measured yet.

    Inside a thread's own exclusive hold, a sleep or a wake of that thread holds it
    already and goes ahead at once. A test that sleeps several times holds the lock
    alone across them (``ServerClient.alone_on_the_gpu``): one wait for the starts under
    way instead of one per sleep, each sleep waiting out the starts that slipped in
    since the last (in a GPU run, a 3-cycle test waited 263 s of its 266 s). Other
    threads of the process, a worker's start threads among them, wait as any holder
    elsewhere does."""
    path = (path or _path()) if gpu else None
    wait_s = WAIT_S if wait_s is None else wait_s
    if path is None:
        yield False
        return
    if getattr(_mine, "path", None) == path:  # inside this thread's own hold: alone already
        if on_wait is not None:
            on_wait(0.0)
        yield True
        return
    path.parent.mkdir(parents=True, exist_ok=True)  # the run's folder, if it went early
    t0 = time.monotonic()
    deadline = t0 + wait_s
    with open(path.with_name(path.name + ".turn"), "a+") as turn, open(path, "a+") as f:
        got = _take(turn, fcntl.LOCK_EX, deadline) if queue else True
        try:
            got = got and _take(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline)
        finally:
            if queue:
                fcntl.flock(turn, fcntl.LOCK_UN)
        if on_wait is not None:
            on_wait(time.monotonic() - t0)
        if not got:
            log.warning("%s: the GPU memory lock was not free after %.0f s; going ahead "
                        "without it", what, wait_s)
            yield False
            return
        if exclusive:
            _mine.path = path
        try:
            yield True
        finally:
            if exclusive:
                _mine.path = None
            fcntl.flock(f, fcntl.LOCK_UN)


def _take(f, mode: int, deadline: float) -> bool:
    """``flock`` ``f`` in ``mode`` by ``deadline`` (polled: a blocking flock has no
    timeout)."""
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
