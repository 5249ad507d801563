"""The plugin's command-line options, ini keys and markers, and the settings they
resolve to (``harness.run.settings``: command line > environment > ini > default)."""

from __future__ import annotations

import warnings

import pytest

from harness.run import settings as _settings

MARKERS = (
    "models(*names): zoo models / paths this test runs on; --vllm-model narrows them",
    "dtypes(*names): dtypes this test runs on; --vllm-dtype narrows them",
    "backends(*ids): backend variants this test runs on; --vllm-backend narrows them",
    "layouts(*names): layouts this test runs on; --vllm-layout narrows them",
    "modes(*names): serving modes (eager, graphs) this test runs on; --vllm-mode narrows them",
    "trainers(*names): trainer code (harness, vllm; user: the trainers of your own "
    "--vllm-trainer names) this test runs with; --vllm-trainer "
    "narrows them",
    "features(*names): server features (harness.run.cases.FEATURES: fp8, sleep, 2api, lora) every "
    "case of this test carries; not narrowed, -k selects them by id",
    "fresh_server: the test needs a server that has never been synced (dummy weights)",
    "twin: the test also needs a second server that loads the model from disk (in the "
    "case's mode; twin(mode='eager') names another)",
    "parity: compares vLLM with the Hugging Face reference after a sync",
    "pause_resume: checks /pause, /resume and /is_paused semantics",
    "gpu: runs on a GPU layout (set on every case whose layout uses a GPU)",
    "smoke: the seed flow on one server (gibberish, sync, parity, a request held by /pause "
    "until /resume): `pytest -m smoke`, is it working?",
    "selftest: shows that a check fails when the behaviour it checks is broken",
    "faults: bad input, protocol misuse, dying processes and leaks",
    "breaks_server: the test may leave its server unusable; it runs after every other "
    "test on that server, which is then stopped or restarted",
    "sleeps: the test sleeps or wakes its server, a turn of the GPU-memory lock that waits "
    "out other servers' starts on the GPU; it runs after the server's other tests",
    "bench: runs harness bench against real servers (timings, not parity)",
    "harness_deselect(reason): set by the harness on cases this run cannot or must not run",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("weight-sync-harness")
    for opt in _settings.OPTIONS:
        where = f"default {opt.default_text()}; env {opt.env}; ini {opt.name}".replace("%", "%%")
        if isinstance(opt.default, bool):
            group.addoption(opt.flag, action="store_true", default=None,
                            help=f"{opt.help} ({where})")
            parser.addini(opt.name, opt.help, type="bool", default=None)
        elif opt.multiple:
            group.addoption(opt.flag, action="append", default=None,
                            help=f"{opt.help} (repeatable, or comma-separated; {where})")
            parser.addini(opt.name, opt.help, type="linelist", default=[])
        else:
            group.addoption(opt.flag, default=None, help=f"{opt.help} ({where})")
            parser.addini(opt.name, opt.help, default=None)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser, args) -> None:
    """An option value that is a path outside the project must not move the rootdir."""
    from harness.pytest.rootdir import anchor

    anchor(early_config, args)


def register_markers(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def resolve_settings(config: pytest.Config) -> _settings.Settings:
    """Every option's value, resolved and checked once; a bad value is a usage error,
    a deprecated one a warning said where a user sees it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            s = _settings.resolve(config.getoption, config.getini)
        except _settings.SettingsError as e:
            raise pytest.UsageError(str(e)) from None
    for w in caught:  # said once, where a user sees it
        kind = (pytest.PytestDeprecationWarning if issubclass(w.category, DeprecationWarning)
                else pytest.PytestConfigWarning)
        config.issue_config_time_warning(kind(str(w.message)), stacklevel=2)
    if s.harness_require_gpu and s.gpus() == 0:
        raise pytest.UsageError("--harness-require-gpu: no GPU is visible to this run")
    return s
