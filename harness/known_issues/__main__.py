"""``python -m harness.known_issues``: the known-issues command (``cli``)."""

import sys

from harness.known_issues.cli import main

sys.exit(main())
