"""The worker side's reload calls by vLLM release: what the shm engine calls around an
update, in vLLM's worker processes (where importing vLLM is fine). Portable because
``harness repro --emit`` writes it into the engine file it puts next to a script, which
then runs without the harness."""

import contextlib
import importlib
from typing import Any


def reload_lifecycle(reload_module: Any = None) -> tuple[Any, Any]:
    """``(start(model), finish(model, model_config, device))``: what a worker-side engine
    calls around an update. 0.34's ``start_reload`` / ``finish_reload`` where the reload
    package has them (they honour ``VLLM_RELOAD_MODE`` and set ``weight_update_active()``),
    else the layerwise pair of 0.26-0.33 (``finish`` then ignores ``device``)."""
    if reload_module is None:
        reload_module = importlib.import_module("vllm.model_executor.model_loader.reload")
    start = getattr(reload_module, "start_reload", None)
    finish = getattr(reload_module, "finish_reload", None)
    if start is not None and finish is not None:
        return start, finish
    layerwise_finish = reload_module.finalize_layerwise_reload
    return (reload_module.initialize_layerwise_reload,
            lambda model, model_config, device: layerwise_finish(model, model_config))


def mtp_guard():
    """0.27-0.33's ``disable_mtp_completeness_check()`` (a partial update must not trip
    the multi-token-prediction completeness check); a no-op where it is gone (0.34: the
    check reads ``weight_update_active()``, which ``start_reload`` sets)."""
    try:
        mod = importlib.import_module("vllm.model_executor.model_loader.mtp_validation")
        return mod.disable_mtp_completeness_check()
    except (ImportError, AttributeError):
        return contextlib.nullcontext()
