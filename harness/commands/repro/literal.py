"""Plain data (a scenario) as a Python literal written for a reader: what fits stays on
one line, a container that does not opens a hanging block, a long text is cut into
pieces; ``ast.literal_eval`` reads every form back."""

from __future__ import annotations

import re
from typing import Any


def literal(x: Any, col: int, indent: int = 0, width: int = 88) -> str:
    """A Python literal of plain data, starting at column ``col`` of a line indented by
    ``indent``: what fits stays on one line; a container that does not fit opens a
    hanging block four columns in, its short items packed; a long string is cut into
    implicitly joined pieces (``ast.literal_eval`` reads all of it back)."""
    flat = repr(x)
    if col + len(flat) <= width or not isinstance(x, (dict, list, str)):
        return flat
    inner = indent + 4
    if isinstance(x, str) and triple_quotable(x):
        return '"""' + ("" if x.startswith("\n") else "\\\n") + x + '"""'
    if isinstance(x, str):
        hang = width - col - 2 < 32  # else the pieces line up after an opening parenthesis
        room = width - inner - 2 if hang else width - col - 2
        pieces = []
        for line in x.splitlines(keepends=True):
            chunk = ""
            for word in re.split(r"(?<= )", line):
                if chunk and len(repr(chunk + word)) > room:
                    pieces.append(chunk)
                    chunk = ""
                chunk += word
            pieces.append(chunk)
        body = [repr(s) for s in pieces]
        if not hang:
            return "(" + ("\n" + " " * (col + 1)).join(body) + ")"
        return "(\n" + "\n".join(" " * inner + s for s in body) + "\n" + " " * indent + ")"
    opening, closing = ("{", "}") if isinstance(x, dict) else ("[", "]")
    values = list(x.values()) if isinstance(x, dict) else list(x)
    flat_items = [f"{k!r}: {v!r}" for k, v in x.items()] if isinstance(x, dict) \
        else [repr(v) for v in x]
    if values and not any(isinstance(v, (dict, list)) for v in values) \
            and all(col + 1 + len(item) + 2 <= width for item in flat_items):
        # plain items only: packed in lines that start after the opening bracket
        lines = [flat_items[0]]
        for item in flat_items[1:]:
            if col + 1 + len(lines[-1]) + len(item) + 3 <= width:
                lines[-1] += ", " + item
            else:
                lines.append(item)
        return opening + (",\n" + " " * (col + 1)).join(lines) + closing
    if isinstance(x, dict):
        items = [f"{k!r}: " + literal(v, inner + len(repr(k)) + 2, inner, width)
                 for k, v in x.items()]
        items.sort(key=lambda item: item.count("\n"))  # a dict's shortest items first
    else:
        items = [literal(v, inner, inner, width) for v in x]
    lines = []
    for item in items:  # as many single-line items to a line as fit
        if lines and "\n" not in item and "\n" not in lines[-1] \
                and inner + len(lines[-1]) + len(item) + 3 <= width:
            lines[-1] += ", " + item
        else:
            lines.append(item)
    body = opening + "\n" + ",\n".join(" " * inner + line for line in lines)
    # the outermost closes on a line of its own, a nested one after its last item
    return body + (",\n" + closing if indent == 0 else closing)


def triple_quotable(x: str) -> bool:
    """A text of several lines that reads back unchanged from between triple quotes,
    each of its lines printable and short enough."""
    lines = x.split("\n")
    return len(lines) > 2 and not x.endswith('"') and '"""' not in x and "\\" not in x \
        and all(line.isprintable() and len(line) <= 88 for line in lines)
