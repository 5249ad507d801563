"""LoRA adapters as an RL trainer produces them: a PEFT directory the server loads by path.

The trainer's side of ``--enable-lora`` rollouts: after a training step it saves the
adapter (``adapter_config.json`` + ``adapter_model.safetensors``, peft's format) and
tells the server to serve it under a name (``POST /v1/load_lora_adapter``); rollouts
then ask for that name as their model. The weights here are drawn, not trained: peft's
LoRA starts with B = 0 (an adapter that changes nothing), so B is drawn nonzero, at a
scale that moves logprobs by whole nats, and each seed gives another adapter.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from harness.models import cache_root

TARGET_MODULES = ("q_proj", "v_proj")
RANK = 8
ALPHA = 16
ADAPTER_VERSION = 1  # bump when what write_adapter writes changes
B_STD = 0.15         # with A's std 0.15 and alpha/r = 2: a visible change of the outputs


def write_adapter(base_dir: str | Path, seed: int, *, dest_root: Path | None = None,
                  target_modules: tuple[str, ...] = TARGET_MODULES, rank: int = RANK) -> Path:
    """A PEFT LoRA adapter for the model of ``base_dir`` (its ``target_modules``), A and
    B drawn from ``seed``; cached by (base, seed, shape of the adapter)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = Path(base_dir)
    key = hashlib.sha256(json.dumps([str(base_dir.resolve()), seed, list(target_modules), rank,
                                     ADAPTER_VERSION]).encode()).hexdigest()[:12]
    root = dest_root or (cache_root() / "adapters")
    out = root / f"{base_dir.name}-lora{seed}-{key}"
    if (out / "adapter_model.safetensors").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".lora-", dir=root))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        cfg = LoraConfig(r=rank, lora_alpha=ALPHA, target_modules=list(target_modules),
                         lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(peft_model.named_parameters()):
                if "lora_A" in name or "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * B_STD)
        peft_model.save_pretrained(str(tmp))
        try:
            tmp.rename(out)
        except OSError:  # another process won the race; its copy is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def adapter_tensors(adapter_dir: str | Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))


# ----------------------------------------------------------------------------- the routes

LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"


def post(client, route: str, body: dict, timeout: float = 120.0) -> tuple[int, str]:
    """(status, body text) of one adapter route: the caller decides what an answer means
    (vLLM refuses a name it holds with a 400)."""
    r = client.raw("POST", route, json=body, timeout=timeout)
    return r.status_code, r.text[:2000]


def load(client, name: str, path: str | Path, *, load_inplace: bool | None = None,
         timeout: float = 120.0) -> tuple[int, str]:
    body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
    if load_inplace is not None:
        body["load_inplace"] = load_inplace
    return post(client, LOAD_ROUTE, body, timeout)


def unload(client, name: str, timeout: float = 120.0) -> tuple[int, str]:
    return post(client, UNLOAD_ROUTE, {"lora_name": name}, timeout)


def load_fields(client) -> set[str]:
    """The fields /v1/load_lora_adapter takes, from the server's /openapi.json
    (``load_inplace`` on vLLM 0.32; absent on releases that refuse a held name only)."""
    spec = client.openapi()
    schema = spec.get("components", {}).get("schemas", {}).get("LoadLoRAAdapterRequest", {})
    return set(schema.get("properties", {}))


def adapter_client(client, name: str):
    """A client whose completions name the adapter as their model."""
    from harness.vllm.client import ServerClient

    return ServerClient(client.url, timeout=client.timeout, model=name,
                        context=client.context, confirm_timeout=client.confirm_timeout,
                        api_key=client.api_key)
