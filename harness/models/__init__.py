"""Models by name: the zoo (``zoo``: tiny deterministic models and SmolLM2, built offline,
and the copies a run needs), sized weightless models for ``harness bench`` (``sized``), a
local directory or a hub id; ``classify_model`` says which a name is.

Every model is a Hugging Face directory (config, safetensors, tokenizer) that vLLM can
serve with ``--load-format dummy`` and that the trainer and the reference load for real.
Directories are built once and cached on disk under a key that covers the recipe and the
library versions, so a change to either rebuilds. A user with hub access passes any model
id or local path instead; ``resolve_model`` accepts both.
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.models.sized import SIZED_DTYPE, sized_model_dir
from harness.models.zoo import (CACHE_ENV, RECIPE_VERSION, TINY_MODELS, TOKENIZER_RECIPE,
                                VOCAB_SIZE, ZOO, ModelUnavailable, ZooModel, as_sent_path,
                                build_into, cache_root, dummy_copy, ensure_built, hub_unavailable,
                                model_dir, perturbed_copy, unavailable, zoo_dir)

# The zoo's names, read as ``models.X`` by the rest of the harness, and the classifier's.
__all__ = ["CACHE_ENV", "RECIPE_VERSION", "TINY_MODELS", "TOKENIZER_RECIPE", "VOCAB_SIZE", "ZOO",
           "ModelUnavailable", "ZooModel", "as_sent_path", "build_into", "cache_root",
           "dummy_copy", "ensure_built", "hub_unavailable", "model_dir", "perturbed_copy",
           "unavailable", "zoo_dir", "SIZED_NAME", "sized_bytes", "classify_model",
           "planned_path", "resolve_model"]


SIZED_NAME = re.compile(r"sized-(\d+)(mb|gb)")


def sized_bytes(name: str) -> int | None:
    """``sized-256mb`` -> 256e6 bytes (``sized-2gb`` -> 2e9): a weightless Llama of that
    size (``sized_model_dir``), for the checks whose signal grows with the bytes of a
    sync (memory) rather than with its values; None for any other name."""
    m = SIZED_NAME.fullmatch(name)
    if m is None or int(m.group(1)) == 0:
        return None
    return int(m.group(1)) * (10**6 if m.group(2) == "mb" else 10**9)


def classify_model(name_or_path: str) -> tuple[str, str]:
    """What a user's model argument names, without building anything: ``("zoo", name)``,
    ``("sized", name)``, ``("path", absolute directory)`` or ``("hub", id)``. Raises
    ValueError otherwise."""
    if name_or_path in ZOO:
        return "zoo", name_or_path
    if sized_bytes(name_or_path):
        return "sized", name_or_path
    p = Path(name_or_path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise ValueError(f"{p} exists but has no config.json: not a Hugging Face model dir")
        return "path", str(p.resolve())
    if "/" in name_or_path and not name_or_path.startswith(("/", ".")):
        return "hub", name_or_path  # vLLM and transformers resolve it
    raise ValueError(
        f"model {name_or_path!r} is neither a zoo model ({', '.join(ZOO)}), an existing "
        "directory, nor a hub id of the form org/name"
    )


def planned_path(name_or_path: str) -> str:
    """The directory (or hub id) a model argument will be served from, without building
    a zoo model: what a server plan is made of before anything is built."""
    kind, value = classify_model(name_or_path)
    if kind == "sized":  # a config and a tokenizer: built now, in about a second
        return str(sized_model_dir(sized_bytes(value), SIZED_DTYPE))
    return str(zoo_dir(value)) if kind == "zoo" else value


def resolve_model(name_or_path: str) -> tuple[str, Path | None]:
    """Map a user's model argument to (id for logs, local directory or None for a hub id)."""
    kind, value = classify_model(name_or_path)
    if kind == "zoo":
        return value, model_dir(value)
    if kind == "sized":
        return value, sized_model_dir(sized_bytes(value), SIZED_DTYPE)
    if kind == "path":
        return Path(value).name, Path(value)
    return value, None
