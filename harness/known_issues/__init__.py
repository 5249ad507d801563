"""Known upstream issues: data (``known_issues.toml``) turned into strict xfails.

``mark_known_issues(config, items)`` runs at collection (called from the plugin's
``pytest_collection_modifyitems``). Every test that matches an entry, on a vLLM
version inside the entry's ``affected`` specifier set (and on a matching host), gets
``pytest.mark.xfail(strict=True, reason="known issue <id> (<upstream>): <symptom>")``:

* it fails as described -> XFAIL, reported as "known", not as a new failure;
* it passes -> XPASS(strict), a failure whose message reads "known issue <id> fixed —
  remove this entry" (rewritten here from pytest's bare "[XPASS(strict)] <reason>");
* it fails as described but a number it recorded lies outside the entry's ``bounds``
  -> a failure, "beyond known issue <id>: got ..., known up to ..." (``bounds``);
* vLLM outside the range -> nothing is applied; the test runs as usual, and the
  end-of-run summary says whether the entry's tests pass there or fail too (a hint
  that the range is too narrow).

The matching is pure logic (``KnownIssue.matches`` / ``applies`` / ``select``) so it is
unit-testable without vLLM. ``HARNESS_KNOWN_ISSUES`` points at another file
(``none`` disables the mechanism).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import sys
from pathlib import Path
from typing import Iterable, Mapping

import pytest

from harness.core.environment import REPORTED_ENV
from harness.core.facts import DTYPE_ALIASES
from harness.known_issues import bounds as _bounds
# what the entries are matched against, looked up here by mark_known_issues
from harness.known_issues.target import host_kind, target_version

DEFAULT_PATH = Path(__file__).with_name("known_issues.toml")
ENV_PATH = "HARNESS_KNOWN_ISSUES"
FIXED_PHRASE = "fixed — remove this entry"
BEYOND_PHRASE = "a failure BEYOND its bounds: a new failure"

_FIELDS = {"id", "upstream", "affected", "checked", "read_from_source", "hosts", "tests",
           "backends", "models", "dtypes", "unless_env", "symptom", "workaround", "raises",
           "match", "bounds", "unbounded"}
_HOSTS = {"cpu", "gpu"}


def _toml():
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib


@dataclasses.dataclass(frozen=True)
class KnownIssue:
    id: str
    upstream: str
    affected: str
    symptom: str
    checked: tuple[str, ...] = ()           # versions whose tests ran: backed by a report
    read_from_source: tuple[str, ...] = ()  # versions whose source was read, not run
    hosts: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    # (VARIABLE, value) pairs, for a workaround that is an environment variable (the
    # servers inherit the run's): where one is set so, the entry does not apply
    unless_env: tuple[tuple[str, str], ...] = ()
    workaround: str = ""
    raises: str = ""   # exception class (builtin name or dotted path) the failure must be
    match: str = ""    # regex its message must match (pytest >= 8.4's RaisesExc)
    # how far the numbers its test records may go (harness.known_issues.bounds); or, for
    # a symptom with numbers that no bound fits, why not
    bounds: tuple[_bounds.Bound, ...] = ()
    unbounded: str = ""

    # ---------------------------------------------------------------- applicability
    def applies_to_version(self, version: str | None) -> bool:
        """Is ``version`` (of vLLM) inside ``affected``? Unknown version: no."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        if not version:
            return False
        try:
            v = Version(version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.affected).contains(v, prereleases=True)

    def applies_to_host(self, host: str) -> bool:
        return not self.hosts or host in self.hosts

    def workaround_set(self, env: Mapping[str, str] | None) -> str | None:
        """The first of ``unless_env`` that ``env`` sets ("VAR=value"), else None."""
        for var, value in self.unless_env:
            if env is not None and env.get(var) == value:
                return f"{var}={value}"
        return None

    def applies(self, version: str | None, host: str,
                env: Mapping[str, str] | None = None) -> bool:
        """Inside the range, on this host kind, and (``env`` given) no workaround set."""
        return (self.applies_to_version(version) and self.applies_to_host(host)
                and self.workaround_set(env) is None)

    def matches(self, nodeid: str, case: dict | None = None) -> bool:
        """Does the test ``nodeid`` (with its case fields, if any) fall under this entry?"""
        if self.tests and not any(fnmatch.fnmatchcase(nodeid, g) for g in self.tests):
            return False
        if self.backends or self.models or self.dtypes:
            if not case:
                return False
            if self.backends and not ({case.get("backend"), case.get("engine")}
                                      & set(self.backends)):
                return False
            if self.models:
                model = str(case.get("model") or "")
                names = {model, Path(model).name}
                if not any(fnmatch.fnmatchcase(n, g) for n in names for g in self.models):
                    return False
            if self.dtypes:
                want = {DTYPE_ALIASES.get(d, d) for d in self.dtypes}
                if DTYPE_ALIASES.get(case.get("dtype"), case.get("dtype")) not in want:
                    return False
        return True

    def raises_spec(self):
        """What to pass as xfail(raises=...): a failure of another kind is a real failure."""
        if not self.raises:
            return None
        import builtins
        import importlib

        if "." in self.raises:
            module, _, name = self.raises.rpartition(".")
            cls = getattr(importlib.import_module(module), name)
        else:
            cls = getattr(builtins, self.raises)
        if self.match and hasattr(pytest, "RaisesExc"):
            return pytest.RaisesExc(cls, match=self.match)
        return cls

    def check_raises(self) -> None:
        """That ``raises`` names an exception class, checked without importing its
        module (an import can cost seconds, and every run loads this file): a builtin,
        or a name the module's source defines or imports at its top level. Raises
        ImportError or AttributeError otherwise; ``raises_spec`` imports it, for the
        tests an entry marks."""
        import ast
        import builtins
        import importlib.util

        if not self.raises:
            return
        if "." not in self.raises:
            if not isinstance(getattr(builtins, self.raises, None), type):
                raise AttributeError(f"no builtin exception {self.raises!r}")
            return
        module, _, name = self.raises.rpartition(".")
        if module in sys.modules:
            getattr(sys.modules[module], name)
            return
        spec = importlib.util.find_spec(module)
        if spec is None:
            raise ImportError(f"no module named {module!r}")
        try:  # the file itself: pytest's import hook, a loader too, cannot give sources
            source = (Path(spec.origin).read_text(encoding="utf-8")
                      if spec.origin and spec.origin.endswith(".py") else None)
        except OSError:
            source = None
        if source is None:  # no source to read (an extension module): import it
            getattr(importlib.import_module(module), name)
            return
        defined = set()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Assign):
                defined |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if name not in defined:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")

    def reason(self) -> str:
        return f"known issue {self.id} ({self.upstream}): {self.symptom}"

    def judge(self, metrics: dict) -> list[_bounds.Judged]:
        """Each bound against the metrics a run of the entry's test recorded."""
        return _bounds.judge(self.bounds, metrics)

    def fixed_message(self, version: str | None, source: str) -> str:
        return (f"[XPASS(strict)] known issue {self.id} {FIXED_PHRASE}: the test passed on "
                f"vLLM {version}, inside the entry's affected range '{self.affected}'. Remove "
                f"the entry from {source} (or, if older releases still need it, bound "
                f"'affected' below {version}). Upstream: {self.upstream}")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- loading

def _str_tuple(entry: dict, key: str, where: str) -> tuple[str, ...]:
    v = entry.get(key, [])
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{where}: '{key}' must be a list of strings, got {v!r}")
    return tuple(v)


def parse(data: dict, source: str = "<known issues>") -> list[KnownIssue]:
    """Validate the parsed TOML and build the entries; errors name the entry."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    entries = data.get("issue", [])
    if not isinstance(entries, list):
        raise ValueError(f"{source}: expected [[issue]] tables")
    out: list[KnownIssue] = []
    seen: set[str] = set()
    for i, e in enumerate(entries):
        where = f"{source}: issue #{i + 1} ({e.get('id', 'no id')})"
        unknown = set(e) - _FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
        for key in ("id", "upstream", "affected", "symptom"):
            if not isinstance(e.get(key), str) or not e[key].strip():
                raise ValueError(f"{where}: '{key}' is required (a non-empty string)")
        if e["id"] in seen:
            raise ValueError(f"{where}: duplicate id {e['id']!r}")
        seen.add(e["id"])
        try:
            SpecifierSet(e["affected"])
        except InvalidSpecifier as err:
            raise ValueError(f"{where}: 'affected' is not a PEP 440 specifier set: {err}") from None
        for key in ("checked", "read_from_source"):
            for v in _str_tuple(e, key, where):
                try:
                    Version(v)
                except InvalidVersion:
                    raise ValueError(f"{where}: '{key}' holds {v!r}, not a version") from None
        unless_env = e.get("unless_env", {})
        if not (isinstance(unless_env, dict)
                and all(isinstance(v, str) for v in unless_env.values())):
            raise ValueError(f"{where}: 'unless_env' must be a table of VARIABLE = \"value\", "
                             f"got {unless_env!r}")
        unreported = [k for k in unless_env if not k.startswith(REPORTED_ENV)]
        if unreported:
            raise ValueError(f"{where}: 'unless_env' names {unreported}, which reports do not "
                             f"record (they record {', '.join(REPORTED_ENV)}*)")
        hosts = _str_tuple(e, "hosts", where)
        if set(hosts) - _HOSTS:
            raise ValueError(f"{where}: hosts must be among {sorted(_HOSTS)}, got {list(hosts)}")
        issue = KnownIssue(id=e["id"], upstream=e["upstream"], affected=e["affected"],
                           symptom=e["symptom"], checked=_str_tuple(e, "checked", where),
                           read_from_source=_str_tuple(e, "read_from_source", where),
                           hosts=hosts, tests=_str_tuple(e, "tests", where),
                           backends=_str_tuple(e, "backends", where),
                           models=_str_tuple(e, "models", where),
                           dtypes=_str_tuple(e, "dtypes", where),
                           unless_env=tuple(sorted(unless_env.items())),
                           workaround=str(e.get("workaround", "")),
                           raises=str(e.get("raises", "")), match=str(e.get("match", "")),
                           bounds=_bounds.parse(e.get("bounds"), where),
                           unbounded=str(e.get("unbounded", "")))
        if issue.bounds and issue.unbounded:
            raise ValueError(f"{where}: 'bounds' and 'unbounded' exclude each other")
        try:
            issue.check_raises()
        except (ImportError, AttributeError) as err:
            raise ValueError(f"{where}: 'raises' names no exception class: {err}") from None
        if not (issue.tests or issue.backends or issue.models or issue.dtypes):
            raise ValueError(f"{where}: needs at least one of tests/backends/models/dtypes "
                             "(an entry must not swallow the whole suite)")
        out.append(issue)
    return out


def issues_path() -> Path | None:
    env = os.environ.get(ENV_PATH)
    if env is not None:
        return None if env.strip().lower() in ("", "none", "off") else Path(env)
    return DEFAULT_PATH


def load(path: Path | None = None) -> list[KnownIssue]:
    path = path if path is not None else issues_path()
    if path is None:
        return []
    with open(path, "rb") as f:
        return parse(_toml().load(f), str(path))


def select(issues: Iterable[KnownIssue], nodeid: str, case: dict | None, version: str | None,
           host: str, env: Mapping[str, str] | None = None) -> KnownIssue | None:
    """The first entry that matches the test and applies to (version, host, env)."""
    for issue in issues:
        if issue.matches(nodeid, case) and issue.applies(version, host, env):
            return issue
    return None


# ----------------------------------------------------------------------------- pytest

KNOWN_ISSUE = pytest.StashKey[KnownIssue]()
WATCHED = pytest.StashKey[KnownIssue]()  # matches an entry whose range excludes this vLLM
STATE = pytest.StashKey["KnownIssuesState"]()


@dataclasses.dataclass
class KnownIssuesState:
    source: str
    version: str | None
    version_source: str
    host: str
    issues: list[KnownIssue]
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # the run's, at collection
    applied: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # id -> nodeids
    watched: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # id -> nodeids
    outcomes: dict[str, str] = dataclasses.field(default_factory=dict)       # nodeid -> outcome
    judged: dict[str, list] = dataclasses.field(default_factory=dict)  # nodeid -> [bounds.Judged]
    error: str | None = None

    def entries(self) -> list[dict]:
        """Every entry with whether it applies here and what its tests did."""
        out = []
        for issue in self.issues:
            nodeids = self.applied.get(issue.id, []) or self.watched.get(issue.id, [])
            outs = {n: self.outcomes.get(n, "not run") for n in nodeids}
            if not issue.applies_to_version(self.version):
                status = f"not applied: vLLM {self.version} outside '{issue.affected}'"
                if any(o == "failed" for o in outs.values()):
                    status += ("; its tests FAIL here too: does the range need widening? "
                               "(read the failure first)")
                elif outs and all(o == "passed" for o in outs.values()):
                    status += "; its tests pass here"
            elif not issue.applies_to_host(self.host):
                status = f"not applied: {self.host} host (entry is for {', '.join(issue.hosts)})"
            elif workaround := issue.workaround_set(self.env):
                status = f"not applied: {workaround} is set (its workaround)"
            elif not nodeids:
                status = "applies, but no collected test matches"
            elif any(o == "fixed" for o in outs.values()):
                status = FIXED_PHRASE
            elif any(o == "beyond" for o in outs.values()):
                status = BEYOND_PHRASE
            elif any(o == "known" for o in outs.values()):
                status = "known"
            else:
                status = "applied, not run"
            out.append({**issue.as_dict(), "status": status, "tests_outcomes": outs})
        return out


def _case_of(item: pytest.Item) -> dict | None:
    callspec = getattr(item, "callspec", None)
    case = callspec.params.get("case") if callspec else None
    return case.as_dict() if hasattr(case, "as_dict") else None


def names_any(items: list[pytest.Item]) -> bool:
    """Does an entry of the known-issues file name one of these tests by its node id?
    (The harness's own tests that take no case, run alone, still get their entries.)"""
    path = issues_path()
    try:
        issues = load(path) if path else []
    except (OSError, ValueError):
        return True  # in use or not, mark_known_issues then says what is wrong with it
    globs = [g for issue in issues for g in issue.tests]
    return any(fnmatch.fnmatchcase(item.nodeid, g) for item in items for g in globs)


def mark_known_issues(config: pytest.Config, items: list[pytest.Item],
                      url: str | None = None) -> None:
    path = issues_path()
    version, vsource = target_version(url)
    state = KnownIssuesState(source=str(path) if path else "(disabled)", version=version,
                             version_source=vsource, host=host_kind(), issues=[],
                             env=dict(os.environ))
    config.stash[STATE] = state
    try:
        state.issues = load(path) if path else []
    except (OSError, ValueError) as e:
        # A broken data file must not silently turn known failures into new ones.
        raise pytest.UsageError(f"known issues file: {e}") from None
    for item in items:
        case = _case_of(item)
        issue = select(state.issues, item.nodeid, case, version, state.host, state.env)
        if issue is None:
            # Outside an entry's range: run unmarked, but remember what the tests do.
            for other in state.issues:
                if other.matches(item.nodeid, case) and other.applies_to_host(state.host):
                    item.stash[WATCHED] = other
                    state.watched.setdefault(other.id, []).append(item.nodeid)
                    break
            continue
        item.add_marker(pytest.mark.xfail(strict=True, reason=issue.reason(),
                                          raises=issue.raises_spec()))
        item.stash[KNOWN_ISSUE] = issue
        item.user_properties.append(("known_issue", issue.id))
        state.applied.setdefault(issue.id, []).append(item.nodeid)
    if not config.pluginmanager.has_plugin("harness-known-issues"):
        config.pluginmanager.register(_Reporter(config), "harness-known-issues")


class _Reporter:
    """Rewrites XPASS(strict) of a known issue into "fixed — remove this entry" and
    summarises known issues at the end of the run."""

    def __init__(self, config: pytest.Config):
        self.config = config

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        rep = outcome.get_result()
        issue = item.stash.get(KNOWN_ISSUE, None)
        state = self.config.stash[STATE]
        if issue is None:
            if item.stash.get(WATCHED, None) is not None:
                if rep.failed:
                    state.outcomes[item.nodeid] = "failed"
                elif rep.when == "call" and rep.passed:
                    state.outcomes[item.nodeid] = "passed"
                elif rep.skipped:
                    state.outcomes[item.nodeid] = "skipped"
            return
        if rep.when == "call" and rep.failed and isinstance(rep.longrepr, str) \
                and rep.longrepr.startswith("[XPASS(strict)]"):
            rep.longrepr = issue.fixed_message(state.version, state.source)
            state.outcomes[item.nodeid] = "fixed"
        elif rep.skipped and hasattr(rep, "wasxfail"):
            state.outcomes[item.nodeid] = "known"
            if issue.bounds and rep.when == "call":
                self._judge(item, rep, issue, state)
        elif rep.failed:
            state.outcomes[item.nodeid] = "failed"  # not the known failure (xfail raises=)
        elif rep.when == "call" and rep.passed:
            state.outcomes[item.nodeid] = "passed"

    @staticmethod
    def _judge(item: pytest.Item, rep, issue: KnownIssue, state: "KnownIssuesState") -> None:
        """The known failure against the entry's bounds: the judgement goes into the
        report (``known_issue_bounds``); a number beyond them turns the XFAIL into a
        failure that says so, the original failure below it."""
        metrics: dict = {}
        for name, value in item.user_properties:
            if name == "metrics" and isinstance(value, dict):
                metrics.update(value)
        judged = issue.judge(metrics)
        prop = ("known_issue_bounds", [j.as_dict() for j in judged])
        item.user_properties.append(prop)
        rep.user_properties = list(rep.user_properties) + [prop]
        state.judged[item.nodeid] = judged
        if not _bounds.beyond(judged):
            return
        original = str(rep.longrepr) if rep.longrepr is not None else ""
        rep.outcome = "failed"
        del rep.wasxfail
        rep.longrepr = (f"{_bounds.beyond_message(issue.id, judged)}\n\n"
                        f"the failure, which matches the entry's pattern:\n{original}")
        state.outcomes[item.nodeid] = "beyond"

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:
        state = config.stash.get(STATE, None)
        if state is None or not any(o != "not run" for o in state.outcomes.values()):
            return
        tr = terminalreporter
        tr.section("known issues")
        tr.write_line(f"{state.source}; vLLM {state.version} ({state.version_source}), "
                      f"{state.host} host")
        for e in state.entries():
            ran = {n: o for n, o in e["tests_outcomes"].items() if o != "not run"}
            if not ran:  # nothing to say about an entry none of whose tests ran
                continue
            markup = ({"red": True} if e["status"] in (FIXED_PHRASE, BEYOND_PHRASE)
                      else {"yellow": True})
            tr.write_line(f"{e['id']}: {e['status']}", **markup)
            for nodeid, o in ran.items():
                tr.write_line(f"    {o:8} {nodeid}")
                for j in state.judged.get(nodeid, []):
                    tr.write_line(f"             {j.describe()}")
