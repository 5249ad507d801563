"""Modules stay small enough to read: the pytest plugin, the module pytest loads and
that only gathers hooks and fixtures, at most 400 lines; every other module of
``harness/`` at most 500. A module that grows past its bound is split by concept into
modules named for what they hold (docs/layout.md lists them)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "harness"
PLUGIN = HARNESS / "pytest" / "plugin.py"
PLUGIN_MAX = 400
MODULE_MAX = 500

def lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def too_long(root: Path = HARNESS, bound: int = MODULE_MAX) -> dict[str, int]:
    """Every module under ``root`` longer than ``bound`` lines."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if lines(path) > bound:
            out[name] = lines(path)
    return out


def test_the_plugin_is_at_most_400_lines():
    assert lines(PLUGIN) <= PLUGIN_MAX, (
        f"{PLUGIN.relative_to(ROOT)}: {lines(PLUGIN)} lines; it gathers the hooks and "
        f"fixtures of harness/pytest/'s modules and wires the session's plugin objects")


def test_every_harness_module_is_at_most_500_lines():
    assert too_long() == {}, "split these by concept (docs/layout.md)"
