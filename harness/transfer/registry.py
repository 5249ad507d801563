"""Which weight-transfer backends this run knows, by engine name.

vLLM's own engines (``nccl``, ``ipc``) are built in. Every other backend comes from
the entry point group ``weight_sync_harness.backends``: each entry names a
``harness.transfer.Backend`` object (``name = "package.module:BACKEND"``). The
harness's own ``shm`` is registered there by this package's pyproject.toml, as a
backend of yours would be by yours (docs/backends.md). Its worker side reaches vLLM
through vLLM's own plugin mechanism (the ``vllm.general_plugins`` entry point),
which this registry does not touch.

The entry points are read once per process, on first use, so that importing the
harness loads no third-party code. A backend that fails to load, or whose engine
name is already taken, stops the run with one line naming the entry point.
"""

from __future__ import annotations

import functools
import importlib.metadata

from harness.transfer.backend import Backend

GROUP = "weight_sync_harness.backends"
# The commands' default: the reference engine, which runs wherever vLLM runs.
DEFAULT_ENGINE = "shm"
BUILT_IN = ("harness.transfer.nccl", "harness.transfer.ipc")  # vLLM's own engines


class BackendRegistryError(RuntimeError):
    pass


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=GROUP), key=lambda ep: ep.name)


@functools.cache
def backends() -> dict[str, Backend]:
    """Every registered backend by engine name: the built-in ones first, then the
    entry points' in name order."""
    found: dict[str, tuple[Backend, str]] = {}
    candidates = [(importlib.import_module(m).BACKEND, m) for m in BUILT_IN]
    for ep in _entry_points():
        where = f"entry point {ep.name} = {ep.value!r} ({GROUP})"
        try:
            candidates.append((ep.load(), where))
        except Exception as e:
            raise BackendRegistryError(f"{where} does not load: {type(e).__name__}: {e}") from e
    for obj, where in candidates:
        if not isinstance(obj, Backend):
            raise BackendRegistryError(f"{where} is a {type(obj).__name__}, not a "
                                       "harness.transfer.Backend")
        if obj.engine in found:
            if found[obj.engine][0] == obj:
                continue  # the same object, reached twice (an installed copy and a checkout)
            raise BackendRegistryError(f"{where}: engine {obj.engine!r} is already registered "
                                       f"by {found[obj.engine][1]}")
        clash = {v.id for v in obj.variants} & {v.id for b, _ in found.values()
                                                for v in b.variants}
        if clash or any(v.engine != obj.engine for v in obj.variants):
            raise BackendRegistryError(f"{where}: variant ids must be new and name engine "
                                       f"{obj.engine!r} (taken: {', '.join(sorted(clash))})")
        found[obj.engine] = (obj, where)
    # the commands' default first (it runs anywhere), then as found
    order = sorted(found, key=lambda name: name != DEFAULT_ENGINE)
    return {name: found[name][0] for name in order}


def backend(engine: str) -> Backend:
    """The backend of ``engine``; ValueError naming the registered ones."""
    known = backends()
    if engine not in known:
        raise ValueError(f"unknown weight-transfer engine {engine!r}; registered: "
                         f"{', '.join(known)} (a backend of your own registers through the "
                         f"entry point group {GROUP})")
    return known[engine]


def vllm_engines() -> dict:
    """The engines vLLM itself implements, as ``harness.vllm.api`` probes them."""
    return {name: b.vllm_api for name, b in backends().items() if b.vllm_api is not None}


def trainer_code_path(engine: str, caps: dict) -> tuple[str | None, str]:
    """``harness.vllm.api.trainer_code_path`` for ``engine``'s backend."""
    from harness.vllm import api as vllm_api

    b = backend(engine)
    init_info = b.vllm_api.init_info if b.vllm_api is not None else b.trainer_init_info
    return vllm_api.trainer_code_path(engine, b.vllm_api, caps, init_info)


def probe(isolated: bool = False) -> dict:
    """``harness.vllm.api.probe`` for every engine vLLM implements."""
    from harness.vllm import api as vllm_api

    return vllm_api.probe(vllm_engines(), isolated=isolated)
