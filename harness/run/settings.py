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
import tempfile
import urllib.parse
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from harness import models
from harness.core import facts
from harness.run import layouts
from harness.trainer import user as trainer_plugin
from harness.transfer import VARIANTS


class SettingsError(ValueError):
    """A bad option value; the message is one line for the user."""


# ----------------------------------------------------------------------------- parsers

def _positive_float(flag: str, v: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SettingsError(f"{flag}: expected a number of seconds, got {v!r}") from None
    if not x > 0:
        raise SettingsError(f"{flag}: must be greater than 0, got {v!r}")
    if x == float("inf"):  # every wait has a bound
        raise SettingsError(f"{flag}: must be a finite number of seconds, got {v!r}")
    return x


def _count(flag: str, v: str, minimum: int) -> int:
    try:
        x = int(str(v).strip())
    except (TypeError, ValueError):
        raise SettingsError(f"{flag}: expected a whole number, got {v!r}") from None
    if x < minimum:
        raise SettingsError(f"{flag}: must be at least {minimum}, got {v!r}")
    return x


def _choice(known: Mapping[str, Any], what: str) -> Callable[[str, str], str]:
    def check(flag: str, v: str) -> str:
        if v not in known:
            raise SettingsError(f"{flag}: unknown {what} {v!r}; known: {', '.join(known)}")
        return v
    return check


def _trainer(flag: str, v: str) -> str:
    """harness, vllm, or a trainer of your own (loaded and checked: trainer_plugin)."""
    try:
        return trainer_plugin.check_option(flag, v)
    except trainer_plugin.PluginError as e:
        raise SettingsError(str(e)) from None


def _dtype(flag: str, v: str) -> str:
    try:
        return facts.canonical_dtype(v)
    except facts.UnknownDtype:
        raise SettingsError(f"{flag}: unknown dtype {v!r}; known: float32 (fp32), "
                            "bfloat16 (bf16)") from None


def check_model(flag: str, v: str) -> str:
    """A zoo name, a sized model, an existing local directory, or a hub id: what
    ``models.classify_model`` (the one rule) accepts, said as an option error. A local
    directory comes back absolute; the others as given."""
    p = Path(v).expanduser()
    looks_like_path = v.startswith(("/", ".", "~")) or os.sep in v and p.exists()
    if looks_like_path and not p.is_dir():
        raise SettingsError(f"{flag}: {v!r} is not a directory")
    try:
        kind, value = models.classify_model(v)
    except ValueError:
        if p.is_dir():
            raise SettingsError(f"{flag}: {v!r} has no config.json (not a Hugging Face model "
                                "directory)") from None
        raise SettingsError(f"{flag}: unknown model {v!r}: not a zoo model "
                            f"({', '.join(models.ZOO)}), a sized model (sized-256mb), a local "
                            "directory or a hub id (org/name)") from None
    return value if kind == "path" else v  # a hub id is checked when it is downloaded


def _url(flag: str, v: str) -> str:
    u = urllib.parse.urlparse(v)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise SettingsError(f"{flag}: expected http://host:port, got {v!r}")
    try:
        u.port
    except ValueError:
        raise SettingsError(f"{flag}: bad port in {v!r}") from None
    return v.rstrip("/")


def _text(flag: str, v: str) -> str:
    return v


def _host_spec(flag: str, v: str) -> str:
    from harness.run.plan import Host

    try:
        Host.parse(v, Host(gpus=0, cores=1, gpu_memory_gib=0.0, ram_gib=1.0))
    except ValueError as e:
        raise SettingsError(f"{flag}: {e}") from None
    return v


def _shard(flag: str, v: str) -> tuple[int, int]:
    """``K/N``: the K-th of N shards, 1 <= K <= N (harness.run.partition)."""
    k, sep, n = str(v).strip().partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit() and 1 <= int(k) <= int(n)):
        raise SettingsError(f"{flag}: expected K/N with 1 <= K <= N (shard 2 of 3: 2/3), "
                            f"got {v!r}")
    return int(k), int(n)


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _writable_dir(d: Path) -> bool:
    """Can a file be created in ``d``? Tried, not guessed: root passes os.access on
    read-only file systems such as /proc."""
    try:
        fd, name = tempfile.mkstemp(prefix=".harness-probe-", dir=d)
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def _directory(flag: str, v: str) -> str:
    """A directory that exists, or can be created, and can be written to."""
    if not v.strip():
        raise SettingsError(f"{flag}: empty path")
    p = Path(v).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise SettingsError(f"{flag}: {v} exists and is not a directory")
    base = _nearest_existing(p)
    if not base.is_dir():
        raise SettingsError(f"{flag}: {base} is not a directory, so {v} cannot be created")
    if not _writable_dir(base):
        raise SettingsError(f"{flag}: cannot create files in {base}")
    return v


def _attention_backend(flag: str, v: str) -> str:
    """A name the installed vLLM's ``--attention-backend`` accepts, read from its source
    (importing vLLM to ask would cost seconds at every start). Without vLLM, or where
    its names cannot be found, the value is taken as it is, with a warning."""
    names, where = facts.attention_backend_names()
    if names is None:
        warnings.warn(f"{flag}: {v!r} not checked: {where}", UserWarning, stacklevel=2)
        return v
    if v.strip().lower() != "auto" and v.strip().upper() not in names:
        raise SettingsError(f"{flag}: unknown attention backend {v!r}; the installed vLLM "
                            f"knows: auto, {', '.join(names)}")
    return v.strip()


def output_file(flag: str, v: str) -> str:
    """A file the harness will write (--harness-report, harness repro --emit): not a
    directory, in an existing directory this user can write; nothing is created.
    Checked before the run, not after it."""
    p = Path(v).expanduser()
    if not v.strip():
        raise SettingsError(f"{flag}: empty path")
    if p.is_dir():
        raise SettingsError(f"{flag}: {v} is a directory; name the report file, "
                            f"e.g. {p / 'report.json'}")
    parent = p.absolute().parent
    if not parent.exists():
        raise SettingsError(f"{flag}: the directory {parent} does not exist (create it first)")
    if not parent.is_dir():
        raise SettingsError(f"{flag}: {parent} is not a directory")
    if not _writable_dir(parent):
        raise SettingsError(f"{flag}: cannot create a file in {parent}")
    if p.exists() and not os.access(p, os.W_OK):
        raise SettingsError(f"{flag}: {v} exists and is not writable")
    return v


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
           "(its backend and model must match the selected cases)", None, _url,
           shown_default="none: servers are started", metavar="URL"),
    Option("vllm_model", "model(s): zoo names (" + ", ".join(models.ZOO) + "), local "
           "directories or hub ids", ["llama"], check_model, True, metavar="MODEL",
           cli_alias="--model"),
    Option("vllm_dtype", "dtype(s): float32/fp32, bfloat16/bf16", ["float32"], _dtype, True,
           metavar="DTYPE", cli_alias="--dtype"),
    Option("vllm_backend", "backend variant(s): " + ", ".join(VARIANTS), list(VARIANTS),
           _choice(VARIANTS, "backend"), True, shown_default="all", metavar="BACKEND",
           cli_alias="--backend"),
    Option("vllm_layout", "layout(s): " + ", ".join(layouts.LAYOUTS),
           list(layouts.DEFAULT_LAYOUTS), _choice(layouts.LAYOUTS, "layout"), True,
           shown_default="all but the opt-in " + _OPT_IN_LAYOUTS, metavar="LAYOUT",
           cli_alias="--layout"),
    Option("vllm_mode", "serving mode(s): " + ", ".join(
        f"{k} ({v})" for k, v in facts.MODES.items()), [facts.DEFAULT_MODE],
           _choice(facts.MODES, "serving mode"), True, metavar="MODE"),
    Option("vllm_trainer", "trainer code(s): " + ", ".join(
        f"{k} ({v})" for k, v in facts.TRAINERS.items()) + ", or your own: MODULE:ATTRIBUTE "
           f"or an entry point name of group {trainer_plugin.ENTRY_POINT_GROUP} "
           "(harness/trainer/user.py)", [facts.DEFAULT_TRAINER],
           _trainer, True, metavar="CODE"),
    Option("vllm_gpus", "use at most this many GPUs", None, lambda f, v: _count(f, v, 0),
           shown_default="all visible", metavar="N"),
    Option("vllm_log_dir", "directory for per-server and per-trainer logs",
           ".harness-cache/logs", _directory, metavar="DIR", cli_alias="--log-dir"),
    Option("vllm_start_timeout", "seconds a server may take to become healthy", 600.0,
           _positive_float, metavar="SECONDS", cli_alias="--start-timeout"),
    Option("vllm_sync_timeout", "seconds one whole trainer sync may take", 600.0,
           _positive_float, metavar="SECONDS", cli_alias="--sync-timeout"),
    Option("vllm_max_servers", "servers alive at once, those starting ahead included", None,
           lambda f, v: _count(f, v, 1), shown_default="what the host's memory holds "
           "(harness.run.plan.Host)", metavar="N", cli_alias="--max-servers"),
    Option("vllm_max_starting", "servers started at once", None, lambda f, v: _count(f, v, 1),
           shown_default="one per two CPU cores, two on a host of 2-3 cores", metavar="N"),
    Option("vllm_attention_backend", "attention backend for GPU servers, a name vLLM knows "
           "(FlashAttention 3 refuses float32)", None, _attention_backend,
           shown_default="FLEX_ATTENTION for float32, else vLLM's choice", metavar="NAME"),
    Option("vllm_api_key", "API key of the servers: started with it (as VLLM_API_KEY) and "
           "sent by every client of the harness, trainers included, as 'Authorization: "
           "Bearer <key>'", None, _text, secret=True, metavar="KEY"),
    Option("harness_report", "write the run's machine-readable JSON report to this file, "
           "in an existing directory", None, output_file, metavar="PATH"),
    Option("harness_plan", "print the server plan of the selected tests (servers, the "
           "tests on each, starts, expected waves) and run nothing", False,
           lambda f, v: _flag(f, v)),
    Option("harness_plan_host", "plan for another host: name=value pairs among gpus, cores, "
           "gpu_memory_gib, ram_gib (e.g. gpus=2,cores=32)", None,
           lambda f, v: _host_spec(f, v), shown_default="this host", metavar="SPEC"),
    Option("harness_shard", "run shard K of N of the selection: whole servers (a dummy "
           "server with its disk-loaded twin) per shard, balanced by the plan's estimate; "
           "harness merge joins the shards' reports", None, _shard, metavar="K/N"),
    Option("harness_depth", "how far the default selection goes: 'full' runs every zoo "
           "architecture in every dtype its tests pin, with their disk-loaded twins, and the "
           "graph-mode cases; 'quick' runs llama in every dimension and each other "
           "architecture once, in float32, without twins, and graph mode only on GPUs "
           "(naming --vllm-model, --vllm-dtype or --vllm-mode widens it again)", None,
           _choice(DEPTHS, "depth"), shown_default="full with GPUs, quick without",
           metavar="DEPTH"),
    Option("harness_trainer_spares", "trainer processes kept started ahead, their imports "
           "and CUDA context done, for the tests that need a fresh trainer (0 starts none)", None,
           lambda f, v: _count(f, v, 0), shown_default="2 on 8 cores or more, else 0",
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
    sources: tuple[tuple[str, str], ...] = ()  # (option, where its value came from)

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
    explicit, sources = set(), []
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
        sources.append((opt.name, where))
        values[opt.name] = parse_value(opt, raw, where)
    s = Settings(**values, explicit=frozenset(explicit), sources=tuple(sources))
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
