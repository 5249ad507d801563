"""How wrong a known failure may be: an entry's ``bounds`` over what its test records.

An entry's ``match`` says which failure it is (the assertion's words); its bounds say how
far the numbers may go. ``bounds = { "max_abs_dlogprob" = [5.0, 20.0] }`` reads: every
finite number the test recorded under that metric lies in [5.0, 20.0]. A failure that
matches the pattern but records a number outside is a new failure, "beyond known issue
X: got ..., known up to ..." (``beyond_message``): a symptom ten times worse is another
bug of the same test, and a known issue must not absorb it.

Paths are dotted: each part names a key of the test's metrics (``session.record``; a key
that holds a dot, like ``conv1d.weight``, is matched whole), ``*`` any one key, and a
list is walked element by element (``steps.max_abs_dlogprob`` is every step's).
Booleans count as 0 and 1. NaN, infinities and strings (a report keeps NaN as a string)
are left out: non-finite output is the test's own check. A path the test recorded
nothing under judges nothing ("not recorded"), and does not fail the run: the failure
came before the number. Pure functions; the pytest side is ``harness.known_issues``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Bound:
    path: str
    low: float
    high: float

    def range_text(self) -> str:
        if self.low == 0:
            return f"up to {_fmt(self.high)}"
        if self.low == self.high:
            return f"exactly {_fmt(self.low)}"
        return f"{_fmt(self.low)} to {_fmt(self.high)}"

    def as_dict(self) -> dict:
        return {"path": self.path, "low": self.low, "high": self.high}


def _fmt(v: float) -> str:
    return f"{v:.3g}"


def parse(table: Any, where: str) -> tuple[Bound, ...]:
    """``bounds`` of one entry: a table of path = [low, high]; ValueError naming the
    entry otherwise."""
    if table is None:
        return ()
    if not isinstance(table, dict) or not table:
        raise ValueError(f"{where}: 'bounds' must be a table of \"metric.path\" = [low, high], "
                         f"got {table!r}")
    out = []
    for path, rng in table.items():
        ok = (isinstance(rng, list) and len(rng) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                      and math.isfinite(x) for x in rng) and rng[0] <= rng[1])
        if not ok or not path or any(not p for p in path.split(".")):
            raise ValueError(f"{where}: bounds.{path} must be [low, high] with low <= high, "
                             f"finite numbers, under a dotted metric path; got {rng!r}")
        out.append(Bound(path, float(rng[0]), float(rng[1])))
    return tuple(out)


def values(metrics: Any, path: str) -> list[float]:
    """Every finite number ``metrics`` holds under ``path`` (see the module's doc)."""
    return _walk(metrics, path.split("."))


def _walk(node: Any, parts: list[str]) -> list[float]:
    if isinstance(node, (list, tuple)):
        return [v for x in node for v in _walk(x, parts)]
    if not parts:
        if isinstance(node, bool):
            return [float(node)]
        if isinstance(node, (int, float)) and math.isfinite(node):
            return [float(node)]
        return []
    if not isinstance(node, dict):
        return []
    if parts[0] == "*":
        return [v for x in node.values() for v in _walk(x, parts[1:])]
    out: list[float] = []
    for n in range(1, len(parts) + 1):  # a key may hold dots: try each join
        key = ".".join(parts[:n])
        if key in node:
            out += _walk(node[key], parts[n:])
    return out


@dataclasses.dataclass(frozen=True)
class Judged:
    """One bound against what a run recorded."""

    bound: Bound
    values: tuple[float, ...]

    @property
    def recorded(self) -> bool:
        return bool(self.values)

    @property
    def within(self) -> bool:
        return all(self.bound.low <= v <= self.bound.high for v in self.values)

    @property
    def worst(self) -> float | None:
        """The value farthest outside the bound, or the largest when all are inside."""
        if not self.values:
            return None
        above = [v for v in self.values if v > self.bound.high]
        below = [v for v in self.values if v < self.bound.low]
        return max(above) if above else min(below) if below else max(self.values)

    def distance(self) -> str:
        """How far the worst value is from the bound, in words."""
        b, w = self.bound, self.worst
        if w is None:
            return "not recorded"
        if w > b.high:
            return (f"{w / b.high:.3g}x the upper bound" if b.high > 0
                    else f"{_fmt(w - b.high)} above it")
        if w < b.low:
            return (f"{w / b.low:.3g}x the lower bound" if b.low > 0
                    else f"{_fmt(b.low - w)} below it")
        return (f"{100 * w / b.high:.0f}% of the upper bound" if b.high > 0
                else "inside")

    def describe(self) -> str:
        b = self.bound
        if not self.recorded:
            return f"{b.path}: not recorded (known {b.range_text()})"
        n = len(self.values)
        got = _fmt(self.worst) + (f" (worst of {n})" if n > 1 else "")
        verdict = "within" if self.within else "BEYOND"
        return f"{b.path}: got {got}, known {b.range_text()}: {verdict}, {self.distance()}"

    def as_dict(self) -> dict:
        return {**self.bound.as_dict(), "values": list(self.values), "worst": self.worst,
                "recorded": self.recorded, "within": self.within if self.recorded else None,
                "distance": self.distance()}


def judge(bounds: tuple[Bound, ...], metrics: dict) -> list[Judged]:
    return [Judged(b, tuple(values(metrics, b.path))) for b in bounds]


def beyond(judged: list[Judged]) -> list[Judged]:
    return [j for j in judged if j.recorded and not j.within]


def beyond_message(issue_id: str, judged: list[Judged]) -> str:
    """The one line a failure beyond an entry's bounds opens with."""
    parts = [f"got {j.bound.path} {_fmt(j.worst)}, known "
             + (f"up to {_fmt(j.bound.high)}" if j.worst > j.bound.high
                else f"down to {_fmt(j.bound.low)}")
             + f" ({j.distance()})" for j in beyond(judged)]
    return f"beyond known issue {issue_id}: " + "; ".join(parts)
