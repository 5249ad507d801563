"""``harness diff`` of two ``harness bench`` files: per backend and size, the GB/s of
the median warm send in B against A; a drop beyond ``--max-drop`` is a REGRESSION
(see ``harness.commands.diff`` for the rules both comparisons share).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from harness.commands.bench import benchfile
from harness.commands.diff.common import (INFO, REGRESSION, BadInput, _count, _fmt, _num, _rel,
                                          _verdict, describe_host, host, output_width, para, table,
                                          unlike)
from harness.core import reportfile, text

BENCH_KIND = benchfile.KIND


def file_kind(path: Path) -> str | None:
    """The ``kind`` a JSON file declares (bench files do), or None when it declares none
    or cannot be read (``load`` then says what is wrong)."""
    try:
        data = json.loads(reportfile.read_text(path))
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


def run_bench(args: argparse.Namespace) -> int:
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
