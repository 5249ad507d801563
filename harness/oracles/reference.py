"""Hugging Face reference: what the trainer's weights should make vLLM produce.

For each prompt: the greedy continuation (full forward per step, no KV cache, so
it is exactly the argmax of the teacher-forced distribution) and teacher-forced
per-token logprobs of that whole sequence, the actual token and the top-k.
Runs on CPU in the test process (it never touches a GPU), cached per
(weights, dtype, prompts, length) in memory and on disk.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from harness.core.facts import canonical_dtype
from harness.models import cache_root

DEFAULT_PROMPTS = (
    "The capital of France is",
    "Once upon a time there was",
    "The quick brown fox",
    "One, two, three, four,",
)
REFERENCE_VERSION = 2


@dataclasses.dataclass
class PromptReference:
    prompt: str
    prompt_ids: list[int]
    greedy_ids: list[int]                  # the continuation only
    token_logprobs: list[float | None]     # per position of prompt_ids + greedy_ids; [0] is None
    top_logprobs: list[dict[int, float] | None]
    greedy_text: str

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.greedy_ids


@dataclasses.dataclass
class Reference:
    model_dir: str
    dtype: str
    prompts: list[PromptReference]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Reference":
        prompts = []
        for p in d["prompts"]:
            p = dict(p)
            p["top_logprobs"] = [None if t is None else {int(k): v for k, v in t.items()}
                                 for t in p["top_logprobs"]]
            prompts.append(PromptReference(**p))
        return cls(d["model_dir"], d["dtype"], prompts)


_MEMO: dict[str, Reference] = {}


def _weights_fingerprint(model_dir: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def torch_dtype(name: str):
    """``fp32`` / ``float32`` -> ``torch.float32`` (the names of harness.core.facts)."""
    import torch

    return getattr(torch, canonical_dtype(name))


def load_hf_model(model_dir: Path | str, dtype: str, device: str = "cpu",
                  adapter: Path | str | None = None):
    """The model of ``model_dir``; with ``adapter`` (a PEFT LoRA directory) wrapped in
    peft's ``PeftModel``, unmerged, as a trainer holds it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype(dtype))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter), torch_dtype=torch_dtype(dtype))
    return model.to(device).eval()


def hf_reference(model_dir: Path | str, dtype: str = "float32", *,
                 prompts: tuple[str, ...] = DEFAULT_PROMPTS, max_tokens: int = 12,
                 top_k: int = 5, use_cache: bool = True,
                 adapter: Path | str | None = None) -> Reference:
    import torch
    from transformers import AutoTokenizer

    model_dir = Path(model_dir)
    parts = [REFERENCE_VERSION, str(model_dir.resolve()), _weights_fingerprint(model_dir), dtype,
             list(prompts), max_tokens, top_k, torch.__version__]
    if adapter is not None:  # the adapter's weights are part of what is computed
        adapter = Path(adapter)
        parts += [str(adapter.resolve()), _weights_fingerprint(adapter)]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]
    if key in _MEMO:
        return _MEMO[key]
    disk = cache_root() / "references" / f"{key}.json"
    if use_cache and disk.exists():
        ref = Reference.from_json(json.loads(disk.read_text()))
        _MEMO[key] = ref
        return ref

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_hf_model(model_dir, dtype, adapter=adapter)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            seq = list(ids)
            for _ in range(max_tokens):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(torch.argmax(logits.float())))
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
            token_lp: list[float | None] = [None]
            top: list[dict[int, float] | None] = [None]
            for i in range(1, len(seq)):
                row = logp[i - 1]
                token_lp.append(float(row[seq[i]]))
                v, ix = torch.topk(row, top_k)
                top.append({int(a): float(b) for a, b in zip(ix, v)})
            gen = seq[len(ids):]
            out.append(PromptReference(prompt, list(ids), gen, token_lp, top,
                                       tok.decode(gen, skip_special_tokens=False)))
    ref = Reference(str(model_dir), dtype, out)
    _MEMO[key] = ref
    if use_cache:
        disk.parent.mkdir(parents=True, exist_ok=True)
        tmp = disk.with_suffix(".tmp")
        tmp.write_text(json.dumps(ref.to_json()))
        tmp.rename(disk)
    return ref
