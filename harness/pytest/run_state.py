"""What the plugin keeps for one pytest session: ``RunState``, under ``STATE`` in the
config's stash, and each test's ``SyncSession`` under ``SESSION`` in its item's stash."""

from __future__ import annotations

import collections
import dataclasses
import time

import pytest

from harness.core import measure
from harness.run import parallel
from harness.run import plan as _plan
from harness.run import settings as _settings
from harness.run.flow import FlowResult, SyncSession
from harness.run.pool import ServerPool
from harness.vllm.server import ServerConfig


@dataclasses.dataclass
class RunState:
    """What the plugin keeps for one pytest session."""

    settings: _settings.Settings
    t0: float = dataclasses.field(default_factory=time.monotonic)
    cpu0: dict | None = dataclasses.field(default_factory=measure.cpu_times)  # the host's
    pool: ServerPool | None = None
    deselected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dropped: list = dataclasses.field(default_factory=list)  # (reason, item) the harness deselected
    shortfall: str | None = None  # a selection of GPU cases none of which could run
    case_count: int = 0           # the cases the selection kept (every worker's)
    items: list = dataclasses.field(default_factory=list)   # items that take a case
    outcomes: dict[str, FlowResult | BaseException] = dataclasses.field(default_factory=dict)
    plan: _plan.Plan | None = None
    schedule: _plan.Schedule | None = None
    last_use: dict[str, list[ServerConfig]] = dataclasses.field(default_factory=dict)
    gpu_cases: dict[str, str] = dataclasses.field(default_factory=dict)  # nodeid -> outcome
    verdicts: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # coverage
    stop_error: str | None = None
    # side by side (harness.run.parallel): this worker's tests, and on the controller what
    # each worker sent back when it ended
    worker_tests: set[str] | None = None
    partition: parallel.Partition | None = None
    worker_outputs: dict[str, dict] = dataclasses.field(default_factory=dict)
    gathered: bool = False              # the controller read the records left in the run's folder
    record_mark: tuple = ()             # a worker: its pool as its last record saw it


STATE = pytest.StashKey[RunState]()
SESSION = pytest.StashKey[SyncSession]()


def settings_of(config: pytest.Config) -> _settings.Settings:
    return config.stash[STATE].settings
