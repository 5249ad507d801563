"""Issue 58's rows without a server: which release offers each feature (read from vLLM's
source), the servers the features ask for, the trainer that leaves the frozen part out,
the draft switch, and the worker extension that zeroes fp8 KV scales."""

from __future__ import annotations

import json

import pytest

from harness.core import facts
from harness.run import cases
from harness.run.cases import build_cases, missing_flag, server_config_for
from harness.trainer.child import _SwitchableClient, leave_out
from harness.vllm.server import build_command


def test_the_installed_vllm_flags_are_read_from_its_source():
    version, _ = facts.installed_vllm()
    offered = facts.server_flag_offered("--kv-cache-dtype")
    if offered is None:
        pytest.skip("no readable vLLM source here")
    assert offered is True, f"vLLM {version}: --kv-cache-dtype not found in engine/arg_utils.py"
    assert facts.server_flag_offered("--no-such-flag-anywhere") is False
    assert facts.server_flag_offered("--kv-cache") is False, "a prefix is not the flag"


def test_a_missing_flag_skips_with_the_feature_the_flag_and_the_first_release():
    line = missing_flag(["sleep", "cgpool"], offered=lambda flag: False)
    assert line.startswith("cgpool: vLLM ") and "--sleep-mode-offload-cudagraph" in line
    assert line.endswith("first in vLLM 0.32.0") and "\n" not in line
    assert "0.31.0" in missing_flag(["preserve"], offered=lambda flag: False)
    assert missing_flag(["sleep", "cgpool"], offered=lambda flag: True) is None
    assert missing_flag(["cgpool"], offered=lambda flag: None) is None, "unknown: let it start"
    assert missing_flag(["sleep", "lora"], offered=lambda flag: False) is None, "no flag needed"


def test_a_gpu_case_skips_where_its_release_lacks_the_flag(monkeypatch):
    [case] = build_cases(["ipc-packed"], ["1gpu-colocated"], ["bfloat16"], ["llama"],
                         modes=["graphs"], features=["sleep", "cgpool"])
    assert case.id == "ipc-packed-1gpu-colocated-bf16-llama-graphs-sleep-cgpool"
    monkeypatch.setattr(facts, "server_flag_offered", lambda flag: True)
    assert case.unsupported() is None
    monkeypatch.setattr(facts, "server_flag_offered",
                        lambda flag: flag != "--sleep-mode-offload-cudagraph")
    assert "first in vLLM 0.32.0" in case.unsupported()
    [cpu] = build_cases(["shm"], ["cpu"], ["bfloat16"], ["llama"], features=["sleep", "cgpool"])
    assert cpu.unsupported().startswith("sleep on a CPU server"), "CPU: the platform's reason"


def test_features_add_to_each_other_s_server_arguments():
    [case] = build_cases(["ipc-packed"], ["1gpu-colocated"], ["bfloat16"], ["llama"],
                         modes=["graphs"], features=["sleep", "cgpool", "preserve"])
    cfg = server_config_for(case, "/m")
    assert cfg.enable_sleep_mode and not cfg.enforce_eager
    argv = build_command(cfg, 1)
    assert "--sleep-mode-offload-cudagraph" in argv and "--enable-sleep-mode" in argv
    i = argv.index("--sleep-preserve-parameter-names")
    assert tuple(argv[i + 1:i + 1 + len(cases.PRESERVED_PARAMETERS)]) == \
        cases.PRESERVED_PARAMETERS
    [kv] = build_cases(["ipc-packed"], ["1gpu-colocated"], ["bfloat16"], ["llama"],
                       features=["sleep", "kvfp8", "2api"])
    kcfg = server_config_for(kv, "/m")
    kargv = build_command(kcfg, 1)
    assert kargv[kargv.index("--kv-cache-dtype") + 1] == "fp8"
    assert kargv[kargv.index("--worker-extension-cls") + 1] == cases.KV_SCALES_EXTENSION
    assert dict(kcfg.extra_env)["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "600"


def test_the_draft_server_is_its_own_draft_model():
    [case] = build_cases(["shm"], ["cpu"], ["float32"], ["llama"], features=["draft"])
    assert case.id == "shm-cpu-fp32-llama-draft" and case.unsupported() is None
    argv = build_command(server_config_for(case, "/models/llama"), 1)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "draft_model" and spec["model"] == "/models/llama"
    assert spec["num_speculative_tokens"] >= 1
    plain = build_command(server_config_for(build_cases(["shm"], ["cpu"], ["float32"],
                                                        ["llama"])[0], "/m"), 1)
    assert "--speculative-config" not in plain


def test_leave_out_drops_the_frozen_names_and_refuses_a_glob_that_misses():
    named = [(n, None) for n in ("model.embed_tokens.weight", "lm_head.weight",
                                 "model.layers.0.input_layernorm.weight",
                                 "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")]
    kept, what = leave_out(named, cases.PRESERVED_PARAMETERS)
    assert [n for n, _ in kept] == ["model.layers.0.self_attn.q_proj.weight"]
    assert what.startswith("left out 4 tensor(s)")
    with pytest.raises(ValueError, match="matches no tensor"):
        leave_out(named, ["*.no_such.weight"])


class _Routes:
    def __init__(self):
        self.called = []

    def start_weight_update(self):
        self.called.append("/start_weight_update")

    def start_draft_weight_update(self):
        self.called.append("/start_draft_weight_update")


def test_the_draft_option_opens_each_update_on_the_draft_route():
    target, draft = _Routes(), _Routes()
    _SwitchableClient(target).start_weight_update()
    _SwitchableClient(draft, draft=True).start_weight_update()
    assert target.called == ["/start_weight_update"]
    assert draft.called == ["/start_draft_weight_update"]


def test_the_kv_scale_extension_reads_zeroes_and_restores_every_layer():
    torch = pytest.importorskip("torch")
    from harness.testing.kv_scales import KVScaleFaults

    class Attention(torch.nn.Module):
        def __init__(self, k, v):
            super().__init__()
            self.register_buffer("_k_scale", torch.tensor(k))
            self.register_buffer("_v_scale", torch.tensor(v))
            self._k_scale_float, self._v_scale_float = k, v

    class Worker(KVScaleFaults):
        def __init__(self):
            self.model = torch.nn.ModuleDict({"a": Attention(1.0, 1.0),
                                              "b": Attention(0.5, 2.0),
                                              "mlp": torch.nn.Linear(2, 2)})

        def get_model(self):
            return self.model

    w = Worker()
    before = w.harness_kv_scales()
    assert before == {"a": [1.0, 1.0], "b": [0.5, 2.0]}
    zeroed = w.harness_kv_scales("0")
    assert zeroed == {"a": [0.0, 0.0], "b": [0.0, 0.0]} and w.model["b"]._v_scale_float == 0.0
    assert w.harness_kv_scales(json.dumps(before)) == before
    assert w.model["b"]._k_scale_float == 0.5
