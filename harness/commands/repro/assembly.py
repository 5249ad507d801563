"""A repro script assembled: the template ``script.py`` with the regions its scenario
keeps (``[region NAME]`` ... ``[end]``), the scenario's portable modules (its
backend's script sender first: ``harness.transfer.Backend.script``) put in its marked
place, and one import block for all of them."""

from __future__ import annotations

import io
import ast
import re
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

from harness import transfer

HARNESS = Path(__file__).resolve().parents[2]
TEMPLATE = Path(__file__).with_name("script.py")
PORTABLE = HARNESS / "portable"
PORTABLE_MARK = "# -- portable code: `harness repro --emit` puts the scenario's harness/portable"


class EmitError(RuntimeError):
    pass


def needs(scenario: dict[str, Any]) -> set[str]:
    """The region names the scenario keeps."""
    source = scenario["model"].get("source")
    found = {scenario["engine"], "smollm2" if source == "smollm2-gguf" else source,
             "gpu" if scenario.get("server_gpus") else "cpu"}
    if scenario.get("trainer_api"):
        found.add(scenario["trainer_api"])
    if scenario.get("corrupt"):
        found |= {"corrupt", f"corrupt_{scenario['corrupt']}"}
    return found


def portable_modules(scenario: dict[str, Any]) -> list[str]:
    """The modules of harness/portable the scenario's script holds, in the order the
    script shows them: the engine's send code first, what it calls from vLLM next, the
    model recipes and what every module shares last."""
    script = transfer.backend(scenario["engine"]).script
    if script is None:
        raise EmitError(f"backend {scenario['engine']!r} has no repro script sender")
    mods = list(script.modules)
    if scenario.get("corrupt"):
        mods.append("corrupt")
    if scenario["model"]["source"] in ("zoo", "smollm2-gguf"):
        mods.append("recipes")
    return mods + ["base"]


def assemble(scenario: dict[str, Any], template: str | None = None) -> str:
    """The template with the scenario's portable modules in its marked place and one
    import block for all; regions kept or dropped by ``needs(scenario)``."""
    keep = needs(scenario)
    text = keep_regions(TEMPLATE.read_text() if template is None else template, keep)
    head, imports, body = _split_module(text)
    if body.count(PORTABLE_MARK) != 1:
        raise EmitError(f"the template must hold {PORTABLE_MARK!r} once")
    before, after = body.split(PORTABLE_MARK, 1)
    after = after.split("\n", 1)[1]
    parts = []
    for name in portable_modules(scenario):
        source = keep_regions((PORTABLE / f"{name}.py").read_text(), keep)
        doc, mod_imports, mod_body = _split_module(source)
        imports += mod_imports
        about = " ".join((ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0].split())
        comment = textwrap.fill(f"harness/portable/{name}.py: {about}", 100,
                                initial_indent="# -- ", subsequent_indent="# ")
        parts.append(f"{comment}\n{mod_body.strip()}\n")
    code = before.rstrip() + "\n\n" + "\n".join(parts) + "\n" + after.lstrip("\n")
    # no `from __future__ import annotations`: vLLM needs Python 3.10+, which reads them all
    out = head.rstrip() + "\n\n" + _import_block(imports, code) + "\n\n" + code.lstrip("\n")
    # one blank line between definitions, as in a script (the modules keep PEP 8's two)
    return _tighten(re.sub(r"\n{3,}", "\n\n", out))


def _tighten(code: str) -> str:
    """``code`` without the blank lines inside a block (between two lines of one indent
    that are not a definition); blank lines inside strings stay."""
    in_string: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.STRING:
            in_string.update(range(tok.start[0] + 1, tok.end[0] + 1))
    lines = code.split("\n")

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    keep = []
    for i, line in enumerate(lines):
        prev, nxt = (lines[i - 1] if i else ""), (lines[i + 1] if i + 1 < len(lines) else "")
        if not line.strip() and i + 1 not in in_string and prev.strip() and indent(prev) > 0 \
                and indent(prev) == indent(nxt) \
                and not nxt.lstrip().startswith(("def ", "class ", "@")):
            continue
        keep.append(line)
    return "\n".join(keep)


_REGION = re.compile(r"^\s*(?:#\s*)?\[region ([\w ]+)\]\s*$")
_END = re.compile(r"^\s*(?:#\s*)?\[end\]\s*$")


def keep_regions(text: str, keep: set[str]) -> str:
    """``text`` without its region marker lines, and without the regions none of whose
    names is in ``keep`` (a nested region goes with the one around it)."""
    out: list[str] = []
    inside: list[set[str]] = []  # the names of each open region, outermost first
    for line in text.splitlines(keepends=True):
        m = _REGION.match(line)
        if m:
            inside.append(set(m.group(1).split()))
        elif _END.match(line):
            if not inside:
                raise EmitError("[end] without a region")
            inside.pop()
        elif all(names & keep for names in inside):
            out.append(line)
    if inside:
        raise EmitError(f"a region without its [end]: {sorted(inside[-1])}")
    return "".join(out)


def _split_module(text: str) -> tuple[str, list[tuple[str, str, str | None]], str]:
    """(everything up to the end of the docstring, the top-level imports, the rest)."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    drop: set[int] = set()
    imports: list[tuple[str, str, str | None]] = []  # (module, name or "", asname)
    doc_end = 0
    if tree.body and isinstance(tree.body[0], ast.Expr) \
            and isinstance(getattr(tree.body[0], "value", None), ast.Constant):
        doc_end = tree.body[0].end_lineno
    for node in tree.body:
        if isinstance(node, ast.Import):
            imports += [(a.name, "", a.asname) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imports += [(node.module or "", a.name, a.asname) for a in node.names]
        else:
            continue
        drop.update(range(node.lineno, node.end_lineno + 1))
    body = "".join(line for i, line in enumerate(lines, 1) if i > doc_end and i not in drop)
    return "".join(lines[:doc_end]), imports, body


def _import_block(imports: list[tuple[str, str, str | None]], code: str) -> str:
    """One import block: harness and __future__ imports dropped (the code is in the
    file), names the code does not use dropped, the standard library first."""
    used = _names_used(code)
    plain: set[tuple[str, str | None]] = set()
    froms: dict[str, set[tuple[str, str | None]]] = {}
    for module, name, asname in imports:
        if module == "__future__" or module.split(".")[0] == "harness":
            continue
        if not name:
            if (asname or module) in used:  # `import a.b` is used where `a.b` is
                plain.add((module, asname))
        elif (asname or name) in used:
            froms.setdefault(module, set()).add((name, asname))
    groups: dict[bool, list[str]] = {True: [], False: []}
    for stdlib in (True, False):  # `import a, b, c` lines of at most 100 characters
        names = [m + (f" as {a}" if a else "") for m, a in sorted(plain) if _stdlib(m) == stdlib]
        groups[stdlib] += textwrap.wrap(", ".join(names), 93, initial_indent="import ",
                                        subsequent_indent="import ", break_on_hyphens=False)
        groups[stdlib] = [line.rstrip(",") for line in groups[stdlib]]
    for module in sorted(froms):
        names = ", ".join(n + (f" as {a}" if a else "") for n, a in sorted(froms[module]))
        groups[_stdlib(module)].append(f"from {module} import {names}")
    return "\n\n".join("\n".join(g) for g in (groups[True], groups[False]) if g)


def _names_used(code: str) -> set[str]:
    """The names ``code`` reads, and its dotted names (``a.b`` of ``a.b.c``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            parts, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                dotted = [base.id] + parts[::-1]
                found.update(".".join(dotted[:i]) for i in range(2, len(dotted) + 1))
    return found


def _stdlib(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names


