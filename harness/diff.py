"""``harness diff A.json B.json``: what changed between two runs (two --harness-report files).

Sections: versions; test outcomes matched by node id (changed, new, removed);
known issues; capabilities (routes, /pause modes and parameters, trainer API,
backends); metrics that moved beyond a threshold. Each row carries a level:

* ``REGRESSION`` - a test that passed in A fails (or errors) in B; a known issue
  that newly applies in B; a route the harness uses, a /pause mode or a backend
  that B lost; a logprob error that crossed its dtype's tolerance;
* ``warn`` - worth a look, not a failure (a logprob error that grew by more than
  ``--threshold-rel`` but stays within tolerance, greedy matches lost, ...);
* ``info`` - everything else that changed (timings are always informational).

Exit code: 1 when there is at least one REGRESSION, 0 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from . import parity
from .facts import UnknownDtype, canonical_dtype

REGRESSION, WARN, INFO = "REGRESSION", "warn", "info"
FAILING = ("failed", "error")
PASSING = ("passed", "xpassed")

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


def _tolerance(dtype: str | None) -> float | None:
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


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if a == 0:
        return math.inf
    return (b - a) / abs(a)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v)) or "(none)"
    return str(v)


# ----------------------------------------------------------------------------- sections

def _versions(a: dict, b: dict) -> list[dict]:
    ha, hb = a.get("header") or {}, b.get("header") or {}
    rows = []

    def vllm(h):
        v = h.get("vllm") or {}
        return f"{v.get('version')} ({v.get('dist')})" if v.get("version") else None

    pairs = [("vllm", vllm(ha), vllm(hb))]
    if ha.get("complete") is False or hb.get("complete") is False:
        # written after each test: a run cut short by a time limit still has a report
        pairs.append(("complete run", ha.get("complete", True), hb.get("complete", True)))
    for key in ("torch", "transformers", "tokenizers", "python", "pytest", "harness"):
        pairs.append((key, ha.get(key), hb.get(key)))
    pairs.append(("git commit", (ha.get("git") or {}).get("commit"),
                  (hb.get("git") or {}).get("commit")))
    pairs.append(("harness snapshot", (ha.get("env") or {}).get("HARNESS_SNAPSHOT"),
                  (hb.get("env") or {}).get("HARNESS_SNAPSHOT")))
    pairs.append(("GPUs used", (ha.get("gpus") or {}).get("used"),
                  (hb.get("gpus") or {}).get("used")))
    for key in ("layouts", "models", "dtypes", "backends"):
        pairs.append((f"selection {key}", (ha.get("selection") or {}).get(key),
                      (hb.get("selection") or {}).get(key)))
    for what, va, vb in pairs:
        if va is None and vb is None:
            continue
        rows.append({"what": what, "a": va, "b": vb, "changed": va != vb})
    return rows


def _tests(a: dict, b: dict) -> list[dict]:
    ta = {t["nodeid"]: t for t in a.get("tests") or []}
    tb = {t["nodeid"]: t for t in b.get("tests") or []}
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
            why = "removed in B"
        elif x is None:
            why = "new in B"
            if ob in FAILING:
                level, why = WARN, "new in B, and it fails"
        elif oa in PASSING and ob in FAILING:
            level, why = REGRESSION, "passed in A, fails in B"
        elif y.get("xpass_strict") and kb:
            why = f"known issue {kb} fixed in B: remove (or bound) the entry"
        elif kb and kb != ka and ob == "xfailed":
            level, why = REGRESSION, f"known issue {kb} newly applies in B"
        elif ob in FAILING and oa not in FAILING:
            level, why = WARN, f"{oa} in A, fails in B"
        elif oa in PASSING and ob in ("skipped", "interrupted"):
            level, why = WARN, f"ran in A, {ob} in B"
        elif oa in FAILING and ob in PASSING:
            why = "fixed in B"
        if y is not None and ob in FAILING and y.get("message"):
            why += (": " if why else "") + y["message"].splitlines()[0][:160]
        elif y is not None and ob in ("skipped", "xfailed") and y.get("reason"):
            why += (": " if why else "") + y["reason"].splitlines()[0][:160]
        rows.append({"nodeid": nodeid, "a": oa, "b": ob, "known_a": ka, "known_b": kb,
                     "level": level, "why": why})
    return rows


def _known_issues(a: dict, b: dict) -> list[dict]:
    def statuses(r):
        ki = r.get("known_issues") or {}
        return {e["id"]: e.get("status") for e in ki.get("entries") or []}

    sa, sb = statuses(a), statuses(b)
    rows = []
    for iid in sorted(set(sa) | set(sb)):
        x, y = sa.get(iid), sb.get(iid)
        if x == y:
            continue
        level = INFO
        if y == "known" and x != "known":
            level = REGRESSION
        rows.append({"id": iid, "a": x, "b": y, "level": level})
    return rows


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
        for m in sorted(set(pa.get("modes") or []) - set(pb.get("modes") or [])):
            rows.append({"what": f"/pause mode={m}", "change": "removed", "level": REGRESSION,
                         "why": "pause modes are part of the tested contract"})
        for m in sorted(set(pb.get("modes") or []) - set(pa.get("modes") or [])):
            rows.append({"what": f"/pause mode={m}", "change": "added", "level": INFO, "why": ""})
        for p in sorted(set(pa.get("params") or []) - set(pb.get("params") or [])):
            rows.append({"what": f"/pause ?{p}", "change": "removed", "level": INFO, "why": ""})
        for p in sorted(set(pb.get("params") or []) - set(pa.get("params") or [])):
            rows.append({"what": f"/pause ?{p}", "change": "added", "level": INFO, "why": ""})
        if pa.get("default") != pb.get("default"):
            rows.append({"what": "/pause default mode", "change": f"{pa.get('default')} -> "
                         f"{pb.get('default')}", "level": WARN, "why": ""})
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
                     "why": ((bb.get(engine) or {}).get("reason") or "")[:200] if lost else
                     ((bb.get(engine) or {}).get("reason") or "")[:200]})
    return rows


def _metrics(a: dict, b: dict, threshold_rel: float) -> list[dict]:
    ta = {t["nodeid"]: t for t in a.get("tests") or []}
    rows = []
    for t in b.get("tests") or []:
        x = ta.get(t["nodeid"])
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
            level, why = None, ""
            if kind == "logprob":
                tol = _tolerance(dtype)
                if tol is not None and vb > tol >= va:
                    level, why = REGRESSION, f"above the {dtype} tolerance {tol:g}"
                elif tol is not None and vb > tol:
                    level, why = WARN, f"above the {dtype} tolerance {tol:g} in both"
                elif rel > threshold_rel and vb - va > 1e-9:
                    level, why = WARN, f"grew {rel:+.0%}" + (f", within tolerance {tol:g}"
                                                            if tol is not None else "")
            elif kind == "higher_better":
                if vb < va and abs(rel) > min(threshold_rel, 0.01):
                    level, why = WARN, f"dropped {rel:+.0%}"
            elif kind == "lower_better":
                if vb > va:
                    level, why = WARN, "increased"
            elif kind == "count":
                level, why = INFO, "changed"
            elif abs(rel) > threshold_rel:
                level, why = INFO, f"{rel:+.0%}" + (" (informational)" if kind == "time" else "")
            if level:
                rows.append({"nodeid": t["nodeid"], "metric": key, "a": va, "b": vb,
                             "rel": rel, "level": level, "why": why})
    return rows


def compare(a: dict, b: dict, *, threshold_rel: float = 0.5) -> dict:
    out = {
        "a": {"vllm": (a.get("header") or {}).get("vllm"),
              "start_time": (a.get("header") or {}).get("start_time"),
              "summary": {k: v for k, v in (a.get("summary") or {}).items()
                          if isinstance(v, int)}},
        "b": {"vllm": (b.get("header") or {}).get("vllm"),
              "start_time": (b.get("header") or {}).get("start_time"),
              "summary": {k: v for k, v in (b.get("summary") or {}).items()
                          if isinstance(v, int)}},
        "threshold_rel": threshold_rel,
        "versions": _versions(a, b),
        "tests": _tests(a, b),
        "unchanged_tests": 0,
        "known_issues": _known_issues(a, b),
        "capabilities": _capabilities(a, b),
        "metrics": _metrics(a, b, threshold_rel),
    }
    both = {t["nodeid"] for t in a.get("tests") or []} & {t["nodeid"] for t in b.get("tests") or []}
    out["unchanged_tests"] = len(both) - sum(1 for r in out["tests"] if r["a"] and r["b"])
    regressions = []
    for r in out["tests"]:
        if r["level"] == REGRESSION:
            regressions.append(f"test {r['nodeid']}: {r['a']} -> {r['b']} ({r['why']})")
    for r in out["known_issues"]:
        if r["level"] == REGRESSION:
            regressions.append(f"known issue {r['id']}: {r['a']} -> {r['b']}")
    for r in out["capabilities"]:
        if r["level"] == REGRESSION:
            regressions.append(f"{r['what']} {r['change']}" + (f" ({r['why']})" if r['why'] else ""))
    for r in out["metrics"]:
        if r["level"] == REGRESSION:
            regressions.append(f"{r['nodeid']} {r['metric']} {_fmt(r['a'])} -> {_fmt(r['b'])} "
                               f"({r['why']})")
    out["regressions"] = regressions
    return out


# ----------------------------------------------------------------------------- text

def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    widths[-1] = len(headers[-1])  # the last column is free text
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def render(d: dict, a_name: str = "A", b_name: str = "B") -> str:
    va, vb = d["a"]["vllm"] or {}, d["b"]["vllm"] or {}
    out = [f"harness diff  A = {a_name} (vLLM {va.get('version')}, {d['a']['start_time']})",
           f"              B = {b_name} (vLLM {vb.get('version')}, {d['b']['start_time']})", ""]
    sa, sb = d["a"]["summary"], d["b"]["summary"]
    keys = [k for k in ("total", "passed", "failed", "error", "skipped", "xfailed", "xpassed",
                        "interrupted")
            if k in sa or k in sb]
    out.append("Outcomes   " + "  ".join(f"{k} {sa.get(k, 0)} -> {sb.get(k, 0)}" for k in keys))
    out.append("")
    out.append("== Versions")
    out += _table(["", "A", "B", ""], [[r["what"], _fmt(r["a"]), _fmt(r["b"]),
                                        "changed" if r["changed"] else ""]
                                       for r in d["versions"]])
    out.append("")
    out.append(f"== Tests ({len(d['tests'])} changed, new or removed; "
               f"{d['unchanged_tests']} unchanged)")
    if d["tests"]:
        out += _table(["level", "test", "A", "B", "why"],
                      [[r["level"], r["nodeid"], _fmt(r["a"]) + (f" [{r['known_a']}]" if r["known_a"] else ""),
                        _fmt(r["b"]) + (f" [{r['known_b']}]" if r["known_b"] else ""), r["why"]]
                       for r in d["tests"]])
    out.append("")
    out.append("== Known issues")
    if d["known_issues"]:
        out += _table(["level", "id", "A", "B"],
                      [[r["level"], r["id"], _fmt(r["a"]), _fmt(r["b"])] for r in d["known_issues"]])
    else:
        out.append("(no change)")
    out.append("")
    out.append("== Capabilities")
    if d["capabilities"]:
        out += _table(["level", "what", "change", "why"],
                      [[r["level"], r["what"], r["change"], r["why"]] for r in d["capabilities"]])
    else:
        out.append("(no change)")
    out.append("")
    out.append(f"== Metrics (moved beyond {d['threshold_rel']:.0%} relative, or across a "
               "tolerance; timings are informational)")
    if d["metrics"]:
        out += _table(["level", "test", "metric", "A", "B", "why"],
                      [[r["level"], r["nodeid"], r["metric"], _fmt(r["a"]), _fmt(r["b"]), r["why"]]
                       for r in d["metrics"]])
    else:
        out.append("(no change beyond the threshold)")
    out.append("")
    if d["regressions"]:
        out.append(f"REGRESSED: {len(d['regressions'])}")
        out += [f"  - {r}" for r in d["regressions"]]
    else:
        out.append("No regression.")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- cli

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", type=Path, help="the baseline report (--harness-report of run A)")
    p.add_argument("b", type=Path, help="the report to compare with it (run B)")
    p.add_argument("--threshold-rel", type=float, default=0.5,
                   help="relative change of a metric worth showing (default 0.5 = 50%%)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")


def _load(path: Path) -> dict:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "tests" not in data or "header" not in data:
        raise ValueError(f"{path} is not a harness report (no 'header'/'tests')")
    return data


def run(args: argparse.Namespace) -> int:
    try:
        a, b = _load(args.a), _load(args.b)
    except (OSError, ValueError) as e:
        print(f"harness diff: {e}", file=sys.stderr)
        return 2
    d = compare(a, b, threshold_rel=args.threshold_rel)
    if args.json:
        print(json.dumps(d, indent=1, default=str))
    else:
        sys.stdout.write(render(d, str(args.a), str(args.b)))
    return 1 if d["regressions"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="harness diff", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
