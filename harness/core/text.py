"""Plain text that fits the reader's terminal: its width, paragraphs wrapped at word
boundaries, and tables that wrap their wide cells or, where even that cannot fit,
become one record per row.

``harness diff`` and ``harness bench``'s table render with these; any other renderer
can (nothing here knows about reports). Nothing is cut mid-word: a line longer than the width is broken
at spaces, and a single word longer than the width (a test id, a path) at its own
separators (``::``, ``[``, ``/``, ``-``...).
"""

from __future__ import annotations

import os
import sys
from typing import Collection, Sequence

DEFAULT_WIDTH = 80  # when stdout is not a terminal and COLUMNS is not set
MIN_WIDTH = 40
MIN_CELL = 20       # a wrapped table column narrower than this reads badly: records instead
GAP = "  "
_ID_BREAKS = " :[/,-=._"


def output_width(stream=None) -> int:
    """``COLUMNS`` when set; else the terminal's width when ``stream`` (stdout) is one;
    else 80. Never below ``MIN_WIDTH``."""
    env = os.environ.get("COLUMNS", "").strip()
    if env.isdigit() and int(env) > 0:
        return max(int(env), MIN_WIDTH)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return max(os.get_terminal_size(stream.fileno()).columns, MIN_WIDTH)
    except (AttributeError, OSError, ValueError):
        pass
    return DEFAULT_WIDTH


def split_word(word: str, width: int) -> list[str]:
    """A word longer than ``width`` (a test id, a path) in pieces of at most ``width``,
    each ending at one of its separators where there is one in reach."""
    width = max(width, 1)
    out = []
    while len(word) > width:
        cut = max(word.rfind(c, 0, width) for c in _ID_BREAKS) + 1
        if cut < width * 0.4:  # no separator near the end: a hard break
            cut = width
        out.append(word[:cut])
        word = word[cut:]
    return out + [word] if word or not out else out


def wrap(text: str, width: int, max_lines: int | None = None) -> list[str]:
    """``text`` in lines of at most ``width``, broken at spaces; a word longer than a
    line (a test id, a path) fills the line it starts on and goes on at its own
    separators. With ``max_lines``, what does not fit ends in " [...]" after a whole
    word. At least one line."""
    width = max(width, 1)
    text = str(text)
    if len(text) <= width and "\n" not in text:
        return [text]  # as it is, its spacing included
    lines: list[str] = []
    line = ""
    for word in text.split():
        room = width - len(line) - (1 if line else 0)
        if len(word) <= room:
            line = f"{line} {word}" if line else word
            continue
        if len(word) > width:  # too long for any line: it starts here, where there is room
            if room >= 10:
                piece = split_word(word, room)[0]
                line = f"{line} {piece}" if line else piece
                word = word[len(piece):]
            lines.append(line)
            parts = split_word(word, width)
            lines += parts[:-1]
            line = parts[-1]
            continue
        lines.append(line)
        line = word
    lines.append(line)
    lines = [ln for ln in lines if ln] or [""]
    if max_lines is not None and len(lines) > max_lines:
        lines = lines[:max_lines]
        last = lines[-1]
        while last and len(last) + 6 > width:
            last = last.rsplit(" ", 1)[0] if " " in last else last[:width - 6]
        lines[-1] = last + " [...]"
    return lines


def para(text: str, width: int, indent: str = "", first: str | None = None) -> list[str]:
    """A paragraph: ``first`` (default ``indent``) before its first line, ``indent``
    before the others."""
    first = indent if first is None else first
    body = wrap(text, width - max(len(first), len(indent)))
    return [(first if i == 0 else indent) + ln for i, ln in enumerate(body)]


def record(head: str, details: Sequence[str], width: int, label: str = "",
           label_width: int = 10, max_lines: int | None = 8) -> list[str]:
    """One finding too wide for a table: ``label`` (a level) and ``head`` (a test id,
    wrapped at its separators) on the first lines, each of ``details`` below, indented
    and wrapped at word boundaries."""
    pad = label_width + len(GAP) if label or label_width else 0
    lead = f"{label:<{label_width}}{GAP}" if pad else ""
    head_lines = split_word(head, width - pad) if " " not in head else wrap(head, width - pad)
    out = [lead + head_lines[0]] + [" " * pad + x for x in head_lines[1:]]
    indent = " " * (pad + 2)
    for d in details:
        out += [indent + x for x in wrap(d, width - len(indent), max_lines)]
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int | None,
          flex: Sequence[int] = (), key: Sequence[int] = (0,),
          max_lines: int | None = 8, right: Collection[int] = ()) -> list[str]:
    """Rows under headers in ``width`` columns (None: every column at its natural
    width, however wide). The ``flex`` columns share what the others leave and wrap
    their cells at word boundaries; when that leaves one of them narrower than
    ``MIN_CELL``, each row becomes a record instead: its ``key`` cells on the first
    line, then "header: cell" for the others. The ``right`` columns (numbers) are
    aligned right, their headers too."""
    n = len(headers)
    rows = [[str(c) for c in r] for r in rows]
    natural = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    widths = list(natural)

    def cell(i: int, c: str) -> str:
        return c.rjust(widths[i]) if i in right else c.ljust(widths[i])

    if width is None:
        return [GAP.join(cell(i, h) for i, h in enumerate(headers)).rstrip(),
                GAP.join("-" * w for w in widths)] + \
               [GAP.join(cell(i, c) for i, c in enumerate(r)).rstrip() for r in rows]
    room = width - len(GAP) * (n - 1) - sum(w for i, w in enumerate(natural) if i not in flex)
    if sum(natural) + len(GAP) * (n - 1) > width:
        if not flex or room < MIN_CELL * len(flex):
            return records(headers, rows, width, key, max_lines)
        todo = sorted(flex, key=lambda i: natural[i])
        while todo:  # water-filling: a narrow column keeps its width, the rest share
            i = todo.pop(0)
            widths[i] = min(natural[i], room // (len(todo) + 1)) if todo else room
            room -= widths[i]
        if any(widths[i] < min(MIN_CELL, natural[i]) for i in flex):
            return records(headers, rows, width, key, max_lines)
    out = [GAP.join(cell(i, h) for i, h in enumerate(headers)).rstrip(),
           GAP.join("-" * w for w in widths)]
    for r in rows:
        cells = [wrap(c, widths[i], max_lines) if i in flex else [c] for i, c in enumerate(r)]
        for k in range(max(len(c) for c in cells)):
            out.append(GAP.join(cell(i, c[k] if k < len(c) else "")
                                for i, c in enumerate(cells)).rstrip())
    return out


def records(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int,
            key: Sequence[int] = (0,), max_lines: int | None = 8) -> list[str]:
    """Each row as a record: its ``key`` cells (aligned, where they fit), then its
    other cells as "header: cell", packed on the first line while they fit, long ones
    on lines of their own."""
    out: list[str] = []
    indent = "    "
    pad = {i: max(len(r[i]) for r in rows) for i in key[:-1]} if rows else {}
    if sum(pad.values()) + len(GAP) * len(pad) > width // 2:
        pad = {}
    for r in rows:
        head = GAP.join(r[i].ljust(pad.get(i, 0)) for i in key if r[i]).rstrip()
        lines = [head] if len(head) <= width else wrap(head, width)
        line, first = lines.pop(), True  # the head's last line: items may join it
        out += lines
        for i, (h, c) in enumerate(zip(headers, r)):
            if i in key or not c:
                continue
            item = f"{h}: {c}" if h else c
            used = len(line) + (0 if first else len(indent))
            lead = used + len(GAP) if line else len(indent)
            if lead + len(item) <= width:
                line = f"{line}{GAP}{item}" if line else item
                continue
            if line:
                out.append(line if first else indent + line)
                first = False
            if len(indent) + len(item) <= width:
                line = item
            else:
                out += [indent + x for x in wrap(item, width - len(indent), max_lines)]
                line = ""
        if line:
            out.append(line if first else indent + line)
    return out


def change(a: float, b: float) -> str:
    """How ``b`` compares with ``a`` in words that stay meaningful: a percentage for a
    change within ten-fold; a ratio beyond it ("x4.2e5", "x37"); "from 0 to B" where
    a percentage of nothing means nothing, and across a change of sign."""
    if a == b:
        return "unchanged"
    if a == 0 or (a < 0) != (b < 0) and b != 0:
        return f"from {a:.4g} to {b:.4g}"
    ratio = b / a
    if ratio > 10:
        return "x" + _short(ratio)
    return f"{ratio - 1:+.0%}"


def _short(v: float) -> str:
    if v < 1000:
        return f"{v:.3g}"
    mantissa, exponent = f"{v:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"
