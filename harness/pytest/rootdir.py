"""Keep pytest's rootdir where the project is, whatever the harness's options name.

pytest chooses the rootdir and the ini file (``determine_setup``) from the command
line's path-like arguments *before* any plugin is loaded, so it cannot know that
``/data/mymodel`` in ``--vllm-model /data/mymodel`` is an option's value: an existing
path outside the project becomes the rootdir, and the project's ``pytest.ini`` (its
timeout, ``--strict-markers``, cache directory) is silently dropped. Once the plugin's
options are known (``pytest_load_initial_conftests``, before any conftest is loaded or
any option is finally parsed), ``anchor`` redoes that choice with the real positional
arguments and, where pytest had found no ini file and the real arguments find one,
takes it, with its ``addopts``. Nothing changes where the user named ``--rootdir`` or
``-c``, or where pytest's own choice already stands.

This reaches into the Config's rootdir fields, which have no public setter; where a
pytest release renames them, the run stops with one line saying how to avoid the trap
(the ``=`` form, or ``--rootdir``), instead of running without the project's ini.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

def _overrides(override_ini) -> dict:
    from _pytest.config import findpaths

    parse = getattr(findpaths, "parse_override_ini", None)
    return parse(override_ini) if parse is not None and override_ini else {}


_FIELDS = ("_rootpath", "_inipath", "_inicfg", "_inicache", "_parser", "known_args_namespace")


def anchor(config: pytest.Config, args: list[str]) -> bool:
    """Redo pytest's rootdir choice without the plugin's option values; True if it was
    redone. ``args``: the command line pytest parses next (updated in place)."""
    from _pytest.config.findpaths import determine_setup

    ns = config.known_args_namespace
    if getattr(ns, "rootdir", None) or getattr(ns, "inifilename", None):
        return False  # the user's choice
    if config.inipath is not None:
        return False  # pytest found a configuration: its choice stands
    positional = list(getattr(ns, "file_or_dir", None) or [])
    rootpath, inipath, inicfg, ignored = determine_setup(
        inifile=None, override_ini=getattr(ns, "override_ini", None), args=positional,
        rootdir_cmd_arg=None, invocation_dir=config.invocation_params.dir)
    if inipath is None or Path(rootpath) == Path(config.rootpath):
        return False
    if not all(hasattr(config, f) for f in _FIELDS):
        raise pytest.UsageError(
            f"an option value on the command line made pytest take {config.rootpath} as its "
            f"rootdir instead of {rootpath}; write the option as --option=VALUE, or pass "
            f"--rootdir={rootpath}")
    config._rootpath, config._inipath, config._inicfg = rootpath, inipath, inicfg
    if hasattr(config, "_ignored_config_files"):
        config._ignored_config_files = ignored
    config._inicache.clear()
    config._parser.extra_info["rootdir"] = str(rootpath)
    config._parser.extra_info["inifile"] = str(inipath)
    args[:] = list(config.getini("addopts")) + args
    config.known_args_namespace = ns = config._parser.parse_known_args(
        args, namespace=copy.copy(config.option))
    ns.confcutdir = str(inipath.parent)
    # what addopts sets through -o or flags such as --strict-markers (ini overrides)
    for key, value in _overrides(getattr(ns, "override_ini", None)).items():
        config._inicfg[key] = value
    config._inicache.clear()
    return True
