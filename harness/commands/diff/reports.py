"""``harness diff`` of two test reports (``--harness-report`` files): the sections
(where and what ran, tests, coverage, known issues, capabilities, metrics), each row
with its level, and their text. ``harness.commands.diff`` describes the rules and runs the
command; ``harness.commands.diff.render`` writes the comparison as text.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from harness.commands.diff.common import (FAILING, INFO, KNOWN_SCHEMA, LEVELS, PASSING, REGRESSION,
                                          WARN, BadInput, _beyond, _count, _fmt, _num, _ran, _rel,
                                          describe_host, host, unlike)
from harness.core import report_schema, text
from harness.core.report_schema import Report, ReportedTest
from harness.core.facts import UnknownDtype, canonical_dtype
from harness.oracles import parity
from harness.pause.openapi import LEGACY_FLAGS as PAUSE_LEGACY_FLAGS

# metric -> kind. "logprob": compared with the dtype tolerance; "higher_better" /
# "lower_better": a move in the wrong direction beyond the threshold warns;
# "count": any change is noted; "time": informational only.
METRIC_KINDS = {
    "max_abs_dlogprob": "logprob", "mean_abs_dlogprob": "logprob",
    "topk_overlap": "higher_better", "greedy_match_fraction": "higher_better",
    "greedy_identical": "higher_better",
    "nonfinite": "lower_better", "greedy_ties": "lower_better",
    "tokens_compared": "count", "greedy_prompts": "count", "sync_bytes": "count",
    "sync_tensors": "count",
}


def tolerance(dtype: str | None) -> float | None:
    """The dtype's logprob tolerance from ``harness.oracles.parity`` (the one table), or None
    when parity has none for it: such a metric is then judged by the threshold only."""
    if not dtype:
        return None
    try:
        dtype = canonical_dtype(dtype)
    except UnknownDtype:
        pass  # parity may still know it (float16)
    try:
        return parity.tolerance_for(dtype).max_abs_logprob
    except KeyError:
        return None


# ----------------------------------------------------------------------------- loading

def load(path: Path) -> Report:
    """Read one report (``harness.core.report_schema.load``); ``BadInput`` names the file
    and what is wrong with it."""
    try:
        return report_schema.load(path)
    except report_schema.ReportError as e:
        raise BadInput(str(e)) from None


# ----------------------------------------------------------------------------- what ran

def _pair(t: ReportedTest) -> tuple[str, str] | None:
    case = t.get("case") or {}
    if case.get("backend") and case.get("layout"):
        return str(case["backend"]), str(case["layout"])
    return None


def ran_pairs(report: Report) -> Counter:
    """(backend, layout) -> tests of it that ran, from the per-test records."""
    return Counter(p for t in report.get("tests") or []
                   if _ran(t["outcome"]) and (p := _pair(t)) is not None)


def _ran_summary(pairs: Counter, index: int) -> str:
    c: Counter = Counter()
    for p, n in pairs.items():
        c[p[index]] += n
    return ", ".join(f"{k} ({n})" for k, n in sorted(c.items())) or "(none)"


def _pair_name(p: tuple[str, str]) -> str:
    return f"{p[0]} on {p[1]}"


# ----------------------------------------------------------------------------- sections

def _versions(a: Report, b: Report, ran_a: Counter, ran_b: Counter) -> list[dict]:
    ha, hb = a.get("header") or {}, b.get("header") or {}
    rows = []

    def vllm(h):
        v = h.get("vllm") or {}
        return f"{v.get('version')} ({v.get('dist')})" if v.get("version") else None

    pairs = [("host", describe_host(host(a)), describe_host(host(b))),
             ("backends ran", _ran_summary(ran_a, 0), _ran_summary(ran_b, 0)),
             ("layouts ran", _ran_summary(ran_a, 1), _ran_summary(ran_b, 1)),
             ("vllm", vllm(ha), vllm(hb))]
    if a.get("schema", KNOWN_SCHEMA) != b.get("schema", KNOWN_SCHEMA):
        pairs.append(("report schema", a.get("schema"), b.get("schema")))
    if ha.get("complete") is False or hb.get("complete") is False:
        # written after each test: a run cut short by a time limit still has a report
        pairs.append(("complete run", ha.get("complete", True), hb.get("complete", True)))
    for key in ("torch", "transformers", "tokenizers", "python", "pytest", "harness"):
        pairs.append((key, ha.get(key), hb.get(key)))
    pairs.append(("git commit", (ha.get("git") or {}).get("commit"),
                  (hb.get("git") or {}).get("commit")))
    pairs.append(("harness snapshot", (ha.get("env") or {}).get("HARNESS_SNAPSHOT"),
                  (hb.get("env") or {}).get("HARNESS_SNAPSHOT")))
    for key in ("layouts", "models", "dtypes", "backends"):
        pairs.append((f"selected {key}", (ha.get("selection") or {}).get(key),
                      (hb.get("selection") or {}).get(key)))
    for what, va, vb in pairs:
        if va is None and vb is None:
            continue
        rows.append({"what": what, "a": va, "b": vb, "changed": va != vb})
    return rows


def _tests(ta: dict[str, ReportedTest], tb: dict[str, ReportedTest],
           allow_missing: bool) -> list[dict]:
    rows = []
    for nodeid in sorted(set(ta) | set(tb)):
        x, y = ta.get(nodeid), tb.get(nodeid)
        oa = x["outcome"] if x else None
        ob = y["outcome"] if y else None
        ka = x.get("known_issue") if x else None
        kb = y.get("known_issue") if y else None
        if x and y and oa == ob and ka == kb:
            continue
        level, why = INFO, ""
        if y is None:
            if allow_missing:
                why = "missing in B (allowed: --allow-missing)"
            elif _ran(oa):
                level, why = REGRESSION, "ran in A, missing in B"
            else:
                level, why = WARN, f"missing in B ({oa} in A)"
        elif x is None:
            why = "new in B"
            if ob in FAILING:
                level, why = WARN, "new in B, and it fails"
        elif y.get("xpass_strict") and kb:
            # the test body passed: the known issue did not reproduce
            why = f"known issue {kb} fixed in B: remove (or bound) the entry"
        elif oa in PASSING and ob in FAILING:
            level, why = REGRESSION, "passed in A, fails in B"
        elif ob in FAILING and str(y.get("message") or "").startswith("beyond known issue"):
            level, why = REGRESSION, f"{oa or 'absent'} in A, fails in B beyond its known issue"
        elif kb and kb != ka and ob == "xfailed":
            level, why = REGRESSION, f"known issue {kb} newly applies in B"
        elif ob in FAILING and oa not in FAILING:
            level, why = WARN, f"{oa} in A, fails in B"
        elif _ran(oa) and not _ran(ob):
            level, why = WARN, f"ran in A, {ob} in B"
        elif oa in FAILING and ob in PASSING:
            why = "fixed in B"
        detail = ""
        if y is not None and ob in FAILING and y.get("message"):
            detail = y["message"].splitlines()[0]
        elif y is not None and ob in ("skipped", "xfailed") and y.get("reason"):
            detail = _without_known_issue_id(y["reason"].splitlines()[0], kb)
        if detail:
            why += (": " if why else "") + detail
        rows.append({"nodeid": nodeid, "a": oa, "b": ob, "known_a": ka, "known_b": kb,
                     "level": level, "why": why})
    return sorted(rows, key=lambda r: LEVELS.index(r["level"]))  # stable: by node id within


def _without_known_issue_id(reason: str, known: str | None) -> str:
    """An xfail reason "known issue ID (UPSTREAM): SYMPTOM" as its symptom alone, where
    the row names the known issue already (the known-issues file has the rest)."""
    prefix = f"known issue {known} ("
    if not known or not reason.startswith(prefix):
        return reason
    depth, i = 0, len(prefix) - 1
    for i in range(len(prefix) - 1, len(reason)):  # the upstream's closing parenthesis
        depth += {"(": 1, ")": -1}.get(reason[i], 0)
        if depth == 0:
            break
    rest = reason[i + 1:]
    return rest[2:] if rest.startswith(": ") else reason


def _coverage(ran_a: Counter, ran_b: Counter, allow_missing: bool) -> list[dict]:
    rows = []
    for p in sorted(set(ran_a) - set(ran_b)):
        rows.append({"what": _pair_name(p), "a": ran_a[p], "b": 0,
                     "level": INFO if allow_missing else REGRESSION,
                     "why": "ran in A, not in B" + (" (allowed: --allow-missing)"
                                                    if allow_missing else "")})
    for p in sorted(set(ran_b) - set(ran_a)):
        rows.append({"what": _pair_name(p), "a": 0, "b": ran_b[p], "level": INFO,
                     "why": "new in B"})
    return rows


def _known_issues(a: Report, b: Report, kept_a: set, kept_b: set,
                  host_specific: bool) -> list[dict]:
    def entries(r):
        ki = r.get("known_issues") or {}
        return {e["id"]: e for e in ki.get("entries") or [] if isinstance(e, dict) and "id" in e}

    ea, eb = entries(a), entries(b)
    rows = []
    for iid in sorted(set(ea) | set(eb)):
        x, y = ea.get(iid) or {}, eb.get(iid) or {}
        sx, sy = x.get("status"), y.get("status")
        if sx == sy:
            continue
        if host_specific:
            # unlike hosts: an entry for one kind of host, or whose tests were left out
            tests = set(x.get("tests_outcomes") or {}) | set(y.get("tests_outcomes") or {})
            if x.get("hosts") or y.get("hosts") or not (tests & (kept_a | kept_b)):
                continue
        level = REGRESSION if sy == "known" and sx != "known" else INFO
        rows.append({"id": iid, "a": sx, "b": sy, "level": level})
    return rows


def _known_bounds(ta: dict[str, ReportedTest], tb: dict[str, ReportedTest]) -> list[dict]:
    """For each test of a bounded known issue (the known-issues file in use), each bound
    against what A and B recorded: the worst value, and how far B's is from the bound. A
    B beyond it is a regression (the test then fails "beyond known issue", a row of its
    own above)."""
    from harness import known_issues

    try:
        entries = {i.id: i for i in known_issues.load()}
    except (OSError, ValueError):
        return []
    rows = []
    for nodeid in sorted(set(ta) | set(tb)):
        x, y = ta.get(nodeid) or {}, tb.get(nodeid) or {}
        issue = entries.get(y.get("known_issue") or x.get("known_issue") or "")
        if issue is None or not issue.bounds:
            continue
        for ja, jb in zip(issue.judge(x.get("metrics") or {}), issue.judge(y.get("metrics") or {})):
            if not (ja.recorded or jb.recorded):
                continue
            beyond_b = jb.recorded and not jb.within
            level = REGRESSION if beyond_b and (not ja.recorded or ja.within) else \
                WARN if beyond_b else INFO
            rows.append({"nodeid": nodeid, "id": issue.id, "bound": ja.bound.path,
                         "known": ja.bound.range_text(), "a": ja.worst, "b": jb.worst,
                         "b_distance": jb.distance(), "level": level})
    return sorted(rows, key=lambda r: LEVELS.index(r["level"]))


def _pause_styles(p: dict) -> list[str]:
    """The ways to call /pause a report saw: its modes and the deprecated flags."""
    params = p.get("params") or []
    return [f"mode={m}" for m in p.get("modes") or []] + \
           [f"{f}=true" for f in PAUSE_LEGACY_FLAGS if f in params]


def _capabilities(a: Report, b: Report) -> list[dict]:
    ca, cb = a.get("capabilities") or {}, b.get("capabilities") or {}
    rows: list[dict] = []
    ra, rb = ca.get("routes"), cb.get("routes")
    if ra is not None and rb is not None:
        used = set(ca.get("routes_used") or [])
        for r in sorted(set(ra) - set(rb)):
            rows.append({"what": f"route {r}", "change": "removed",
                         "level": REGRESSION if r in used else INFO,
                         "why": "the harness calls it" if r in used else ""})
        for r in sorted(set(rb) - set(ra)):
            rows.append({"what": f"route {r}", "change": "added", "level": INFO, "why": ""})
    elif (ra is None) != (rb is None):
        rows.append({"what": "routes", "change": f"captured in {'A' if rb is None else 'B'} only",
                     "level": INFO, "why": ca.get("routes_error") or cb.get("routes_error") or ""})
    pa, pb = ca.get("pause") or {}, cb.get("pause") or {}
    if pa and pb:
        sa, sb = _pause_styles(pa), _pause_styles(pb)
        for s in [s for s in sa if s not in sb]:
            rows.append({"what": f"/pause {s}", "change": "removed", "level": REGRESSION,
                         "why": "a /pause mode the tests call" if s.startswith("mode=") else
                                "the deprecated flag for a /pause mode: clients sending it break"})
        for s in [s for s in sb if s not in sa]:
            rows.append({"what": f"/pause {s}", "change": "added", "level": INFO, "why": ""})
        flags = set(PAUSE_LEGACY_FLAGS)  # reported above, as modes
        for p in sorted(set(pa.get("params") or []) - set(pb.get("params") or []) - flags):
            rows.append({"what": f"/pause ?{p}", "change": "removed", "level": INFO, "why": ""})
        for p in sorted(set(pb.get("params") or []) - set(pa.get("params") or []) - flags):
            rows.append({"what": f"/pause ?{p}", "change": "added", "level": INFO, "why": ""})
        if pa.get("default") != pb.get("default"):
            rows.append({"what": "/pause default mode", "change": f"{pa.get('default')} -> "
                         f"{pb.get('default')}", "level": WARN, "why": ""})
    elif bool(pa) != bool(pb):
        rows.append({"what": "/pause modes", "change": f"captured in {'A' if pa else 'B'} only",
                     "level": INFO, "why": "no vLLM server answered /openapi.json in the other"})
    ta, tb = ca.get("trainer_api") or {}, cb.get("trainer_api") or {}
    if "error" not in ta and "error" not in tb:
        for key in sorted(set(ta) | set(tb)):
            if key in ("errors", "vllm_version"):
                continue
            x, y = ta.get(key), tb.get(key)
            if x == y:
                continue
            if isinstance(x, bool) or isinstance(y, bool):
                change = "removed" if x and not y else "added" if y and not x else f"{x} -> {y}"
            else:
                change = f"{_fmt(x)} -> {_fmt(y)}"
            rows.append({"what": f"trainer API {key}", "change": change, "level": INFO, "why": ""})
    elif ta.get("error") != tb.get("error"):
        rows.append({"what": "trainer API probe", "change": "not comparable", "level": INFO,
                     "why": ta.get("error") or tb.get("error") or ""})
    ba, bb = ca.get("backends") or {}, cb.get("backends") or {}
    for engine in sorted(set(ba) | set(bb)):
        x, y = (ba.get(engine) or {}).get("loadable"), (bb.get(engine) or {}).get("loadable")
        if x == y:
            continue
        lost = x is True and y is False
        rows.append({"what": f"backend {engine} loadable", "change": f"{_fmt(x)} -> {_fmt(y)}",
                     "level": REGRESSION if lost else INFO,
                     "why": (bb.get(engine) or {}).get("reason") or ""})
    return rows


def _metrics(ta: dict[str, ReportedTest], tb: dict[str, ReportedTest],
             threshold_rel: float) -> list[dict]:
    rows = []
    for nodeid, t in tb.items():
        x = ta.get(nodeid)
        if not x:
            continue
        ma, mb = x.get("metrics") or {}, t.get("metrics") or {}
        dtype = ((t.get("case") or {}).get("dtype") or (x.get("case") or {}).get("dtype"))
        for key in sorted(set(ma) & set(mb)):
            va, vb = _num(ma[key]), _num(mb[key])
            if va is None or vb is None or va == vb:
                continue
            if math.isnan(va) and math.isnan(vb):
                continue
            kind = METRIC_KINDS.get(key, "time" if "second" in key else "other")
            rel = _rel(va, vb)
            moved = text.change(va, vb)  # a percentage only where one means something
            level, why = None, ""
            if kind == "logprob":
                tol = tolerance(dtype)
                if tol is not None and vb > tol >= va:
                    level, why = REGRESSION, f"above the {dtype} tolerance {tol:g}"
                elif tol is not None and vb > tol:
                    level, why = WARN, f"above the {dtype} tolerance {tol:g} in both"
                elif _beyond(rel, threshold_rel) and vb - va > 1e-9:
                    level, why = WARN, f"grew {moved}" + (f", within tolerance {tol:g}"
                                                         if tol is not None else "")
            elif kind == "higher_better":
                if vb < va and _beyond(rel, min(threshold_rel, 0.01)):
                    level, why = WARN, f"dropped {moved}"
            elif kind == "lower_better":
                if vb > va:
                    level, why = WARN, f"increased {moved}"
            elif kind == "count":
                level, why = INFO, "changed"
            elif _beyond(rel, threshold_rel):
                level, why = INFO, moved + (" (informational)" if kind == "time" else "")
            if level:
                rows.append({"nodeid": nodeid, "metric": key, "a": va, "b": vb,
                             "rel": rel, "level": level, "why": why})
    return rows


def _side(r: Report) -> dict:
    h = r.get("header") or {}
    counts = Counter(t["outcome"] for t in r.get("tests") or [])
    return {"vllm": h.get("vllm"), "start_time": h.get("start_time"), "host": host(r),
            "schema": r.get("schema"), "summary": {"total": sum(counts.values()), **counts}}


def compare(a: Report, b: Report, *, threshold_rel: float = 0.5, allow_missing: bool = False,
            allow_unlike_hosts: bool = False) -> dict:
    """Compare report B with baseline A. Raises ``BadInput`` for unlike hosts unless
    ``allow_unlike_hosts``; then only the backend/layout pairs both ran are compared."""
    ha, hb = host(a), host(b)
    differs = unlike(ha, hb)
    if differs and not allow_unlike_hosts:
        raise BadInput(f"not like with like: A ran on {describe_host(ha)}, B on "
                       f"{describe_host(hb)}; --allow-unlike-hosts compares only the cases "
                       "both ran")
    ran_a, ran_b = ran_pairs(a), ran_pairs(b)
    ta = {t["nodeid"]: t for t in a.get("tests") or []}
    tb = {t["nodeid"]: t for t in b.get("tests") or []}
    left_out = None
    if differs:
        common = set(ran_a) & set(ran_b)

        def keep(t):
            p = _pair(t)
            return p is None or p in common

        out_a = sorted(n for n, t in ta.items() if not keep(t))
        out_b = sorted(n for n, t in tb.items() if not keep(t))
        ta = {n: t for n, t in ta.items() if keep(t)}
        tb = {n: t for n, t in tb.items() if keep(t)}
        left_out = {"differs": differs, "pairs_compared": [_pair_name(p) for p in sorted(common)],
                    "pairs_a_only": [_pair_name(p) for p in sorted(set(ran_a) - common)],
                    "pairs_b_only": [_pair_name(p) for p in sorted(set(ran_b) - common)],
                    "tests_a": len(out_a), "tests_b": len(out_b)}
        cov_a = Counter({p: n for p, n in ran_a.items() if p in common})
        cov_b = Counter({p: n for p, n in ran_b.items() if p in common})
    else:
        cov_a, cov_b = ran_a, ran_b
    out = {
        "a": _side(a), "b": _side(b),
        "threshold_rel": threshold_rel,
        "allow_missing": allow_missing,
        "unlike_hosts": left_out,
        "versions": _versions(a, b, ran_a, ran_b),
        "tests": _tests(ta, tb, allow_missing),
        "unchanged_tests": 0,
        "coverage": _coverage(cov_a, cov_b, allow_missing),
        "known_issues": _known_issues(a, b, set(ta), set(tb), bool(differs)),
        "known_bounds": _known_bounds(ta, tb),
        "capabilities": _capabilities(a, b),
        "metrics": _metrics(ta, tb, threshold_rel),
    }
    out["unchanged_tests"] = len(set(ta) & set(tb)) - sum(1 for r in out["tests"]
                                                          if r["a"] and r["b"])
    findings = []  # (fact, rank within it, the finding, its short form under its fact)
    for r in out["tests"]:
        if r["level"] == REGRESSION:
            change = f"{_fmt(r['a'])} -> {r['b'] or '(missing)'}"
            findings.append((_fact_of(r["nodeid"], r["known_b"]), 3,
                             f"test {r['nodeid']}: {change} ({r['why']})",
                             f"{r['nodeid']}: {change}"))
    for r in out["coverage"]:
        if r["level"] == REGRESSION:
            f = f"{r['what']}: {r['why']} ({_count(r['a'], 'test')} in A)"
            findings.append((("pair", r["what"]), 2, f, f))
    for r in out["known_issues"]:
        if r["level"] == REGRESSION:
            f = f"known issue {r['id']}: {r['a']} -> {r['b']}"
            findings.append((("known", r["id"]), 0, f, f))
    for r in out["capabilities"]:
        if r["level"] == REGRESSION:
            f = f"{r['what']} {r['change']}" + (f" ({r['why']})" if r['why'] else "")
            findings.append((("capability", r["what"]), 1, f, f))
    for r in out["metrics"]:
        if r["level"] == REGRESSION:
            f = f"{r['nodeid']} {r['metric']} {_fmt(r['a'])} -> {_fmt(r['b'])} ({r['why']})"
            known = (tb.get(r["nodeid"]) or {}).get("known_issue")
            findings.append((_fact_of(r["nodeid"], known), 4, f, f))
    out["regressions"] = [f for _, _, f, _ in findings]  # every finding
    out["regressed"] = _facts(findings)                  # the distinct facts they make
    return out


def _fact_of(nodeid: str, known_issue: str | None) -> tuple[str, str]:
    """What a test's regressions are about: the known issue it is now marked with (the
    same fact as that issue's own row), else the test itself (its outcome and metrics)."""
    return ("known", known_issue) if known_issue else ("test", nodeid)


def _facts(findings: list[tuple]) -> list[dict]:
    """The findings grouped by fact, in the order their facts were first found; within
    one, the known issue or capability first, then tests, then metrics."""
    groups: dict[tuple, list[tuple]] = {}
    for fact, rank, full, short in findings:
        groups.setdefault(fact, []).append((rank, full, short))
    out = []
    for items in groups.values():
        items.sort(key=lambda x: x[0])
        out.append({"fact": items[0][1], "also": [short for _, _, short in items[1:]],
                    "findings": len(items)})
    return out
