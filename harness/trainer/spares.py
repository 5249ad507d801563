"""The trainer processes a run keeps beside the one each server talks to: spares started
ahead (``Spares``), so that a test needing a fresh trainer does not wait for its imports,
and retired trainers left to exit on their own (``ExitingTrainers``). ``TrainerProcesses`` holds
both for one run: the pytest session owns it, and stops them at its end.

Both are used from several threads at once (a test's trainer, the pool's start threads
preparing theirs), and each process's result pipe is a bare file descriptor: closed
twice, the second close would close whatever file took its number in between (a lock
file, a socket, a log). So every list here changes under a lock, and a descriptor is
closed only by the one caller that took it off a list (or off its ``Spare``)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

SCRATCH_ENV = "HARNESS_TRAINER_SCRATCH"
# Environment variables that change while a run lasts and that a trainer does not read:
# a spare started under one value serves a trainer started under another.
VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL a trainer child's whole session (it starts one of its own) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def spawn_child(args: list[str], env: dict, log_dir: Path, what: str
           ) -> tuple[subprocess.Popen, Path, Path, int]:
    """``python -m harness.trainer.child ARGS... FD`` in a session of its own, with a
    log file and a scratch directory of its own; (process, log, scratch, result fd)."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    fd, log_path = tempfile.mkstemp(prefix=f"trainer-{what}-", suffix=".log", dir=log_dir)
    os.close(fd)
    from harness.vllm import reaper

    scratch = reaper.make_scratch(f"trainer-{what}")
    env = {**env, SCRATCH_ENV: str(scratch)}
    read_end, write_end = os.pipe()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "harness.trainer.child", *args, str(write_end)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                pass_fds=(write_end,), start_new_session=True)
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
    return proc, Path(log_path), scratch, read_end


class ExitingTrainers:
    """Trainers told to exit and not waited for (``Trainer.close_in_background``): each
    is reaped when it has exited, and its session killed once its grace has passed; ``drain``
    (end of run) waits for the rest within their grace, then kills them."""

    def __init__(self, grace: float = 30.0) -> None:
        self.grace = grace
        self._procs: list[tuple[subprocess.Popen, int | None, Path | None, float]] = []
        self._lock = threading.Lock()

    def add(self, proc: subprocess.Popen, results: int | None, scratch: Path | None) -> None:
        with self._lock:
            self._procs.append((proc, results, scratch, time.monotonic() + self.grace))

    def poll(self) -> None:
        """Reap those that have exited, kill those past their grace; never waits."""
        with self._lock:  # the ones taken off here are this caller's alone to reap
            done = [e for e in self._procs
                    if e[0].poll() is not None or time.monotonic() >= e[3]]
            self._procs = [e for e in self._procs if e not in done]
        for entry in done:
            reap(*entry[:3])

    def drain(self) -> None:
        while True:  # one at a time off the list: an interrupted drain can be re-run
            with self._lock:
                if not self._procs:
                    return
                proc, results, scratch, deadline = self._procs.pop()
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            finally:
                reap(proc, results, scratch)

    def __len__(self) -> int:
        return len(self._procs)


def reap(proc: subprocess.Popen, results: int | None, scratch: Path | None) -> None:
    """A child that is done (exited or not): its session killed (whatever it started
    goes with it), its result pipe closed, its scratch directory removed."""
    kill_session(proc)
    if results is not None:
        os.close(results)
    if scratch is not None:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)



@dataclasses.dataclass
class Spare:
    proc: subprocess.Popen
    log_path: Path
    scratch: Path
    results: int
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False,
                                              compare=False)

    def discard(self) -> None:
        """Kill it and remove what it owns; a second call, from any thread, does nothing."""
        results = self.hand_over()
        if results >= 0:
            reap(self.proc, results, self.scratch)

    def hand_over(self) -> int:
        """Its result pipe, once: the caller owns it from now on (-1 if it was taken)."""
        with self._lock:
            results, self.results = self.results, -1
        return results


class Spares:
    """Trainer processes started ahead: a spare imports what a trainer of its engine and
    trainer code imports (torch, the sender, transformers; vLLM's trainer API for NCCL
    and IPC: 5-20 s) and makes its CUDA context on its device while the tests run, and
    the next trainer of that engine, code, device and environment takes it over and is
    told its spec. A test that needs a fresh trainer (a new group, a second init, a
    killed trainer's successor) then does not wait for them. At most ``count`` wait per
    key; ``count`` 0 (the default outside pytest) starts none."""

    MAX_KEYS = 4  # engine x trainer code x device x environment kept at once

    def __init__(self, count: int = 0, log_dir: Path | None = None) -> None:
        self.count = count
        self.taken = 0
        self.log_dir = log_dir  # where spares log (else the first trainer's)
        self._idle: dict[tuple, list[Spare]] = {}
        self._lock = threading.RLock()

    @staticmethod
    def _key(env: dict, spec) -> tuple:
        # pytest names the running test in the environment: a key with it would match
        # only the trainers of the test that started the spare
        env = {k: v for k, v in env.items() if k not in VOLATILE_ENV}
        return (spec.engine, spec.code, spec.device, tuple(sorted(env.items())))

    @staticmethod
    def spawn(spec, env: dict, log_dir: Path) -> Spare:
        """A spare for ``spec``'s engine, trainer code and device, started now."""
        proc, log_path, scratch, results = spawn_child(
            ["--spare", spec.engine, spec.code, spec.device], env, log_dir, "spare")
        return Spare(proc, log_path, scratch, results)

    def take(self, env: dict, spec) -> Spare | None:
        with self._lock:
            idle = self._idle.get(self._key(env, spec), [])
            while idle:
                spare = idle.pop(0)
                if spare.proc.poll() is None:
                    self.taken += 1
                    return spare
                spare.discard()  # it died waiting (its log says why): start a trainer afresh
        return None

    def replenish(self, env: dict, spec, log_dir: Path) -> None:
        if not self.count:
            return
        with self._lock:
            self._replenish(env, spec, log_dir)

    def _replenish(self, env: dict, spec, log_dir: Path) -> None:
        key = self._key(env, spec)
        idle = self._idle.setdefault(key, [])
        while len(idle) < self.count:
            idle.append(self.spawn(spec, env, self.log_dir or log_dir))
        # Each spare holds a process's memory, and on a GPU a CUDA context: at most
        # MAX_KEYS keys keep spares, the one least recently replenished gives way.
        self._idle[key] = self._idle.pop(key)  # the most recent, last
        while len(self._idle) > self.MAX_KEYS:
            for spare in self._idle.pop(next(iter(self._idle))):
                spare.discard()

    def close(self) -> None:
        """Stop every spare still waiting (end of run): all are told at once (a waiting
        spare exits on end of input) and given 5 s between them, then killed."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for spare in [s for idle in self._idle.values() for s in idle]:
            try:
                spare.proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for idle in self._idle.values():
            while idle:  # one at a time off the list: an interrupted close can be re-run
                spare = idle.pop()
                try:
                    spare.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                finally:
                    spare.discard()
        self._idle.clear()


class TrainerProcesses:
    """One run's spares and retired trainers; ``close`` (the run's end, or the
    interpreter's) stops both."""

    def __init__(self, spares: int = 0, log_dir: Path | None = None) -> None:
        self.spares = Spares(spares, log_dir)
        self.exiting = ExitingTrainers()

    def close(self) -> None:
        try:
            self.spares.close()
        finally:
            self.exiting.drain()
