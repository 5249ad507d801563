"""``harness matrix REPORT.json ...``: one table of vLLM release x check.

Each report is one release's run (``ci/matrix.sh`` writes them under reports/matrix/).
Cells, per test:

* ``pass``, ``FAIL`` (failed or errored), ``known`` (a strict xfail of a known issue),
  ``FIXED`` (the known issue's strict xfail passed: the entry is wrong about that
  release), ``n/o`` (skipped because this vLLM does not offer what the test needs: a
  route, a /pause mode), ``skip`` (skipped otherwise), ``-`` (not in that run).

Three tables: checks by test function (counts where a function has several cases),
every known issue with the first release where it appears and the last where it does
not, and every test case. A known issue *appears* in a release when one of its tests
came out known there, or failed there while the entry did not apply (the range is too
narrow); it does *not* appear when its tests ran and passed (or passed against the
entry: FIXED). Releases sort by version, whatever the order of the files.

Exit code: 0, or 2 for a file that is not a run report.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from harness.core import report_schema
from harness.core.report_schema import Report, ReportedTest
from harness.core.facts import run_command

WIDTH = 120
NOT_OFFERED = re.compile(r"not offered|does not offer|offers no |has no /|no /\w+ route",
                         re.IGNORECASE)
# capability rows: (label, function of a report -> cell)
ROUTES = ("/weight_checker", "/weight_info", "/shutdown_weight_transfer_engine")


class BadInput(Exception):
    """A file that is not a run report: exit code 2, the message on stderr."""


def _version_key(v: str):
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(v))
    except InvalidVersion:
        return (1, v)


def release_of(report: Report) -> str:
    v = ((report.get("header") or {}).get("vllm") or {}).get("version") or "?"
    return v.split("+")[0]


def load(paths: list[str]) -> list[tuple[str, Report]]:
    """(release, report) pairs, oldest release first (``harness.core.report_schema.load``;
    BadInput names a file that is not a run report and what is wrong)."""
    out = []
    for p in paths:
        try:
            data = report_schema.load(p)
        except report_schema.ReportError as e:
            raise BadInput(str(e)) from None
        out.append((release_of(data), data))
    return sorted(out, key=lambda x: _version_key(x[0]))


# ----------------------------------------------------------------------------- cells

def cell(t: ReportedTest) -> str:
    o = t.get("outcome")
    if t.get("xpass_strict"):
        return "FIXED"
    if o == "xfailed" and t.get("known_issue"):
        return "known"
    if o in ("passed", "xpassed"):
        return "pass"
    if o in ("failed", "error"):
        return "FAIL"
    if o == "skipped":
        return "n/o" if NOT_OFFERED.search(t.get("reason") or "") else "skip"
    return "-"


def check_name(nodeid: str) -> str:
    """``tests/test_parity.py::test_x[shm-cpu-fp32-opt]`` -> ``test_parity::test_x[cpu-fp32-opt]``."""
    name = nodeid.removeprefix("tests/").replace(".py::", "::")
    return name.replace("[shm-", "[")


def function_of(nodeid: str) -> str:
    return check_name(nodeid).split("[")[0]


def group_cell(cells: list[str]) -> str:
    """One cell for several cases of a function: pass, known, n/o, or counts."""
    real = [c for c in cells if c != "-"]
    if not real:
        return "-"
    if len(real) == 1:
        return real[0]
    n = {k: real.count(k) for k in ("pass", "known", "FAIL", "FIXED", "n/o", "skip")}
    if n["FAIL"] or n["FIXED"]:
        parts = [f"{n['FAIL']}F" if n["FAIL"] else "", f"{n['FIXED']}X" if n["FIXED"] else "",
                 f"{n['known']}k" if n["known"] else "", f"{n['pass']}p" if n["pass"] else ""]
        return " ".join(p for p in parts if p)
    if n["known"]:
        return "known" if n["known"] == len(real) else f"{n['known']}k {n['pass']}p"
    if n["pass"]:
        return "pass"
    return "n/o" if n["n/o"] else "skip"


# ----------------------------------------------------------------------------- known issues

def _appears(outcome: str, applied: bool) -> str | None:
    """'yes' / 'no' / None (no evidence) for one test outcome of an entry."""
    if outcome == "known":
        return "yes"
    if outcome in ("fixed", "passed"):
        return "no"
    if outcome == "failed" and not applied:
        return "yes"  # failing outside the entry's range: the range is too narrow
    return None


def issue_rows(runs: list[tuple[str, Report]],
               tests_by_release: list[dict[str, ReportedTest]]) -> list[dict]:
    """Per known-issue entry (and per model, where an entry names models and they
    differ): per release yes/no/-, the first release where it appears, the last where
    it does not."""
    entries: dict[str, dict] = {}
    for (release, r), tests in zip(runs, tests_by_release):
        for e in (r.get("known_issues") or {}).get("entries") or []:
            row = entries.setdefault(e["id"], {"id": e["id"], "affected": e.get("affected"),
                                               "per_model": {}})
            row["affected"] = e.get("affected")
            applied = e.get("status", "").startswith(("known", "fixed"))
            for nodeid, outcome in (e.get("tests_outcomes") or {}).items():
                model = ((tests.get(nodeid) or {}).get("case") or {}).get("model") or ""
                per = row["per_model"].setdefault(model, {})
                seen = _appears(outcome, applied)
                if seen is not None:
                    prev = per.get(release)
                    per[release] = "yes" if "yes" in (prev, seen) else seen
    out = []
    releases = [v for v, _ in runs]
    for row in entries.values():
        models = row["per_model"]
        merged: dict[str, str] = {}
        for per in models.values():
            for v, s in per.items():
                merged[v] = "yes" if "yes" in (merged.get(v), s) else s
        subrows = [("", merged)]
        named = {m: p for m, p in models.items() if m}
        if len(named) > 1 and len({tuple(sorted(p.items())) for p in named.values()}) > 1:
            subrows += sorted(named.items())
        for model, per in subrows:
            first = next((v for v in releases if per.get(v) == "yes"), None)
            before = [v for v in releases if per.get(v) == "no"
                      and (first is None or _version_key(v) < _version_key(first))]
            after_fixed = [v for v in releases if per.get(v) == "no" and first is not None
                           and _version_key(v) > _version_key(first)]
            out.append({"id": row["id"] + (f" [{model}]" if model else ""),
                        "affected": row["affected"], "cells": [per.get(v, "-") for v in releases],
                        "first_bad": first, "last_good": before[-1] if before else None,
                        "clean_again": after_fixed[0] if after_fixed else None})
    return out


# ----------------------------------------------------------------------------- render

def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _capabilities(runs: list[tuple[str, Report]]) -> list[list[str]]:
    rows = []
    for route in ROUTES:
        rows.append([f"route {route}"] + [
            "-" if not (r.get("capabilities") or {}).get("routes") else
            ("yes" if route in r["capabilities"]["routes"] else "no") for _, r in runs])
    rows.append(["oracles"] + [str(((r.get("capabilities") or {}).get("oracles") or {})
                                   .get("parity_from") or "-") for _, r in runs])
    rows.append(["/pause modes"] + [",".join(((r.get("capabilities") or {}).get("pause") or {})
                                             .get("modes") or []) or "-" for _, r in runs])
    engines = sorted({key.removesuffix("_path") for _, r in runs
                      for key in ((r.get("capabilities") or {}).get("trainer_api") or {})
                      if key.endswith("_path")})
    for engine in engines:
        rows.append([f"trainer API ({engine})"] + [
            trainer_api_cell((r.get("capabilities") or {}).get("trainer_api") or {}, engine)
            for _, r in runs])
    return rows


def trainer_api_cell(trainer_api: dict, engine: str) -> str:
    """The probed trainer API of ``engine``; where the probe gave no answer, "?" and
    why (a probe that timed out says nothing about the release: "-" would read as
    "absent"); "-" only where the report has no probe at all."""
    path = trainer_api.get(f"{engine}_path")
    if path:
        return str(path)
    error = str(trainer_api.get("error") or "")
    if not error:
        return "-"
    if re.search(r"timed out|TimeoutExpired|had not finished", error):
        return "? (timed out)"
    if "disabled" in error:
        return "? (not probed)"
    return "? (probe failed)"


def render(runs: list[tuple[str, Report]]) -> str:
    releases = [v for v, _ in runs]
    tests_by_release = [{t["nodeid"]: t for t in r.get("tests") or []} for _, r in runs]
    order: list[str] = []
    for tests in reversed(tests_by_release):  # newest run's order first
        order += [n for n in tests if n not in order]
    out = ["vLLM release matrix (CPU host, backend shm): "
           + ", ".join(f"{v} ({(r.get('header') or {}).get('vllm', {}).get('dist', '?')})"
                       for v, r in runs), ""]

    out += ["Runs", ""]
    rows = []
    for label, get in (
            ("tests", lambda r: str(len(r.get("tests") or []))),
            ("passed", lambda r: str((r.get("summary") or {}).get("passed", 0))),
            ("known (xfail)", lambda r: str((r.get("summary") or {}).get("xfailed", 0))),
            ("failed", lambda r: str((r.get("summary") or {}).get("failed", 0)
                                     + (r.get("summary") or {}).get("error", 0))),
            ("skipped", lambda r: str((r.get("summary") or {}).get("skipped", 0))),
            ("servers started", lambda r: str((r.get("timing") or {}).get("servers_started"))),
            ("wall seconds", lambda r: str(round((r.get("header") or {}).get("wall_seconds")
                                                 or 0))),
            ("complete", lambda r: str((r.get("header") or {}).get("complete")).lower())):
        rows.append([label] + [get(r) for _, r in runs])
    out += _table(["", *releases], rows) + [""]

    out += ["Capabilities", ""] + _table(["", *releases], _capabilities(runs)) + [""]

    out += ["Checks (per test function; cases: p pass, k known issue, F fail, X fixed)", ""]
    functions: dict[str, list[str]] = {}
    for n in order:
        functions.setdefault(function_of(n), []).append(n)
    rows = [[f] + [group_cell([cell(tests[n]) if n in tests else "-" for n in nodes])
                   for tests in tests_by_release] for f, nodes in functions.items()]
    out += _table(["check", *releases], rows) + [""]

    out += ["Known issues: appears in the release (yes), does not (no), not run (-)", ""]
    # Appearing in the oldest release run says nothing of the ones before it: "<=".
    rows = [[i["id"], i["affected"] or ""] + i["cells"]
            + [("<=" if i["first_bad"] == releases[0] else "") + (i["first_bad"] or (
                "never" if "no" in i["cells"] else "not run")),
               i["last_good"] or "-", i["clean_again"] or ""]
            for i in issue_rows(runs, tests_by_release)]
    out += _table(["known issue", "affected", *releases, "first bad", "last good",
                   "clean again"], rows) + [""]

    out += ["Every case", ""]
    rows = [[check_name(n)] + [cell(tests[n]) if n in tests else "-" for tests in tests_by_release]
            for n in order]
    out += _table(["case", *releases], rows)
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("reports", nargs="+", metavar="REPORT.json",
                   help="one run report per release (pytest --harness-report)")
    p.add_argument("--json", action="store_true", help="the known-issue rows as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        runs = load(args.reports)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        tests = [{t["nodeid"]: t for t in r.get("tests") or []} for _, r in runs]
        print(json.dumps(issue_rows(runs, tests), indent=1))
    else:
        sys.stdout.write(render(runs))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command("harness matrix", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
