"""The README and the pages under docs/ name only files that exist.

Two kinds of reference are checked, in README.md, docs/*.md and the READMEs under
reports/:

* relative Markdown links and images, ``[text](target)``, resolved against the page's
  directory (web addresses are left alone); a ``#part`` of a link to a Markdown page
  must be one of that page's headings, as GitHub spells its anchors;
* backticked repository paths, ``harness/run/settings.py``: a backticked token whose first
  component is one of the repository's top-level entries (``harness``, ``tests``,
  ``docs``, ``ci``, ``reports``, ...). Paths into vLLM's or another project's source
  (``vllm/platforms/cpu.py``) start elsewhere and are not ours to check; globs and
  placeholders (``reports/matrix/cpu-vllm-X.json``) name no single file.

A page that moved or a file that was renamed then fails here, naming the page, the line
and the reference, instead of sending a newcomer to nothing.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE = re.compile(r"`([^`\n]+)`")
# Words that stand for a value in a path: cpu-vllm-X.json, OUTDIR/report.json.
PLACEHOLDERS = {"X", "OLD", "NEW", "DIR", "OUTDIR", "OUT", "PATH", "N", "V", "NAME", "A", "B"}


def pages(root: Path = ROOT) -> list[Path]:
    found = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    return found + [p for p in (root / "reports" / "README.md",
                                root / "reports" / "gpu" / "README.md") if p.exists()]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page."""
    out = set()
    fence = False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def _top_level(root: Path) -> set[str]:
    """The repository's own top-level names: what git tracks, so that a generated folder
    (``.harness-cache/``, ``.venv/``) present on one machine is not taken for the
    repository's (a path under it is a run's output, which a fresh clone lacks)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {p.name for p in root.iterdir() if p.name not in (".git",)}
    return {line.split("/", 1)[0] for line in out.splitlines() if line}


def _is_placeholder(token: str) -> bool:
    if any(c in token for c in "*<>{}$[]|"):
        return True
    words = re.split(r"[/._\-]", token)
    return any(w in PLACEHOLDERS for w in words)


def _path_of(token: str) -> str | None:
    """The repository path a backticked token names, or None when it names none."""
    token = token.strip().split("::", 1)[0].rstrip(",.;:")
    if " " in token or "=" in token or token.startswith(("/", "~", "http", "-")):
        return None
    if "/" not in token:
        return None
    token = token.removeprefix("./")
    return token


def broken_references(page: Path, root: Path = ROOT) -> list[str]:
    """``page:line: reference`` for each reference on the page that names no file."""
    top = _top_level(root)
    bad = []
    fence = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, part = target.partition("#")
            dest = page.parent / path if path else page
            if not dest.exists():
                bad.append(f"{page.relative_to(root)}:{n}: link {target}")
            elif part and dest.suffix == ".md" and part not in anchors(dest):
                bad.append(f"{page.relative_to(root)}:{n}: anchor {target}")
        if fence:
            continue
        for token in CODE.findall(line):
            path = _path_of(token)
            if path is None or path.split("/", 1)[0] not in top or _is_placeholder(path):
                continue
            if not (root / path).exists():
                bad.append(f"{page.relative_to(root)}:{n}: path {token}")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_names_a_file_that_exists(page):
    assert broken_references(page) == []


def test_the_readme_points_at_nothing_outside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "/tmp/" not in text


def test_a_broken_link_and_a_missing_path_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "real.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Beyond one host: `x`\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/) and [gone](docs/missing.md#part)\n"
                    "`harness/real.py`, `harness/gone.py`, `vllm/platforms/cpu.py`,\n"
                    "`reports/matrix/cpu-vllm-X.json`, [web](https://example.org/x.md)\n"
                    "[here](docs/page.md#beyond-one-host-x), [not](docs/page.md#nowhere)\n")
    assert broken_references(page, tmp_path) == [
        "README.md:1: link docs/missing.md#part",
        "README.md:2: path harness/gone.py",
        "README.md:4: anchor docs/page.md#nowhere",
    ]
