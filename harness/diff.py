"""``harness diff A.json B.json``: what changed between two runs (two --harness-report files).

Sections: where and what ran (host, the backends and layouts that ran, versions);
test outcomes matched by node id (changed, new, missing); coverage (backend/layout
pairs that ran); known issues; capabilities (routes, /pause modes and parameters,
trainer API, backends); metrics that moved beyond a threshold. Each row has a level:

* ``REGRESSION`` - a test that passed in A fails (or errors) in B; a test that ran in A
  is missing from B; a backend/layout pair that ran in A did not run in B (every test of
  it missing or skipped); a known issue that newly applies in B; a route the harness
  calls, a /pause mode (or the deprecated flag that selects one) or a backend that B
  lost; a logprob error that crossed its dtype's tolerance (``harness.parity``);
* ``warn`` - worth a look, not a failure: a test that ran in A and is skipped (or was
  interrupted) in B; a test that fails in B and did not fail in A otherwise (new, or
  skipped in A); a test missing from B that did not run in A either; a logprob error
  that grew by more than ``--threshold-rel`` within tolerance; fewer greedy matches,
  more non-finite values; a changed default /pause mode;
* ``info`` - everything else that changed; timings never regress.

``--allow-missing`` turns missing tests and pairs that no longer ran into ``info``
(for comparing runs of different selections).

Like with like: a report records its host (GPUs used, their names where recorded,
the machine). Reports from unlike hosts are refused (exit 2): on a CPU host the GPU
cases skip, and known issues apply per host, so the difference would be the host's,
not vLLM's. ``--allow-unlike-hosts`` compares them anyway under a "NOT LIKE WITH LIKE"
banner, and only the backend/layout pairs that ran on both hosts (plus the tests that
have no backend); known issues that are specific to a host are left out.

What ran is counted from the per-test records (an outcome other than skipped,
deselected or interrupted), never from the header's selection.

Exit code: 0 no regression, 1 at least one REGRESSION, 2 bad input (a file that cannot
be read, is not JSON or not a harness report; reports from unlike hosts without
``--allow-unlike-hosts``; a bad option).

Two ``harness bench`` files (``bench.json``, recognised by their ``kind``) are compared
by throughput instead: per backend and size, the GB/s of the median warm send in B
against A; a drop of more than ``--max-drop`` (default 20%) is a REGRESSION, and so is
a case that A measured and B did not (unless ``--allow-missing``) or that failed in B.
Each backend's change over all its sizes (geometric mean) heads its table; the
fraction of the raw limit, the /pause-to-/resume seconds and the raw limits themselves
are shown beside it: a limit that moved says the hosts differ. The exit codes and the
like-with-like rule are the same.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from . import benchfile, parity, text
from .facts import UnknownDtype, canonical_dtype, run_command
from .pause.openapi import LEGACY_FLAGS as PAUSE_LEGACY_FLAGS

REGRESSION, WARN, INFO = "REGRESSION", "warn", "info"
LEVELS = (REGRESSION, WARN, INFO)
FAILING = ("failed", "error")
PASSING = ("passed", "xpassed")
NOT_RUN = ("skipped", "deselected", "interrupted")  # no result: the case did not run
KNOWN_SCHEMA = 3  # the newest report schema this module was written against (2 reads the same)
WIDTH = text.DEFAULT_WIDTH  # the text output's width when COLUMNS and a terminal say none
SUMMARY_MAX = 20  # regressions listed again at the end of the text output

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


class BadInput(Exception):
    """A report that cannot be compared: exit code 2, the message on stderr."""


def tolerance(dtype: str | None) -> float | None:
    """The dtype's logprob tolerance from ``harness.parity`` (the one table), or None
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


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)  # "nan"/"inf" were stored as strings
        except ValueError:
            return None
    return None


def _rel(a: float, b: float) -> float | None:
    """(b - a) / |a|; None from 0, where a relative change means nothing."""
    if a == b:
        return 0.0
    if a == 0:
        return None
    return (b - a) / abs(a)


def _beyond(rel: float | None, threshold: float) -> bool:
    return rel is None or abs(rel) > threshold


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v)) or "(none)"
    return str(v)


def _ran(outcome: str | None) -> bool:
    return outcome is not None and outcome not in NOT_RUN


# ----------------------------------------------------------------------------- loading

def load(path: Path) -> dict:
    """Read one report; ``BadInput`` names the file and what is wrong with it."""
    def bad(why: str) -> BadInput:
        return BadInput(f"cannot read {path}: {why}")

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise bad("no such file") from None
    except IsADirectoryError:
        raise bad("is a directory") from None
    except PermissionError:
        raise bad("permission denied") from None
    except UnicodeDecodeError:
        raise bad("not JSON (not UTF-8 text)") from None
    except OSError as e:
        raise bad(e.strerror or type(e).__name__) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON (line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("header"), dict) \
            or not isinstance(data.get("tests"), list):
        raise bad("not a harness report (no 'header' or 'tests'; write one with "
                  "pytest --harness-report PATH)")
    schema = data.get("schema", KNOWN_SCHEMA)
    if isinstance(schema, bool) or not isinstance(schema, int) or schema < 1:
        raise bad(f"not a harness report (schema {schema!r})")
    for i, t in enumerate(data["tests"]):
        if not isinstance(t, dict) or not isinstance(t.get("nodeid"), str) \
                or not isinstance(t.get("outcome"), str):
            raise bad(f"test record {i} has no 'nodeid' or 'outcome'")
    return data


# ----------------------------------------------------------------------------- host, what ran

def host(report: dict) -> dict:
    """What decides which cases a host can run: GPUs used (and their names, where the
    report records them) and the machine."""
    h = report.get("header") or {}
    gpus = h.get("gpus") or {}
    used = gpus.get("used")
    names = gpus.get("names")
    return {"gpus": used if isinstance(used, int) and not isinstance(used, bool) else None,
            "gpu_names": sorted(map(str, names)) if isinstance(names, list) else None,
            "machine": h.get("machine")}


def describe_host(hst: dict) -> str:
    n = hst["gpus"]
    what = ("GPUs unknown" if n is None else "CPU only" if n == 0
            else f"{n} GPU{'s' if n != 1 else ''}")
    if n and hst["gpu_names"]:
        kinds = Counter(hst["gpu_names"])
        what += ": " + ", ".join(f"{c} x {k}" for k, c in kinds.items())
    return what + (f" ({hst['machine']})" if hst["machine"] else "")


def unlike(ha: dict, hb: dict) -> list[str]:
    """How two hosts differ in a way that changes what runs; [] when alike (or unknown)."""
    out = []
    if ha["gpus"] is not None and hb["gpus"] is not None and ha["gpus"] != hb["gpus"]:
        out.append("GPU count")
    if ha["gpus"] and hb["gpus"] and ha["gpu_names"] and hb["gpu_names"] \
            and ha["gpu_names"] != hb["gpu_names"]:
        out.append("GPU kind")
    if ha["machine"] and hb["machine"] and ha["machine"] != hb["machine"]:
        out.append("machine")
    return out


def _pair(t: dict) -> tuple[str, str] | None:
    case = t.get("case") or {}
    if case.get("backend") and case.get("layout"):
        return str(case["backend"]), str(case["layout"])
    return None


def ran_pairs(report: dict) -> Counter:
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

def _versions(a: dict, b: dict, ran_a: Counter, ran_b: Counter) -> list[dict]:
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


def _tests(ta: dict, tb: dict, allow_missing: bool) -> list[dict]:
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


def _known_issues(a: dict, b: dict, kept_a: set, kept_b: set, host_specific: bool) -> list[dict]:
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


def _pause_styles(p: dict) -> list[str]:
    """The ways to call /pause a report saw: its modes and the deprecated flags."""
    params = p.get("params") or []
    return [f"mode={m}" for m in p.get("modes") or []] + \
           [f"{f}=true" for f in PAUSE_LEGACY_FLAGS if f in params]


def _capabilities(a: dict, b: dict) -> list[dict]:
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


def _metrics(ta: dict, tb: dict, threshold_rel: float) -> list[dict]:
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


def _side(r: dict) -> dict:
    h = r.get("header") or {}
    counts = Counter(t["outcome"] for t in r.get("tests") or [])
    return {"vllm": h.get("vllm"), "start_time": h.get("start_time"), "host": host(r),
            "schema": r.get("schema"), "summary": {"total": sum(counts.values()), **counts}}


def compare(a: dict, b: dict, *, threshold_rel: float = 0.5, allow_missing: bool = False,
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


# ----------------------------------------------------------------------------- text

# The layout functions live in harness.text (any renderer may use them); these names
# are kept for the callers that know them from here.
table, records, record, para, wrap, output_width = (text.table, text.records, text.record,
                                                    text.para, text.wrap, text.output_width)
LABEL = 10  # the width of a level ("REGRESSION") before a record's head


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _worst(levels) -> str:
    return min(levels, key=LEVELS.index)


def _tests_text(rows: list[dict], width: int) -> list[str]:
    """One record per test; the symptom of a known issue is said once, at its first test."""
    out, told = [], set()
    for r in rows:
        ka, kb = r["known_a"], r["known_b"]
        known = (f"known issue {ka} in A and B" if ka and ka == kb else
                 ", ".join(f"known issue in {s.upper()}: {k}" for s, k in (("a", ka), ("b", kb))
                           if k))
        why = r["why"]
        if kb and kb in told and why:
            verdict, _, _ = why.partition(": ")
            why = verdict if verdict != why else ""
            why += f"{'; ' if why else ''}known issue {kb}: as above"
        told |= {k for k in (ka, kb) if k}
        out += record(r["nodeid"], [f"{r['a'] or '(not in A)'} -> {r['b'] or '(missing)'}"
                                    + (f" [{known}]" if known else "")
                                    + (f": {why}" if why else "")], width, r["level"], LABEL)
    return out


def _metrics_text(rows: list[dict], width: int) -> list[str]:
    """One record per test, a line per metric that moved, the worst level in front."""
    by_test: dict[str, list[dict]] = {}
    for r in rows:
        by_test.setdefault(r["nodeid"], []).append(r)
    out = []
    for nodeid, ms in by_test.items():
        ms = sorted(ms, key=lambda m: LEVELS.index(m["level"]))
        mixed = len({m["level"] for m in ms}) > 1  # then each line says its level, but info
        out += record(nodeid, [(f"{m['level']}: " if mixed and m["level"] != INFO else "")
                               + f"{m['metric']} {_fmt(m['a'])} -> {_fmt(m['b'])}: {m['why']}"
                               for m in ms], width, ms[0]["level"], LABEL)
    return out


def render(d: dict, a_name: str = "A", b_name: str = "B", width: int | None = None) -> str:
    """The comparison as text in ``width`` columns (default: ``output_width()``)."""
    width = output_width() if width is None else width
    out: list[str] = []
    for side, name in (("a", a_name), ("b", b_name)):
        v = d[side]["vllm"] or {}
        label = "harness diff  A = " if side == "a" else "              B = "
        out += para(f"{name} (vLLM {v.get('version')}, {d[side]['start_time']})", width,
                    " " * 18, first=label)
    u = d.get("unlike_hosts")
    if u:
        out.append("")
        out += para(f"NOT LIKE WITH LIKE: A ran on {describe_host(d['a']['host'])}, B on "
                    f"{describe_host(d['b']['host'])} (differ: {', '.join(u['differs'])}). "
                    "Compared only the backend/layout pairs both ran ("
                    f"{', '.join(u['pairs_compared']) or 'none'}) and the tests without a "
                    "backend. Left out: pairs only A ran ("
                    f"{', '.join(u['pairs_a_only']) or 'none'}), pairs only B ran ("
                    f"{', '.join(u['pairs_b_only']) or 'none'}); "
                    f"{_count(u['tests_a'], 'test')} of A and {u['tests_b']} of B; the known "
                    "issues of one kind of host. Differences below may still be the hosts'.",
                    width, "!! ", first="!! ")
    out.append("")
    sa, sb = d["a"]["summary"], d["b"]["summary"]
    keys = [k for k in ("total", "passed", "failed", "error", "skipped", "xfailed", "xpassed",
                        "interrupted") if k in sa or k in sb]
    out += para(", ".join(f"{k} {sa.get(k, 0)} -> {sb.get(k, 0)}" for k in keys), width,
                " " * 11, first="Outcomes   ")
    out.append("")
    out += para("== Where and what ran (what ran: per-test records, not the selection)", width)
    out += table(["", "A", "B", ""], [[r["what"], _fmt(r["a"]), _fmt(r["b"]),
                                       "changed" if r["changed"] else ""]
                                      for r in d["versions"]], width, flex=(1, 2))
    out.append("")
    out.append(f"== Tests ({len(d['tests'])} changed, new or missing; "
               f"{d['unchanged_tests']} unchanged)")
    out += _tests_text(d["tests"], width)
    out.append("")
    out.append("== Coverage (backend/layout pairs that ran)")
    if d["coverage"]:
        out += table(["level", "pair", "A", "B", "why"],
                     [[r["level"], r["what"], str(r["a"]), str(r["b"]), r["why"]]
                      for r in d["coverage"]], width, flex=(1, 4), key=(0, 1))
    elif u:
        out += para("(only the pairs both hosts ran are compared: "
                    f"{', '.join(u['pairs_compared']) or 'none'})", width)
    else:
        out.append("(the same pairs ran)")
    out.append("")
    out.append("== Known issues")
    if d["known_issues"]:
        out += table(["level", "id", "A", "B"],
                     [[r["level"], r["id"], _fmt(r["a"]), _fmt(r["b"])]
                      for r in d["known_issues"]], width, flex=(2, 3), key=(0, 1))
    else:
        out.append("(no change)")
    out.append("")
    out.append("== Capabilities")
    if d["capabilities"]:
        out += table(["level", "what", "change", "why"],
                     [[r["level"], r["what"], r["change"], r["why"]]
                      for r in d["capabilities"]], width, flex=(2, 3), key=(0, 1))
    else:
        out.append("(no change)")
    out.append("")
    out += para(f"== Metrics (moved beyond {d['threshold_rel']:.0%} relative, or across a "
                "tolerance; timings are informational)", width)
    out += _metrics_text(d["metrics"], width) or ["(no change beyond the threshold)"]
    out.append("")
    out += _verdict(d["regressed"], width, " listed above")
    if u:
        out.append("(NOT LIKE WITH LIKE: see the note at the top)")
    return "\n".join(out) + "\n"


def _verdict(facts: list[dict], width: int, where: str = "") -> list[str]:
    """The closing lines: each distinct regression (the first SUMMARY_MAX) with the
    other findings that are the same fact, or that there is none."""
    if not facts:
        return ["No regression."]
    n = sum(f["findings"] for f in facts)
    out = [f"REGRESSED: {len(facts)}" + (f" ({n} findings, the same fact counted once)"
                                          if n != len(facts) else "")]
    for f in facts[:SUMMARY_MAX]:
        out += para(f["fact"], width, "    ", first="  - ")
        for also in f["also"]:  # the same fact, seen from its tests and metrics
            out += para(also, width, "        ", first="      + ")
    if len(facts) > SUMMARY_MAX:
        out.append(f"  ... and {len(facts) - SUMMARY_MAX} more{where} (--json lists "
                   "them all)")
    return out


# ----------------------------------------------------------------------------- bench files

BENCH_KIND = benchfile.KIND


def file_kind(path: Path) -> str | None:
    """The ``kind`` a JSON file declares (bench files do), or None when it declares none
    or cannot be read (``load`` then says what is wrong)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data.get("kind") if isinstance(data, dict) else None


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _bench_side(doc: dict) -> dict:
    h = doc.get("header") or {}
    return {"vllm": h.get("vllm"), "start_time": h.get("start_time"), "host": host(doc),
            "dtype": (h.get("options") or {}).get("dtype"), "complete": h.get("complete"),
            "cases": len(doc.get("cases") or [])}


def _pause_to_resume(summary: dict) -> float | None:
    return _num((summary.get("warm_pause_to_resume_seconds") or {}).get("median"))


def compare_bench(a: dict, b: dict, *, max_drop: float = 0.2, allow_missing: bool = False,
                  allow_unlike_hosts: bool = False) -> dict:
    """Compare bench file B with baseline A, per backend and size. Raises ``BadInput``
    for unlike hosts unless ``allow_unlike_hosts``."""
    ha, hb = host(a), host(b)
    differs = unlike(ha, hb)
    if differs and not allow_unlike_hosts:
        raise BadInput(f"not like with like: A ran on {describe_host(ha)}, B on "
                       f"{describe_host(hb)}; throughput belongs to the host "
                       "(--allow-unlike-hosts compares anyway)")
    ca = {benchfile.case_key(c): c for c in a.get("cases") or []}
    cb = {benchfile.case_key(c): c for c in b.get("cases") or []}
    rows = []
    for key in sorted(set(ca) | set(cb), key=lambda k: (k[0], k[1], k[2], k[3])):
        x, y = ca.get(key), cb.get(key)
        sx, sy = (x or {}).get("summary") or {}, (y or {}).get("summary") or {}
        ga, gb = _num(sx.get("gbps")), _num(sy.get("gbps"))
        change = _rel(ga, gb) if ga and gb else None
        level, why = INFO, ""
        if y is None:
            if ga is None:
                why = "not measured in A, not in B"
            elif allow_missing:
                why = "measured in A, not in B (allowed: --allow-missing)"
            else:
                level, why = REGRESSION, "measured in A, not in B"
        elif x is None:
            why = "new in B"
        elif gb is None and ga is not None:
            level = REGRESSION
            error = (y.get("error") or "no result").splitlines()[0]
            why = f"measured in A, failed in B: {error}"
        elif ga is None and gb is not None:
            why = "failed in A, measured in B"
        elif change is not None and change < -max_drop:
            level, why = REGRESSION, f"{change:+.0%} GB/s, beyond the {max_drop:.0%} threshold"
        elif change is not None:
            why = f"{change:+.0%} GB/s"
        rows.append({"backend": key[0], "layout": key[1], "dtype": key[2], "size_gb": key[3],
                     "a_gbps": ga, "b_gbps": gb, "change": change,
                     "a_ratio": _num(sx.get("ratio")), "b_ratio": _num(sy.get("ratio")),
                     "a_pause_to_resume": _pause_to_resume(sx),
                     "b_pause_to_resume": _pause_to_resume(sy),
                     "a_cold": _num(sx.get("cold_pause_to_resume_seconds")),
                     "b_cold": _num(sy.get("cold_pause_to_resume_seconds")),
                     "a_server_peak_extra_bytes": sx.get("server_peak_extra_bytes"),
                     "b_server_peak_extra_bytes": sy.get("server_peak_extra_bytes"),
                     "level": level, "why": why})
    backends = []
    for name in sorted({r["backend"] for r in rows}):
        mine = [r for r in rows if r["backend"] == name]
        both = [r["b_gbps"] / r["a_gbps"] for r in mine if r["a_gbps"] and r["b_gbps"]]
        g = _geomean(both)
        backends.append({"backend": name, "change": None if g is None else g - 1,
                         "sizes_compared": len(both),
                         "level": REGRESSION if any(r["level"] == REGRESSION for r in mine)
                         else INFO})
    limits = []
    la = {(l.get("path"), json.dumps(l.get("devices"), sort_keys=True)): l
          for l in a.get("limits") or []}
    lb = {(l.get("path"), json.dumps(l.get("devices"), sort_keys=True)): l
          for l in b.get("limits") or []}
    for key in sorted(set(la) & set(lb), key=str):
        sa = {round(s["bytes"] / 1e9, 3): s for s in la[key].get("sizes") or []}
        sb = {round(s["bytes"] / 1e9, 3): s for s in lb[key].get("sizes") or []}
        for gbytes in sorted(set(sa) & set(sb)):
            va, vb = _num(sa[gbytes].get("gbps")), _num(sb[gbytes].get("gbps"))
            limits.append({"path": key[0], "gb": gbytes, "a_gbps": va, "b_gbps": vb,
                           "change": _rel(va, vb) if va and vb else None})
    regressions = [f"{r['backend']} {r['size_gb']:g} GB ({r['layout']}, {r['dtype']}): "
                   f"{_fmt(r['a_gbps'])} -> {_fmt(r['b_gbps'])} GB/s ({r['why']})"
                   for r in rows if r["level"] == REGRESSION]
    return {"kind": "bench", "a": _bench_side(a), "b": _bench_side(b), "max_drop": max_drop,
            "allow_missing": allow_missing, "unlike_hosts": differs or None,
            "backends": backends, "cases": rows, "limits": limits, "regressions": regressions,
            "regressed": [{"fact": r, "also": [], "findings": 1} for r in regressions]}


def _pct(v: float | None) -> str:
    """A relative change; beyond ten-fold, the ratio."""
    if v is None:
        return "-"
    return f"x{text.change(1, 1 + v)[1:]}" if v > 9 else f"{v:+.0%}"


def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _secs(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_bench(d: dict, a_name: str = "A", b_name: str = "B",
                 width: int | None = None) -> str:
    """The comparison of two bench files as text in ``width`` columns."""
    width = output_width() if width is None else width
    out: list[str] = []
    for side, name in (("a", a_name), ("b", b_name)):
        s = d[side]
        label = "harness diff  A = " if side == "a" else "              B = "
        out += para(f"{name} (bench: vLLM {(s['vllm'] or {}).get('version')}, {s['dtype']}, "
                    f"{describe_host(s['host'])}, {s['start_time']}"
                    + ("" if s["complete"] is not False else ", INCOMPLETE") + ")", width,
                    " " * 18, first=label)
    if d.get("unlike_hosts"):
        out += ["", *para(f"NOT LIKE WITH LIKE (differ: {', '.join(d['unlike_hosts'])}): "
                          "throughput belongs to the host; the changes below may be the "
                          "hosts'.", width, "!! ", first="!! ")]
    out.append("")
    out += para(f"A drop of more than {d['max_drop']:.0%} in GB/s (bytes / median warm send) "
                "for a backend and size is a regression. Per backend: the geometric mean of "
                "B/A over the sizes both measured.", width)
    for be in d["backends"]:
        out.append("")
        out += para(f"== {be['backend']}: {_pct(be['change'])} GB/s over "
                    f"{_count(be['sizes_compared'], 'size')}"
                    + ("  REGRESSION" if be["level"] == REGRESSION else ""), width)
        rows = [r for r in d["cases"] if r["backend"] == be["backend"]]
        out += table(["level", "GB", "A GB/s", "B GB/s", "change", "A of limit", "B of limit",
                      "A p->r s", "B p->r s", "why"],
                     [[r["level"], f"{r['size_gb']:g} GB", _fmt(r["a_gbps"]),
                       _fmt(r["b_gbps"]), _pct(r["change"]), _share(r["a_ratio"]),
                       _share(r["b_ratio"]), _secs(r["a_pause_to_resume"]),
                       _secs(r["b_pause_to_resume"]), r["why"]]
                      for r in rows], width, flex=(9,), key=(0, 1))
    out.append("")
    out += para("== Raw limits (the hardware's; a change here is the host's, not vLLM's)",
                width)
    if d["limits"]:
        out += table(["path", "GB", "A GB/s", "B GB/s", "change"],
                     [[l["path"], f"{l['gb']:g}", _fmt(l["a_gbps"]), _fmt(l["b_gbps"]),
                       _pct(l["change"])] for l in d["limits"]], width, key=(0, 1))
    else:
        out.append("(no path measured in both)")
    out.append("")
    out += _verdict(d["regressed"], width)
    return "\n".join(out) + "\n"


def _run_bench(args: argparse.Namespace) -> int:
    kinds = [file_kind(args.a) == BENCH_KIND, file_kind(args.b) == BENCH_KIND]
    if kinds != [True, True]:
        one, other = (args.a, args.b) if kinds[0] else (args.b, args.a)
        raise BadInput(f"{one} is a bench file (harness bench) and {other} is not: compare "
                       "two bench files, or two test reports")
    try:
        a, b = benchfile.load(args.a), benchfile.load(args.b)
    except benchfile.BenchFileError as e:
        raise BadInput(str(e)) from None
    d = compare_bench(a, b, max_drop=args.max_drop, allow_missing=args.allow_missing,
                      allow_unlike_hosts=args.allow_unlike_hosts)
    if args.json:
        print(json.dumps(d, indent=1, default=str))
    else:
        sys.stdout.write(render_bench(d, str(args.a), str(args.b)))
    return 1 if d["regressions"] else 0


# ----------------------------------------------------------------------------- cli

EXIT_CODES = "exit code: 0 no regression, 1 regression, 2 bad input (unreadable file, unlike hosts)"


def _fraction(flag: str, text: str, below_one: bool) -> float:
    """A fraction given as text, checked here (one line, exit 2) rather than by argparse
    (whose errors print the whole usage)."""
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = float("nan")
    if below_one and not 0 <= v < 1:
        raise BadInput(f"{flag}: a fraction of the GB/s between 0 and 1 (0.2 = a 20% drop), "
                       f"got {text!r}")
    if not 0 <= v < float("inf"):
        raise BadInput(f"{flag}: a relative change >= 0 (0.5 = 50%), got {text!r}")
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXIT_CODES
    p.add_argument("a", type=Path, help="the baseline report (--harness-report of run A)")
    p.add_argument("b", type=Path, help="the report to compare with it (run B)")
    p.add_argument("--threshold-rel", default="0.5", metavar="FRACTION",
                   help="relative change of a metric worth showing (default 0.5 = 50%%)")
    p.add_argument("--allow-missing", action="store_true",
                   help="a test missing from B, or a backend/layout that ran in A and not in "
                        "B, is info, not a regression (runs of different selections)")
    p.add_argument("--allow-unlike-hosts", action="store_true",
                   help="compare reports from unlike hosts (GPU count or kind, machine) "
                        "instead of refusing: only the backend/layout pairs both ran")
    p.add_argument("--max-drop", default="0.2", metavar="FRACTION",
                   help="bench files: a throughput drop beyond this fraction (from 0 up to, "
                        "not including, 1), per backend and size, is a regression (default "
                        "0.2 = 20%%)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        args.threshold_rel = _fraction("--threshold-rel", args.threshold_rel, False)
        args.max_drop = _fraction("--max-drop", args.max_drop, True)
        if BENCH_KIND in (file_kind(args.a), file_kind(args.b)):
            return _run_bench(args)
        a, b = load(args.a), load(args.b)
        d = compare(a, b, threshold_rel=args.threshold_rel, allow_missing=args.allow_missing,
                    allow_unlike_hosts=args.allow_unlike_hosts)
    except BadInput as e:
        print(f"harness diff: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=1, default=str))
    else:
        sys.stdout.write(render(d, str(args.a), str(args.b)))
    return 1 if d["regressions"] else 0


def main(argv: list[str] | None = None) -> int:
    return run_command("harness diff", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
