"""What both of ``harness diff``'s comparisons share (test reports, ``harness.commands.diff.reports``;
bench files, ``harness.commands.diff.bench``): the levels of a finding, numbers as the text
shows them, the like-with-like host rule, and the closing verdict.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.core import text
from harness.core.report_schema import SCHEMA_VERSION

REGRESSION, WARN, INFO = "REGRESSION", "warn", "info"
LEVELS = (REGRESSION, WARN, INFO)
FAILING = ("failed", "error")
PASSING = ("passed", "xpassed")
NOT_RUN = ("skipped", "deselected", "interrupted")  # no result: the case did not run
KNOWN_SCHEMA = SCHEMA_VERSION  # a report dict without "schema" reads as the newest
SUMMARY_MAX = 20  # regressions listed again at the end of the text output

class BadInput(Exception):
    """A report that cannot be compared: exit code 2, the message on stderr."""


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


# ----------------------------------------------------------------------------- hosts

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


# ----------------------------------------------------------------------------- text

# The layout functions live in harness.core.text (any renderer may use them); these names
# are kept for the callers that know them from here.
table, records, record, para, wrap, output_width = (text.table, text.records, text.record,
                                                    text.para, text.wrap, text.output_width)
LABEL = 10  # the width of a level ("REGRESSION") before a record's head


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


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
