"""The architecture holds, read from the folders: every module imports on its own; each
package of ``harness/`` sits on one floor and imports only from its own package or a
lower floor (the README's "Layout of the code"); the packages of one floor do not import
each other; nothing imports the pytest plugin; nothing below the faces imports pytest;
the subcommands do not import each other; and there is no import circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "harness"
MODULES = sorted("harness." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)
                 for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")

# Lowest first: the packages of harness/ by floor. ``portable`` is below everything: it
# imports nothing of the harness outside itself, because the emitted repro scripts carry
# its modules. The packages of one floor are independent of each other.
FLOORS = [
    ("portable", {"portable"}),
    ("core", {"core"}),
    ("models", {"models"}),
    ("vllm", {"vllm"}),
    ("parts", {"transfer", "oracles", "pause", "testing"}),
    ("trainer", {"trainer"}),
    ("run", {"run"}),
    ("known issues", {"known_issues"}),
    ("pytest", {"pytest"}),
    ("commands", {"commands"}),
    ("entry", {"__main__"}),
]
FACES = {"known_issues", "pytest", "commands", "__main__"}
ALL_MODULES = {("harness." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts))
               .removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")}
ALL_MODULES.pop("harness")  # the empty top package


def package_of(module: str) -> str:
    """``harness.run.pool`` is in ``run``; ``harness.__main__`` is its own."""
    return module.split(".")[1]


@pytest.mark.slow_unit  # one interpreter per module; two of them import vLLM
@pytest.mark.parametrize("module", MODULES)
def test_module_imports_on_its_own(module):
    if module in ("harness.transfer.shm_engine", "harness.transfer.shm_trainer_engine"):
        pytest.importorskip("vllm")  # vLLM loads them, in its processes and the trainer's
    r = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_nothing_imports_the_plugin():
    assert [m for m in ALL_MODULES if "harness.pytest.plugin" in harness_imports(m)] == []


def test_below_the_faces_nothing_imports_pytest():
    """pytest is the faces' business: the engine runs the same under ``harness demo``."""
    assert [m for m in sorted(ALL_MODULES) if package_of(m) not in FACES | {"testing"}
            and "pytest" in imported_names(m)] == []


# Which subcommand may use another's module: the dispatcher all of them; every one the
# option table as commands take it (``options``); a merge reads reports as a diff does;
# a diff of two bench files reads them as the bench writes them.
SUBCOMMAND_USES = {("cli", "*"), ("*", "options"), ("merge", "diff"), ("diff", "bench")}


def test_subcommands_do_not_import_each_other():
    def sub(m):
        return m.split(".")[2] if package_of(m) == "commands" and m.count(".") > 1 else None

    bad = [(m, o) for m in sorted(ALL_MODULES) if sub(m) for o in sorted(harness_imports(m))
           if sub(o) and sub(o) != sub(m) and (sub(m), "*") not in SUBCOMMAND_USES
           and ("*", sub(o)) not in SUBCOMMAND_USES and (sub(m), sub(o)) not in SUBCOMMAND_USES]
    assert bad == []


def test_packages_of_one_floor_do_not_import_each_other():
    bad = [f"{m} imports {o}" for m in sorted(ALL_MODULES) for o in sorted(harness_imports(m))
           if floor_of(o) == floor_of(m) and package_of(o) != package_of(m)]
    assert bad == []


def floor_of(module: str) -> int | None:
    """The index of the floor ``module``'s package is on."""
    for i, (_, packages) in enumerate(FLOORS):
        if package_of(module) in packages:
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


def imported_names(module: str) -> set[str]:
    """Every module name ``module`` imports (its top-level packages), inside functions too."""
    found = set()
    for node in ast.walk(ast.parse(ALL_MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
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
                        lambda m: original(m) | ({"harness.core.facts"}
                                                 if m == "harness.portable.recipes" else set()))
    assert upward_imports() == ["harness.portable.recipes (portable) imports harness.core.facts "
                                "(core)"]


def test_a_floor_mate_a_subcommand_and_pytest_are_caught(monkeypatch):
    """Each package rule above fails on the import it forbids."""
    original, names = harness_imports, imported_names
    extra = {"harness.oracles.parity": {"harness.pause.driver"},
             "harness.commands.demo": {"harness.commands.bench.run"}}
    monkeypatch.setitem(globals(), "harness_imports",
                        lambda m, **kw: original(m, **kw) | extra.get(m, set()))
    monkeypatch.setitem(globals(), "imported_names",
                        lambda m: names(m) | ({"pytest"} if m == "harness.run.flow" else set()))
    for check in (test_packages_of_one_floor_do_not_import_each_other,
                  test_subcommands_do_not_import_each_other,
                  test_below_the_faces_nothing_imports_pytest):
        with pytest.raises(AssertionError):
            check()


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
    extra = {"harness.core.facts": {"harness.run.settings"}}
    circles = import_circles(lambda m: original(m, main_block=False) | extra.get(m, set()))
    assert any({"harness.core.facts", "harness.run.settings"} <= set(c) for c in circles), circles
    assert import_circles() == [], "the extra import is the only circle"

