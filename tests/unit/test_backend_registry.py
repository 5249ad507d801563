"""Backends as plug-ins: what one engine is lives in its ``Backend`` (harness/transfer/),
and everything else asks the registry. Read from the code (no server, no vLLM)."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

from harness import transfer
from harness.run import layouts
from harness.transfer import registry
from harness.transfer.backend import Backend, BackendVariant

PACKAGE = Path(__file__).resolve().parents[2] / "harness"
OUTSIDE_TRANSFER = sorted(p for p in PACKAGE.rglob("*.py")
                          if p.relative_to(PACKAGE).parts[0] != "transfer")


def _strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, its docstrings left out."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def engine_literals(paths, names) -> list[str]:
    return [f"{p.relative_to(PACKAGE)}:{n.lineno}: {n.value!r}" for p in paths
            for n in _strings(ast.parse(p.read_text())) if n.value in names]


def engine_branches(paths) -> list[str]:
    """Comparisons of an engine (``engine``, ``x.engine``, ``engine_name``) by ``==``,
    ``!=``, ``in`` or ``not in`` with a name fixed in the code (a string, a tuple of
    them, or a constant such as ``shm.BACKEND_NAME``): a decision by engine name.
    Asking whether an engine is in a registry (``engine in registered``) is not one."""
    def name_of(node) -> str:
        return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")

    def is_engine(node) -> bool:
        return name_of(node) in ("engine", "engine_name", "backend_engine")

    def fixed(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return all(fixed(e) for e in node.elts)
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)) \
            or name_of(node).isupper()

    out = []
    for p in paths:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Compare) and is_engine(n.left) and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and fixed(right)
                    for op, right in zip(n.ops, n.comparators)):
                out.append(f"{p.name}:{n.lineno}")
    return out


def test_engine_names_are_literal_only_in_transfer():
    names = set(registry.backends()) | set(transfer.VARIANTS)
    assert engine_literals(OUTSIDE_TRANSFER, names) == []


def test_the_literal_check_sees_a_literal(tmp_path):
    bad = PACKAGE / "run" / "cases.py"
    found = engine_literals([bad], {"float32"})  # a literal cases.py holds, as an engine would
    assert found and found[0].startswith("run/cases.py:")


def test_at_most_three_branches_on_an_engine_outside_transfer():
    assert len(engine_branches(OUTSIDE_TRANSFER)) <= 3, engine_branches(OUTSIDE_TRANSFER)


def test_the_branch_check_sees_a_branch(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f(v, engine, known):\n    if v.engine == 'a' or engine in ('b',):\n"
                 "        pass\n    if engine in known or v.engine == shm.BACKEND_NAME:\n"
                 "        pass\n")
    assert engine_branches([f]) == ["x.py:2", "x.py:2", "x.py:4"]


def test_shm_is_registered_through_the_entry_point():
    eps = [ep for ep in importlib.metadata.entry_points(group=registry.GROUP)
           if ep.name == "shm"]
    assert eps and eps[0].value == "harness.transfer.shm:BACKEND"
    assert "shm" in registry.backends()
    assert not any(m.endswith(".shm") for m in registry.BUILT_IN)


@pytest.mark.parametrize("engine", sorted(registry.backends()))
def test_every_backend_is_whole(engine):
    b = registry.backend(engine)
    assert b.engine == engine and b.variants
    assert all(v.engine == engine for v in b.variants)
    assert set(b.layouts) <= set(layouts.LAYOUTS), b.layouts
    assert all(layouts.runs_on(v, layouts.LAYOUTS[b.default_layout]) for v in b.variants)
    assert b.twin_engine is None or b.twin_engine in registry.backends()
    assert b.sender_class().__name__
    assert (b.vllm_api is None) != (b.vllm_plugin is None), "vLLM's own engine or a plugin's"
    assert b.raw_limit in ("host", "d2d", "nccl")


def _registry_with(monkeypatch, *objects):
    eps = [importlib.metadata.EntryPoint(f"ep{i}", f"mod{i}:X", registry.GROUP)
           for i in range(len(objects))]
    loads = dict(zip((ep.name for ep in eps), objects))
    monkeypatch.setattr(importlib.metadata.EntryPoint, "load",
                        lambda ep: loads[ep.name]() if callable(loads[ep.name])
                        else loads[ep.name])
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)
    registry.backends.cache_clear()


@pytest.fixture
def fresh_registry():
    registry.backends.cache_clear()
    yield
    registry.backends.cache_clear()


def _backend(engine: str, vid: str | None = None) -> Backend:
    return Backend(engine=engine, description="test", sender="x:Y", layouts=("cpu",),
                   variants=(BackendVariant(vid or engine, engine, False, False, False, "t"),),
                   vllm_plugin="x")


def test_a_backend_of_yours_joins_every_variant_table(monkeypatch, fresh_registry):
    _registry_with(monkeypatch, _backend("carrier-pigeon"))
    assert "carrier-pigeon" in transfer.VARIANTS
    assert "carrier-pigeon" in layouts.LAYOUTS["cpu"].engines


@pytest.mark.parametrize("objects, words", [
    ((lambda: (_ for _ in ()).throw(ImportError("no module x")),), "does not load: ImportError"),
    (("not a backend",), "is a str, not a harness.transfer.Backend"),
    ((_backend("nccl"),), "engine 'nccl' is already registered by harness.transfer.nccl"),
    ((_backend("pigeon", "shm2"), _backend("owl", "shm2")), "variant ids must be new"),
])
def test_a_bad_entry_point_is_one_line_naming_it(monkeypatch, fresh_registry, objects, words):
    _registry_with(monkeypatch, *objects)
    with pytest.raises(registry.BackendRegistryError, match=words) as e:
        registry.backends()
    assert "\n" not in str(e.value) and "entry point ep" in str(e.value)


def test_an_unknown_engine_names_the_registered_ones():
    with pytest.raises(ValueError, match="unknown weight-transfer engine 'pigeon'; registered: "
                                         "shm, nccl, ipc"):
        registry.backend("pigeon")


def test_vllms_trainer_code_skips_a_plugin_without_a_trainer_engine(monkeypatch, fresh_registry):
    """A plug-in's ``-via-vllm`` cases are known unrunnable before a trainer starts."""
    import dataclasses

    from harness.run import cases

    _registry_with(monkeypatch, _backend("carrier-pigeon"))
    case = dataclasses.replace(cases.make_case("carrier-pigeon", None, "float32", "llama"),
                               trainer="vllm")
    assert "names no trainer engine for vLLM's trainer factory" in case.unsupported()
    assert dataclasses.replace(case, trainer="harness").unsupported() is None


def test_vllms_trainer_code_runs_over_shm_and_vllms_engines():
    import dataclasses

    from harness.run import cases

    for variant in ("shm", "ipc-packed", "nccl-packed"):  # shm: its ShmTrainerInitInfo
        case = cases.make_case(variant, None, "float32", "llama")
        assert "trainer factory" not in (dataclasses.replace(case, trainer="vllm")
                                         .unsupported() or "")
