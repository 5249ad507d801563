"""Time SmolLM2's GGUF conversion with and without parsing the file once.

    .venv/bin/python ci/gguf_conversion_bench.py once    # as harness.models builds it
    .venv/bin/python ci/gguf_conversion_bench.py plain   # transformers left to itself

Each run converts into a fresh temporary directory; run the two in turn several times
(e.g. with `/usr/bin/time -f %e`) and compare medians.
"""

import contextlib
import sys
import tempfile
from pathlib import Path

from harness.models.zoo import _gguf_parsed_once
from harness.portable.recipes import build_smollm2

mode = sys.argv[1] if len(sys.argv) > 1 else "once"
with tempfile.TemporaryDirectory() as d:
    with _gguf_parsed_once() if mode == "once" else contextlib.nullcontext():
        build_smollm2(Path(d) / "smollm2")
