"""The trainer, in its own process, alive as long as its transfer group.

NCCL groups and CUDA IPC handles must never live in the pytest process, and a hung
or crashed trainer must be killable. Real RL trainers open the weight-transfer group
once and push hundreds of updates through it, so a ``Trainer`` does the same: it
spawns ``python -m harness.trainer.child`` once, the child opens the group
(``/init_weight_transfer_engine``, and the NCCL rendezvous) on its first update, and
every ``sync()`` is then one command over a pipe: which weights, which deliberate
corruption. Imports, the CUDA context and the group are paid for once.

Every command is bounded by a timeout. On a timeout the child is asked to dump its
stacks (SIGUSR1, faulthandler) into its log and is killed. A failed sync leaves its
group in an unknown state: an IPC or shm trainer closes that group and stays (the next
``sync()`` opens a new group in the same process, without paying again for imports,
the CUDA context and the weights); an NCCL trainer, whose group may be stuck in a
collective, is killed, and the next ``sync()`` starts a new child. Either way the
error carries the child's log tail and the server's.

The child carries the run's owner tag (``harness.vllm.reaper``) and a scratch directory of
its own (the shm backend's buckets), which the parent removes when the child is gone,
however it went. The server's API key reaches it through its environment, never its
command line. Besides the deliberate corruptions of the tensors (``corrupt``), a sync
can lie about them (``lie``): the update info then disagrees with what is sent.

This module is the parent's half: the ``Trainer`` the session holds, the spec it
starts a child with, the errors, and the names parent and child agree on. What runs in
the child (the weights, the damage, the lies, the two trainer codes, the command loop)
is ``harness.trainer.child``, which imports the names it shares from here (never the
other way round: the parent does not load the child's code).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any, Callable

from harness import transfer
from harness.portable import corrupt as _portable_corrupt
from harness.trainer.spares import SCRATCH_ENV, Spare, TrainerProcesses, kill_session, spawn_child

CORRUPTIONS = _portable_corrupt.CORRUPTIONS  # ("drop", "scale", "swap", "nothing", "nan")
# Damage the model cannot even take, for the fault tests (not a parity self-test, so not
# in CORRUPTIONS, which harness repro offers): narrow sends a 2-D weight one column short,
# its update info agreeing.
SHAPE_FAULTS = ("narrow",)
# Damage the logits of the usual prompts do not see, for the checksum oracle's tests:
# row adds 1.0 to the last row of the input embedding (a token id no zoo prompt uses;
# on a tensor-parallel server that row lives on the last rank).
UNSEEN_FAULTS = ("row",)
# Metadata that disagrees with the tensors sent (the tensors themselves are right):
# names (the first tensor announced under a name the model lacks), shapes (its first
# dimension announced one larger), dtypes (announced as the other float dtype), count
# (one shape fewer than names), gpu (CUDA IPC handles keyed by a GPU that is not there).
# rank0-only is a lie about who gets the update: the update info goes, as vLLM's list
# form (one entry per global worker rank, 0.26+), to rank 0 alone, every other rank of
# every engine getting an update of no tensor (the data- and pipeline-parallel self-tests).
RANK0_ONLY = "rank0-only"
LIES = ("names", "shapes", "dtypes", "count", "gpu", RANK0_ONLY)
FAKE_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"
API_KEY_ENV = "HARNESS_TRAINER_API_KEY"
# The vllm trainer code (TrainerSpec.code "vllm", harness.transfer.vllm_code) sends what a
# ModuleSource over its live module yields, through vLLM's own client: the damage it can
# take is a source that leaves a parameter out (corrupt "drop"); options {"wrap": ...}
# hand ModuleSource a wrapped module. DROP_ENV applies a drop to every sync of that code
# ("auto": the parameter corrupt "drop" would pick, or a name), so that a run shows its
# checks failing without editing a test.
VLLM_CODE_CORRUPTIONS = ("drop",)
DROP_ENV = "HARNESS_VLLM_TRAINER_DROP"
# The options the vllm trainer code has (vllm_code.SeedTrainer's, wrap, and the child's);
# any other (a fault test's hold or delay) is the harness path's only.
VLLM_CODE_OPTIONS = ("device", "packed_buffer_size_bytes", "packed_num_buffers", "bucket_bytes",
                     "reprocess_tied", "master_address", "nccl_port", "wrap", "recover_in_place")
# The options a trainer of your own takes (harness.trainer.user): the child's; the
# harness path's (holds, delays, workarounds) it cannot honour, so a test asking is skipped.
USER_CODE_OPTIONS = ("device", "recover_in_place")


def recovers_in_place(engine: str) -> bool:
    """Does a trainer of ``engine`` survive a failed sync? It closes its group and opens
    a new one with the next sync (see child._child_main) where its backend says so
    (``Backend.recovers_in_place``); other trainers are ended instead, and so is any
    trainer whose options say {"recover_in_place": False}."""
    return transfer.backend(engine).recovers_in_place


class TrainerError(RuntimeError):
    pass


class TrainerCodeUnavailable(TrainerError, unittest.SkipTest):
    """The trainer code asked for cannot run on this release or host (vLLM's trainer
    code for an engine its release has no trainer API for, or cannot register); the
    message says why. A ``unittest.SkipTest``: pytest reports a test that meets it as
    skipped with that reason, without this module knowing pytest."""


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """What makes two trainers different: one trainer per server and backend variant
    (and per set of init options)."""

    url: str
    engine: str                      # the weight-transfer engine (harness.transfer)
    packed: bool
    dtype: str = "float32"
    device: str = "cpu"
    code: str = "harness"            # whose trainer code: harness | vllm | your own
    #                                  (facts.TRAINERS; MODULE:ATTRIBUTE or NAME: trainer_plugin)
    timeout: float = 300.0           # per HTTP call
    options: tuple[tuple[str, Any], ...] = ()  # the sender's options (hashable)

    @classmethod
    def make(cls, *, options: dict | None = None, **kw: Any) -> "TrainerSpec":
        return cls(options=tuple(sorted((options or {}).items())), **kw)


# ----------------------------------------------------------------------------- parent

def trainer_env(env: dict | None = None, api_key: str | None = None) -> dict:
    """The environment a trainer process starts with: ``env`` (else this process's),
    tagged for the reaper, with the API key the server wants."""
    from harness.vllm import reaper

    env = reaper.tagged(os.environ if env is None else env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop(API_KEY_ENV, None)
    env.pop(SCRATCH_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    return env


class Trainer:
    """One trainer process for one server and backend variant; ``sync`` many times."""

    def __init__(self, spec: TrainerSpec, *, log_dir: Path,
                 context: Callable[[], str] | None = None, env: dict | None = None,
                 api_key: str | None = None, processes: TrainerProcesses | None = None,
                 spares: bool = True, spare: Spare | None = None):
        self.spec = spec
        # the run's spares and exiting trainers (None: no spares, and close_in_background waits)
        self.processes = processes
        self.spares = spares  # take over one of the run's spares, and start the next one
        self.log_dir = Path(log_dir)
        self.context = context or (lambda: "")
        self.env = env
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.scratch: Path | None = None
        self.syncs = 0
        self._results: int | None = None
        self._buf = b""
        # how the process came to be, told with the first result it gives: seconds to
        # start it (or take over a spare), and whether it was a spare
        self._started: dict[str, Any] | None = None
        # a spare started for this trainer alone (Spares.spawn, with trainer_env's
        # environment of the same env and api_key), that its first command takes over
        self._own_spare = spare

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _start(self) -> None:
        env = trainer_env(self.env, self.api_key)
        t0 = time.monotonic()
        if self.processes is not None:
            self.processes.exiting.poll()
        spec = dataclasses.asdict(self.spec)
        spare, self._own_spare = self._own_spare, None
        if spare is not None and spare.proc.poll() is not None:
            spare.discard()  # it died importing (its log says why): start afresh
            spare = None
        run_spares = self.processes.spares if self.processes is not None and self.spares else None
        if spare is None and run_spares is not None:
            spare = run_spares.take(env, self.spec)
        if spare is not None:  # imports done already: tell it who it is
            try:
                spare.proc.stdin.write((json.dumps({"op": "become", "spec": spec},
                                                   default=str) + "\n").encode())
                spare.proc.stdin.flush()
            except OSError:
                spare.discard()
                spare = None
        if spare is not None:
            self.proc, self.log_path, self.scratch = spare.proc, spare.log_path, spare.scratch
            self._results = spare.hand_over()  # this trainer's to close, not the spare's
        else:
            self.proc, self.log_path, self.scratch, self._results = spawn_child(
                [json.dumps(spec, default=str)], env, self.log_dir, self.spec.engine)
        self._buf, self.syncs = b"", 0
        if run_spares is not None:
            run_spares.replenish(env, self.spec, self.log_dir)
        self._started = {"start_seconds": time.monotonic() - t0, "spare": spare is not None}

    def prepare(self, weights_dir: str, *, timeout: float = 600.0) -> dict:
        """Start the process and do all a first sync does short of calling the server:
        imports, the CUDA context, ``weights_dir``'s tensors on the device, the sender.
        ``harness bench`` prepares its trainers side by side, so that a cold sync times
        the group's opening and the first update, not Python's imports."""
        return self._command({"op": "prepare", "weights_dir": str(weights_dir)}, timeout)

    def sync(self, weights_dir: str, *, corrupt: str | None = None,
             corrupt_target: str | None = None, lie: str | None = None,
             timeout: float = 600.0) -> dict:
        """Push ``weights_dir`` (optionally damaged, or described by a lying update
        info: ``lie``, one of LIES) through this trainer's group; return its result
        dict (``first`` says whether it opened the group) or raise ``TrainerError``,
        after which the trainer is gone."""
        if lie is not None and lie not in LIES:
            raise ValueError(f"unknown lie {lie!r}; known: {', '.join(LIES)}")
        result = self._command({"op": "sync", "weights_dir": str(weights_dir),
                                "corrupt": corrupt, "corrupt_target": corrupt_target,
                                "lie": lie}, timeout)
        result["first"] = "init_seconds" in result  # this sync opened the group
        self.syncs += 1
        return result

    def describe(self, weights_dir: str, *, timeout: float = 600.0) -> dict:
        """vllm trainer code only: what a ``ModuleSource`` over ``weights_dir``'s model
        announces, next to the harness path's list for it, the checkpoint's names, the
        tied parameters and buffers ``named_parameters()`` leaves out, and the names a
        wrapped module's source would announce. Calls no route."""
        return self._command({"op": "describe", "weights_dir": str(weights_dir)}, timeout)

    def _command(self, cmd: dict, timeout: float) -> dict:
        if not self.alive():
            self.close()
            self._start()
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
            result = self._read_result(timeout)
        except BaseException:
            self.kill()
            raise
        result["trainer_log"] = str(self.log_path)
        if self._started is not None:
            result.update(self._started)
            self._started = None
        if not result["ok"]:
            if not result.get("alive"):
                self.kill()
            if result.get("unavailable"):
                raise TrainerCodeUnavailable(f"{self.spec.code} trainer code, {self._what()}: "
                                             f"{result['error'].split(': ', 1)[-1]}")
            error = TrainerError(f"trainer ({self._what()}) failed: {result['error']}\n"
                                 f"{result.get('traceback', '')}\n{self.context()}")
            error.child_error = result["error"]  # what the trainer code itself raised
            raise error
        return result

    def _what(self) -> str:
        return f"{self.spec.engine}, packed={self.spec.packed}, {self.spec.device}"

    def _read_result(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([self._results], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self._dump_stacks()
                self.kill()
                raise TrainerError(f"trainer ({self._what()}) did not finish within "
                                   f"{timeout:.0f}s; its stacks and output:\n"
                                   f"{self.log_tail()}\n{self.context()}") from None
            chunk = os.read(self._results, 1 << 16)
            if not chunk:
                code = self.proc.wait(timeout=30)
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise TrainerError(f"trainer ({self._what()}, pid {self.proc.pid}) {how} "
                                   f"during the sync, without a result:\n{self.log_tail()}\n"
                                   f"{self.context()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _dump_stacks(self) -> None:
        try:
            self.proc.send_signal(signal.SIGUSR1)  # every thread's stack, into the log
            time.sleep(2)
        except (ProcessLookupError, AttributeError):
            pass

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no trainer output)"

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to close its group and exit; kill it if it does not."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def close_in_background(self) -> None:
        """Like ``close``, without waiting: the child is asked to exit and left to do
        it (a process with a CUDA context takes seconds to end) while the caller goes
        on; the run's ``ExitingTrainers`` reaps it, and kills it if it outlives its grace.
        Only for an engine whose group is the trainer's own (IPC handles, shm buckets); an NCCL
        trainer, whose group spans the server, is closed and waited for."""
        if (not recovers_in_place(self.spec.engine) or not self.alive()
                or self.processes is None):
            self.close()
            return
        try:
            self.proc.stdin.write(b'{"op": "exit"}\n')
            self.proc.stdin.flush()
            self.proc.stdin.close()
        except OSError:
            self.kill()
            return
        self.processes.exiting.add(self.proc, self._results, self.scratch)
        self.proc, self._results, self.scratch = None, None, None

    def kill(self) -> None:
        if self._own_spare is not None:
            self._own_spare.discard()
            self._own_spare = None
        if self.proc is not None:
            kill_session(self.proc)
            for f in (self.proc.stdin,):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None
        if self._results is not None:
            os.close(self._results)
            self._results = None
        if self.scratch is not None:  # what a killed child could not remove itself
            import shutil

            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def run_trainer(spec: TrainerSpec, weights_dir: str, *, corrupt: str | None = None,
                corrupt_target: str | None = None, lie: str | None = None,
                timeout: float = 600.0, log_dir: Path | None = None,
                context: Callable[[], str] | None = None, api_key: str | None = None,
                processes: TrainerProcesses | None = None) -> dict:
    """One sync by a trainer of its own (a fresh process and group, one of the run's
    spares where ``processes`` keeps them), then gone: closed in the background
    (``Trainer.close_in_background``) when it was given a log directory and the run's ``processes``, else closed before the
    temporary one holding its log is removed. ``close_seconds`` in the result: how long
    the caller waited for that."""
    with tempfile.TemporaryDirectory(prefix="harness-trainer-") as tmp:
        t = Trainer(spec, log_dir=log_dir or Path(tmp), context=context, api_key=api_key,
                    processes=processes if log_dir is not None else None)
        try:
            result = t.sync(weights_dir, corrupt=corrupt, corrupt_target=corrupt_target,
                            lie=lie, timeout=timeout)
        except BaseException:
            t.close()
            raise
        t0 = time.monotonic()
        t.close_in_background() if log_dir is not None else t.close()
        result["close_seconds"] = time.monotonic() - t0
        return result
