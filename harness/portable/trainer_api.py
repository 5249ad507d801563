"""Which of vLLM's trainer APIs the installed release has for an engine, and the
``WeightSource`` of the shape its release asks for: decided by what vLLM's code
offers, not by its version number.

harness/vllm_api.py is the harness's own view of this."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from harness.portable.base import Unusable, vllm_version


def _wt(module: str):
    return importlib.import_module(f"vllm.distributed.weight_transfer.{module}")


def engine_module(engine: str):
    """vLLM's engine module for ``engine``, or Unusable naming why it cannot be imported
    (vLLM 0.26's ipc_engine.py runs ``import ray`` at module level)."""
    try:
        return _wt(f"{engine}_engine")
    except ModuleNotFoundError as e:
        # [region ipc]
        if e.name == "ray":
            raise Unusable(f"vLLM {vllm_version()}'s {engine}_engine.py imports ray at module "
                           "level, and ray is not installed (HTTP transport never uses it): "
                           "pip install ray, or rerun with --stub-ray") from e
        # [end]
        raise Unusable(f"vLLM's {engine} weight-transfer engine cannot be imported: {e}") from e


def trainer_api(engine: str) -> str:
    """``factory`` (0.27.1+: the factory's stateful trainer engine calls the routes
    itself) or ``static`` (0.26: static helpers; this script calls the routes)."""
    mod = engine_module(engine)
    try:
        factory = _wt("factory").WeightTransferTrainerFactory
    except (ImportError, AttributeError):
        factory = None
    if hasattr(mod, f"{engine.upper()}TrainerInitInfo") \
            and engine in (getattr(factory, "_registry", None) or {}):
        params = list(inspect.signature(factory.trainer_init).parameters)
        if not params or params[0] != "backend":  # 0.26's (backend, config, init_info)
            return "factory"
    send = getattr(getattr(mod, f"{engine.upper()}WeightTransferEngine", None),
                   "trainer_send_weights", None)
    try:
        positional = [p for p in inspect.signature(send).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    if len(positional) >= 2:  # 0.27.1 keeps IPC's as a (*args, **kwargs) stub that raises
        return "static"
    raise Unusable(f"vLLM {vllm_version()} has no trainer API for {engine} that this script "
                   "knows (neither WeightTransferTrainerFactory with "
                   f"{engine.upper()}TrainerInitInfo nor a static trainer_send_weights)")


def weight_source(weights: list[tuple[str, Any]]):
    """The exact list to send (possibly damaged) as a vLLM ``WeightSource`` of the shape
    this release asks for: ``metadata()`` and ``__iter__`` up to 0.32; from 0.33
    ``metadata`` a ``functools.cached_property`` and ``iter_full()`` as well."""
    base = _wt("base")

    def meta(self):
        return [base.ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in weights]

    def fresh(self):
        return iter(list(weights))

    body: dict[str, Any] = {"__iter__": fresh, "metadata": meta}
    declared = inspect.getattr_static(base.WeightSource, "metadata", None)
    if isinstance(declared, (property, functools.cached_property)) \
            or callable(getattr(base.WeightSource, "iter_full", None)):
        body.update(metadata=functools.cached_property(meta), iter_full=fresh)
    return type("ListWeightSource", (base.WeightSource,), body)()

