"""Measured test durations, per test function and host kind, for the plan's estimates.

The plan and the partition weigh each test by what it costs (``plan.estimates``). One
figure for every test hides what matters: on a GPU a refusal takes a tenth of a
second and a pause test 10 to 80 s, and the pause tests sit together in run order, so a
replica cut by test count can get all of them and become the run's critical path while
the plan takes it for the equal of the others.

``durations.json`` beside this module holds, per host kind (``gpu``, ``cpu``), each
test function's median duration in some run reports (``source`` names them, with
their start times and commits). Only tests on a server count (those with a case), and
only passed and xfailed ones: a failure may be a hang cut short by its timeout, and
one such would poison a median. What a test waited for its servers (``server_wait``,
``twin_wait`` of its timing) is left out: a start is the server's cost, counted once
per server by the plan. So is ``lock_wait``, a sleep's or a wake's wait for other
servers' starts on the same GPU (``harness.vllm.memory_lock``).

``harness durations REPORT... --kind gpu`` measures a kind again (``update``). The
figures only steer the plan: what is not measured falls back to a constant, and no
decision of the pool depends on any of them being right.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from pathlib import Path
from typing import Iterable

PATH = Path(__file__).with_name("durations.json")
KINDS = ("gpu", "cpu")
COUNTED = ("passed", "xfailed")
WAITS = ("server_wait", "twin_wait", "lock_wait")
FLOOR_SECONDS = 0.1


def function_of(nodeid: str) -> str:
    """``tests/test_x.py::test_y[case]`` -> ``test_y``: the key of the table, shared by
    every case of one function."""
    return nodeid.split("[", 1)[0].rsplit("::", 1)[-1]


def own_seconds(test: dict) -> float:
    """A report's test entry's duration less its waits for servers."""
    timing = test.get("timing") or {}
    waited = sum(timing.get(k) or 0.0 for k in WAITS)
    return max(FLOOR_SECONDS, (test.get("duration") or 0.0) - waited)


def counted(report: dict) -> list[dict]:
    """The test entries of ``report`` that the table is measured from."""
    return [t for t in report.get("tests") or []
            if t.get("case") and t.get("outcome") in COUNTED]


def measure(reports: Iterable[dict]) -> dict[str, float]:
    """Test function -> the median of its tests' own seconds over ``reports``, to 0.1 s."""
    samples: dict[str, list[float]] = {}
    for report in reports:
        for t in counted(report):
            samples.setdefault(function_of(t["nodeid"]), []).append(own_seconds(t))
    return {name: round(statistics.median(v), 1) for name, v in sorted(samples.items())}


def kind_of(report: dict) -> str:
    """``gpu`` for a report of a run that used a GPU, else ``cpu``."""
    gpus = ((report.get("header") or {}).get("gpus") or {}).get("used") or 0
    return "gpu" if gpus else "cpu"


def source_of(name: str, report: dict) -> dict:
    """What the file's ``source`` keeps of a report: which run, when, how many tests."""
    header = report.get("header") or {}
    return {"report": name, "start_time": header.get("start_time"),
            "commit": (header.get("git") or {}).get("commit"),
            "tests": len(counted(report))}


def defined_functions(tests: Path) -> set[str]:
    """The test functions defined under ``tests``: a report may name one renamed or
    removed since, whose figure would describe no test."""
    pattern = re.compile(r"^\s*(?:async\s+)?def (test\w*)\(", re.M)
    return {name for f in tests.rglob("*.py") for name in pattern.findall(f.read_text())}


def update(path: Path, kind: str, reports: list[tuple[str, dict]],
           defined: set[str]) -> tuple[dict, list[str]]:
    """Write ``kind``'s table at ``path`` measured again from ``reports`` ((name,
    report) pairs), of the functions in ``defined`` only, the other kinds' as they were;
    return the whole file's data and the functions left out."""
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    data = json.loads(path.read_text()) if path.exists() else {}
    measured = measure(r for _, r in reports)
    data[kind] = {k: v for k, v in measured.items() if k in defined}
    data.setdefault("source", {})[kind] = [source_of(n, r) for n, r in reports]
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data, sorted(set(measured) - defined)


@functools.lru_cache(maxsize=None)
def table(kind: str) -> dict[str, float]:
    """The committed durations of ``kind``: test function -> seconds."""
    return dict(json.loads(PATH.read_text()).get(kind) or {})
