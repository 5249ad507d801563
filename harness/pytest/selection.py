"""What a selection asked for, and what of it this host runs: the run's end says so.

The plugin deselects the cases a run cannot or must not run (a layout that needs more
GPUs than there are, a case beyond ``--harness-depth quick``, a test pinned to models
or dtypes the options did not select). Those cases are counted here as ``-k`` and
``-m`` would have counted them, so ``pytest -k ipc`` speaks of the IPC cases only and
``-k zzznomatch`` of none; the summary is at most three lines, whatever the selection.

A selection that names GPU cases of which none can run here (``-k ipc`` on a CPU host)
is refused before any test runs (exit 4) unless ``--harness-allow-no-gpu`` says that is
expected: its other tests passing (26 unit tests whose names hold "ipc") is not what it
asked for. Where the options and ``-k`` alone show it (``names_only_gpu_cases``), before
collection; else at its end.

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
    return (f"{who} names {n} GPU case(s) and none can run here ({gpus} GPU(s)): nothing "
            "was run; --harness-allow-no-gpu runs the rest of the selection")


# The words of a case id that -k is documented to select by: an engine, a backend
# variant, a layout. Before collection they are judged from the case ids alone; any
# other word of -k may match a test's own name, module or markers, so it is left free.
def case_vocabulary(backends: Iterable[str], engines: Iterable[str],
                    layout_names: Iterable[str]) -> frozenset[str]:
    return frozenset(w.lower() for w in (*backends, *engines, *layout_names))


class _Free(Exception):
    def __init__(self, name: str):
        self.name = name


def _values(expression: str, decided: Callable[[str], bool | None], limit: int = 10
            ) -> set[bool]:
    """The values a -k or -m expression can take when ``decided(name)`` fixes some of
    its names (True or False) and leaves the rest (None) free: every assignment of the
    free names is tried, up to ``limit`` of them (beyond: both values)."""
    from _pytest.mark.expression import Expression

    expr = Expression.compile(expression)
    out: set[bool] = set()

    def run(assign: dict[str, bool]) -> None:
        def match(name: str, /, **kwargs) -> bool:
            key = f"{name}{sorted(kwargs.items())}" if kwargs else name  # -m 'm(k=v)': free
            got = None if kwargs else decided(name)
            if got is not None:
                return got
            if key in assign:
                return assign[key]
            raise _Free(key)
        try:
            out.add(bool(expr.evaluate(match)))
        except _Free as f:
            if len(assign) >= limit:
                out.update((True, False))
                return
            run({**assign, f.name: True})
            run({**assign, f.name: False})
    run({})
    return out


def names_only_gpu_cases(keyword: str, marks: str, gpu_ids: Iterable[str],
                         here_ids: Iterable[str], vocabulary: frozenset[str]) -> list[str]:
    """Before anything is collected: the case ids of ``gpu_ids`` (cases whose layout
    needs more GPUs than this host has) that ``-k keyword -m marks`` selects, when it
    can select none of ``here_ids`` (cases that run here); else []. A word of
    ``vocabulary`` is judged by whether the id holds it; any other word may be in a
    test's own name, module or markers: a case that runs here is counted as selected if
    some such words make the selection hold, a GPU case only if it holds without them
    (a test named by none of them). ``-m`` is judged only by its ``gpu`` marker. A
    selection that cannot be read (pytest says why itself) gives []."""
    def judge(case_id: str, gpu: bool, free: bool | None) -> set[bool]:
        def by_word(name: str) -> bool | None:
            return name.lower() in case_id.lower() if name.lower() in vocabulary else free
        def by_mark(name: str) -> bool | None:
            return gpu if name == "gpu" else free
        k = _values(keyword, by_word) if keyword.strip() else {True}
        m = _values(marks, by_mark) if marks.strip() else {True}
        return {a and b for a in k for b in m}
    try:
        if any(True in judge(i, False, None) for i in here_ids):
            return []
        return [i for i in gpu_ids if judge(i, True, False) == {True}]
    except (ImportError, SyntaxError):  # pytest reports a bad expression itself
        return []
