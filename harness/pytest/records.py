"""The report's per-test records (its ``tests``) and what is summed over them.

``TestRecorder`` gathers one test's phase reports (setup, call, teardown) and the
``user_properties`` the test stated (``case``, ``metrics``, ``sync``, ``phase``,
``known_issue``, ``known_issue_bounds``) into one ``ReportedTest`` of
``harness.core.report_schema``: its outcome, reason, failure message, when and where it
ran, and where its time went. ``summarize`` is the report's ``summary`` of such records
and ``trainer_starts`` the ``timing`` figures of the syncs that started a trainer;
``harness merge`` recomputes both over the joined tests.
"""

from __future__ import annotations

from typing import Any

import pytest

from harness.core.report_schema import ReportedTest, Summary, json_safe

def _phase_outcome(rep: pytest.TestReport) -> str:
    if hasattr(rep, "wasxfail"):
        return "xfailed" if rep.skipped else "xpassed"
    if rep.failed and isinstance(rep.longrepr, str) and rep.longrepr.startswith("[XPASS(strict)]"):
        return "xpassed_strict"
    return rep.outcome


def _skip_reason(rep: pytest.TestReport) -> str | None:
    if hasattr(rep, "wasxfail"):
        return rep.wasxfail or None
    lr = rep.longrepr
    if rep.skipped and isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return None


def _failure_message(rep: pytest.TestReport, limit: int = 4000) -> str | None:
    if not rep.failed:
        return None
    crash = getattr(rep.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(rep.longrepr)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class TestRecorder:
    """One test's record as its phase reports come in (``add``); ``as_dict`` is its
    ``ReportedTest``."""
    __test__ = False  # a class of the harness, not a test class

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self.phases: dict[str, str] = {}
        self.duration = 0.0
        self.reason: str | None = None
        self.message: str | None = None
        self.props: list[tuple[str, Any]] = []
        self.began: float | None = None   # epoch seconds, the set-up's start
        self.worker: str | None = None

    def add(self, rep: pytest.TestReport) -> None:
        if rep.when == "setup" or self.began is None:
            self.began = getattr(rep, "start", None) or self.began
        node = getattr(rep, "node", None)  # xdist: the worker the report came from
        self.worker = getattr(getattr(node, "gateway", None), "id", None) or self.worker
        self.phases[rep.when] = _phase_outcome(rep)
        self.duration += rep.duration
        self.reason = _skip_reason(rep) or self.reason
        msg = _failure_message(rep)
        if msg and self.message is None:
            self.message = msg
        self.props = list(rep.user_properties)  # the item's list, as of this phase

    def ran(self) -> bool:
        """The test body ran (it was not skipped or refused at setup)."""
        return "call" in self.phases

    def outcome(self) -> str:
        p = self.phases
        setup, call, teardown = p.get("setup"), p.get("call"), p.get("teardown")
        if setup in ("failed", "xpassed_strict"):
            return "error"
        if setup in ("skipped", "xfailed"):
            return setup
        if call is None:
            if "failed" in p.values():
                return "error"
            # set up, never finished: the run was interrupted (Ctrl-C, a time limit)
            return "interrupted" if setup == "passed" else "skipped"
        if call == "xpassed_strict":
            return "failed"
        if teardown == "failed" and call != "failed":
            return "error"
        return call

    def as_dict(self, epoch_t0: float = 0.0) -> ReportedTest:
        case, metrics, known, syncs, bounds = None, {}, None, [], None
        timing: dict[str, float] = {}
        for name, value in self.props:
            if name == "case" and isinstance(value, dict):
                case = value
            elif name == "metrics" and isinstance(value, dict):
                metrics.update(value)
            elif name == "sync" and isinstance(value, dict):
                syncs.append(value)
            elif name == "phase" and isinstance(value, dict):
                for phase, seconds in value.items():
                    timing[phase] = timing.get(phase, 0.0) + seconds
            elif name == "known_issue":
                known = value
            elif name == "known_issue_bounds":
                bounds = value
        if timing:  # where the test's time went; "other" is what no phase accounts for
            timing = {k: round(v, 3) for k, v in timing.items()}
            timing["other"] = round(max(0.0, self.duration - sum(timing.values())), 3)
        return ReportedTest(nodeid=self.nodeid, outcome=self.outcome(),
                            duration=round(self.duration, 3), reason=self.reason,
                            at=(round(self.began - epoch_t0, 3) if self.began else None),
                            worker=self.worker,
                            known_issue=known,
                            known_issue_bounds=json_safe(bounds),
                            xpass_strict="xpassed_strict" in self.phases.values(),
                            case=case, metrics=json_safe(metrics), syncs=json_safe(syncs),
                            timing=timing,
                            message=self.message,
                            phases=dict(self.phases))


# Where a sync that started a trainer spent its time (see flow.SYNC_TIMES)
_START_PIECES = ("start_seconds", "cuda_init_seconds", "load_seconds", "sender_seconds",
                 "init_seconds", "sync_seconds", "drop_seconds", "close_seconds",
                 "push_seconds")


def trainer_starts(syncs: list[dict]) -> dict:
    """The syncs that started a trainer process (a persistent trainer's first, or a
    fresh trainer's only one): how many, how many took over a spare, and the median and
    sum of each piece of their time; ``push_seconds`` is the whole of it as the test
    saw it, between /pause and /resume."""
    started = [x for x in syncs if x.get("start_seconds") is not None]
    pieces = {}
    for k in _START_PIECES:
        vals = sorted(x[k] for x in started if isinstance(x.get(k), (int, float)))
        if vals:
            pieces[k] = {"median": round(vals[len(vals) // 2], 3), "sum": round(sum(vals), 1)}
    return {"count": len(started), "spare": sum(1 for x in started if x.get("spare")),
            "seconds": pieces}


def summarize(tests: list[ReportedTest]) -> Summary:
    """The report's ``summary``: counts per outcome, and the known, fixed and new
    failures by node id."""
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return Summary(
        total=len(tests), **counts,
        known=sorted(t["nodeid"] for t in tests
                     if t["outcome"] == "xfailed" and t.get("known_issue")),
        fixed_known_issues=sorted(t["nodeid"] for t in tests
                                  if t.get("xpass_strict") and t.get("known_issue")),
        new_failures=sorted(t["nodeid"] for t in tests
                            if t["outcome"] in ("failed", "error")
                            and not (t.get("xpass_strict") and t.get("known_issue"))),
    )
