"""The host's server-start slots, shared by the workers of a parallel run.

Starts are CPU-bound (``plan.Host.max_starting``: two cores a start). Dealt a fixed
share of them, one start at a time each, with eight workers on one GPU, a worker with
seven servers started them one after another while a worker with one server left its
share idle: the whole run waited on the first worker's seventh start
(reports/gpu/README.md). So the slots belong to the host, not to a
worker:

* worker k's own slot is slot k;
* a worker may start several servers at once (up to its pool's bound): besides its
  own slot it takes only slots nobody else needs now, a spare one (more slots than
  workers) or the slot of a worker that has no start left to make (it says so with
  an ``idle-K`` file, and takes its slot back for a restart, once the borrower's
  start is done);
* a worker beyond the slots (``-n`` above the host's starts) has no slot of its own
  and takes any free one.

Slots are ``flock``-ed files in the run's folder: a worker that dies frees its slots,
and a pytest run inside a test (with its own folder, or none) takes none of them.
Every wait is bounded: past ``wait_s`` the start goes ahead without a slot and the
log says so.

A worker's own starts queue for slots in a line (``ticket``), in the order its pool
planned them, a start some test waits for now at the front (``hurry``). Left to race
for the lock files, a worker's three starts on 2 CPU cores took the slot in any order:
in a CI run the twin went first and the server of the longest chain of tests, planned
first, waited 209 s for its slot (docs/planning.md, "CPU CI").
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

WAIT_S = 900.0     # a start's own limit is about this long
POLL_S = 0.1
log = logging.getLogger(__name__)


class Abandoned(Exception):
    """A start gave up its place in the line: its run is ending."""


class StartSlots:
    """``slots`` start slots of the host, seen from worker ``worker`` of ``workers``."""

    def __init__(self, folder: Path | str, slots: int, worker: int, workers: int, *,
                 wait_s: float = WAIT_S):
        self.folder, self.slots = Path(folder), max(1, slots)
        self.worker, self.workers, self.wait_s = worker, workers, wait_s
        self._line: list[int] = []   # this worker's tickets waiting for a slot, in turn
        self._next = 0
        self._line_lock = threading.Lock()

    def ticket(self) -> int:
        """A place at the end of this worker's line for a slot."""
        with self._line_lock:
            self._next += 1
            self._line.append(self._next)
            return self._next

    def hurry(self, ticket: int) -> None:
        """A test waits for this start now: it goes to the front of the line."""
        with self._line_lock:
            if ticket in self._line:
                self._line.remove(ticket)
                self._line.insert(0, ticket)

    def leave(self, ticket: int) -> None:
        """Out of the line (it holds a slot, gave up, or never came): idempotent."""
        with self._line_lock:
            if ticket in self._line:
                self._line.remove(ticket)

    def _first(self, ticket: int) -> bool:
        with self._line_lock:
            return bool(self._line) and self._line[0] == ticket

    @property
    def own(self) -> int | None:
        return self.worker if self.worker < self.slots else None

    def _borrowable(self) -> list[int]:
        """Slots no worker needs now: spare ones, and those of idle workers."""
        out = []
        for j in range(self.slots):
            if j == self.own:
                continue
            if j >= self.workers or (self.folder / f"idle-{j}").exists():
                out.append(j)
        return out

    def idle(self, idle: bool) -> None:
        """Whether this worker has no start left to make: others may use its slot."""
        if self.own is None:
            return
        marker = self.folder / f"idle-{self.own}"
        try:
            if idle:
                marker.touch()
            else:
                marker.unlink(missing_ok=True)
        except OSError:   # the run's folder went early: nothing left to share
            pass

    @contextlib.contextmanager
    def held(self, what: str, ticket: int | None = None, *,
             abort: Callable[[], bool] | None = None) -> Iterator[dict]:
        """Hold a slot while the block starts a server; yields what the wait was
        (``slot``: its number, or None past ``wait_s``; ``waited``: seconds;
        ``borrowed``: whether it is another worker's). ``ticket``: its place in the
        line (``ticket()``); without one it joins the end of the line. ``abort``: asked
        while waiting; once true the wait ends in ``Abandoned`` (the run is ending: a
        start that got its slot then would launch a server nobody stops)."""
        t0 = time.monotonic()
        got: tuple[int, object] | None = None
        ticket = self.ticket() if ticket is None else ticket
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            deadline = t0 + self.wait_s
            while got is None:
                if self.own is None:   # no slot of its own: any free one
                    candidates = list(range(self.slots))
                else:
                    candidates = [self.own] + self._borrowable()
                if self._first(ticket):
                    got = self._try(candidates)
                    if got is not None:
                        self.leave(ticket)   # the next in line may borrow a slot
                if got is None:
                    if abort is not None and abort():
                        raise Abandoned(f"{what}: the run ended while it waited for a "
                                        "start slot")
                    if time.monotonic() >= deadline:
                        log.warning("%s: no start slot free after %.0f s; going ahead "
                                    "without one", what, self.wait_s)
                        break
                    time.sleep(POLL_S)
            yield {"slot": None if got is None else got[0],
                   "waited": round(time.monotonic() - t0, 3),
                   "borrowed": got is not None and got[0] != self.own}
        finally:
            self.leave(ticket)
            if got is not None:
                fcntl.flock(got[1], fcntl.LOCK_UN)
                got[1].close()

    def _try(self, candidates: list[int]) -> tuple[int, object] | None:
        for j in candidates:
            f = open(self.folder / f"start-slot-{j}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return j, f
            except BlockingIOError:
                f.close()
        return None
