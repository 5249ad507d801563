"""``harness diff A.json B.json``: what changed between two runs (two --harness-report files).

Sections: where and what ran (host, the backends and layouts that ran, versions);
test outcomes matched by node id (changed, new, missing); coverage (backend/layout
pairs that ran); known issues; capabilities (routes, /pause modes and parameters,
trainer API, backends); metrics that moved beyond a threshold. Each row has a level:

* ``REGRESSION`` - a test that passed in A fails (or errors) in B; a test that ran in A
  is missing from B; a backend/layout pair that ran in A did not run in B (every test of
  it missing or skipped); a known issue that newly applies in B; a route the harness
  calls, a /pause mode (or the deprecated flag that selects one) or a backend that B
  lost; a logprob error that crossed its dtype's tolerance (``harness.oracles.parity``);
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

Where it is: the command line here; the report comparison in ``harness.commands.diff.reports``
and its text in ``harness.commands.diff.render``; the bench comparison in ``harness.commands.diff.bench``;
what they share (levels, the host rule, the verdict) in ``harness.commands.diff.common``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.commands.diff.bench import BENCH_KIND, file_kind, run_bench
from harness.commands.diff.common import BadInput
from harness.commands.diff.render import render
from harness.commands.diff.reports import compare, load
from harness.core.facts import run_command

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
            return run_bench(args)
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
