"""The run report's schema (``pytest --harness-report PATH``): its version, the typed
parts of the JSON document, and ``load``, which every command that reads a run report
(``harness diff``, ``merge``, ``matrix``, ``durations``,
``python -m harness.known_issues verify``) reads it through.

The writer (``harness.pytest.report``) builds each part with these types; they are
TypedDicts, so a part is a plain dict and the JSON is what ``json.dumps`` makes of it.
A reader gets a ``Report`` whose required keys are there and of the right kind; every
other key may be absent in a report of an older schema (``SCHEMA_HISTORY``) and is read
with ``.get``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Required, TypedDict

from harness.core import reportfile

SCHEMA_VERSION = 3
OLDEST_SCHEMA = 1
# What each schema added; a reader of the newest reads all of them.
SCHEMA_HISTORY = {1: "header, capabilities, summary, tests, known_issues, servers",
                  2: "per-test 'syncs', top-level 'timing'",
                  3: "per-test 'timing', 'plan'"}
REQUIRED = {"schema": int, "header": dict, "tests": list}  # key -> its JSON kind
TEST_REQUIRED = {"nodeid": str, "outcome": str}
# A test's outcome: pytest's, plus "interrupted" (set up, never finished: the run was cut).
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "interrupted")
WRITE_ONE = "write one with pytest --harness-report PATH"


class ReportError(ValueError):
    """A file that is not a run report this harness reads; the message is one line:
    ``cannot read PATH: what is wrong``."""


# ----------------------------------------------------------------------------- the parts

class ReportedTest(TypedDict, total=False):
    """One test: ``harness.pytest.records`` builds it from the test's phase reports."""
    nodeid: Required[str]
    outcome: Required[str]           # one of OUTCOMES
    duration: float                  # seconds, every phase
    reason: str | None               # why skipped, or the xfail reason
    at: float | None                 # when its set-up began, on the servers' clock
    worker: str | None               # the xdist worker that ran it; None in a serial run
    known_issue: str | None          # the id of the known-issue entry applied to it
    known_issue_bounds: list | None  # the entry's bounds judged (bounds.Judged.as_dict)
    xpass_strict: bool               # a known issue's strict xfail passed: fixed
    case: dict | None                # the case's fields (backend, layout, dtype, model, ...)
    metrics: dict                    # numbers it recorded, merged
    syncs: list[dict]                # one per sync: its time pieces (schema 2+)
    timing: dict[str, float]         # seconds per phase and "other" (schema 3+)
    message: str | None              # the failure's message
    phases: dict[str, str]           # setup / call / teardown -> that phase's outcome


class Summary(TypedDict, total=False):
    """Counts per outcome (one key per outcome that occurred) and these lists."""
    total: Required[int]
    known: list[str]               # xfailed by a known issue
    fixed_known_issues: list[str]  # a known issue's strict xfail passed
    new_failures: list[str]        # failed or error, not a fixed known issue


class Header(TypedDict, total=False):
    """What ran, where, with what; besides these, the versions and the host of
    ``harness.core.environment`` (torch, python, cpu, memory, ...)."""
    vllm: dict                # version and distribution
    harness_path: str
    git: dict | None          # commit, dirty
    gpus: dict                # present, used, names
    selection: dict           # layouts, models, dtypes, backends
    seed: int
    options: dict             # every harness option, resolved
    env: dict                 # the environment variables that matter
    argv: list[str]
    args: list[str]
    cwd: str
    executable: str
    command: str              # the command line that reproduces the run
    start_time: str           # ISO 8601, UTC
    wall_seconds: float
    exitstatus: int | None    # None: not finished
    complete: bool            # not cut short nor interrupted


class KnownIssueMatch(TypedDict, total=False):
    """A known-issue entry (its fields) and what it did in the run."""
    id: Required[str]
    status: str                     # known, fixed, not applied: why, ...
    tests_outcomes: dict[str, str]  # nodeid -> known, fixed, beyond, failed, passed, not run


class KnownIssues(TypedDict, total=False):
    source: str                  # the known-issues file
    vllm_version: str | None
    version_source: str
    host: str                    # cpu or gpu
    entries: list[KnownIssueMatch]


class ServerRecord(TypedDict, total=False):
    """A vLLM server the run started (``harness.run.pool``)."""
    config: str
    start_seconds: float
    version: str | None
    log: str | None
    shard: int  # in a merged report: its part, 1-based


class Timing(TypedDict, total=False):
    """Where the run's time went (schema 2+); ``harness.pytest.report`` says what each
    figure is."""
    servers_started: int
    servers_planned: int | None
    start_seconds_sum: float
    start_wall_seconds: float
    start_seconds_by_mode: dict
    restarts: int
    restart_reasons: list
    resets: list
    workers: int | None
    workers_partial: list[str]
    worker_torch_threads: dict
    pool_made_at: float | None
    phase_seconds_sum: dict[str, float]
    host_samples: list[dict]
    host_cpu: Any
    test_seconds_sum: float
    trainer_spares: dict
    trainer_starts: dict
    syncs: int
    sync_seconds: list[float]
    first_sync_seconds: list[float]
    warm_sync_seconds: list[float]


class Shard(TypedDict, total=False):
    """One part of a report joined by ``harness merge``."""
    shard: list | None  # [K, N], or None
    start_time: str | None
    wall_seconds: float | None
    exitstatus: int | None
    complete: bool | None
    command: str | None
    tests: int
    servers: int
    plan: dict | None


class Report(TypedDict, total=False):
    schema: Required[int]
    header: Required[Header]
    shards: list[Shard]      # a merged report's parts
    capabilities: dict       # what the vLLM under test offers
    summary: Summary
    tests: Required[list[ReportedTest]]
    known_issues: KnownIssues | None
    uncovered_capabilities: list[dict] | None
    servers: list[ServerRecord]
    plan: dict | None        # harness.run.plan (schema 3+)
    timing: Timing           # schema 2+


# ----------------------------------------------------------------------------- values

def json_safe(v: Any) -> Any:
    """``v`` as the report holds it: NaN and infinities (not JSON) as strings, keys as
    strings, tuples as lists, anything else that is not JSON as its str."""
    if isinstance(v, float):
        return v if v == v and v not in (float("inf"), float("-inf")) else str(v)
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if v is None or isinstance(v, (str, int, bool)):
        return v
    return str(v)


# ----------------------------------------------------------------------------- reading

def _kind(t: type) -> str:
    return {int: "a number", dict: "an object", list: "a list", str: "a string"}[t]


def check(data: Any, name: str | os.PathLike) -> Report:
    """``data`` (a parsed JSON document) as a ``Report``, or ReportError naming ``name``
    and the first thing wrong: a required key missing or of the wrong kind, a schema
    this harness does not read, a test record without its nodeid or outcome."""
    def bad(why: str) -> ReportError:
        return ReportError(f"cannot read {name}: {why}")

    if not isinstance(data, dict):
        raise bad(f"not a harness report (a JSON {type(data).__name__}, not an object; "
                  f"{WRITE_ONE})")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise bad(f"not a harness report (no {' or '.join(map(repr, missing))}; {WRITE_ONE})")
    for key, kind in REQUIRED.items():
        if not isinstance(data[key], kind) or isinstance(data[key], bool):
            raise bad(f"not a harness report ('{key}' is not {_kind(kind)}: "
                      f"{str(data[key])[:40]!r})")
    schema = data["schema"]
    if not OLDEST_SCHEMA <= schema <= SCHEMA_VERSION:
        newer = " (written by a newer harness)" if schema > SCHEMA_VERSION else ""
        raise bad(f"report schema {schema}{newer}; this harness reads schemas "
                  f"{OLDEST_SCHEMA} to {SCHEMA_VERSION}")
    for i, t in enumerate(data["tests"]):
        if not isinstance(t, dict):
            raise bad(f"test record {i} is not an object")
        for key, kind in TEST_REQUIRED.items():
            if not isinstance(t.get(key), kind):
                raise bad(f"test record {i} has no '{key}'"
                          + (f" ({t['nodeid']})" if isinstance(t.get("nodeid"), str) else ""))
    return data  # type: ignore[return-value]


def load(path: str | os.PathLike) -> Report:
    """The run report at ``path`` (plain or gzip-compressed), checked (``check``);
    ReportError, one line naming the file and what is wrong, otherwise."""
    def bad(why: str) -> ReportError:
        return ReportError(f"cannot read {path}: {why}")

    try:
        text = reportfile.read_text(path)
    except FileNotFoundError:
        raise bad("no such file") from None
    except IsADirectoryError:
        raise bad("is a directory") from None
    except PermissionError:
        raise bad("permission denied") from None
    except UnicodeDecodeError:
        raise bad("not JSON (not UTF-8 text)") from None
    except ValueError as e:  # gzip that does not decompress
        raise bad(str(e)) from None
    except OSError as e:
        raise bad(e.strerror or type(e).__name__) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON (line {e.lineno} column {e.colno})") from None
    return check(data, path)
