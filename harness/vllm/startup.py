"""Where a server start's time goes, read from its log.

A start is three processes that each import vLLM, one after the other (API server,
engine core, worker), then the model, the KV cache and warm-up (or compilation), then
the API server's routes. vLLM stamps each log line with its process and the time to
the second, so the gaps between the first lines of each process and a few known
messages give the phases. Each start's record in the report carries them
(``servers[].profile``), and docs/planning.md sums them per host.

The marks are vLLM's own messages (0.26 to 0.32); a phase whose mark is missing is
left out, not guessed. Nothing here imports vLLM.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

_STAMP = re.compile(r"^\((?P<proc>[A-Za-z]+)[-\w]* pid=\d+\) \w+ (?P<md>\d\d-\d\d) "
                    r"(?P<hms>\d\d:\d\d:\d\d)")
# (phase, the process or message that ends it), in start order
_MARKS = (
    ("api_server_imports", lambda proc, text: proc == "APIServer"),
    ("engine_core_imports", lambda proc, text: proc == "EngineCore"),
    ("worker_imports", lambda proc, text: proc in ("Worker", "VllmWorker")),
    ("model_load", lambda proc, text: "Model loading took" in text
     or "Initializing model took" in text or "Loading weights took" in text),
    ("engine_init", lambda proc, text: "init engine (profile, create kv cache" in text),
    ("api_routes", lambda proc, text: "Starting vLLM API server" in text
     or "Starting vLLM server on" in text),
)


def profile(log_path: str | Path, launched_at: float, ready_seconds: float | None = None
            ) -> dict[str, float]:
    """Seconds of each phase of the start logged at ``log_path`` (``launched_at``: the
    epoch second the process was started; ``ready_seconds``: when /health answered,
    after launch). The last phase, ``until_healthy``, runs from the routes to /health."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return {}
    year = _dt.datetime.fromtimestamp(launched_at, _dt.timezone.utc).year
    out: dict[str, float] = {}
    prev, k = launched_at, 0
    for line in lines:
        if k >= len(_MARKS):
            break
        m = _STAMP.match(line)
        if not m:
            continue
        name, ends = _MARKS[k]
        if not ends(m["proc"], line):
            continue
        at = _dt.datetime.strptime(f"{year}-{m['md']} {m['hms']}", "%Y-%m-%d %H:%M:%S")
        t = at.replace(tzinfo=_local_tz()).timestamp()
        out[name] = round(max(0.0, t - prev), 1)
        prev, k = t, k + 1
    if ready_seconds is not None and out:
        out["until_healthy"] = round(max(0.0, launched_at + ready_seconds - prev), 1)
    return out


def _local_tz():
    return _dt.datetime.now().astimezone().tzinfo
