"""The option table as the ``harness`` commands take it: each command names the options
it uses (``Use``); they get pytest's flag, help, parser and environment variable, the
command's own default, and are checked as pytest checks them."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping

from harness.run.settings import (BY_NAME, Option, SettingsError, parse_value,
                                   value_from_environment)


_TABLE = object()  # Use.default: the table's own


@dataclasses.dataclass(frozen=True)
class Use:
    """A ``harness`` command's use of one option of the table: the flag, help, parser,
    environment variable and deprecated alias are the option's; the command decides
    only its default there (``why``, when it differs from pytest's, says why; ``shown``
    is --help's words for a default that is not a value) and whether it takes one value
    or a list (``repeatable``). ``shorthands``: more words the command accepts."""

    name: str
    default: Any = _TABLE
    why: str = ""
    shown: str | None = None
    repeatable: bool = False
    shorthands: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def option(self) -> Option:
        return BY_NAME[self.name]

    def value(self) -> Any:
        """The default: the command's, or the table's (one value, unless repeatable)."""
        if self.default is not _TABLE:
            return self.default
        d = self.option.default
        if self.option.multiple and not self.repeatable:
            if not isinstance(d, (list, tuple)) or len(d) != 1:
                raise TypeError(f"{self.name}: a command taking one value needs its default")
            return d[0]
        return list(d) if isinstance(d, (list, tuple)) else d


class _CommandValue(argparse.Action):
    """Keeps the raw text (a list of them with ``repeatable``), checked later by
    ``resolve_command``; notes a deprecated alias where one was used."""

    def __init__(self, option_strings, dest, repeatable: bool = False,
                 alias: str | None = None, **kw):
        super().__init__(option_strings, dest, **kw)
        self.repeatable, self.alias = repeatable, alias

    def __call__(self, parser, namespace, values, option_string=None):
        if self.alias is not None:
            namespace._deprecated_flags = [*getattr(namespace, "_deprecated_flags", []),
                                           (self.alias, "--" + self.dest.replace("_", "-"))]
        if self.repeatable:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def add_command_options(parser: argparse.ArgumentParser, uses: tuple[Use, ...]) -> None:
    """Add the table's options a command uses to its parser: ``--vllm-model`` as in
    pytest, the command's old name (``--model``) as a deprecated alias."""
    for u in uses:
        opt = u.option
        text = u.shown or opt.default_text(None if u.default is _TABLE else u.default)
        what = (opt.help + " (repeatable, or comma-separated)" if u.repeatable
                else opt.help.replace("(s)", ""))
        help_ = (f"{what}; default {text}" + (f" ({u.why})" if u.why else "")
                 + f"; env {opt.env}" + (f"; {opt.cli_alias} is a deprecated alias"
                                         if opt.cli_alias else ""))
        parser.add_argument(opt.flag, dest=opt.name, default=None, action=_CommandValue,
                            repeatable=u.repeatable, metavar=opt.metavar,
                            help=help_.replace("%", "%%"))
        if opt.cli_alias:  # still works; not listed beside the new name
            parser.add_argument(opt.cli_alias, dest=opt.name, default=None,
                                action=_CommandValue, repeatable=u.repeatable,
                                alias=opt.cli_alias, help=argparse.SUPPRESS)


def resolve_command(args: argparse.Namespace, uses: tuple[Use, ...],
                    environ: Mapping[str, str] | None = None) -> list[str]:
    """Check a command's table options in place, as pytest does (command line >
    ``HARNESS_*`` environment > the command's default): afterwards ``args.vllm_model``
    is the checked value (a list for a repeatable option). Returns the deprecation
    notes to show; raises SettingsError for a bad value, naming the option and, when
    it came from the environment, the variable."""
    environ = os.environ if environ is None else environ
    for u in uses:
        opt = u.option
        raw, where = getattr(args, opt.name, None), "command line"
        if raw is None or raw == []:
            raw, where = value_from_environment(opt, environ, legacy=False)
        if raw is None:
            setattr(args, opt.name, u.value())
            continue
        if u.shorthands:
            raw = ([u.shorthands.get(x, x) for x in raw] if isinstance(raw, list)
                   else u.shorthands.get(raw, raw))
        value = parse_value(opt, raw, where)
        if opt.multiple and not u.repeatable:
            if len(value) != 1:
                label = opt.flag if where == "command line" else f"{opt.flag} ({where})"
                raise SettingsError(f"{label}: this command takes one value, got {raw!r}")
            value = value[0]
        setattr(args, opt.name, list(value) if u.repeatable else value)
    return [f"{old} is deprecated; use {new}"
            for old, new in dict.fromkeys(getattr(args, "_deprecated_flags", []))]
