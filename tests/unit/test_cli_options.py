"""One option vocabulary: the ``harness`` commands take the options they share with
pytest under pytest's names, from the same table (``harness.run.settings.OPTIONS``), with
the same ``HARNESS_*`` environment variables; their old names still work, with a
deprecation note. Nothing here starts a server."""

from __future__ import annotations

import argparse
import importlib

import pytest

from harness.commands import cli
from harness.commands import options, repro
from harness.run import settings
from harness.run import layouts

COMMANDS = ("demo", "repro", "bench")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    for opt in settings.OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(layouts, "gpu_count", lambda: 0)


def _parser(command: str) -> tuple[argparse.ArgumentParser, object]:
    module = importlib.import_module(f"harness.commands.{command}")
    p = argparse.ArgumentParser(prog=f"harness {command}")
    module.add_arguments(p)
    return p, module


def _uses(module) -> tuple[options.Use, ...]:
    return module.USES if hasattr(module, "USES") else module._uses()


@pytest.mark.parametrize("command", COMMANDS)
def test_shared_options_come_from_the_table(command):
    p, module = _parser(command)
    flags = {s: a for a in p._actions for s in a.option_strings}
    for u in _uses(module):
        opt = settings.BY_NAME[u.name]
        action = flags[opt.flag]
        assert action.dest == opt.name
        assert f"env {opt.env}" in action.help and "default " in action.help
        if opt.cli_alias:
            assert flags[opt.cli_alias].dest == opt.name  # the old name, hidden
            assert flags[opt.cli_alias].help == argparse.SUPPRESS
    # every --vllm-* flag of a command is the table's
    table = {o.flag for o in settings.OPTIONS}
    assert {f for f in flags if f.startswith("--vllm-")} <= table


def test_the_environment_chooses_the_model_of_repro(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_MODEL", "opt")
    assert cli.main(["repro", "--emit-only", "--emit", str(tmp_path / "r.py")]) == 0
    assert capsys.readouterr().out.startswith("harness repro: shm cpu float32 opt\n")
    # the command line beats the environment
    assert cli.main(["repro", "--emit-only", "--emit", str(tmp_path / "r.py"),
                     "--vllm-model", "gpt2"]) == 0
    assert capsys.readouterr().out.startswith("harness repro: shm cpu float32 gpt2\n")


def test_a_bad_value_in_the_environment_names_the_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_DTYPE", "fp64")
    assert cli.main(["repro", "--emit-only", "--emit", str(tmp_path / "r.py")]) == 2
    assert capsys.readouterr().err == (
        "harness repro: --vllm-dtype (env HARNESS_DTYPE): unknown dtype 'fp64'; known: "
        "float32 (fp32), bfloat16 (bf16)\n")


def test_old_names_still_work_with_a_deprecation_note(tmp_path, capsys):
    assert cli.main(["repro", "--emit-only", "--emit", str(tmp_path / "r.py"),
                     "--model", "gpt2", "--dtype", "bf16", "--start-timeout", "30"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("harness repro: shm cpu bfloat16 gpt2\n")
    assert err.splitlines() == ["harness repro: --model is deprecated; use --vllm-model",
                                "harness repro: --dtype is deprecated; use --vllm-dtype",
                                "harness repro: --start-timeout is deprecated; use "
                                "--vllm-start-timeout"]


def test_the_demo_and_bench_read_the_environment_too(monkeypatch, capsys):
    monkeypatch.setenv("HARNESS_LAYOUT", "2gpu-split")
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == ("harness demo: layout 2gpu-split needs 2 GPU(s), 0 "
                                       "available\n")
    monkeypatch.delenv("HARNESS_LAYOUT")
    monkeypatch.setenv("HARNESS_BACKEND", "nccl-packed")
    assert cli.main(["bench"]) == 2
    assert "0 GPUs visible; nccl-packed needs 2" in capsys.readouterr().err


def test_one_sync_timeout_default_for_pytest_and_every_command():
    table = settings.BY_NAME["vllm_sync_timeout"].default
    for command in COMMANDS:
        p, module = _parser(command)
        args = p.parse_args([])
        options.resolve_command(args, _uses(module), environ={})
        assert args.vllm_sync_timeout == table == 600.0, command


def test_defaults_that_differ_from_pytest_say_so_in_help():
    p, _ = _parser("demo")
    help_ = " ".join(p.format_help().split())
    assert "default smollm2 (real weights" in help_ and "default to llama" in help_
    p, _ = _parser("bench")
    help_ = " ".join(p.format_help().split())
    assert "default bfloat16 (the dtype RL trainers sync in" in help_


def test_repro_backend_shorthands_are_the_packed_variants(tmp_path, capsys):
    assert cli.main(["repro", "--emit-only", "--emit", str(tmp_path / "r.py"),
                     "--vllm-backend", "nccl", "--trainer-api", "factory"]) == 0
    assert capsys.readouterr().out.startswith("harness repro: nccl-packed 2gpu-split")
    assert repro.EXIT_USAGE == 2


@pytest.mark.parametrize("command", ["demo", "repro"])
@pytest.mark.parametrize("short,variant", [("nccl", "nccl-packed"), ("ipc", "ipc-packed")])
def test_demo_and_repro_share_one_backend_vocabulary(command, short, variant, monkeypatch,
                                                     capsys):
    """`harness demo --vllm-backend nccl` said "unknown backend" while repro took it.
    Both take the shorthands; without GPUs both then refuse at once (exit 2, one line),
    before a server starts: repro used to start one and fail 77 s later at the sync."""
    from harness.run import pool

    def no_pool(*a, **kw):
        raise AssertionError("a server pool was created")

    monkeypatch.setattr(pool, "ServerPool", no_pool)
    assert cli.main([command, "--vllm-backend", short]) == 2
    err = capsys.readouterr().err
    assert "unknown backend" not in err
    layout = "2gpu-split" if short == "nccl" else "1gpu-colocated"
    need = 2 if short == "nccl" else 1
    assert err == f"harness {command}: layout {layout} needs {need} GPU(s), 0 available\n", err


def test_repro_emit_into_a_missing_directory_is_refused_like_the_report(tmp_path, capsys):
    """`harness repro --emit /nonexistent/dir/x.py --emit-only` created the directory
    and exited 0, while --harness-report into a missing directory is refused: one rule
    for every output file (its directory must exist), one line, exit 2, nothing made."""
    missing = tmp_path / "nonexistent" / "dir"
    assert cli.main(["repro", "--emit", str(missing / "x.py"), "--emit-only"]) == 2
    err = capsys.readouterr().err
    assert err == (f"harness repro: --emit: the directory {missing} does not exist "
                   "(create it first)\n"), err
    assert not missing.parent.exists()
    assert cli.main(["repro", "--emit", str(tmp_path / "x.py"), "--emit-only"]) == 0


def _hub_cache(root, repo_id):
    """A Hugging Face cache holding ``repo_id``'s config.json, as huggingface_hub lays it out."""
    d = root / "hub" / f"models--{repo_id.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text("abc")
    (d / "snapshots" / "abc").mkdir(parents=True)
    (d / "snapshots" / "abc" / "config.json").write_text("{}")


@pytest.mark.parametrize("command", ["repro", "demo"])
def test_a_hub_id_that_cannot_be_fetched_is_refused_before_anything_starts(
        command, tmp_path, monkeypatch, capsys):
    """`harness repro --vllm-model org/name` without hub access started a server and
    failed 44 s later with a Hugging Face traceback: one line, exit 2, nothing started.
    A hub id in the local cache is taken offline."""
    from harness import models
    from harness.run import pool

    def no_pool(*a, **kw):
        raise AssertionError("a server pool was created")

    monkeypatch.setattr(pool, "ServerPool", no_pool)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main([command, "--vllm-model", "org/name"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"harness {command}: --vllm-model: org/name is not in the Hugging "
                          "Face cache and the hub is off (HF_HUB_OFFLINE)"), err
    assert err.count("\n") == 1, err
    _hub_cache(tmp_path / "hf", "org/name")
    assert models.hub_unavailable("org/name") is None


def test_python_dash_m_harness_is_the_harness_command():
    """``python -m harness`` is what a user tries when the venv's bin is not on PATH."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: harness"), r.stderr[-1000:]
