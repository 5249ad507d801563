"""``harness``: the command line. Each subcommand lives in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# name: (module, help)
COMMANDS = {
    "bench": ("harness.bench", "how fast weight syncs are, per backend and model size, against "
                               "the raw limit of their data path"),
    "demo": ("harness.demo", "the seed flow, narrated and asserted, against a real server"),
    "diff": ("harness.diff", "compare two JSON reports; non-zero exit when something regressed"),
    "matrix": ("harness.matrix", "one table of vLLM release x check from one report per release, "
                                 "with the first release of every known issue"),
    "repro": ("harness.repro", "run one scenario step by step; --emit writes a standalone script"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harness", description="vLLM weight-sync conformance "
                                     "harness (tests: run pytest)")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:  # import only the module that runs: the others may pull in heavy deps
            importlib.import_module(module).add_arguments(p)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
