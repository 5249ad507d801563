"""``python -m harness CMD``: the same as the ``harness`` command."""

import sys

from harness.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
