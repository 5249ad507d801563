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

from . import facts, layouts, models
from .backends import VARIANTS


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


def _dtype(flag: str, v: str) -> str:
    try:
        return facts.canonical_dtype(v)
    except facts.UnknownDtype:
        raise SettingsError(f"{flag}: unknown dtype {v!r}; known: float32 (fp32), "
                            "bfloat16 (bf16)") from None


def check_model(flag: str, v: str) -> str:
    """A zoo name, an existing local directory, or a hub id (``org/name``)."""
    if v in models.ZOO:
        return v
    looks_like_path = v.startswith(("/", ".", "~")) or os.sep in v and Path(v).expanduser().exists()
    if looks_like_path:
        p = Path(v).expanduser()
        if not p.is_dir():
            raise SettingsError(f"{flag}: {v!r} is not a directory")
        if not (p / "config.json").exists():
            raise SettingsError(f"{flag}: {v!r} has no config.json (not a Hugging Face model "
                                "directory)")
        return str(p.resolve())
    parts = v.split("/")
    if len(parts) == 2 and all(parts):
        return v  # a hub id: checked when it is downloaded
    raise SettingsError(f"{flag}: unknown model {v!r}: not a zoo model "
                        f"({', '.join(models.ZOO)}), a local directory or a hub id (org/name)")


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


def _report_path(flag: str, v: str) -> str:
    """A file the report can be written to: not a directory, in an existing directory
    this user can write. Checked before the run, not after it."""
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
    name: str            # attribute of Settings and ini key; --vllm-model is vllm_model
    help: str
    default: Any
    parse: Callable[[str, str], Any]
    multiple: bool = False
    secret: bool = False  # never shown: reports and headers say only whether it is set

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


OPTIONS: tuple[Option, ...] = (
    Option("vllm_url", "attach to a running vLLM server at this URL instead of starting one "
           "(its backend and model must match the selected cases)", None, _url),
    Option("vllm_model", "model(s): zoo names (" + ", ".join(models.ZOO) + "), local "
           "directories or hub ids", ["llama"], check_model, True),
    Option("vllm_dtype", "dtype(s): float32/fp32, bfloat16/bf16", ["float32"], _dtype, True),
    Option("vllm_backend", "backend variant(s): " + ", ".join(VARIANTS), list(VARIANTS),
           _choice(VARIANTS, "backend"), True),
    Option("vllm_layout", "layout(s): " + ", ".join(layouts.LAYOUTS) + " (default: all but "
           "the opt-in " + ", ".join(sorted(set(layouts.LAYOUTS) - set(layouts.DEFAULT_LAYOUTS)))
           + ")", list(layouts.DEFAULT_LAYOUTS), _choice(layouts.LAYOUTS, "layout"), True),
    Option("vllm_gpus", "use at most this many GPUs (default: all visible)", None,
           lambda f, v: _count(f, v, 0)),
    Option("vllm_log_dir", "directory for per-server and per-trainer logs",
           ".harness-cache/logs", _text),
    Option("vllm_start_timeout", "seconds a server may take to become healthy", 600.0,
           _positive_float),
    Option("vllm_sync_timeout", "seconds one whole trainer sync may take", 600.0,
           _positive_float),
    Option("vllm_max_servers", "servers alive at once, those starting ahead included "
           "(default: 3 on a CPU host, 8 with GPUs)", None, lambda f, v: _count(f, v, 1)),
    Option("vllm_attention_backend", "attention backend for GPU servers (default: "
           "FLEX_ATTENTION in float32, which FlashAttention 3 refuses)", None, _text),
    Option("vllm_api_key", "API key of the servers: started with it (as VLLM_API_KEY) and "
           "sent by every client of the harness, trainers included, as 'Authorization: "
           "Bearer <key>'", None, _text, secret=True),
    Option("harness_report", "write the run's machine-readable JSON report to this path "
           "(its directory must exist)", None, _report_path),
    Option("harness_require_gpu", "fail the run when no GPU is visible, or when GPU cases "
           "were selected and none of them ran (a runner that lost its GPUs)", False,
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
    vllm_gpus: int | None = None
    vllm_log_dir: str = ".harness-cache/logs"
    vllm_start_timeout: float = 600.0
    vllm_sync_timeout: float = 600.0
    vllm_max_servers: int | None = None
    vllm_attention_backend: str | None = None
    vllm_api_key: str | None = dataclasses.field(default=None, repr=False)
    harness_report: str | None = None
    harness_require_gpu: bool = False
    explicit: frozenset[str] = frozenset()  # options the user set (not defaults)
    sources: tuple[tuple[str, str], ...] = ()  # (option, where its value came from)

    def gpus(self) -> int:
        """GPUs the run may use: those visible, capped by --vllm-gpus. Probes lazily."""
        present = layouts.gpu_count()
        return present if self.vllm_gpus is None else min(present, self.vllm_gpus)

    def max_servers(self) -> int:
        if self.vllm_max_servers is not None:
            return self.vllm_max_servers
        # CPU: the group under test, its disk-loaded twin, and the next group starting
        return 8 if self.gpus() > 0 else 3

    def as_dict(self) -> dict[str, Any]:
        """Every option's value; a secret one only as whether it is set."""
        return {o.name: ("(set)" if getattr(self, o.name) else None) if o.secret
                else getattr(self, o.name) for o in OPTIONS}


def _split(values: list[Any]) -> list[str]:
    out: list[str] = []
    for v in values:
        out += [x.strip() for x in str(v).split(",") if x.strip()]
    return out


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
            raw, where = environ.get(opt.env) or None, f"env {opt.env}"
            if raw is None and opt.legacy_env and environ.get(opt.legacy_env):
                raw, where = environ[opt.legacy_env], f"env {opt.legacy_env}"
                warnings.warn(f"{opt.legacy_env} is deprecated (it sits in vLLM's namespace); "
                              f"use {opt.env}", DeprecationWarning, stacklevel=2)
            if raw is not None and opt.multiple:
                raw = [raw]
        if raw is None or raw == []:
            raw, where = ini(opt.name) or None, "ini"
        if raw is None:
            values[opt.name] = tuple(opt.default) if opt.multiple else opt.default
            continue
        explicit.add(opt.name)
        sources.append((opt.name, where))
        label = opt.flag if where == "command line" else f"{opt.flag} ({where})"
        if opt.multiple:
            items = _split(raw if isinstance(raw, list) else [raw])
            if not items:
                raise SettingsError(f"{label}: empty value")
            parsed = [opt.parse(label, x) for x in items]
            values[opt.name] = tuple(dict.fromkeys(parsed))  # keep order, drop repeats
        else:
            values[opt.name] = opt.parse(label, raw)
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
