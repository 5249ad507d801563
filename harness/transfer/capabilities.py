"""What the installed vLLM offers the trainers, probed: the trainer API
(``harness.vllm.api.probe``) and which registered weight-transfer engines load.

Importing vLLM takes tens of seconds on 2 cores, so the report runs these probes
through ``harness.vllm.probe_cache`` in a process of its own (``child_main``), which
outlives a short run and keeps a complete answer for the next one: on a loaded 2-core
host importing vLLM took over the probes' 120 s, so without the cache no answer was ever
complete, and every run paid the wait."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import sys
from concurrent.futures import ThreadPoolExecutor

from harness.transfer import registry
from harness.vllm import api as vllm_api


def backend_capabilities(probe_vllm: bool = True, why: str = "probes disabled"
                         ) -> tuple[dict, dict]:
    """(trainer_api, backends): what the installed vLLM's trainer API offers and which
    registered engines load. ``probe_vllm=False`` says only what needs no vLLM import
    (``why``)."""
    backends: dict[str, dict] = {}
    own = {name: b for name, b in registry.backends().items() if b.vllm_api is not None}
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    for name, b in registry.backends().items():
        if b.vllm_api is not None:
            continue
        # an engine of a plugin: registered with vLLM through its vllm.general_plugins entry point
        eps = [ep for ep in plugins if b.vllm_plugin and ep.module == b.vllm_plugin]
        backends[name] = {"loadable": bool(eps),
                          "reason": (f"vllm.general_plugins entry point {eps[0].name} = "
                                     f"{eps[0].value}") if eps else
                          f"no vllm.general_plugins entry point for {b.vllm_plugin}: the "
                          "package that holds it is not installed"}
    if not probe_vllm:
        return {"error": why}, {**backends, **{e: {"loadable": None, "reason": why}
                                               for e in own}}

    def _probe():
        return vllm_api.probe(registry.vllm_engines(), isolated=True)

    def _importable(engine):
        return vllm_api.backend_importable(own[engine].vllm_api.module)

    with ThreadPoolExecutor(max_workers=1 + len(own)) as pool:
        probe_f = pool.submit(_probe)
        eng_f = {e: pool.submit(_importable, e) for e in own}
        try:
            trainer_api = probe_f.result()
        except Exception as e:
            trainer_api = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        for engine, f in eng_f.items():
            try:
                ok, reason = f.result()
                backends[engine] = {"loadable": bool(ok), "reason": reason}
            except Exception as e:
                backends[engine] = {"loadable": None, "reason": f"{type(e).__name__}: {e}"}
    return trainer_api, backends


def child_main() -> None:
    """The probe process: probe with the child's longer bounds, keep the answer for the
    next run, and hand this one to the caller in the file ``sys.argv[1]``."""
    from harness.vllm import probe_cache

    vllm_api.PROBE_TIMEOUT_S = probe_cache.CHILD_TIMEOUT_S
    vllm_api.backend_importable = functools.partial(vllm_api.backend_importable,
                                                    timeout=probe_cache.CHILD_TIMEOUT_S)
    value = backend_capabilities(True)
    probe_cache.store(value)
    with open(sys.argv[1], "w") as f:
        f.write(json.dumps(value))
