"""What a run's known-issue entries are matched against: the vLLM version the tests run
against (and where it was read) and the kind of host, GPU or CPU. ``mark_known_issues``
(``harness.known_issues``) reads both once, at collection."""

from __future__ import annotations

from harness.core.facts import installed_vllm, server_version


def target_version(url: str | None) -> tuple[str | None, str]:
    """The vLLM version the tests run against, and where it was read: the attached
    server's /version with --vllm-url, else the installed distribution."""
    if url:
        v = server_version(url)
        if v:
            return v, f"server {url}"
    v, dist = installed_vllm()
    return v, f"installed {dist}" if dist else "not installed"


def host_kind() -> str:
    from harness.run.layouts import gpu_count

    return "gpu" if gpu_count() > 0 else "cpu"
