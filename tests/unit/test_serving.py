"""How a rollout server serves, as case data: the mode (eager, graphs) and the server
features (fp8, sleep, 2api) reach the ids, the server's flags and its twin; the cases a
CPU server cannot run say why; the plan keeps them in groups of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import models
from harness.run import cases
from harness.run import layouts
from harness.run import plan as P
from harness.run.cases import Case, server_config_for, twin_config
from harness.run.pool import start_seconds_by_mode
from harness.transfer import VARIANTS
from harness.vllm.server import build_command

GPU, CPU = layouts.LAYOUTS["1gpu-colocated"], layouts.LAYOUTS["cpu"]


def _case(layout=GPU, backend="ipc-packed", dtype="bfloat16", mode="eager", features=()):
    return Case(VARIANTS[backend], layout, dtype, "llama", mode, features=tuple(features))


def test_ids_name_the_mode_and_features_only_where_not_default():
    assert _case().id == "ipc-packed-1gpu-colocated-bf16-llama"
    assert _case(mode="graphs").id == "ipc-packed-1gpu-colocated-bf16-llama-graphs"
    assert (_case(mode="graphs", features=("fp8",)).id
            == "ipc-packed-1gpu-colocated-bf16-llama-graphs-fp8")
    assert _case(CPU, "shm", "float32", features=("2api",)).id == "shm-cpu-fp32-llama-2api"
    assert _case(features=("sleep",)).as_dict()["features"] == ["sleep"]


def test_build_cases_gives_every_case_the_features_and_refuses_unknown_ones():
    got = cases.build_cases(["shm", "ipc-packed"], ["cpu", "1gpu-colocated"], ["bf16"],
                            ["llama"], ["graphs"], features=["fp8"])
    assert got and all(c.features == ("fp8",) and c.mode == "graphs" for c in got)
    with pytest.raises(ValueError, match="unknown server feature 'fp4'"):
        cases.build_cases(["shm"], ["cpu"], ["bf16"], ["llama"], features=["fp4"])


def test_graph_mode_is_vllms_default_command_line():
    eager = build_command(server_config_for(_case(), "/m"), 1)
    graphs = build_command(server_config_for(_case(mode="graphs"), "/m"), 1)
    assert "--enforce-eager" in eager and "--enforce-eager" not in graphs
    assert [a for a in eager if a != "--enforce-eager"] == graphs


def test_features_reach_the_server_flags():
    fp8 = server_config_for(_case(features=("fp8",)), "/m")
    argv = build_command(fp8, 1)
    assert argv[argv.index("--quantization") + 1] == "fp8" and fp8.quantization == "fp8"
    sleep = server_config_for(_case(features=("sleep",)), "/m")
    assert "--enable-sleep-mode" in build_command(sleep, 1)
    two = server_config_for(_case(CPU, "shm", "float32", features=("2api",)), "/m")
    argv = build_command(two, 1)
    assert argv[argv.index("--api-server-count") + 1] == "2"
    assert dict(two.extra_env)["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == "600"
    assert ("mode=graphs" in server_config_for(_case(mode="graphs"), "/m").describe()
            and "mode=" not in server_config_for(_case(), "/m").describe())
    assert "quant=fp8" in fp8.describe() and "sleep-mode" in sleep.describe()
    assert "api-servers=2" in two.describe()


def test_the_twin_keeps_mode_and_features_unless_told_otherwise():
    cfg = server_config_for(_case(mode="graphs", features=("fp8",)), "/m")
    twin = twin_config(cfg, "/w")
    assert (twin.load_format, twin.model) == ("auto", models.as_sent_path("/w", "bfloat16"))
    assert twin.mode == "graphs" and twin.quantization == "fp8"
    other = twin_config(cfg, "/w", mode="eager")
    assert other.mode == "eager" and other == twin_config(
        server_config_for(_case(features=("fp8",)), "/m"), "/w")


def test_the_nccl_and_ipc_servers_of_one_engine_share_their_twin():
    """A twin takes no update: the NCCL case on its own GPU and the CUDA IPC case beside
    the trainer load the same weights into the same engine on GPU 0, so one start serves
    both; the synced servers stay apart, the backend being their launch flag."""
    split = layouts.LAYOUTS["2gpu-split"]
    for backend in ("nccl-packed", "nccl-unpacked"):
        nccl = server_config_for(_case(split, backend), "/m")
        ipc = server_config_for(_case(), "/m")
        assert nccl != ipc
        assert twin_config(nccl, "/w") == twin_config(ipc, "/w")
    shm = server_config_for(_case(CPU, "shm", "float32"), "/m")
    assert twin_config(shm, "/w").backend == "shm"


def test_a_cpu_server_says_what_it_cannot_serve():
    for f in ("fp8", "sleep"):
        why = _case(CPU, "shm", features=(f,)).unsupported()
        assert why and why.startswith(f"{f} on a CPU server: ")
        assert _case(features=(f,)).unsupported() is None  # GPU layout
    assert _case(CPU, "shm", features=("2api",)).unsupported() is None
    assert _case(CPU, "shm", mode="graphs").unsupported() is None


def test_the_plan_keeps_each_way_of_serving_a_group_of_its_own():
    """A serving mode is a server of its own; the variants of one mode share one."""
    eager = server_config_for(_case(), "/zoo/llama")
    graphs = server_config_for(_case(mode="graphs"), "/zoo/llama")
    eager_u = server_config_for(_case(backend="ipc-unpacked"), "/zoo/llama")
    graphs_u = server_config_for(_case(backend="ipc-unpacked", mode="graphs"), "/zoo/llama")
    assert eager == eager_u and graphs == graphs_u and eager != graphs
    keys = {P.group_key(c) for c in (eager, graphs, eager_u, graphs_u)}
    assert len(keys) == 2


def test_start_seconds_by_mode():
    started = [{"mode": "eager", "start_seconds": 40.0}, {"mode": "graphs", "start_seconds": 80.0},
               {"mode": "graphs", "start_seconds": 100.0}, {"start_seconds": 50.0}]
    assert start_seconds_by_mode(started) == {
        "eager": {"servers": 2, "mean": 45.0, "max": 50.0},
        "graphs": {"servers": 2, "mean": 90.0, "max": 100.0}}


def test_a_twin_outside_float32_loads_the_bytes_a_trainer_in_that_dtype_sends(tmp_path,
                                                                            monkeypatch):
    """vLLM keeps the Mamba2 mixer's A in float32 whatever the dtype: a bfloat16 twin of
    the float32 files held more than the bfloat16 trainer sent (1 x H200, nemotron-h,
    0.04 nats). The twin of a bfloat16 server loads a bfloat16 copy, built at its start."""
    import torch
    from safetensors.torch import load_file, save_file

    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "m"
    src.mkdir()
    save_file({"a": torch.randn(8), "ids": torch.arange(3)}, src / "model.safetensors")
    (src / "config.json").write_text("{}")
    bf16 = twin_config(server_config_for(_case(dtype="bfloat16"), str(src)), str(src))
    assert bf16.model != str(src) and bf16.load_format == "auto"
    assert not Path(bf16.model).exists(), "planning a twin builds nothing"
    models.ensure_built(bf16.model)
    got = load_file(Path(bf16.model) / "model.safetensors")
    want = load_file(src / "model.safetensors")
    assert got["a"].dtype == torch.bfloat16 and torch.equal(got["a"], want["a"].bfloat16())
    assert torch.equal(got["ids"], want["ids"]) and (Path(bf16.model) / "config.json").exists()
    assert twin_config(server_config_for(_case(dtype="bfloat16"), str(src)), str(src)) == bf16
    fp32 = twin_config(server_config_for(_case(dtype="float32"), str(src)), str(src))
    assert fp32.model == str(src)
    hub = twin_config(server_config_for(_case(dtype="bfloat16"), "org/model"), "org/model")
    assert hub.model == "org/model"
