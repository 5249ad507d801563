"""What the installed vLLM offers, probed once per installation and kept on disk.

The report's capability probes (``harness.vllm.api.probe`` and the engine-module
imports) each import vLLM in a child process: about 27 s on 2 cores, and minutes on a
loaded machine, paid by every run with ``--harness-report``, even ``--collect-only``.
Their answer changes only when the installation does, so it is cached under
``<cache root>/probes/``, keyed on what identifies one:

* the Python interpreter;
* the vLLM distribution: name, version, where its metadata lies and that directory's
  modification time (a reinstall rewrites it), and the modification time of the
  directory that holds it (installing or removing any package there changes it: ray,
  for instance, decides whether vLLM 0.26's IPC engine imports);
* the harness version and the source of the probe itself (``vllm_api.py``).

On a miss the probes run in a process of their own session, which writes the cache
itself: a run that ends first (``--collect-only``, a short selection) waits for them
only as long as it is willing to, and the next run finds the answer. Only complete
answers are kept: one that records a probe error or a timeout is probed again next
time. Nothing here imports vLLM, torch or pytest.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.core.facts import dist_version, installed_vllm

SCHEMA = 1
CHILD_TIMEOUT_S = 900.0  # the bound on each probe in the process of its own


def _mtime_ns(p: Path | None) -> int | None:
    try:
        return p.stat().st_mtime_ns if p is not None else None
    except OSError:
        return None


def install_key() -> dict[str, Any]:
    """What identifies the installation the probes describe."""
    version, dist = installed_vllm()
    where = None
    if dist:
        d = importlib.metadata.distribution(dist)
        where = getattr(d, "_path", None)
        where = Path(str(where)).resolve() if where is not None else None
    # the probe's code: api.py, and the backends that name what it probes (harness/transfer)
    here = Path(__file__).resolve()
    sources = [here.with_name("api.py"), *sorted((here.parents[1] / "transfer").glob("*.py"))]
    try:
        probe_code = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:16]
    except OSError:
        probe_code = None
    return {"schema": SCHEMA, "python": sys.executable, "vllm_dist": dist,
            "vllm_version": version, "vllm_metadata": str(where) if where else None,
            "vllm_metadata_mtime_ns": _mtime_ns(where),
            "site_mtime_ns": _mtime_ns(where.parent if where else None),
            "harness": dist_version("weight-sync-harness"), "probe_code": probe_code}


def cache_path(key: dict[str, Any] | None = None) -> Path:
    from harness.models import cache_root

    key = install_key() if key is None else key
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_root() / "probes" / f"{digest}.json"


def complete(value: Any) -> bool:
    """A probe answer worth keeping: no probe error, no timeout."""
    try:
        trainer_api, backends = value
    except (TypeError, ValueError):
        return False
    if not isinstance(trainer_api, dict) or "error" in trainer_api:
        return False
    return isinstance(backends, dict) and all(
        isinstance(b, dict) and b.get("loadable") is not None
        and "did not finish" not in str(b.get("reason")) for b in backends.values())


def load() -> tuple[Any, Path]:
    """(the cached answer for this installation, or None; the cache file)."""
    key = install_key()
    path = cache_path(key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") == key and complete(data.get("value")):
            return tuple(data["value"]), path
    except (OSError, ValueError, AttributeError):
        pass
    return None, path


def store(value: Any) -> bool:
    """Keep a complete answer for this installation (atomically); False otherwise. An
    unwritable cache is never an error, only a cost."""
    if not complete(value):
        return False
    key = install_key()
    path = cache_path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "value": list(value)}, f, indent=1)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def answer(child_code: str, timeout: float) -> tuple[Any, str | None]:
    """(the probes' answer, the cache file it came from, or None when it was probed
    now). On a miss, ``child_code`` runs in a process of its own session with the
    path of a file to write the answer to as ``sys.argv[1]``; it stores the answer
    itself, so one that outlives this process still fills the cache. Waits at most
    ``timeout`` seconds; returns (None, None) when it had not finished by then."""
    value, path = load()
    if value is not None:
        return value, str(path)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    fd, out = tempfile.mkstemp(prefix="harness-probe-", suffix=".json")
    os.close(fd)
    proc = subprocess.Popen([sys.executable, "-c", child_code, out], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None  # it goes on, and leaves its answer in the cache
    try:
        return tuple(json.loads(Path(out).read_text())), None
    except (OSError, ValueError, TypeError):
        return ({"error": f"the probe process ended (exit {proc.returncode}) without an "
                          "answer"}, {}), None
    finally:
        Path(out).unlink(missing_ok=True)
