"""What a selection asked for, and what of it this host runs: the run's end says so.

The plugin deselects the cases a run cannot or must not run (a layout that needs more
GPUs than there are, a case beyond ``--harness-depth quick``, a test pinned to models
or dtypes the options did not select). Those cases are counted here as ``-k`` and
``-m`` would have counted them, so ``pytest -k ipc`` speaks of the IPC cases only and
``-k zzznomatch`` of none; the summary is at most three lines, whatever the selection.

A selection that names GPU cases of which none can run here (``-k ipc`` on a CPU host)
fails the run (exit 1) unless ``--harness-allow-no-gpu`` says that is expected: its
other tests passing (26 unit tests whose names hold "ipc") is not what it asked for.

Nothing here imports the rest of the harness.
"""

from __future__ import annotations

import collections
import re
from typing import Callable, Iterable

_GPU = re.compile(r"layout (\S+) needs (\d+) GPU\(s\), (\d+) available")
DEPTH_PREFIX = "beyond --harness-depth quick"
BUILD_PREFIX = "the cpu layout needs a CPU build of vLLM"


def matcher(config) -> Callable[[object], bool]:
    """Would ``-k`` and ``-m`` have kept this item? (pytest's own matching, from
    ``_pytest.mark``; everything is kept where those internals cannot be used.)"""
    try:
        from _pytest.mark import KeywordMatcher, MarkMatcher
        from _pytest.mark.expression import Expression
    except ImportError:  # a pytest without them: count as pytest would have, unfiltered
        return lambda item: True
    keyword = (getattr(config.option, "keyword", "") or "").lstrip()
    marks = getattr(config.option, "markexpr", "") or ""
    try:
        kexpr = Expression.compile(keyword) if keyword else None
        mexpr = Expression.compile(marks) if marks else None
    except SyntaxError:  # pytest reports it itself
        return lambda item: True

    def keep(item) -> bool:
        if kexpr is not None and not kexpr.evaluate(KeywordMatcher.from_item(item)):
            return False
        return mexpr is None or bool(mexpr.evaluate(MarkMatcher.from_markers(item.iter_markers())))
    return keep


def kind(reason: str) -> str:
    """'gpu', 'build', 'depth' or 'options': why the harness deselected a case."""
    if _GPU.match(reason):
        return "gpu"
    if reason.startswith(BUILD_PREFIX):
        return "build"
    if reason.startswith(DEPTH_PREFIX):
        return "depth"
    return "options"


def asked(config) -> str:
    """The selection in the user's words: ``-k 'ipc'``, ``-m gpu``, or 'the options'."""
    parts = []
    if (getattr(config.option, "keyword", "") or "").strip():
        parts.append(f"-k {config.option.keyword.strip()!r}")
    if (getattr(config.option, "markexpr", "") or "").strip():
        parts.append(f"-m {config.option.markexpr.strip()!r}")
    return " ".join(parts)


def selected(dropped: Iterable[tuple[str, object]], keep: Callable[[object], bool]
             ) -> list[str]:
    """The reasons of the harness-deselected items that the selection would have kept."""
    return [reason for reason, item in dropped if keep(item)]


def summary(reasons: list[str], runnable: int, selection: str, gpus: int) -> list[str]:
    """At most three lines: what the selection asked for, what runs here, why not the
    rest. ``reasons``: one per deselected case the selection names; ``runnable``: the
    cases it names that this run keeps."""
    if not reasons:
        return []
    by_kind = collections.defaultdict(list)
    for r in reasons:
        by_kind[kind(r)].append(r)
    who = f"the selection ({selection})" if selection else "the selection"
    total = len(reasons) + runnable
    lines = [f"{total} case(s) in {who}: {runnable} run here, {len(reasons)} deselected"]
    why = []
    if by_kind["gpu"]:
        layouts = collections.Counter()
        for r in by_kind["gpu"]:
            name, need, _ = _GPU.match(r).groups()
            layouts[(name, int(need))] += 1
        why.append(f"{len(by_kind['gpu'])} need more GPUs than the {gpus} here ("
                   + ", ".join(f"{n} on {name} ({need} GPU{'s' if need > 1 else ''})"
                               for (name, need), n in sorted(layouts.items())) + ")")
    if by_kind["build"]:
        why.append(f"{len(by_kind['build'])} on the cpu layout, which this vLLM, built for "
                   "GPUs, cannot serve (--vllm-layout cpu runs them anyway)")
    if by_kind["depth"]:
        why.append(f"{len(by_kind['depth'])} beyond --harness-depth quick "
                   "(--harness-depth full runs them)")
    if why:
        lines.append("  " + "; ".join(why))
    if by_kind["options"]:
        pinned = collections.Counter(by_kind["options"]).most_common()
        shown = "; ".join(r for r, _ in pinned[:2]) + ("; ..." if len(pinned) > 2 else "")
        lines.append(f"  {len(by_kind['options'])} test(s) pinned to what the options did "
                     f"not select ({shown}; -v lists each)")
    return lines


def detail(reasons: list[str]) -> list[str]:
    """Every reason with its count, for ``-v``."""
    return [f"deselected {n}: {r}" for r, n in sorted(collections.Counter(reasons).items())]


def gpu_shortfall(reasons: list[str], runnable: int, gpus: int, selection: str) -> str | None:
    """The failure of a selection that names GPU cases of which none can run here, or
    None. (Cases it names that run here, shm ones, make it a partial run, said by the
    summary, not a failure.)"""
    n = sum(kind(r) == "gpu" for r in reasons)
    if not n or runnable:
        return None
    who = f"the selection ({selection})" if selection else "the selection"
    return (f"{who} names {n} GPU case(s) and none can run here ({gpus} GPU(s)): failed; "
            "--harness-allow-no-gpu accepts that")
