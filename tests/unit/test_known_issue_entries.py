"""known_issues.py: the data file, version ranges, selectors and the pytest outcomes
(known, fixed), on fake runs. No server."""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

import pytest

from harness import known_issues as ki


# ----------------------------------------------------------------------------- logic

def _issue(**kw) -> ki.KnownIssue:
    base = dict(id="x", upstream="up#1", affected=">=0.26.0", symptom="breaks")
    return ki.KnownIssue(**{**base, **kw})


@pytest.mark.parametrize("version, expected", [
    ("0.26.0", True), ("0.27.1", True), ("0.32.0", True), ("0.32.0+cpu", True),
    ("0.25.9", False), (None, False), ("not-a-version", False),
])
def test_open_range(version, expected):
    assert _issue(affected=">=0.26.0").applies_to_version(version) is expected


@pytest.mark.parametrize("version, expected", [
    ("0.26.0", True), ("0.32.9", True), ("0.33.0", False), ("0.33.0rc1", False),
    ("0.40.0", False),
])
def test_bounded_range(version, expected):
    assert _issue(affected=">=0.26.0,<0.33").applies_to_version(version) is expected


def test_entry_not_applied_outside_its_range():
    issue = _issue(tests=["*test_a.py::test_one"], affected=">=0.30,<0.31")
    nodeid = "tests/test_a.py::test_one"
    assert ki.select([issue], nodeid, None, "0.30.2", "cpu") is issue
    assert ki.select([issue], nodeid, None, "0.31.0", "cpu") is None   # fixed release
    assert ki.select([issue], nodeid, None, "0.29.9", "cpu") is None   # before the bug
    assert ki.select([issue], nodeid, None, None, "cpu") is None        # vLLM unknown


def test_hosts():
    issue = _issue(tests=["*"], hosts=("cpu",))
    assert issue.applies("0.32.0", "cpu") and not issue.applies("0.32.0", "gpu")
    assert _issue(tests=["*"]).applies("0.32.0", "gpu")


def test_case_selectors():
    issue = _issue(backends=("nccl",), dtypes=("bf16",), models=("qwen3*",))
    case = {"backend": "nccl-packed", "engine": "nccl", "dtype": "bfloat16",
            "model": "/cache/models/qwen3-moe-abc"}
    assert issue.matches("t::x[nccl-packed]", case)
    assert not issue.matches("t::x", dict(case, dtype="float32"))
    assert not issue.matches("t::x", dict(case, engine="ipc", backend="ipc-packed"))
    assert not issue.matches("t::x", dict(case, model="llama"))
    assert not issue.matches("t::x", None)  # a test without a case never matches selectors
    by_variant = _issue(backends=("nccl-unpacked",))
    assert not by_variant.matches("t", case) and by_variant.matches(
        "t", dict(case, backend="nccl-unpacked"))


def test_test_globs():
    issue = _issue(tests=("*test_sync.py::test_parity_after_sync[shm-*",))
    assert issue.matches("tests/test_sync.py::test_parity_after_sync[shm-cpu-fp32-llama]")
    assert not issue.matches("tests/test_sync.py::test_parity_after_sync[ipc-packed-1gpu]")
    assert not issue.matches("tests/test_sync.py::test_gibberish_before_sync[shm-cpu]")


@pytest.mark.parametrize("toml, error", [
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\ntests=["*"]', "'affected' is required"),
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected="=>0.2"\ntests=["*"]',
     "not a PEP 440 specifier"),
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected=">=1"', "needs at least one of"),
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected=">=1"\ntests=["*"]\nhost=["cpu"]',
     "unknown field"),
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected=">=1"\ntests=["*"]\nhosts=["tpu"]',
     "hosts must be among"),
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected=">=1"\ntests=["*"]\n'
     'raises="NoSuchError"', "'raises' names no exception class"),
    ('[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected=">=1"\ntests=["*"]\n'
     '[[issue]]\nid="a"\nupstream="u"\nsymptom="s"\naffected=">=1"\ntests=["*"]', "duplicate id"),
])
def test_invalid_files_are_refused(tmp_path, toml, error):
    p = tmp_path / "k.toml"
    p.write_text(toml)
    with pytest.raises(ValueError, match=error):
        ki.load(p)


def test_shipped_file():
    """The real data file parses, and its entry covers the versions whose source was
    read, on CPU hosts only, and selects the test above (a rename must not orphan it)."""
    issues = {i.id: i for i in ki.load(ki.DEFAULT_PATH)}
    issue = issues["base-update-weights-accelerator-sync"]
    for v in issue.checked + issue.read_from_source:
        assert issue.applies(v, "cpu"), v
    assert set(issue.checked) | set(issue.read_from_source) >= {"0.26.0", "0.27.1", "0.32.0"}
    assert not issue.applies("0.32.0", "gpu")
    assert issue.matches("tests/test_known_issues.py::"
                         "test_base_update_weights_without_accelerator")
    assert not issue.matches("tests/test_known_issues.py::"
                             "test_shm_engine_update_weights_without_accelerator")


def test_every_shipped_entry_is_consistent():
    """Each entry's checked versions lie inside its range, its exception resolves, and
    each of its test globs names a test function that exists (a rename must not
    silently orphan an entry)."""
    import ast

    tests_dir = Path(__file__).resolve().parents[1]  # the server tests' directory
    functions = {}
    for f in tests_dir.glob("test_*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                functions.setdefault(f.name, set()).add(node.name)
    for issue in ki.load(ki.DEFAULT_PATH):
        for v in issue.checked + issue.read_from_source:
            assert issue.applies_to_version(v), (issue.id, v)
        issue.raises_spec()
        for glob in issue.tests:
            file_part, _, func_part = glob.partition("::")
            func_glob = func_part.split("[")[0]
            hits = [(fname, fn) for fname, fns in functions.items()
                    if fnmatch(f"tests/{fname}", file_part) or fnmatch(fname, file_part)
                    for fn in fns if fnmatch(fn, func_glob)]
            assert hits, f"{issue.id}: no test matches {glob!r}"


def test_raises_spec():
    assert _issue().raises_spec() is None
    assert _issue(raises="RuntimeError").raises_spec() is RuntimeError
    assert _issue(raises="json.JSONDecodeError").raises_spec().__name__ == "JSONDecodeError"
    spec = _issue(raises="RuntimeError", match="accelerator").raises_spec()
    if hasattr(pytest, "RaisesExc"):
        assert spec.matches(RuntimeError("no accelerator here"))
        assert not spec.matches(RuntimeError("something else"))
        assert not spec.matches(ValueError("accelerator"))


def test_reason_and_fixed_message():
    issue = _issue(id="abc", upstream="org/repo#7", symptom="it raises")
    assert issue.reason() == "known issue abc (org/repo#7): it raises"
    msg = issue.fixed_message("0.40.0", "harness/known_issues/known_issues.toml")
    assert msg.startswith("[XPASS(strict)] known issue abc fixed — remove this entry")
    assert "0.40.0" in msg and "harness/known_issues/known_issues.toml" in msg


# ----------------------------------------------------------------------------- end to end

FAKE_ISSUES = """
[[issue]]
id = "fake-broken"
upstream = "example/upstream#1"
affected = ">=0.30,<0.40"
tests = ["*test_fake.py::test_still_broken", "*test_fake.py::test_now_works"]
symptom = "the thing raises"

[[issue]]
id = "fake-bf16"
upstream = "example/upstream#2"
affected = ">=0.30"
backends = ["shm"]
dtypes = ["bf16"]
tests = ["*test_fake.py::test_case*"]
symptom = "bf16 only"

[[issue]]
id = "fake-raises"
upstream = "example/upstream#3"
affected = ">=0.30"
tests = ["*test_fake.py::test_other_failure"]
raises = "RuntimeError"
match = "the thing raises"
symptom = "raises RuntimeError"
"""

FAKE_TESTS = """
def test_still_broken():
    raise RuntimeError("the thing raises")

def test_now_works():
    pass

def test_case(case):
    assert case.dtype != "bfloat16", "bf16 broken"

def test_other_failure():
    raise KeyError("a different failure")
"""


@pytest.fixture
def fake_run(pytester, monkeypatch):
    """Run pytest (in process, with the harness plugin) on FAKE_TESTS with FAKE_ISSUES,
    as if vLLM ``version`` were installed."""
    issues = pytester.path / "issues.toml"
    issues.write_text(FAKE_ISSUES)
    pytester.makepyfile(test_fake=FAKE_TESTS)
    monkeypatch.setenv(ki.ENV_PATH, str(issues))
    monkeypatch.delenv("HARNESS_REPORT", raising=False)

    def run(version: str, *args: str):
        monkeypatch.setattr(ki, "target_version", lambda config: (version, "faked by the test"))
        return pytester.runpytest("-rA", "-p", "no:cacheprovider", "--vllm-layout", "cpu",
                                  "--vllm-dtype", "float32,bfloat16", *args)
    return run


def test_known_and_fixed_inside_the_range(fake_run):
    r = fake_run("0.32.0")
    r.assert_outcomes(passed=1, failed=2, xfailed=2)
    out = r.stdout.str()
    # the still-broken test is "known": an XFAIL carrying the entry's reason
    assert re.search(r"XFAIL test_fake.py::test_still_broken - known issue fake-broken "
                     r"\(example/upstream#1\): the thing raises", out), out
    # the test that now passes fails the run, saying exactly what to do
    assert "known issue fake-broken fixed — remove this entry" in out
    assert re.search(r"FAILED test_fake.py::test_now_works", out)
    # case selectors: only the bf16 case is marked
    assert re.search(r"XFAIL test_fake.py::test_case\[shm-cpu-bf16-llama\] - known issue fake-bf16",
                     out), out
    assert re.search(r"PASSED test_fake.py::test_case\[shm-cpu-fp32-llama\]", out)
    # the summary separates known from fixed
    summary = out[out.index("known issues"):]
    assert "fake-broken: fixed — remove this entry" in summary
    assert "fake-bf16: known" in summary
    # a failure of another kind than the entry's `raises` is a real failure, not "known"
    assert re.search(r"FAILED test_fake.py::test_other_failure - KeyError", out), out


def test_entries_not_applied_outside_the_range(fake_run):
    r = fake_run("0.29.0")
    r.assert_outcomes(passed=2, failed=3)
    out = r.stdout.str()
    assert "known issue fake-" not in out  # no xfail reason anywhere
    # the summary still says what the entries' tests do outside the range
    summary = out[out.index("= known issues ="):]
    assert "fake-broken: not applied: vLLM 0.29.0 outside '>=0.30,<0.40'; its tests FAIL " \
           "here too" in summary
    assert "fake-raises: not applied: vLLM 0.29.0 outside '>=0.30'; its tests FAIL" in summary
    assert re.search(r"FAILED test_fake.py::test_still_broken - RuntimeError: the thing raises",
                     out)


def test_broken_issues_file_is_a_usage_error(pytester, monkeypatch):
    bad = pytester.path / "bad.toml"
    bad.write_text('[[issue]]\nid = "a"\n')
    pytester.makepyfile(test_x="def test_x(case): pass")  # a harness test: entries apply
    monkeypatch.setenv(ki.ENV_PATH, str(bad))
    r = pytester.runpytest("-p", "no:cacheprovider")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["*known issues file*'upstream' is required*"])


def test_docs_table_lists_every_entry():
    """docs/known-issues.md documents each entry of the shipped file."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "known-issues.md").read_text()
    for issue in ki.load(ki.DEFAULT_PATH):
        assert issue.id in doc, f"docs/known-issues.md does not mention {issue.id}"
        assert issue.affected in doc, f"docs/known-issues.md does not give {issue.id}'s range"



def test_an_entry_applies_to_a_caseless_test_that_it_names(pytester, monkeypatch):
    """A run of only tests that take no case (the harness's session tests, run alone)
    still gets the entries that name those tests; the plugin leaves alone only what no
    entry names (a project that does not use the harness)."""
    issues = pytester.path / "issues.toml"
    issues.write_text('[[issue]]\nid = "fake-caseless"\nupstream = "example/upstream#4"\n'
                      'affected = ">=0.30"\ntests = ["*test_caseless.py::test_named"]\n'
                      'raises = "AssertionError"\nsymptom = "the routes answer"\n')
    pytester.makepyfile(test_caseless="def test_named():\n    raise AssertionError('open')\n\n"
                                      "def test_other():\n    pass\n")
    monkeypatch.delenv(ki.ENV_PATH, raising=False)  # the default file's place, not a choice
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    monkeypatch.setattr(ki, "DEFAULT_PATH", issues)
    monkeypatch.setattr(ki, "target_version", lambda url: ("0.32.0", "faked by the test"))
    r = pytester.runpytest("-rA", "-p", "no:cacheprovider")
    r.assert_outcomes(passed=1, xfailed=1)
    assert "known issue fake-caseless" in r.stdout.str()


def test_a_workaround_variable_set_turns_its_entry_off(pytester, monkeypatch):
    """An entry whose workaround is an environment variable (``unless_env``) does not
    apply where the run sets it, so the documented workaround gives a pass, not an
    XPASS(strict) failure; the summary says why. Without the variable it applies."""
    issues = pytester.path / "issues.toml"
    issues.write_text('[[issue]]\nid = "fake-env"\nupstream = "example/upstream#5"\n'
                      'affected = ">=0.30"\ntests = ["*test_env.py::test_fixed_by_env*"]\n'
                      'unless_env = { TRITON_FAKE_WORKAROUND = "on" }\n'
                      'symptom = "fails unless the variable is set"\n')
    pytester.makepyfile(test_env="import os\n\ndef test_fixed_by_env(case):\n"
                                 "    assert os.environ.get('TRITON_FAKE_WORKAROUND') == 'on'\n")
    monkeypatch.setenv(ki.ENV_PATH, str(issues))
    monkeypatch.delenv("HARNESS_REPORT", raising=False)
    monkeypatch.setattr(ki, "target_version", lambda url: ("0.32.0", "faked by the test"))
    args = ("-rA", "-p", "no:cacheprovider", "--vllm-layout", "cpu", "--vllm-dtype", "float32")
    monkeypatch.delenv("TRITON_FAKE_WORKAROUND", raising=False)
    pytester.runpytest(*args).assert_outcomes(xfailed=1)
    monkeypatch.setenv("TRITON_FAKE_WORKAROUND", "on")
    r = pytester.runpytest(*args)
    r.assert_outcomes(passed=1)
    assert "fake-env: not applied: TRITON_FAKE_WORKAROUND=on is set (its workaround)" \
        in r.stdout.str()


@pytest.mark.parametrize("table, error", [
    ('unless_env = ["TRITON_F32_DEFAULT"]', "must be a table"),
    ('unless_env = { TRITON_F32_DEFAULT = 1 }', "must be a table"),
    ('unless_env = { MY_FLAG = "1" }', "names ['MY_FLAG'], which reports do not record"),
])
def test_unless_env_is_checked(table, error):
    data = ki._toml().loads('[[issue]]\nid = "a"\nupstream = "u"\naffected = ">=0.26"\n'
                            f'symptom = "s"\ntests = ["t"]\n{table}\n')
    with pytest.raises(ValueError, match=re.escape(error)):
        ki.parse(data)
