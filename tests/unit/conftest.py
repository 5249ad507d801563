"""Fixtures the unit tests share, and the ``slow_unit`` mark.

``slow_unit`` marks a unit test that runs whole processes: a child pytest (every
``child_pytest`` run collects the whole suite, 10-13 s of CPU, so each test that asks
for one is marked here, by its fixture), a trainer or the harness's CLI in a child, or
one interpreter per module. The README's unit-test command leaves them out
(``-m "not slow_unit"``); ``python -m pytest`` (README line 2, ``.ci/run``) runs them
with the rest of the suite, and ``pytest tests/unit -m slow_unit`` runs them alone."""

from __future__ import annotations

import os

import pytest

pytest.register_assert_rewrite("child_pytest")

from child_pytest import ChildRuns  # noqa: E402  (after the rewrite is registered)

SLOW_UNIT = ("slow_unit: a unit test that runs whole processes (a child pytest, a trainer, "
             "an interpreter per module); the README's unit-test command leaves it out, "
             "`python -m pytest` runs it")


def pytest_configure(config):
    config.addinivalue_line("markers", SLOW_UNIT)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Before ``-m`` deselects: every test that asks for a child pytest is slow_unit."""
    for item in items:
        if "child_pytest" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow_unit)


@pytest.fixture(autouse=True)
def no_report_probes(monkeypatch):
    """A report written in a unit test probes no vLLM: the probes import it in child
    interpreters (10 s of CPU and more per report, pytester's fresh HOME leaving their
    cache empty). The tests of the probes turn them back on (``delenv``);
    tests/test_installed_vllm.py runs them against the installed vLLM."""
    monkeypatch.setenv("HARNESS_REPORT_PROBES", "0")


@pytest.fixture(scope="session")
def child_pytest(tmp_path_factory) -> ChildRuns:
    """Child pytest runs of this repository, each made once per test run: side by side
    (pytest-xdist) in the folder the workers' temporary folders share, else in this
    session's own."""
    base = tmp_path_factory.getbasetemp()
    return ChildRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
                     / "child-pytest")
