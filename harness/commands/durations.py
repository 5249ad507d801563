"""``harness durations REPORT.json ... [--kind gpu|cpu] [--out FILE]``: measure the
plan's per-test durations again from run reports (``harness.run.durations``).

Writes one host kind's table (the median duration of each test function, its waits for
servers left out, over the passed and xfailed tests on a server) into the durations
file, the other kind's kept, less the functions no longer defined under ``--tests``
(renamed or removed since the reports). The kind is the reports' own (a run that used
a GPU is ``gpu``) unless ``--kind`` says. Exit code: 0, or 2 for a file that is not a
run report, reports of both kinds without ``--kind``, or no tests folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.core import report_schema
from harness.core.report_schema import Report
from harness.run import durations


class BadInput(Exception):
    pass


def load(path: str) -> Report:
    """The run report at ``path`` (``harness.core.report_schema.load``); BadInput names
    the file and what is wrong with it."""
    try:
        return report_schema.load(path)
    except report_schema.ReportError as e:
        raise BadInput(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("reports", nargs="+", metavar="REPORT.json",
                   help="run reports (pytest --harness-report) of one host kind")
    p.add_argument("--kind", choices=durations.KINDS,
                   help="the table to write (default: the reports' kind)")
    p.add_argument("--out", type=Path, default=durations.PATH, metavar="FILE",
                   help=f"the durations file (default {durations.PATH.name} of harness/run)")
    p.add_argument("--tests", type=Path, default=Path("tests"), metavar="DIR",
                   help="where the test functions are defined; a function the reports "
                        "name that is not (renamed, removed) is left out (default tests)")


def run(args: argparse.Namespace) -> int:
    try:
        reports = [(p, load(p)) for p in args.reports]
        kinds = {durations.kind_of(r) for _, r in reports}
        if args.kind is None and len(kinds) > 1:
            raise BadInput("reports of GPU and CPU runs: name the table with --kind")
        kind = args.kind or kinds.pop()
        if not args.tests.is_dir():
            raise BadInput(f"no folder {args.tests}: name the tests' folder with --tests")
        data, left_out = durations.update(args.out, kind, reports,
                                          durations.defined_functions(args.tests))
    except (BadInput, OSError) as e:
        print(f"harness durations: {e}", file=sys.stderr)
        return 2
    tests = sum(s["tests"] for s in data["source"][kind])
    print(f"{kind}: {len(data[kind])} test functions from {tests} tests in {len(reports)} "
          f"reports -> {args.out}")
    if left_out:
        print(f"left out, not defined under {args.tests}: {', '.join(left_out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from harness.core.facts import run_command

    return run_command("harness durations", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
