"""``python -m harness.known_issues [VERSION]`` and ``... verify REPORT.json ...``: the
known-issues command. Above both of its halves: ``harness.known_issues`` (the entries,
their matching, the pytest marking) and ``harness.known_issues.verify`` (the check of
``checked`` against run reports) import nothing of it."""

from __future__ import annotations

import sys

from harness.core.facts import installed_vllm
from harness.known_issues import load
from harness.known_issues.verify import main as verify_main


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.known_issues [VERSION]``: validate the file and list entries.
    ``python -m harness.known_issues verify REPORT.json ...``: ``harness.known_issues.verify``."""
    from packaging.version import InvalidVersion, Version

    from harness.core.facts import command_parser

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "verify":  # the name CI scripts and the docs use
        return verify_main(argv[1:])
    prog = "python -m harness.known_issues"
    ap = command_parser(
        prog=prog, description="Validate the known-issues file and say which entries apply "
        "to a vLLM version. `python -m harness.known_issues verify REPORT.json ...` checks "
        "the versions the entries call checked against run reports (verify --help).")
    ap.add_argument("version", nargs="?", metavar="VERSION",
                    help="a vLLM version, e.g. 0.32.0 (default: the installed vLLM's)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad argument (2, said on stderr)
        return int(e.code or 0)
    version = args.version or installed_vllm()[0]
    if args.version is not None:
        try:
            Version(args.version)
        except InvalidVersion:
            print(f"{prog}: {args.version!r} is not a vLLM version (e.g. 0.32.0)",
                  file=sys.stderr)
            return 2
    for issue in load():
        where = "applies" if issue.applies_to_version(version) else "does not apply"
        print(f"{issue.id}: {where} to vLLM {version} (affected '{issue.affected}', "
              f"hosts {list(issue.hosts) or 'any'})\n    {issue.upstream}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
