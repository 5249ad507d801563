"""Owner tags and the reaper: what a harness run starts, a later run can find and stop.

A run stops its servers and trainers itself, on a normal end, after failed tests and
on Ctrl-C. A run that is killed outright (SIGKILL, the OOM killer, a CI job limit)
cannot: its vLLM servers and trainers live in sessions of their own and keep their
memory, GPU memory included. So every process the harness starts carries, in its
environment, the identity of the run that owns it:

    HARNESS_OWNER=<pid>:<start time>

(the start time, from psutil, tells a live owner from a later process that reused its
pid). vLLM's engine core and workers inherit it from the API server (the server runs
with SPT_NOENV=1, or vLLM's setproctitle would overwrite their environment block; should
a tag be unreadable anyway, a tagged orphan's descendants and process group go with
it). ``find_orphans``
lists the processes, of this user, whose tag names an owner that no longer exists;
``reap`` stops them, leaves first, TERM then KILL. A process without the tag, or
whose owner is alive (another run going on beside this one), is never touched.

The server pool reaps when it is created, so the next run cleans up after a killed
one; ``python -m harness.vllm.reaper`` lists what it would stop, and ``--yes`` stops it, by
hand. Scratch
directories that trainers keep on tmpfs are named after their owner too and are
removed with it.

Nothing here imports pytest, vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

OWNER_ENV = "HARNESS_OWNER"
SCRATCH_PREFIX = "harness-scratch-"


def _create_time(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def owner_tag(pid: int | None = None) -> str:
    """This process's tag (or ``pid``'s): ``<pid>:<start time, 2 decimals>``."""
    pid = os.getpid() if pid is None else pid
    t = _create_time(pid)
    return f"{pid}:{t:.2f}" if t is not None else f"{pid}:?"


def tagged(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this process as the owner (an inherited tag is replaced: a run
    started by another run owns what it starts)."""
    return {**env, OWNER_ENV: owner_tag()}


def owner_alive(tag: str) -> bool:
    """Is the process named by ``tag`` still the one that wrote it?"""
    pid_s, _, when = tag.partition(":")
    try:
        pid = int(pid_s)
    except ValueError:
        return True  # not a tag this module wrote: never judged dead, never reaped
    t = _create_time(pid)
    if t is None:
        return False
    return when == "?" or abs(t - float(when)) < 0.05


@dataclasses.dataclass(frozen=True)
class Orphan:
    pid: int
    owner: str
    name: str
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name}; owner {self.owner} is gone): {self.cmdline[:160]}"


def find_orphans(exclude: Iterable[int] = ()) -> list[Orphan]:
    """Processes of this user whose ``HARNESS_OWNER`` names a dead owner."""
    import psutil

    skip = set(exclude) | {os.getpid()}
    uid = os.getuid()
    alive_cache: dict[str, bool] = {}
    out = []
    for p in psutil.process_iter(["pid", "uids", "name", "cmdline"]):
        try:
            if p.info["pid"] in skip or p.info["uids"] is None or p.info["uids"].real != uid:
                continue
            tag = p.environ().get(OWNER_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        if not tag:
            continue
        if tag not in alive_cache:
            alive_cache[tag] = owner_alive(tag)
        if not alive_cache[tag]:
            out.append(Orphan(p.info["pid"], tag, p.info["name"] or "?",
                              " ".join(p.info["cmdline"] or [])))
    return out


def reap(orphans: list[Orphan] | None = None, *, timeout: float = 15.0) -> list[Orphan]:
    """Stop ``orphans`` (default: ``find_orphans()``): TERM, wait, KILL what is left.
    Children go before parents. Returns those that were signalled."""
    import psutil

    orphans = find_orphans() if orphans is None else orphans
    procs: dict[int, psutil.Process] = {}
    for o in orphans:
        try:
            p = psutil.Process(o.pid)
            if p.environ().get(OWNER_ENV) == o.owner:  # still the same process
                procs[p.pid] = p
                # its descendants and process group too, tagged or not (a process that
                # renamed itself without SPT_NOENV has lost its environment block)
                for c in p.children(recursive=True):
                    procs[c.pid] = c
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    leaders = set(procs)
    uid = os.getuid()
    for p in psutil.process_iter(["pid", "uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == uid and os.getpgid(p.pid) in leaders:
                procs.setdefault(p.pid, p)
        except (psutil.Error, OSError):
            pass
    procs = list(procs.values())
    depth = {}
    for p in procs:
        try:
            depth[p.pid] = len(p.parents())
        except psutil.NoSuchProcess:
            depth[p.pid] = 0
    procs.sort(key=lambda p: -depth.get(p.pid, 0))  # leaves first
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=wait)
        if not procs:
            break
    remove_orphan_scratch()
    return [o for o in orphans]


# ----------------------------------------------------------------------------- scratch

def scratch_base() -> str | None:
    """tmpfs where it exists (trainer buckets are written and read at memory speed)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def make_scratch(what: str) -> Path:
    """A fresh scratch directory named after this run: ``harness-scratch-<pid>-<t>-...``."""
    pid, _, when = owner_tag().partition(":")
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{pid}-{when}-{what}-",
                                 dir=scratch_base()))


def remove_orphan_scratch() -> list[Path]:
    """Scratch directories whose owning run is gone."""
    base = Path(scratch_base() or tempfile.gettempdir())
    gone = []
    for d in base.glob(f"{SCRATCH_PREFIX}*"):
        parts = d.name[len(SCRATCH_PREFIX):].split("-")
        if len(parts) < 2 or owner_alive(f"{parts[0]}:{parts[1]}"):
            continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.vllm.reaper [--yes]``: list orphans of dead runs; stop them with
    --yes (or --kill)."""
    from harness.core.facts import command_parser

    p = command_parser(
        prog="python -m harness.vllm.reaper",
        description="Stop what killed harness runs left behind: the processes of this user "
                    f"whose {OWNER_ENV} tag names a run that no longer exists, and their "
                    "scratch directories. Processes without the tag, or of a live run, are "
                    "never touched.")
    p.add_argument("--yes", "--kill", dest="act", action="store_true",
                   help="stop the orphans (without it, they are only listed)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the orphans, stop nothing (the default; kept for scripts)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, said on stderr)
        return int(e.code or 0)
    if args.act and args.dry_run:
        print("python -m harness.vllm.reaper: --yes and --dry-run contradict each other",
              file=sys.stderr)
        return 2
    orphans = find_orphans()
    for o in orphans:
        print(("stopping " if args.act else "would stop ") + o.describe())
    if orphans and args.act:
        reap(orphans)
    elif orphans:
        print(f"{len(orphans)} orphan(s) listed, none stopped: --yes stops them")
    if not orphans:
        print("no orphaned harness processes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
