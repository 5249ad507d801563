"""The harness's settings: one table of options, resolved and validated once.

Every setting exists as a command-line option, an ini key and an environment variable
under the harness's own prefix (``HARNESS_MODEL`` for ``--vllm-model``). Resolution
order: command line > environment > ini file > default (a test's marker narrows what
the command line selected; see ``narrow``). Values are checked here, when the run is
configured: a bad value is one ``SettingsError`` naming the option and what it
accepts, never a traceback at collection or a surprise at test setup.

The environment names of the first release (``VLLM_MODEL``, ``VLLM_BACKEND``...) sit
in vLLM's namespace, where vLLM warns about them (or refuses to start with
``--fail-on-environ-validation``). They are still read, with a deprecation warning,
and never passed on to a server.

Nothing here imports pytest: the plugin, ``harness demo`` and ``harness repro`` share it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable, Mapping

from harness import models
from harness.core import facts
from harness.run import layouts
from harness.run import option_values
from harness.run.option_values import SettingsError, check_model, output_file
from harness.trainer import user as trainer_plugin
from harness.transfer import VARIANTS


# ----------------------------------------------------------------------------- the table

@dataclasses.dataclass(frozen=True)
class Option:
    """One setting: a pytest option, an ini key, an environment variable and, where a
    ``harness`` command takes it (``Use``), that command's option under the same name."""

    name: str            # attribute of Settings and ini key; --vllm-model is vllm_model
    help: str
    default: Any
    parse: Callable[[str, str], Any]
    multiple: bool = False
    secret: bool = False  # never shown: reports and headers say only whether it is set
    shown_default: str | None = None  # --help's words for a default that is not a value
    metavar: str | None = None
    cli_alias: str | None = None  # the commands' name for it before they shared the table

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        base = self.name.removeprefix("vllm_").removeprefix("harness_")
        return "HARNESS_" + base.upper()

    @property
    def legacy_env(self) -> str | None:
        """The first release's name, for the options it had (``VLLM_MODEL``); options
        added since have none (``VLLM_API_KEY`` is vLLM's own variable, not ours)."""
        old = self.name.upper()
        return old if old != self.env and old in facts.HARNESS_LEGACY_ENV else None

    def default_text(self, default: Any = None) -> str:
        """The default as --help states it (``default``: a command's own)."""
        if default is None:
            if self.shown_default is not None:
                return self.shown_default
            default = self.default
        if default is None:
            return "none"
        if isinstance(default, bool):
            return "on" if default else "off"
        if isinstance(default, (list, tuple)):
            return ",".join(map(str, default))
        if isinstance(default, float):
            return f"{default:g}"
        return str(default)


DEPTHS = ("full", "quick")
_OPT_IN_LAYOUTS = ", ".join(sorted(set(layouts.LAYOUTS) - set(layouts.DEFAULT_LAYOUTS)))

OPTIONS: tuple[Option, ...] = (
    Option("vllm_url", "attach to a running vLLM server at this URL instead of starting one "
           "(its backend and model must match the selected cases)", None, option_values.url,
           shown_default="none: servers are started", metavar="URL"),
    Option("vllm_model", "model(s): zoo names (" + ", ".join(models.ZOO) + "), local "
           "directories or hub ids", ["llama"], check_model, True, metavar="MODEL",
           cli_alias="--model"),
    Option("vllm_dtype", "dtype(s): float32/fp32, bfloat16/bf16", ["float32"],
           option_values.dtype, True, metavar="DTYPE", cli_alias="--dtype"),
    Option("vllm_backend", "backend variant(s): " + ", ".join(VARIANTS), list(VARIANTS),
           option_values.choice(VARIANTS, "backend"), True, shown_default="all", metavar="BACKEND",
           cli_alias="--backend"),
    Option("vllm_layout", "layout(s): " + ", ".join(layouts.LAYOUTS),
           list(layouts.DEFAULT_LAYOUTS), option_values.choice(layouts.LAYOUTS, "layout"), True,
           shown_default="all but the opt-in " + _OPT_IN_LAYOUTS, metavar="LAYOUT",
           cli_alias="--layout"),
    Option("vllm_mode", "serving mode(s): " + ", ".join(
        f"{k} ({v})" for k, v in facts.MODES.items()), [facts.DEFAULT_MODE],
           option_values.choice(facts.MODES, "serving mode"), True, metavar="MODE"),
    Option("vllm_trainer", "trainer code(s): " + ", ".join(
        f"{k} ({v})" for k, v in facts.TRAINERS.items()) + ", or your own: MODULE:ATTRIBUTE "
           f"or an entry point name of group {trainer_plugin.ENTRY_POINT_GROUP} "
           "(harness/trainer/user.py)", [facts.DEFAULT_TRAINER],
           option_values.trainer, True, metavar="CODE"),
    Option("vllm_gpus", "use at most this many GPUs", None,
           lambda f, v: option_values.count(f, v, 0), shown_default="all visible", metavar="N"),
    Option("vllm_log_dir", "directory for per-server and per-trainer logs",
           ".harness-cache/logs", option_values.directory, metavar="DIR", cli_alias="--log-dir"),
    Option("vllm_start_timeout", "seconds a server may take to become healthy", 600.0,
           option_values.positive_float, metavar="SECONDS", cli_alias="--start-timeout"),
    Option("vllm_sync_timeout", "seconds one whole trainer sync may take", 600.0,
           option_values.positive_float, metavar="SECONDS", cli_alias="--sync-timeout"),
    Option("vllm_max_servers", "servers alive at once, those starting ahead included", None,
           lambda f, v: option_values.count(f, v, 1), shown_default="what the host's memory holds "
           "(harness.run.plan.Host)", metavar="N", cli_alias="--max-servers"),
    Option("vllm_max_starting", "servers started at once", None,
           lambda f, v: option_values.count(f, v, 1),
           shown_default="one per two CPU cores, two on a host of 2-3 cores", metavar="N"),
    Option("vllm_attention_backend", "attention backend for GPU servers, a name vLLM knows "
           "(FlashAttention 3 refuses float32)", None, option_values.attention_backend,
           shown_default="FLEX_ATTENTION for float32, else vLLM's choice", metavar="NAME"),
    Option("vllm_api_key", "API key of the servers: started with it (as VLLM_API_KEY) and "
           "sent by every client of the harness, trainers included, as 'Authorization: "
           "Bearer <key>'", None, option_values.text, secret=True, metavar="KEY"),
    Option("harness_report", "write the run's machine-readable JSON report to this file, "
           "in an existing directory", None, output_file, metavar="PATH"),
    Option("harness_plan", "print the server plan of the selected tests (servers, the "
           "tests on each, starts, expected waves) and run nothing", False,
           lambda f, v: _flag(f, v)),
    Option("harness_plan_host", "plan for another host: name=value pairs among gpus, cores, "
           "gpu_memory_gib, ram_gib (e.g. gpus=2,cores=32)", None,
           lambda f, v: option_values.host_spec(f, v), shown_default="this host", metavar="SPEC"),
    Option("harness_shard", "run shard K of N of the selection: whole servers (a dummy "
           "server with its disk-loaded twin) per shard, balanced by the plan's estimate; "
           "harness merge joins the shards' reports", None, option_values.shard, metavar="K/N"),
    Option("harness_depth", "how far the default selection goes: 'full' runs every zoo "
           "architecture in every dtype its tests pin, with their disk-loaded twins, and the "
           "graph-mode cases; 'quick' runs llama in every dimension and each other "
           "architecture once, in float32, without twins, and graph mode only on GPUs "
           "(naming --vllm-model, --vllm-dtype or --vllm-mode widens it again)", None,
           option_values.choice(DEPTHS, "depth"), shown_default="full with GPUs, quick without",
           metavar="DEPTH"),
    Option("harness_trainer_spares", "trainer processes kept started ahead, their imports "
           "and CUDA context done, for the tests that need a fresh trainer (0 starts none)", None,
           lambda f, v: option_values.count(f, v, 0), shown_default="2 on 8 cores or more, else 0",
           metavar="N"),
    Option("harness_require_gpu", "fail the run when no GPU is visible, or when GPU cases "
           "were selected and none of them ran (a runner that lost its GPUs)", False,
           lambda f, v: _flag(f, v)),
    Option("harness_allow_no_gpu", "a selection that names GPU cases none of which can run "
           "here (-k ipc on a host without GPUs) passes instead of failing", False,
           lambda f, v: _flag(f, v)),
)
BY_NAME = {o.name: o for o in OPTIONS}


def _flag(flag: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise SettingsError(f"{flag}: expected true or false, got {v!r}")


# ----------------------------------------------------------------------------- settings

@dataclasses.dataclass(frozen=True)
class Settings:
    vllm_url: str | None = None
    vllm_model: tuple[str, ...] = ("llama",)
    vllm_dtype: tuple[str, ...] = ("float32",)
    vllm_backend: tuple[str, ...] = tuple(VARIANTS)
    vllm_layout: tuple[str, ...] = tuple(layouts.DEFAULT_LAYOUTS)
    vllm_mode: tuple[str, ...] = (facts.DEFAULT_MODE,)
    vllm_trainer: tuple[str, ...] = (facts.DEFAULT_TRAINER,)
    vllm_gpus: int | None = None
    vllm_log_dir: str = ".harness-cache/logs"
    vllm_start_timeout: float = 600.0
    vllm_sync_timeout: float = 600.0
    vllm_max_servers: int | None = None
    vllm_max_starting: int | None = None
    vllm_attention_backend: str | None = None
    vllm_api_key: str | None = dataclasses.field(default=None, repr=False)
    harness_report: str | None = None
    harness_plan: bool = False
    harness_plan_host: str | None = None
    harness_depth: str | None = None
    harness_shard: tuple[int, int] | None = None
    harness_require_gpu: bool = False
    harness_trainer_spares: int | None = None
    harness_allow_no_gpu: bool = False
    explicit: frozenset[str] = frozenset()  # options the user set (not defaults)

    def trainer_spares(self) -> int:
        """Trainer spares to keep: as set, else 2 on a host of 8 cores or more (a GPU
        host), else none: on 2 cores a spare's imports compete with the servers."""
        if self.harness_trainer_spares is not None:
            return self.harness_trainer_spares
        return 2 if (os.cpu_count() or 1) >= 8 else 0

    def gpus(self) -> int:
        """GPUs the run may use: those visible (or, planning for another host, that
        host's), capped by --vllm-gpus. Probes lazily."""
        present = self.host().gpus
        return present if self.vllm_gpus is None else min(present, self.vllm_gpus)

    def depth(self) -> str:
        """'full' or 'quick' (harness_depth; quick by default, on GPUs as without)."""
        return self.harness_depth or "quick"

    def host(self):
        """The host the run is planned for (``harness.run.plan.Host``): this one, or the one
        --harness-plan-host describes."""
        from harness.run.plan import Host

        here = Host.this()
        return Host.parse(self.harness_plan_host, here) if self.harness_plan_host else here

    def as_dict(self) -> dict[str, Any]:
        """Every option's value; a secret one only as whether it is set."""
        return {o.name: ("(set)" if getattr(self, o.name) else None) if o.secret
                else getattr(self, o.name) for o in OPTIONS}


def _split(values: list[Any]) -> list[str]:
    out: list[str] = []
    for v in values:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


def value_from_environment(opt: Option, environ: Mapping[str, str],
                           legacy: bool) -> tuple[Any, str]:
    """(raw value, where it came from) of ``opt`` in the environment, or (None, '')."""
    if environ.get(opt.env):
        return environ[opt.env], f"env {opt.env}"
    if legacy and opt.legacy_env and environ.get(opt.legacy_env):
        warnings.warn(f"{opt.legacy_env} is deprecated (it sits in vLLM's namespace); "
                      f"use {opt.env}", DeprecationWarning, stacklevel=3)
        return environ[opt.legacy_env], f"env {opt.legacy_env}"
    return None, ""


def parse_value(opt: Option, raw: Any, where: str) -> Any:
    """``raw`` (a string, or a list of them) checked by ``opt``'s parser; a tuple of
    unique values for an option that takes several. Raises SettingsError."""
    label = opt.flag if where == "command line" else f"{opt.flag} ({where})"
    if not opt.multiple:
        return opt.parse(label, raw)
    items = _split(raw if isinstance(raw, list) else [raw])
    if not items:
        raise SettingsError(f"{label}: empty value")
    return tuple(dict.fromkeys(opt.parse(label, x) for x in items))  # in order, no repeats


def resolve(cli: Callable[[str], Any], ini: Callable[[str], Any],
            environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from ``cli(name)`` (None when not given), the environment and
    ``ini(name)`` (None or empty when absent), validated. Raises SettingsError."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    explicit = set()
    for opt in OPTIONS:
        raw, where = cli(opt.name), "command line"
        if raw is None or raw == []:
            raw, where = value_from_environment(opt, environ, legacy=True)
        if raw is None or raw == []:
            raw, where = ini(opt.name) or None, "ini"
        if raw is None:
            values[opt.name] = tuple(opt.default) if opt.multiple else opt.default
            continue
        explicit.add(opt.name)
        values[opt.name] = parse_value(opt, raw, where)
    s = Settings(**values, explicit=frozenset(explicit))
    _check_combinations(s)
    return s


def _check_combinations(s: Settings) -> None:
    """Refuse selections that cannot produce a single case."""
    runnable = {(b, l) for b in s.vllm_backend for l in s.vllm_layout
                if layouts.runs_on(VARIANTS[b], layouts.LAYOUTS[l])}
    if not runnable:
        raise SettingsError(
            f"--vllm-backend {','.join(s.vllm_backend)} cannot run on --vllm-layout "
            f"{','.join(s.vllm_layout)}; " + "; ".join(
                f"{b} runs on {', '.join(layouts.layouts_for(VARIANTS[b])) or 'none'}"
                for b in s.vllm_backend))
    if {"vllm_backend", "vllm_layout"} <= s.explicit:
        for b in s.vllm_backend:
            if not any(bb == b for bb, _ in runnable):
                raise SettingsError(
                    f"--vllm-backend {b} runs on none of the selected layouts "
                    f"({', '.join(s.vllm_layout)}); it runs on "
                    f"{', '.join(layouts.layouts_for(VARIANTS[b]))}")


def narrow(pinned: tuple[str, ...] | None, chosen: tuple[str, ...], user_named: bool,
           canonical: Callable[[str], str] = lambda x: x) -> tuple[str, ...]:
    """What a test marked with ``pinned`` values runs on.

    The command line narrows, it never widens: a marker alone picks its values; when the
    user named values too, the test runs on those of its marker the user named (possibly
    none: the test is then deselected). Without a marker, the user's choice applies."""
    if not pinned:
        return chosen
    pinned = tuple(canonical(p) for p in pinned)
    if not user_named:
        return pinned
    return tuple(p for p in pinned if p in chosen)


def legacy_env_names() -> set[str]:
    """The first release's environment names, which must never reach a vLLM server."""
    return {o.legacy_env for o in OPTIONS if o.legacy_env}
