"""A trainer of your own: the protocol its sender follows, and how the harness finds it.

``--vllm-trainer`` takes, besides ``harness`` and ``vllm``, your own trainer code:

* ``MODULE:ATTRIBUTE`` (``mypkg.sync:MySender``), MODULE importable as ``python -m``
  imports it from the current directory, or installed; its cases' ids end
  ``-via-ATTRIBUTE`` (``-via-MySender``);
* ``NAME``, an entry point of the group ``weight_sync_harness.trainers``
  (``[project.entry-points."weight_sync_harness.trainers"] mine = "mypkg.sync:MySender"``);
  its ids end ``-via-NAME``.

ATTRIBUTE is a class. The harness builds it once per transfer group, in the trainer's
own process (the same process, with the same life, as the harness's and vLLM's trainer
codes: ``harness.trainer.child``), and calls, in this order::

    sender = MySender(ctx)    # ctx: TrainerContext, below; call no route yet
    sender.init()             # open the group: /init_weight_transfer_engine (NCCL: join
                              #   the rendezvous as rank 0 beside it)
    sender.send(model)        # one update per sync: /start_weight_update,
    sender.send(model)        #   /update_weights..., /finish_weight_update
    sender.close()            # the group ends (also after a failed send)

``model`` is the live Hugging Face module (``torch.nn.Module``) on ``ctx.device`` in
``ctx.dtype``, the same object every time: before each sync the harness loads that
sync's weights into its parameters in place, as an optimizer step changes them. Send
``model.named_parameters()``; the server's model loads those names. ``send`` may return
a dict of what it moved (``tensors``, ``bytes``, ``chunks``); the rest is counted for it.
``/pause`` and ``/resume`` around the sync are the harness's: do not call them.

What the harness checks, your sender is held to: the server matches Hugging Face
after the sync, repeated syncs through one group, updates while requests are held,
the disk-loaded twin. What only the harness's own sender can do (deliberate damage,
lying update info, its fault options) is skipped with the reason, as for ``vllm``.

A bad value (no such module, attribute or entry point, an object that is not such a
class) is one line naming the option, before anything starts (``check``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from typing import Any, Protocol, runtime_checkable

from harness.core import facts

ENTRY_POINT_GROUP = "weight_sync_harness.trainers"
# A test's trainers marker may name this: every trainer of your own the run selects
# (the checks that hold for any trainer code: tests/test_sync.py, test_parity.py, ...).
USER_PIN = "user"
METHODS = ("init", "send", "close")


class PluginError(ValueError):
    """A --vllm-trainer value that names no usable sender; the message is one line."""


@dataclasses.dataclass(frozen=True)
class TrainerContext:
    """What a sender of your own receives when it is built."""

    url: str                 # the server's base URL (http://127.0.0.1:PORT)
    urls: tuple[str, ...]    # every URL it serves on (one today)
    backend: str             # the server's weight-transfer engine: shm | nccl | ipc
    packed: bool             # the case's data-plane variant (ipc-packed, nccl-unpacked...)
    init_info: dict          # what /init_weight_transfer_engine takes here, as the
    #                          harness's sender posts it: shm {"root": a bucket directory},
    #                          ipc {}, nccl {master_address, master_port, world_size,
    #                          rank_offset}: your process is rank 0 of world_size
    device: str              # where the model lives: cpu, cuda:0, ...
    dtype: str               # float32 | bfloat16
    timeout: float           # seconds one HTTP call may take
    api_key: str | None      # the server's key (send "Authorization: Bearer <key>"), or None
    scratch: str             # a directory of the trainer's own, removed when it is gone
    options: dict = dataclasses.field(default_factory=dict)


@runtime_checkable
class Sender(Protocol):
    def init(self) -> None: ...

    def send(self, model: Any) -> dict | None: ...

    def close(self) -> None: ...


def is_builtin(code: str) -> bool:
    return code in facts.TRAINERS


def label(code: str) -> str:
    """The id part of a trainer code: ``-via-<label>`` (harness's cases have none)."""
    return code.rsplit(":", 1)[1] if ":" in code else code


def target(code: str) -> str:
    """``MODULE:ATTRIBUTE`` that ``code`` names (an entry point's value for a NAME)."""
    if ":" in code:
        return code
    eps = [ep for ep in _entry_points() if ep.name == code]
    if not eps:
        known = sorted({ep.name for ep in _entry_points()})
        raise PluginError(f"unknown trainer {code!r}: not harness or vllm, not MODULE:ATTRIBUTE, "
                          f"and no entry point of group {ENTRY_POINT_GROUP} has that name"
                          + (f" (installed: {', '.join(known)})" if known else ""))
    return eps[0].value


def load(code: str) -> type:
    """The sender class ``code`` names, checked (``PluginError`` otherwise)."""
    where = target(code)
    module_name, _, attr = where.partition(":")
    if not module_name or not attr:
        raise PluginError(f"trainer {code!r}: expected MODULE:ATTRIBUTE, got {where!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m finds a module of this directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PluginError(f"trainer {code!r}: cannot import {module_name}: {e}") from None
    except Exception as e:
        raise PluginError(f"trainer {code!r}: importing {module_name} raised "
                          f"{type(e).__name__}: {e}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"trainer {code!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    check(obj, code)
    return obj


def check(obj: Any, code: str) -> None:
    """``obj`` is a class built from one argument (the context) with ``init``, ``send``
    and ``close``; else ``PluginError`` saying what it lacks."""
    what = f"trainer {code!r}"
    if not inspect.isclass(obj):
        raise PluginError(f"{what}: {type(obj).__name__} {obj!r:.60} is not a class; the "
                          f"sender is a class with {', '.join(METHODS)} "
                          "(harness/trainer/user.py)")
    missing = [m for m in METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise PluginError(f"{what}: {obj.__name__} has no {', '.join(missing)} method; a sender "
                          f"has {', '.join(METHODS)} (harness/trainer/user.py)")
    try:
        inspect.signature(obj).bind(None)
    except TypeError:
        raise PluginError(f"{what}: {obj.__name__}(ctx) cannot be called with the one "
                          "argument the harness passes, a TrainerContext") from None
    except ValueError:
        pass  # no signature to read (a builtin): judged when it is built
    try:
        inspect.signature(obj.send).bind(None, None)
    except TypeError:
        raise PluginError(f"{what}: {obj.__name__}.send(model) cannot be called with the "
                          "model") from None
    except ValueError:
        pass


def check_option(flag: str, code: str) -> str:
    """--vllm-trainer's parser: a built-in trainer code, or one of your own, loaded."""
    if not is_builtin(code):
        try:
            load(code)
        except PluginError as e:
            raise PluginError(f"{flag}: {e}") from None
    return code


def pin(pinned: tuple[str, ...] | None, chosen: tuple[str, ...]) -> tuple[str, ...] | None:
    """A trainers marker with ``USER_PIN`` in it names the trainers of your own the run
    chose, besides its other values (none when the run chose none)."""
    if not pinned or USER_PIN not in pinned:
        return pinned
    return tuple(p for p in pinned if p != USER_PIN) + tuple(
        c for c in chosen if not is_builtin(c))


def _entry_points() -> list:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))
