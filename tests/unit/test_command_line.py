"""The small command lines: each parses its arguments for real (``--help`` helps, an
unknown flag or a bad value is one line on stderr and a non-zero exit, and nothing
runs)."""

from __future__ import annotations

import pytest

from harness.vllm import reaper


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
    assert out.startswith("usage: python -m harness.vllm.reaper") and "--dry-run" in out
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


def test_reaper_without_an_option_is_a_dry_run_and_yes_reaps(reaper_calls, capsys):
    """`python -m harness.vllm.reaper` with no option reaped at once: it lists now, and
    stops only with --yes (or --kill)."""
    assert reaper.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("would stop pid 1 (vllm;") and "--yes stops them" in out, out
    assert reaper_calls == ["find"]
    for flag in ("--yes", "--kill"):
        assert reaper.main([flag]) == 0
        assert capsys.readouterr().out.startswith("stopping pid 1 (vllm;")
    assert reaper_calls == ["find", "find", "reap", "find", "reap"]


# ----------------------------------------------------------------------------- ci/gpu-run.sh

def test_gpu_run_requires_the_gpu_cases_to_run(tmp_path):
    """`ci/gpu-run.sh OUT -k ipc` on a host without GPUs ran only the unit tests named
    *ipc* and passed: the script must fail a run whose GPU cases did not run."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "argv"
    # a python3 that records the pytest command line (and says the harness is installed)
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\nif [ "$1" = "-m" ]; then echo "$@" >> {seen}; fi\nexit 0\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["bash", str(root / "ci" / "gpu-run.sh"), str(tmp_path / "out"),
                        "-k", "ipc"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    argv = seen.read_text().split()
    assert argv[:2] == ["-m", "pytest"] and "--harness-require-gpu" in argv, argv
    assert argv[-2:] == ["-k", "ipc"]
    # an existing OUT outside the clone must not become pytest's rootdir: the rootdir is
    # named, and no value of an option stands alone where pytest looks for paths
    assert f"--rootdir={root}" in argv, argv
    out = str(tmp_path / "out")
    assert not any(a.startswith(out) for a in argv), argv


# ----------------------------------------------------------------------------- known_issues

def test_known_issues_refuses_a_word_that_is_not_a_version(capsys):
    from harness.known_issues import cli as known_issues_cli

    assert known_issues_cli.main(["notaversion"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("python -m harness.known_issues: 'notaversion' is not a vLLM "
                                 "version (e.g. 0.32.0)\n")


def test_known_issues_help_helps(capsys):
    from harness.known_issues import cli as known_issues_cli

    assert known_issues_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m harness.known_issues") and "verify" in out
    assert "applies to vLLM --help" not in out
    assert known_issues_cli.main(["0.32.0"]) == 0
    assert "applies to vLLM 0.32.0" in capsys.readouterr().out


# ----------------------------------------------------------------------------- one style

def _harness(capsys, *argv) -> tuple[int, str, str]:
    from harness.commands import cli

    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_harness_version_prints_the_version(capsys):
    from harness.core.facts import dist_version

    code, out, err = _harness(capsys, "--version")
    assert (code, err) == (0, "") and out == f"harness {dist_version('weight-sync-harness')}\n"


@pytest.mark.parametrize("argv, says", [
    ([], "harness: name a command: bench, demo, diff, durations, matrix, merge, repro (see harness --help)"),
    (["frob"], "harness: argument COMMAND: invalid choice: 'frob'"),
    (["demo", "--nope"], "harness demo: unrecognized arguments: --nope (see harness demo --help)"),
    (["repro", "--nope"], "harness repro: unrecognized arguments: --nope"),
    (["bench", "--warm", "x"], "harness bench: argument --warm: invalid int value: 'x'"),
    (["diff", "a.json"], "harness diff: the following arguments are required: b"),
    (["demo", "--vllm-model", "nope"], "harness demo: --vllm-model: unknown model 'nope'"),
    (["demo", "--max-tokens", "0"], "harness demo: --max-tokens: at least 1, got 0"),
])
def test_bad_input_is_one_line_in_one_style_and_exit_2(argv, says, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, out, err = _harness(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith(says) and err.count("\n") == 1, err
    assert "error:" not in err and "usage:" not in err


def test_the_small_commands_say_errors_in_the_same_style(capsys, tmp_path):
    from harness.known_issues import cli as known_issues_cli

    assert known_issues_cli.main(["verify", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m harness.known_issues verify: ") and err.count("\n") == 1
    assert reaper.main(["--nope"]) == 2
    assert capsys.readouterr().err == ("python -m harness.vllm.reaper: unrecognized arguments: "
                                       "--nope (see python -m harness.vllm.reaper --help)\n")


def test_demo_help_lists_its_exit_statuses(capsys):
    """`harness demo --help` had no exit statuses (harness repro's had them)."""
    from harness.commands import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    for line in ("0  every step passed", "1  a step failed", "2  usage error"):
        assert line in out, out
