"""Fixtures the unit tests share."""

from __future__ import annotations

import os

import pytest

pytest.register_assert_rewrite("child_pytest")

from child_pytest import ChildRuns  # noqa: E402  (after the rewrite is registered)


@pytest.fixture(scope="session")
def child_pytest(tmp_path_factory) -> ChildRuns:
    """Child pytest runs of this repository, each made once per test run: side by side
    (pytest-xdist) in the folder the workers' temporary folders share, else in this
    session's own."""
    base = tmp_path_factory.getbasetemp()
    return ChildRuns((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)
                     / "child-pytest")
