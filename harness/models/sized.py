"""Models of a given size for ``harness bench``, from about 0.1 GB to several GB.

Nothing needs their values: the server runs with --load-format dummy and the trainer
draws random weights on its own device (``random_weights``), so such a model is a
directory with a config and a tokenizer and no weights on disk."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from harness.models.zoo import (_LLAMA, RECIPE_VERSION, TOKENIZER_RECIPE, VOCAB_SIZE, build_into,
                                cache_root)

SIZED_ARCHITECTURE = "LlamaForCausalLM"
_SIZED_HIDDEN = (4096, 3072, 2048, 1536, 1024, 768, 512, 256)
_SIZED_VOCAB_MAX = 131072  # Llama 3's is 128256
WEIGHTLESS_MARKER = "random"  # harness-model.json "weights": the trainer draws them
# A sized model named on the command line or in a marker (``sized-256mb``) is shaped for
# this many bytes of float32; in bfloat16 the same model is half as many bytes.
SIZED_DTYPE = "float32"


def _round_to(x: float, step: int) -> int:
    return max(step, int(round(x / step)) * step)


def _sized_layer_params(hidden: int) -> tuple[int, dict[str, int]]:
    """Parameters of one Llama decoder layer of width ``hidden`` and the shape knobs
    that give them: head_dim 64 (128 from 1024 up), a quarter as many key/value heads
    (at least 2: see _LLAMA), an MLP of 8/3 the width (Llama's ratio), two norms."""
    head_dim = 128 if hidden >= 1024 else 64
    heads = hidden // head_dim
    kv_heads = max(2, heads // 4)
    inter = _round_to(hidden * 8 / 3, 256)
    params = (2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
              + 3 * hidden * inter + 2 * hidden)
    return params, dict(hidden_size=hidden, intermediate_size=inter, head_dim=head_dim,
                        num_attention_heads=heads, num_key_value_heads=kv_heads)


def sized_config(target_bytes: int, dtype: str) -> dict[str, Any]:
    """A Llama config whose weights take about ``target_bytes`` in ``dtype``.

    The widest layer (of ``_SIZED_HIDDEN``) that still gives at least eight layers; the
    layers take about four fifths of the bytes and the embeddings (input and output,
    untied) the rest, the vocabulary sized to land on the target. Real models have
    about this many tensors per byte, which matters to the per-tensor (unpacked) paths."""
    from harness.core.facts import canonical_dtype

    per = {"float32": 4, "bfloat16": 2}[canonical_dtype(dtype)]
    want = max(1, int(target_bytes) // per)
    for hidden in _SIZED_HIDDEN:
        layer, shape = _sized_layer_params(hidden)
        if 8 * layer <= want:
            break
    layers = max(1, int(want * 0.8 // layer))
    vocab = _round_to((want - layers * layer - hidden) / (2 * hidden), 256)
    vocab = min(max(vocab, VOCAB_SIZE), _SIZED_VOCAB_MAX)  # every token of the tokenizer a row
    return dict(_LLAMA, **shape, vocab_size=vocab, num_hidden_layers=layers,
                max_position_embeddings=512, tie_word_embeddings=False,
                dtype=canonical_dtype(dtype))


def config_params(config: dict[str, Any]) -> int:
    """Parameters of a ``sized_config``."""
    layer, _ = _sized_layer_params(config["hidden_size"])
    return (config["num_hidden_layers"] * layer + 2 * config["vocab_size"] * config["hidden_size"]
            + config["hidden_size"])


def sized_model_dir(target_bytes: int, dtype: str) -> Path:
    """A weightless model directory (config, tokenizer, no weights) of about
    ``target_bytes`` of ``dtype`` weights; built once and cached."""
    config = sized_config(target_bytes, dtype)
    key = hashlib.sha256(json.dumps({"recipe": RECIPE_VERSION, "config": config,
                                     "tokenizer": TOKENIZER_RECIPE},
                                    sort_keys=True).encode()).hexdigest()[:12]
    gb = f"{target_bytes / 1e9:g}gb".replace(".", "p")
    final = cache_root() / "sized" / f"llama-{gb}-{config['dtype']}-{key}"
    if (final / "harness-model.json").exists():
        return final

    def build(tmp: Path) -> None:
        import transformers

        from harness.portable.recipes import build_tokenizer  # the zoo's tokenizer, from its recipe

        build_tokenizer(dict(TOKENIZER_RECIPE), tmp)
        cfg = transformers.LlamaConfig(**config)
        cfg.architectures = [SIZED_ARCHITECTURE]
        cfg.save_pretrained(tmp)
        meta = {"sized": True, "weights": WEIGHTLESS_MARKER, "target_bytes": int(target_bytes),
                "params": config_params(config), "key": key}
        (tmp / "harness-model.json").write_text(json.dumps(meta, indent=1))

    return build_into(final, build)


def is_weightless(model_dir: str | Path) -> bool:
    """A directory whose weights the trainer draws at random (``sized_model_dir``)."""
    try:
        meta = json.loads((Path(model_dir) / "harness-model.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("weights") == WEIGHTLESS_MARKER


def random_weights(model_dir: str | Path, dtype: str, device: str, seed: int = 0
                   ) -> list[tuple[str, Any]]:
    """The checkpoint's tensors (names, shapes, ``dtype``) drawn at random directly on
    ``device``: a meta-device model gives the names and shapes, so nothing of the size
    of the model is built on the host."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.core.facts import canonical_dtype

    tdtype = getattr(torch, canonical_dtype(dtype))
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=tdtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for name, p in model.named_parameters():
        t = torch.empty(p.shape, dtype=tdtype, device=device)
        if p.ndim >= 2:
            t.normal_(0.0, 0.02, generator=gen)
        else:
            t.fill_(1.0 if "norm" in name else 0.0)
        out.append((name, t))
    return out
