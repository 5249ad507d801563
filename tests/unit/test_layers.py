"""The architecture holds: every module imports on its own, nothing imports the pytest
plugin, the front ends (plugin, CLI commands) never import each other, and the engine
never imports pytest."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "harness"
MODULES = sorted("harness." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
                 for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
FRONT_ENDS = {"harness.plugin", "harness.report", "harness.known_issues", "harness.demo",
              "harness.repro", "harness.diff", "harness.bench", "harness.cli",
              "harness.bench_run", "harness.bench_view", "harness.diff_reports",
              "harness.diff_render", "harness.diff_bench", "harness.known_issues_verify"}
ENGINE = {"harness.facts", "harness.settings", "harness.cases", "harness.pool", "harness.flow",
          "harness.trainer", "harness.server", "harness.client", "harness.layouts",
          "harness.models", "harness.reference", "harness.parity", "harness.vllm_api",
          "harness.sync", "harness.measure", "harness.environment"}


def _imports(module: str) -> set[str]:
    path = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = module.split(".")[:-node.level]
                name = ".".join(base + ([node.module] if node.module else []))
                found |= {name} | {f"{name}.{a.name}" for a in node.names}
            elif node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_on_its_own(module):
    if module in ("harness.backends.shm_engine", "harness.backends.shm_trainer_engine"):
        pytest.importorskip("vllm")  # vLLM loads them, in its processes and the trainer's
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_nothing_imports_the_plugin():
    offenders = [m for m in MODULES if m != "harness.plugin" and "harness.plugin" in _imports(m)]
    assert offenders == []


def test_front_ends_do_not_import_each_other():
    # the plugin may register its report and known-issues hooks: they are its parts
    allowed = {("harness.plugin", "harness.report"), ("harness.plugin", "harness.known_issues"),
               ("harness.report", "harness.known_issues"),
               ("harness.cli", "harness.demo"), ("harness.cli", "harness.repro"),
               ("harness.cli", "harness.diff"), ("harness.cli", "harness.bench"),
               # one command's parts
               ("harness.bench", "harness.bench_run"), ("harness.bench", "harness.bench_view"),
               ("harness.bench_run", "harness.bench_view"),
               ("harness.diff", "harness.diff_reports"), ("harness.diff", "harness.diff_render"),
               ("harness.diff", "harness.diff_bench"),
               ("harness.known_issues", "harness.known_issues_verify"),
               ("harness.known_issues_verify", "harness.known_issues")}
    bad = [(m, other) for m in FRONT_ENDS if m in MODULES
           for other in FRONT_ENDS - {m} if other in _imports(m) and (m, other) not in allowed]
    assert bad == []


def test_the_engine_knows_nothing_of_pytest_or_the_front_ends():
    for m in ENGINE:
        imported = _imports(m)
        assert "pytest" not in imported, m
        assert not imported & FRONT_ENDS, (m, imported & FRONT_ENDS)
