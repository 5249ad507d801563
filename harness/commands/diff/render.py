"""The text of ``harness diff`` of two test reports (``harness.commands.diff.reports.compare``'s
result), in the reader's width: a heading per section, tables that wrap or become
records (``harness.core.text``), and the verdict.
"""

from __future__ import annotations

from harness.commands.diff.common import (INFO, LABEL, LEVELS, _count, _fmt, _verdict,
                                          describe_host, output_width, para, record, table)


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
    out.append("== Known issues' bounds (how far each known failure went)")
    if d.get("known_bounds"):
        out += table(["level", "test", "bound", "known", "A", "B"],
                     [[r["level"], r["nodeid"], r["bound"], r["known"], _fmt(r["a"]),
                       f"{_fmt(r['b'])} ({r['b_distance']})"]
                      for r in d["known_bounds"]], width, flex=(1, 5), key=(0, 1))
    else:
        out.append("(no test of a bounded known issue)")
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
