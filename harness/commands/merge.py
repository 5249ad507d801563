"""``harness merge A.json B.json ... -o ALL.json``: the reports of one run made in parts,
as one report: the shards of ``--harness-shard K/N`` on several machines, or the
partial reports of the workers of one run. ``harness diff``, ``harness matrix`` and
``python -m harness.known_issues verify`` read the result as one run.

Parts of one run only: a merge is refused (``MergeError``, one line; exit 2) when the
reports differ in schema, git commit, vLLM version and distribution, or selection
(the header's ``selection``, its ``options`` less those that differ per part by
design, ``harness_report``, ``harness_shard``'s K and ``vllm_log_dir``, the ``-k``
and ``-m`` expressions and the number of shards), or when a test is in two of them.
Test paths given on the command line are not compared.

How each part of the report is combined (``merge_reports``):

``header``        the first report's, except ``start_time`` (the earliest),
                  ``wall_seconds`` (the longest: the parts ran side by side),
                  ``exitstatus`` (the worst: any exit other than 0 and 5, "no tests",
                  the highest of them; else 0 if a part ran tests; None if a part
                  never finished) and ``complete`` (every part complete)
``shards``        new: per part, in the order given, its shard (K/N or None), start
                  time, wall time, exit status, completeness, command, test and
                  server counts and its own plan
``capabilities``  the first part's that saw a server's routes (a part that started no
                  server has none), else the first part's
``summary``       ``harness.pytest.records.summarize`` over the merged tests
``tests``         concatenated, in the order given
``known_issues``  each entry once, its ``tests_outcomes`` joined (a test that ran in
                  one part is "not run" in the others) and its ``status`` the most
                  telling one: fixed, then known, then the first part's
``servers``       concatenated, each with ``shard``: its part's position (1-based)
``plan``          the parts' plans joined: tests, starts and expected start time
                  summed, servers, contingent restarts and waves concatenated, the
                  expected wall time the longest
``timing``        counts and seconds that add up are summed (servers started and
                  planned, start time summed, restarts, test time, syncs, phases,
                  spares kept and taken); the starts' wall time and ``pool_made_at``
                  are the longest (each part started its servers on its own machine,
                  side by side with the others); lists (restart reasons, sync times,
                  host samples, each sample with its ``shard``) are concatenated;
                  ``start_seconds_by_mode`` adds the servers, weighs the means and
                  keeps the highest max; ``trainer_starts`` is recomputed from the
                  merged tests' syncs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.core import report_schema
from harness.core.report_schema import Header, KnownIssues, Report, ReportedTest, Shard, Timing
from harness.pytest.records import summarize, trainer_starts

PER_PART_OPTIONS = ("harness_report", "harness_shard", "vllm_log_dir")


class MergeError(ValueError):
    """Reports that are not parts of one run; the message is one line."""


# ----------------------------------------------------------------------------- refusals

def _expressions(args: list, flag: str) -> list[str]:
    """The values of ``-k`` or ``-m`` in a pytest command line (``-k x``, ``-kx``)."""
    out, args = [], [str(a) for a in args or []]
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag) and len(a) > 2 and not a.startswith("--"):
            out.append(a[2:])
    return out


def selection_of(header: Header) -> dict:
    """What must be alike in every part of one run."""
    options = dict(header.get("options") or {})
    shard = options.get("harness_shard")
    for name in PER_PART_OPTIONS:
        options.pop(name, None)
    return {"selection": header.get("selection"), "options": options,
            "-k": _expressions(header.get("args"), "-k"),
            "-m": _expressions(header.get("args"), "-m"),
            "shards": shard[1] if isinstance(shard, (list, tuple)) and len(shard) == 2 else None}


def _refuse_unlike(reports: list[Report], names: list[str]) -> None:
    def facts(r: Report) -> dict:
        h = r.get("header") or {}
        return {"schema": r.get("schema"), "commit": (h.get("git") or {}).get("commit"),
                "vLLM": "{version} ({dist})".format(**{"version": None, "dist": None,
                                                       **(h.get("vllm") or {})}),
                "selection": selection_of(h)}

    first = facts(reports[0])
    for r, name in zip(reports[1:], names[1:]):
        other = facts(r)
        for what in first:
            if other[what] != first[what]:
                a, b = first[what], other[what]
                if what == "selection":
                    keys = [k for k in a if a[k] != b[k]]
                    a, b = ({k: x[k] for k in keys} for x in (a, b))
                raise MergeError(f"{names[0]} and {name} are not parts of one run: "
                                 f"different {what} ({a} against {b})")
    seen: dict[str, str] = {}
    for r, name in zip(reports, names):
        for t in r.get("tests") or []:
            if t["nodeid"] in seen:
                raise MergeError(f"{seen[t['nodeid']]} and {name} overlap: both have "
                                 f"{t['nodeid']}")
            seen[t["nodeid"]] = name


# ----------------------------------------------------------------------------- merging

def _exitstatus(codes: list) -> int | None:
    if any(c is None for c in codes):
        return None
    bad = [c for c in codes if c not in (0, 5)]
    return max(bad) if bad else 0 if 0 in codes else 5


def _known_issues(reports: list[Report]) -> KnownIssues | None:
    parts = [r["known_issues"] for r in reports if isinstance(r.get("known_issues"), dict)]
    if not parts:
        return None
    entries: dict[str, dict] = {}
    for part in parts:
        for e in part.get("entries") or []:
            got = entries.setdefault(e["id"], {**e, "tests_outcomes": {}})
            for nodeid, outcome in (e.get("tests_outcomes") or {}).items():
                if got["tests_outcomes"].get(nodeid, "not run") == "not run":
                    got["tests_outcomes"][nodeid] = outcome
            rank = {"fixed — remove this entry": 0, "known": 1}
            if rank.get(e.get("status"), 2) < rank.get(got.get("status"), 2):
                got["status"] = e["status"]
    return {**parts[0], "entries": list(entries.values())}


def _plan(reports: list[Report]) -> dict | None:
    plans = [r["plan"] for r in reports if isinstance(r.get("plan"), dict)]
    if not plans:
        return None
    out = {**plans[0]}
    for key in ("tests", "starts"):
        out[key] = sum(p.get(key) or 0 for p in plans)
    for key in ("servers", "contingent_restarts"):
        out[key] = [x for p in plans for x in p.get(key) or []]
    expected = [p["expected"] for p in plans if isinstance(p.get("expected"), dict)]
    if expected:
        out["expected"] = {
            "wall_seconds": max(e.get("wall_seconds") or 0 for e in expected),
            "start_seconds_sum": round(sum(e.get("start_seconds_sum") or 0 for e in expected), 1),
            "waves": [w for e in expected for w in e.get("waves") or []]}
    return out


_LONGEST = ("start_wall_seconds", "pool_made_at")


def _timing(reports: list[Report], tests: list[ReportedTest]) -> Timing:
    parts = [(k, r.get("timing") or {}) for k, r in enumerate(reports, 1)]
    out: dict = {}
    for key in dict.fromkeys(k for _, t in parts for k in t):
        values = [(k, t[key]) for k, t in parts if key in t and t[key] is not None]
        if not values:
            out[key] = None
        elif key in _LONGEST:
            out[key] = max(v for _, v in values)
        elif key == "host_samples":
            out[key] = [{**s, "shard": k} for k, v in values for s in v]
        elif key == "start_seconds_by_mode":
            out[key] = _by_mode([v for _, v in values])
        elif key == "trainer_starts":
            out[key] = trainer_starts([x for t in tests for x in t.get("syncs") or []])
        elif all(isinstance(v, bool) or not isinstance(v, (int, float)) for _, v in values):
            out[key] = _combine([v for _, v in values])
        else:
            out[key] = round(sum(v for _, v in values), 3)
    return out


def _combine(values: list):
    """Lists concatenated, dicts combined key by key (numbers summed), else the first."""
    if all(isinstance(v, list) for v in values):
        return [x for v in values for x in v]
    if all(isinstance(v, dict) for v in values):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _combine([v[k] for v in values if k in v]) for k in keys}
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return round(sum(values), 3)
    return values[0]


def _by_mode(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        for mode, v in part.items():
            o = out.setdefault(mode, {"servers": 0, "mean": 0.0, "max": 0.0})
            n = o["servers"] + v.get("servers", 0)
            if n:
                o["mean"] = round((o["mean"] * o["servers"]
                                   + v.get("mean", 0) * v.get("servers", 0)) / n, 1)
            o["servers"], o["max"] = n, max(o["max"], v.get("max", 0))
    return out


def merge_reports(reports: list[Report], names: list[str] | None = None) -> Report:
    """One report of ``reports``, the parts of one run (``names``: how to call them in
    a refusal; "report 1", ... by default). Raises MergeError."""
    if not reports:
        raise MergeError("no report to merge")
    names = names or [f"report {k}" for k in range(1, len(reports) + 1)]
    _refuse_unlike(reports, names)
    headers = [r.get("header") or {} for r in reports]
    tests = [t for r in reports for t in r.get("tests") or []]
    header: Header = {
        **headers[0],
        "start_time": min((h.get("start_time") for h in headers if h.get("start_time")),
                          default=None),
        "wall_seconds": max((h.get("wall_seconds") or 0 for h in headers), default=0),
        "exitstatus": _exitstatus([h.get("exitstatus") for h in headers]),
        "complete": all(h.get("complete") for h in headers)}
    with_routes = [r for r in reports if (r.get("capabilities") or {}).get("routes")]
    return Report(
        schema=reports[0].get("schema"),
        header=header,
        shards=[Shard(shard=(h.get("options") or {}).get("harness_shard"),
                      start_time=h.get("start_time"), wall_seconds=h.get("wall_seconds"),
                      exitstatus=h.get("exitstatus"), complete=h.get("complete"),
                      command=h.get("command"), tests=len(r.get("tests") or []),
                      servers=len(r.get("servers") or []), plan=r.get("plan"))
                for h, r in zip(headers, reports)],
        capabilities=(with_routes or reports)[0].get("capabilities"),
        summary=summarize(tests),
        tests=tests,
        known_issues=_known_issues(reports),
        servers=[{**s, "shard": k} for k, r in enumerate(reports, 1)
                 for s in r.get("servers") or []],
        plan=_plan(reports),
        timing=_timing(reports, tests),
    )


# ----------------------------------------------------------------------------- command

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("exit 0: merged; 2: bad input, or reports that are not parts of one run "
                "(different commits, vLLM versions or selections, or a test in two)")
    p.add_argument("reports", nargs="+", type=Path, help="the parts' --harness-report files")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="ALL.json",
                   help="where to write the merged report")


def run(args: argparse.Namespace) -> int:
    try:
        merged = merge_reports([report_schema.load(p) for p in args.reports],
                               [str(p) for p in args.reports])
        if args.output.is_dir():
            raise MergeError(f"{args.output} is a directory; name the merged report's file")
        args.output.write_text(json.dumps(merged, indent=1, default=str) + "\n")
    except (report_schema.ReportError, MergeError, OSError) as e:
        print(f"harness merge: {e}", file=sys.stderr)
        return 2
    s = merged["summary"]
    counts = ", ".join(f"{s[k]} {k}" for k in ("passed", "failed", "error", "skipped",
                                                "xfailed", "xpassed") if s.get(k))
    print(f"merged {len(args.reports)} reports: {s['total']} tests ({counts or 'none'}), "
          f"exit status {merged['header']['exitstatus']}, wall time "
          f"{merged['header']['wall_seconds']:.0f}s (the longest part) -> {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from harness.core.facts import run_command

    return run_command("harness merge", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
