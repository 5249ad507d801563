"""How each option's value is read and checked: one parser a kind of value, called
with the flag and the raw text, returning the value or raising ``SettingsError``
with one line naming the flag and what it accepts (``harness.run.settings`` holds the
table of options that use them)."""

from __future__ import annotations

import os
import tempfile
import urllib.parse
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from harness import models
from harness.core import facts
from harness.trainer import user as trainer_plugin


class SettingsError(ValueError):
    """A bad option value; the message is one line for the user."""


def positive_float(flag: str, v: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SettingsError(f"{flag}: expected a number of seconds, got {v!r}") from None
    if not x > 0:
        raise SettingsError(f"{flag}: must be greater than 0, got {v!r}")
    if x == float("inf"):  # every wait has a bound
        raise SettingsError(f"{flag}: must be a finite number of seconds, got {v!r}")
    return x


def count(flag: str, v: str, minimum: int) -> int:
    try:
        x = int(str(v).strip())
    except (TypeError, ValueError):
        raise SettingsError(f"{flag}: expected a whole number, got {v!r}") from None
    if x < minimum:
        raise SettingsError(f"{flag}: must be at least {minimum}, got {v!r}")
    return x


def choice(known: Mapping[str, Any], what: str) -> Callable[[str, str], str]:
    def check(flag: str, v: str) -> str:
        if v not in known:
            raise SettingsError(f"{flag}: unknown {what} {v!r}; known: {', '.join(known)}")
        return v
    return check


def trainer(flag: str, v: str) -> str:
    """harness, vllm, or a trainer of your own (loaded and checked: trainer_plugin)."""
    try:
        return trainer_plugin.check_option(flag, v)
    except trainer_plugin.PluginError as e:
        raise SettingsError(str(e)) from None


def dtype(flag: str, v: str) -> str:
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


def url(flag: str, v: str) -> str:
    u = urllib.parse.urlparse(v)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise SettingsError(f"{flag}: expected http://host:port, got {v!r}")
    try:
        u.port
    except ValueError:
        raise SettingsError(f"{flag}: bad port in {v!r}") from None
    return v.rstrip("/")


def text(flag: str, v: str) -> str:
    return v


def host_spec(flag: str, v: str) -> str:
    from harness.run.plan import Host

    try:
        Host.parse(v, Host(gpus=0, cores=1, gpu_memory_gib=0.0, ram_gib=1.0))
    except ValueError as e:
        raise SettingsError(f"{flag}: {e}") from None
    return v


def shard(flag: str, v: str) -> tuple[int, int]:
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


def directory(flag: str, v: str) -> str:
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


def attention_backend(flag: str, v: str) -> str:
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
