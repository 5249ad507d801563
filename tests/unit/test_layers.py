"""The architecture holds: every module imports on its own, nothing imports the pytest
plugin, the front ends (plugin, CLI commands, the standalone repro script) never import
each other, the engine never imports pytest, and every module imports only from its
own floor or the floors below it (the README's "Layout of the code")."""

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
              "harness.repro_script",
              "harness.bench_run", "harness.bench_view", "harness.diff_reports",
              "harness.diff_render", "harness.diff_bench", "harness.known_issues_verify",
              "harness.sharding", "harness.merge", "harness.__main__",
              "harness.known_issues_cli"}
ENGINE = {"harness.facts", "harness.settings", "harness.cases", "harness.pool", "harness.flow",
          "harness.trainer", "harness.server", "harness.client", "harness.layouts",
          "harness.models", "harness.reference", "harness.parity", "harness.vllm_api",
          "harness.sync", "harness.measure", "harness.environment", "harness.partition",
          "harness.parallel", "harness.memory_lock", "harness.trainer_plugin"}


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
               ("harness.report", "harness.known_issues"), ("harness.plugin", "harness.sharding"),
               ("harness.cli", "harness.demo"), ("harness.cli", "harness.repro"),
               ("harness.cli", "harness.diff"), ("harness.cli", "harness.bench"),
               ("harness.__main__", "harness.cli"),
               # one command's parts
               ("harness.bench", "harness.bench_run"), ("harness.bench", "harness.bench_view"),
               ("harness.bench_run", "harness.bench_view"),
               ("harness.diff", "harness.diff_reports"), ("harness.diff", "harness.diff_render"),
               ("harness.diff", "harness.diff_bench"),
               ("harness.known_issues_verify", "harness.known_issues"),
               ("harness.known_issues_cli", "harness.known_issues"),
               ("harness.known_issues", "harness.known_issues_cli"),  # its script block
               ("harness.known_issues_cli", "harness.known_issues_verify"),
               # a merge reads reports as diff does and summarizes them as the report does
               ("harness.merge", "harness.diff_reports"), ("harness.merge", "harness.report")}
    bad = [(m, other) for m in FRONT_ENDS if m in MODULES
           for other in FRONT_ENDS - {m} if other in _imports(m) and (m, other) not in allowed]
    assert bad == []


def test_the_engine_knows_nothing_of_pytest_or_the_front_ends():
    for m in ENGINE:
        imported = _imports(m)
        assert "pytest" not in imported, m
        assert not imported & FRONT_ENDS, (m, imported & FRONT_ENDS)


# ----------------------------------------------------------------------------- floors
# Lowest first. A module imports only from its own floor or a lower one. ``portable`` is
# below everything: it imports nothing of the harness outside itself, because the
# emitted repro scripts carry its modules. A name ending in "." stands for the modules
# of that package; ``harness.backends`` itself is the backend variants as data, a fact,
# its modules are parts.
FLOORS = [
    ("portable", {"harness.portable", "harness.portable."}),
    ("facts", {"harness.facts", "harness.server", "harness.client", "harness.layouts",
               "harness.models", "harness.vllm_api", "harness.settings", "harness.reaper",
               "harness.text", "harness.probe_cache", "harness.plan", "harness.backends",
               "harness.measure", "harness.environment", "harness.sync",
               "harness.partition", "harness.startup", "harness.memory_lock",
               "harness.trainer_plugin"}),
    ("parts", {"harness.backends.", "harness.reference", "harness.parity", "harness.checksums",
               "harness.pause", "harness.pause.", "harness.standin", "harness.faults",
               "harness.frontends", "harness.lora"}),
    ("engine", {"harness.cases", "harness.pool", "harness.trainer", "harness.trainer_child",
                "harness.flow", "harness.parallel"}),
    ("faces", {"harness.plugin", "harness.report", "harness.known_issues", "harness.cli",
               "harness.demo", "harness.repro", "harness.repro_emit", "harness.repro_script",
               "harness.diff", "harness.matrix", "harness.bench", "harness.benchfile",
               "harness.rawlimit", "harness.bench_run", "harness.bench_view",
               "harness.diff_reports", "harness.diff_render", "harness.diff_bench",
               "harness.diff_common", "harness.known_issues_verify", "harness.sharding",
               "harness.merge", "harness.rootdir", "harness.selection", "harness.__main__",
               "harness.known_issues_cli"}),
]
ALL_MODULES = {("harness." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
               .removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")}
ALL_MODULES.pop("harness")  # the empty top package


def floor_of(module: str) -> int | None:
    """The index of ``module``'s floor: where it is named, or where its package's
    modules are ("harness.pause." holds ``harness.pause.driver``)."""
    for i, (_, names) in enumerate(FLOORS):
        if module in names or module.rsplit(".", 1)[0] + "." in names:
            return i
    return None


def _is_main_block(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def harness_imports(module: str, *, main_block: bool = True) -> set[str]:
    """The harness modules ``module`` imports, anywhere in it (inside functions too);
    ``main_block=False`` leaves out its ``if __name__ == "__main__":`` block, which runs
    only as a script, as another module than this one."""
    path = ALL_MODULES[module]
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    tree = ast.parse(path.read_text())
    if not main_block:
        tree.body = [n for n in tree.body if not _is_main_block(n)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] if node.level else [])
            mod = ".".join(x for x in (base, node.module or "") if x)
            names = {mod} | {f"{mod}.{a.name}" for a in node.names}
        else:
            continue
        found |= {n for n in names if n in ALL_MODULES and n != module}
    return found


def test_every_module_has_a_floor():
    assert [m for m in sorted(ALL_MODULES) if floor_of(m) is None] == []


def upward_imports() -> list[str]:
    bad = []
    for m in sorted(ALL_MODULES):
        for other in sorted(harness_imports(m)):
            if floor_of(other) > floor_of(m):
                bad.append(f"{m} ({FLOORS[floor_of(m)][0]}) imports {other} "
                           f"({FLOORS[floor_of(other)][0]})")
    return bad


def test_modules_import_only_from_their_floor_or_below():
    assert upward_imports() == []


def test_the_portable_core_imports_nothing_else_of_the_harness():
    for m in ALL_MODULES:
        if floor_of(m) == 0:
            assert {o for o in harness_imports(m) if floor_of(o) != 0} == set(), m


def test_an_upward_import_is_caught(monkeypatch):
    """The rule sees imports inside functions and relative ones: a portable module
    that reached for the facts would be reported."""
    original = harness_imports
    monkeypatch.setitem(globals(), "harness_imports",
                        lambda m: original(m) | ({"harness.facts"}
                                                 if m == "harness.portable.recipes" else set()))
    assert upward_imports() == ["harness.portable.recipes (portable) imports harness.facts "
                                "(facts)"]


def import_circles(imports=None) -> list[list[str]]:
    """Every circle in the graph of who imports whom in the harness (inside functions
    too, a module's script block aside): its strongly connected components."""
    imports = imports or (lambda m: harness_imports(m, main_block=False))
    graph = {m: imports(m) for m in ALL_MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return circles


def test_the_import_graph_has_no_circle():
    assert import_circles() == []


def test_a_circle_is_caught():
    """Two modules that import each other, one of them inside a function only."""
    original = harness_imports
    extra = {"harness.facts": {"harness.settings"}}
    circles = import_circles(lambda m: original(m, main_block=False) | extra.get(m, set()))
    assert any({"harness.facts", "harness.settings"} <= set(c) for c in circles), circles
    assert import_circles() == [], "the extra import is the only circle"

