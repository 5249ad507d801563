"""``python -m harness.known_issues verify REPORT.json ...``: every version a known-issue
entry lists as ``checked`` must be backed by a run.

A run backs a version when its report is of that vLLM version, from a host the entry
applies to, made without the entry's workaround variable (``unless_env``) set, and the
entry's tests ran in it and came out "known" (or "fixed"). A
strict xfail that is wrong about a version turns into an XPASS(strict) failure the
first time someone runs it there; this is how to find out before they do. The entries
and their matching are ``harness.known_issues``; ``python -m
harness.known_issues.verify`` is the same command.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Iterable

from harness.core import report_schema
from harness.core.report_schema import Report
from harness.known_issues import _HOSTS, ENV_PATH, KnownIssue, load
from harness.known_issues import bounds as _bounds

PROG = "python -m harness.known_issues verify"


def _public(version: str | None) -> str | None:
    """'0.32.0+cpu' and '0.32.0' name the same release for `checked`."""
    from packaging.version import InvalidVersion, Version

    if not version:
        return None
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def report_facts(report: Report) -> tuple[str | None, str]:
    """(vLLM version, host kind) of a run report (``harness.core.report_schema``)."""
    header = report.get("header") or {}
    version = (header.get("vllm") or {}).get("version")
    host = (report.get("known_issues") or {}).get("host")
    if host not in _HOSTS:
        host = "gpu" if ((header.get("gpus") or {}).get("present") or 0) > 0 else "cpu"
    return version, host


def _env(report: Report) -> dict:
    """The environment a report recorded (harness.core.environment.REPORTED_ENV)."""
    return (report.get("header") or {}).get("env") or {}


def _entry_outcomes(issue: KnownIssue, report: Report) -> dict[str, str]:
    """nodeid -> what the entry's tests did in ``report``: known, fixed, or the plain
    outcome (passed, failed, skipped, ...) of a matching test the entry was not applied to."""
    out = {}
    for t in report.get("tests") or []:
        nodeid = t.get("nodeid", "")
        if not issue.matches(nodeid, t.get("case")):
            continue
        if t.get("known_issue") == issue.id and t.get("xpass_strict"):
            out[nodeid] = "fixed"
        elif t.get("known_issue") == issue.id and t.get("outcome") == "xfailed":
            out[nodeid] = "known"
        else:
            out[nodeid] = str(t.get("outcome"))
    return out


def _judged_over(issue: KnownIssue, reports: list[Report]) -> list:
    """Each bound of ``issue`` against every number its known runs in ``reports``
    recorded (one ``bounds.Judged`` per bound, the worst of them all)."""
    metrics = [t.get("metrics") or {} for r in reports for t in r.get("tests") or []
               if t.get("known_issue") == issue.id and t.get("outcome") == "xfailed"
               and issue.matches(t.get("nodeid", ""), t.get("case"))]
    return [_bounds.Judged(b, tuple(v for m in metrics for v in _bounds.values(m, b.path)))
            for b in issue.bounds]


@dataclasses.dataclass
class Check:
    """One (entry, checked version) pair and the runs that back it, or why none does."""
    id: str
    version: str
    backed_by: list[tuple[str, str, str]]   # (report name, nodeid, known|fixed)
    why_not: str = ""
    fixed: bool = False                      # some run says the entry is fixed there
    judged: list = dataclasses.field(default_factory=list)  # bounds.Judged over the known runs

    @property
    def backed(self) -> bool:
        return bool(self.backed_by)


def verify(issues: Iterable[KnownIssue],
           reports: Iterable[tuple[str, Report]]) -> tuple[list[Check], list[str]]:
    """Check every entry's `checked` versions against ``reports`` ((name, report dict)
    pairs). Returns the checks and notes: versions where an entry's tests came out known
    that its `checked` list does not name (candidates to add)."""
    reports = list(reports)
    facts = [(name, r, *report_facts(r)) for name, r in reports]
    checks: list[Check] = []
    notes: list[str] = []
    for issue in issues:
        for version in issue.checked:
            same_version = [f for f in facts if _public(f[2]) == _public(version)]
            on_host = [f for f in same_version if issue.applies_to_host(f[3])]
            without = [f for f in on_host if not issue.workaround_set(_env(f[1]))]
            backed, seen = [], []
            for name, r, _, _ in without:
                outs = _entry_outcomes(issue, r)
                seen.append((name, outs))
                backed += [(name, n, o) for n, o in outs.items() if o in ("known", "fixed")]
            check = Check(issue.id, version, backed,
                          fixed=any(o == "fixed" for _, _, o in backed),
                          judged=_judged_over(issue, [r for _, r, _, _ in without]))
            if not backed:
                if not same_version:
                    check.why_not = f"no report of vLLM {version}"
                elif not on_host:
                    hosts = sorted({f[3] for f in same_version})
                    check.why_not = (f"reports of vLLM {version} are from {'/'.join(hosts)} "
                                     f"hosts only; the entry is for {', '.join(issue.hosts)}")
                elif not without:
                    check.why_not = (f"every report of vLLM {version} was made with "
                                     f"{issue.workaround_set(_env(on_host[0][1]))} set, "
                                     "the entry's workaround")
                elif not any(outs for _, outs in seen):
                    check.why_not = (f"none of its tests ran in the report(s) of vLLM {version} "
                                     f"({', '.join(n for n, _ in seen)})")
                else:
                    got = sorted({o for _, outs in seen for o in outs.values()})
                    check.why_not = (f"its tests ran on vLLM {version} but came out "
                                     f"{', '.join(got)}, not known")
            checks.append(check)
        claimed = {_public(v) for v in issue.checked}
        for name, r, version, host in facts:
            if (_public(version) in claimed or not issue.applies_to_host(host)
                    or issue.workaround_set(_env(r))):
                continue
            if any(o == "known" for o in _entry_outcomes(issue, r).values()):
                notes.append(f"{issue.id}: known on vLLM {version} in {name}, which "
                             "'checked' does not list")
    return checks, notes


def load_report(path: str) -> Report:
    """A run report (``harness.core.report_schema.load``), or ReportError, a ValueError
    naming the file and what is wrong with it."""
    return report_schema.load(path)


def main(argv: list[str] | None = None) -> int:
    from harness.core.facts import command_parser

    prog = PROG
    argv = sys.argv[1:] if argv is None else argv
    ap = command_parser(
        prog=prog,
        description="Check that every version each known-issue entry lists as 'checked' is "
                    "backed by a run: a report of that vLLM version, from a host the entry "
                    "applies to, in which the entry's tests came out known (or fixed). "
                    "Exit 0: all backed; 1: some are not; 2: bad input.")
    ap.add_argument("reports", nargs="+", metavar="REPORT.json")
    ap.add_argument("--file", help="known-issues file (default: the shipped one, or "
                                   f"${ENV_PATH})")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, said on stderr)
        return int(e.code or 0)
    try:
        issues = load(Path(args.file) if args.file else None)
        reports = [(p, load_report(p)) for p in args.reports]
    except (OSError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    for name, r in reports:
        version, host = report_facts(r)
        print(f"report {name}: vLLM {version}, {host} host, {len(r.get('tests') or [])} tests")
    checks, notes = verify(issues, reports)
    missing = [c for c in checks if not c.backed]
    for c in checks:
        if c.backed:
            known = sorted({r for r, _, o in c.backed_by if o == "known"})
            fixed = [n for _, n, o in c.backed_by if o == "fixed"]
            what = f"known in {', '.join(known)}" if known else "ran"
            if fixed:
                what += (f"; FIXED there for {len(fixed)} test(s), the entry is wrong about "
                         f"them: {', '.join(fixed)}")
            print(f"ok       {c.id} {c.version}: {what}")
            for j in c.judged:
                print(f"         bound {j.describe()}")
        else:
            print(f"NOT RUN  {c.id} {c.version}: {c.why_not}")
    for n in notes:
        print(f"note     {n}")
    print(f"{len(checks) - len(missing)} of {len(checks)} checked versions backed by a run"
          + (f"; {len(missing)} not: move them to 'read_from_source' or run their tests"
             if missing else ""))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
