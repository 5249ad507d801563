"""The small command lines: each parses its arguments for real (``--help`` helps, an
unknown flag or a bad value is one line on stderr and a non-zero exit, and nothing
runs)."""

from __future__ import annotations

import pytest

from harness import reaper


# ----------------------------------------------------------------------------- reaper

@pytest.fixture
def reaper_calls(monkeypatch):
    calls = []
    orphan = reaper.Orphan(pid=1, owner="1:0.00", name="vllm", cmdline="vllm serve m")
    monkeypatch.setattr(reaper, "find_orphans", lambda: calls.append("find") or [orphan])
    monkeypatch.setattr(reaper, "reap", lambda orphans: calls.append("reap"))
    return calls


def test_reaper_help_helps_and_stops_nothing(reaper_calls, capsys):
    assert reaper.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m harness.reaper") and "--dry-run" in out
    assert reaper_calls == []


def test_reaper_refuses_an_unknown_flag_and_stops_nothing(reaper_calls, capsys):
    assert reaper.main(["--dryrun"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --dryrun" in err
    assert reaper_calls == []


def test_reaper_dry_run_lists_and_stops_nothing(reaper_calls, capsys):
    assert reaper.main(["--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("would stop pid 1 (vllm;")
    assert reaper_calls == ["find"]
    assert reaper.main([]) == 0
    assert reaper_calls == ["find", "find", "reap"]
