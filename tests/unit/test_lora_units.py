"""The lora feature and adapters without a server: the flags and environment a lora case's
server gets, the adapter the trainer writes (peft's format, nonzero B, deterministic) and
the Hugging Face reference with it applied."""

from __future__ import annotations

import pytest

from harness import models
from harness.run.cases import build_cases, server_config_for
from harness.vllm.server import build_command, build_env


def test_lora_case_server_flags_and_env():
    [case] = build_cases(["shm"], ["cpu"], ["float32"], ["llama"], features=["lora"])
    assert case.id == "shm-cpu-fp32-llama-lora" and case.unsupported() is None
    cfg = server_config_for(case, "/m")
    argv = build_command(cfg, 1)
    i = argv.index("--enable-lora")
    assert argv[i + 1:i + 5] == ["--max-loras", "2", "--max-lora-rank", "16"]
    assert build_env(cfg)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert " lora" in cfg.describe()
    plain = server_config_for(build_cases(["shm"], ["cpu"], ["float32"], ["llama"])[0], "/m")
    assert "--enable-lora" not in build_command(plain, 1)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in build_env(plain)


def test_adapter_is_peft_nonzero_deterministic_and_changes_the_reference(tmp_path):
    pytest.importorskip("peft")
    from harness.oracles.reference import hf_reference
    from harness.trainer import lora

    base = models.model_dir("llama")
    a = lora.write_adapter(base, 7, dest_root=tmp_path / "x")
    again = lora.write_adapter(base, 7, dest_root=tmp_path / "y")
    other = lora.write_adapter(base, 8, dest_root=tmp_path / "x")
    ta, tb, tc = (lora.adapter_tensors(d) for d in (a, again, other))
    assert (a / "adapter_config.json").exists() and sorted(ta) == sorted(tc)
    assert any("q_proj" in n for n in ta) and any("v_proj" in n for n in ta)
    assert all(("lora_A" in n or "lora_B" in n) for n in ta), sorted(ta)
    assert all(t.abs().sum() > 0 for n, t in ta.items() if "lora_B" in n), "B must be nonzero"
    assert all((ta[n] == tb[n]).all() for n in ta), "same seed, same adapter"
    assert any((ta[n] != tc[n]).any() for n in ta), "another seed, another adapter"
    prompts = ("The capital of France is",)
    plain = hf_reference(base, prompts=prompts, max_tokens=4, use_cache=False)
    with_a = hf_reference(base, prompts=prompts, max_tokens=4, use_cache=False, adapter=a)
    assert plain.prompts[0].token_logprobs[1:] != with_a.prompts[0].token_logprobs[1:]
