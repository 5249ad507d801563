"""The trainer API (factory or static) the installed vLLM offers.

A script holds one of the two APIs, the one of the release it was emitted for: the
factory's stateful trainer engine (0.27.1+ for IPC, 0.28.0+ for NCCL), which calls the
weight-sync routes itself, or the static helpers of 0.26, with the routes called by the
script. The release decides by what its code offers, not by its version number, as in
harness/vllm/api.py (the harness's own view of this)."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from harness.portable.base import Unusable, vllm_version

RELEASES = {"factory": "vLLM 0.27.1+ for IPC, 0.28.0+ for NCCL", "static": "vLLM 0.26"}


def _wt(module: str):
    return importlib.import_module(f"vllm.distributed.weight_transfer.{module}")


def engine_module(engine: str):  # vLLM's, or Unusable naming why it cannot be imported
    try:
        return _wt(f"{engine}_engine")
    except ModuleNotFoundError as e:
        # [region static]
        # [region ipc]
        if e.name == "ray":  # vLLM 0.26's ipc_engine.py runs `import ray` at module level
            raise Unusable(f"vLLM's {engine}_engine.py imports ray at module level, and ray "
                           "is not installed (HTTP transport never uses it): pip install ray, "
                           "or rerun with --stub-ray") from e
        # [end]
        # [end]
        raise Unusable(f"vLLM's {engine} weight-transfer engine cannot be imported: {e}") from e


def factory_for(engine: str):
    """vLLM's WeightTransferTrainerFactory if it takes ``engine`` (0.26's does not), else None."""
    try:
        factory = _wt("factory").WeightTransferTrainerFactory
    except (ImportError, AttributeError):
        return None
    if hasattr(engine_module(engine), f"{engine.upper()}TrainerInitInfo") \
            and engine in (getattr(factory, "_registry", None) or {}) \
            and list(inspect.signature(factory.trainer_init).parameters)[:1] != ["backend"]:
        return factory
    return None
# [region template]


def has_static_sender(engine: str) -> bool:
    """Whether there is a static trainer_send_weights(iterator, args) (0.26; 0.27.1 keeps
    IPC's as a (*args, **kwargs) stub that raises)."""
    cls = getattr(engine_module(engine), f"{engine.upper()}WeightTransferEngine", None)
    params = inspect.signature(cls.trainer_send_weights).parameters.values() \
        if callable(getattr(cls, "trainer_send_weights", None)) else []
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2


def trainer_api(engine: str) -> str:
    """``factory`` or ``static``: the trainer API this release offers for ``engine``."""
    if factory_for(engine) is not None:
        return "factory"
    if has_static_sender(engine):
        return "static"
    raise Unusable(f"vLLM {vllm_version()} has no trainer API for {engine} that this script "
                   f"knows (neither WeightTransferTrainerFactory with "
                   f"{engine.upper()}TrainerInitInfo nor a static trainer_send_weights)")
# [end]


def check_trainer_api(engine: str, api: str) -> None:
    """Before the server starts: one line where this release needs the other trainer API."""
    # [region static]
    engine_module(engine)  # importable (vLLM 0.26's IPC engine imports ray)
    # [end]
    if (factory_for(engine) is not None) != (api == "factory"):
        raise Unusable(f"this script holds vLLM's {api} trainer API for {engine} "
                       f"({RELEASES[api]}), which the vLLM installed here does not offer: "
                       "emit the script again where this vLLM is installed")
# [region factory]


def weight_source(weights: list[tuple[str, Any]]):
    """The exact list to send as a vLLM ``WeightSource``: ``metadata()`` and ``__iter__``
    up to 0.32; from 0.33 ``metadata`` a cached_property and ``iter_full()`` as well."""
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
# [end]
