"""``harness``: the command line. Each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import sys

# name: (module, help)
COMMANDS = {
    "bench": ("harness.commands.bench", "how fast weight syncs are, per backend and model size, against "
                               "the raw limit of their data path"),
    "demo": ("harness.commands.demo", "the seed flow, narrated and asserted, against a real server"),
    "diff": ("harness.commands.diff", "compare two JSON reports; non-zero exit when something regressed"),
    "durations": ("harness.commands.durations", "measure the plan's per-test durations again from "
                                         "run reports"),
    "matrix": ("harness.commands.matrix", "one table of vLLM release x check from one report per release, "
                                 "with the first release of every known issue"),
    "merge": ("harness.commands.merge", "join the reports of one run's shards (--harness-shard K/N) "
                               "into one report"),
    "repro": ("harness.commands.repro", "run one scenario step by step; --emit writes a standalone script"),
}


def main(argv: list[str] | None = None) -> int:
    """``harness COMMAND ...``. Bad input is one line on stderr, ``harness COMMAND:
    MESSAGE``, exit 2; --help and --version exit 0."""
    from harness.core.facts import command_parser, dist_version

    argv = sys.argv[1:] if argv is None else argv
    parser = command_parser(prog="harness", description="vLLM weight-sync conformance "
                            "harness (tests: run pytest)")
    version = dist_version("weight-sync-harness") or "(not installed)"
    parser.add_argument("--version", action="version", version=f"harness {version}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    subparsers = {}
    for name, (module, help_) in COMMANDS.items():
        p = subparsers[name] = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:  # import only the module that runs: the others may pull in heavy deps
            importlib.import_module(module).add_arguments(p)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"name a command: {', '.join(COMMANDS)}")
    if extra:  # said by the command they were given to, not by "harness"
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
