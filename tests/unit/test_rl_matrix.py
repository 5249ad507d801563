"""docs/vllm-rl-matrix.md stays true: every test a row names exists as a function in
its file, and is collected on the host the row says (cpu rows: in the default CPU
selection; 1gpu rows: with ``-k ipc`` planned for one GPU; 2gpu / 3gpu rows: planned for
that many GPUs); GPU rows are not run on a CPU host. The counts under the table and in
the README are the table's."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm-rl-matrix.md"
README = ROOT / "README.md"
STATUSES = ("covered", "partly", "missing", "GPU, next visit", "being built (issue 34)")
HOSTS = {"cpu": None, "1gpu": "gpus=1,cores=16,ram_gib=128",
         "2gpu": "gpus=2,cores=32,ram_gib=256", "3gpu": "gpus=3,cores=48,ram_gib=384"}
TEST = re.compile(r"^`(tests/[\w/]+\.py)::(\w+)`$")

def rows(text: str | None = None) -> list[dict]:
    text = DOC.read_text() if text is None else text
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or not cells[0].isdigit():
            continue
        num, scenario, source, status, test, host, note = cells
        out.append({"n": int(num), "scenario": scenario, "status": status, "test": test,
                    "host": host, "note": note})
    return out


def counts(rs: list[dict]) -> dict[str, int]:
    return {s: sum(r["status"] == s for r in rs) for s in STATUSES}


def counts_line(rs: list[dict]) -> str:
    c = counts(rs)
    return (f"{len(rs)} scenarios: {c['covered']} covered, {c['partly']} partly, "
            f"{c['missing']} missing, {c['GPU, next visit']} GPU, next visit (written, not run), "
            f"{c['being built (issue 34)']} being built (issue 34)")


def functions_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def named_files(host: str) -> tuple[str, ...]:
    """The files the rows of ``host`` name (whether a test is collected is decided test
    by test, so its file alone collects it as the whole selection does)."""
    return tuple(sorted({m.group(1) for r in rows()
                         if r["host"] == host and (m := TEST.match(r["test"]))}))


def collected(child_pytest, host: str) -> dict[str, str]:
    """{file::test function: 'run' | 'skip'} collected on ``host``: for cpu, the default
    selection on the CPU CI's host; else from the files the host's rows name (one child
    pytest per host, shared by the tests that ask)."""
    if HOSTS[host] is None:
        r = child_pytest.cpu_default()
    else:
        r = child_pytest("--collect-only", *named_files(host),
                         *(["-k", "ipc"] if host == "1gpu" else []),
                         "--harness-plan-host", HOSTS[host])
    assert r.returncode in (0, 5), f"collection for {host} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    out: dict[str, str] = {}
    for nodeid, skip in r.items:
        name = nodeid.split("::", 1)[1].split("[", 1)[0]
        key = nodeid.split("::", 1)[0] + "::" + name
        if out.get(key) != "run":
            out[key] = "skip" if skip else "run"
    return out


def test_every_row_is_well_formed():
    rs = rows()
    assert rs, "no rows parsed from docs/vllm-rl-matrix.md"
    assert [r["n"] for r in rs] == list(range(1, len(rs) + 1)), "rows are not numbered 1..N"
    for r in rs:
        assert r["status"] in STATUSES, f"row {r['n']}: status {r['status']!r}"
        if r["status"] == "missing":
            assert r["test"] == "-" and r["note"], f"row {r['n']}: a missing row says why, names no test"
            continue
        assert r["host"] in HOSTS, f"row {r['n']}: host {r['host']!r}"
        if r["status"].startswith("being built"):
            assert re.fullmatch(r"tests/\w+\.py", r["test"]), f"row {r['n']}: {r['test']!r}"
            continue
        assert TEST.match(r["test"]), f"row {r['n']}: test {r['test']!r} is not `tests/file.py::name`"
        if r["status"] == "GPU, next visit":
            assert r["host"] != "cpu", f"row {r['n']}: a GPU row on host cpu"


def test_every_named_test_exists():
    for r in rows():
        m = TEST.match(r["test"])
        if not m:
            continue
        path = ROOT / m.group(1)
        assert path.exists(), f"row {r['n']}: {m.group(1)} does not exist"
        assert m.group(2) in functions_in(path), f"row {r['n']}: no function {m.group(2)} in {m.group(1)}"


def _named(host: str, statuses: tuple[str, ...]) -> list[tuple[dict, str]]:
    return [(r, TEST.match(r["test"])) for r in rows()
            if r["host"] == host and r["status"] in statuses and TEST.match(r["test"])]


def test_cpu_rows_are_collected_and_run_in_the_default_cpu_selection(child_pytest):
    named = _named("cpu", ("covered", "partly"))
    got = collected(child_pytest, "cpu")
    for r, m in named:
        key = f"{m.group(1)}::{m.group(2)}"
        assert got.get(key) == "run", (f"row {r['n']}: {key} is "
                                       f"{'skipped' if key in got else 'not collected'} in the "
                                       "default CPU selection")


@pytest.mark.parametrize("host", ["1gpu", "2gpu", "3gpu"])
def test_gpu_rows_are_collected_on_their_host(child_pytest, host):
    named = _named(host, ("covered", "partly", "GPU, next visit"))
    if not named:
        pytest.skip(f"no {host} rows")
    got = collected(child_pytest, host)
    for r, m in named:
        key = f"{m.group(1)}::{m.group(2)}"
        assert got.get(key) == "run", (f"row {r['n']}: {key} is "
                                       f"{'skipped' if key in got else 'not collected'} on a "
                                       f"{host} host ({HOSTS[host]}{', -k ipc' if host == '1gpu' else ''})")


def test_gpu_rows_do_not_run_on_a_cpu_host(child_pytest):
    named = [(r, m) for h in ("1gpu", "2gpu", "3gpu")
             for r, m in _named(h, ("GPU, next visit",))]
    got = collected(child_pytest, "cpu")
    for r, m in named:
        key = f"{m.group(1)}::{m.group(2)}"
        assert got.get(key) != "run", f"row {r['n']}: {key} would run on a CPU host"


def test_the_counts_are_the_tables():
    line = counts_line(rows())
    assert f"Counts: {line}." in DOC.read_text(), f"docs/vllm-rl-matrix.md should say: Counts: {line}."
    assert line in README.read_text(), f"README.md's coverage section should say: {line}"


def test_the_parser_sees_a_bad_row():
    bad = ("| 1 | x | 1 | covered | `tests/test_sleep.py::no_such_test` | cpu | |\n"
           "| 2 | y | 1 | done | - | cpu | |\n")
    rs = rows(bad)
    assert [r["status"] for r in rs] == ["covered", "done"]
    assert "no_such_test" not in functions_in(ROOT / "tests" / "test_sleep.py")
    assert counts(rs)["covered"] == 1
