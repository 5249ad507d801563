"""Comments and docstrings in ``harness/`` say what the code does and why, never where or
when it was seen: no GPU visit ("the ninth visit"), no card model (H100, "1 x H200"), no
date. Those belong in docs/ and reports/, which keep the measurement and its host; the
code keeps the reason. Comments are read with ``tokenize`` and docstrings (every bare
string statement) with ``ast``, so string literals used as data are not judged."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "harness"

_ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
            r"twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
            r"nineteenth|twentieth|twenty-\w+|thirtieth|thirty-\w+|\d+(?:st|nd|rd|th))")
PATTERNS = {
    "a GPU visit": re.compile(rf"\b{_ORDINAL}\s+(?:GPU\s+)?visits?\b|\bvisits?\s+(?:#\s*)?\d+\b"
                              r"|\bGPU\s+visits?\b", re.I),
    "a card model": re.compile(r"\b(?:A100|H100|H200|B200|GH200|GB200|V100|L40S?)\b", re.I),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}

# (path under the repository, the matched text, lower case) -> why it may stay. Keep it
# short: an entry is a string the user reads, not a note of where something was seen.
ALLOWED = {
    ("harness/commands/bench/__init__.py", "h200"):
        "the module docstring is `harness bench --help`; its example's --out folder follows "
        "reports/bench/, whose runs are named after the card they ran on "
        "(reports/bench/h200-vllm-0.26.0)",
}


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each run of comments on consecutive lines, the ``#`` and the
    indentation gone, lines joined by newlines: a phrase split over two lines is one."""
    blocks: list[tuple[int, list[str]]] = []
    last = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line, text = tok.start[0], tok.string.lstrip("#").strip()
        if last is not None and line == last + 1:
            blocks[-1][1].append(text)
        else:
            blocks.append((line, [text]))
        last = line
    return [(line, "\n".join(texts)) for line, texts in blocks]


def _docstrings(source: str) -> list[tuple[int, str]]:
    """(first line, source text) of every string statement: the docstrings of modules,
    classes and functions and any bare string that documents an attribute."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            out.append((node.lineno, ast.get_source_segment(source, node) or ""))
    return out


def findings(rel: str, source: str) -> list[tuple[str, int, str, str]]:
    """(path, line, what, matched text) for each comment or docstring of ``source`` that
    names a visit, a card or a date."""
    out = []
    for kind, texts in (("comment", _comment_blocks(source)), ("docstring", _docstrings(source))):
        for first, text in texts:
            for what, pattern in PATTERNS.items():
                for m in pattern.finditer(text):
                    line = first + text.count("\n", 0, m.start())
                    out.append((rel, line, f"{what} in a {kind}", " ".join(m.group(0).split())))
    return sorted(out)


def test_the_patterns_catch_what_they_are_for():
    """The forms the code used to hold are caught, split over lines included; plain
    words around them are not."""
    src = ('"""Seen on 1 x H200 (reports/gpu/README.md, the ninth visit)."""\n'
           "x = 1  # on an H100 the wake took 227 s (the fourteenth GPU\n"
           "# visit), shared 2026-12-04\n"
           "def f():\n"
           '    """visits every node: the visitor pattern, 20 of 2026."""\n'
           'y = "1 x H200, 2026-12-04"  # data, not judged\n')
    got = [(line, what, text) for _, line, what, text in findings("x.py", src)]
    assert got == [
        (1, "a GPU visit in a docstring", "ninth visit"),
        (1, "a card model in a docstring", "H200"),
        (2, "a GPU visit in a comment", "fourteenth GPU visit"),
        (2, "a card model in a comment", "H100"),
        (3, "a date in a comment", "2026-12-04"),
    ], got


def test_no_comment_or_docstring_names_a_visit_a_card_or_a_date():
    found, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for f in findings(rel, path.read_text()):
            key = (rel, f[3].lower())
            if key in ALLOWED:
                used.add(key)
            else:
                found.append(f)
    stale = sorted(set(ALLOWED) - used)
    assert not found, (f"{len(found)} finding(s): comments and docstrings say where or "
                       "when something was seen; say what the code does and why, and leave the card, the "
                       "visit and the date to docs/ or reports/:\n"
                       + "\n".join(f"{p}:{line}: {what}: {text!r}" for p, line, what, text in found))
    assert not stale, f"allowed but no longer found (drop them from ALLOWED): {stale}"
