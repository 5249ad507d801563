"""/pause, /resume and /is_paused: what the server offers, requests driven through
them, and the checks.

* ``openapi``: the ways to call /pause, read from the server's /openapi.json (the
  run report's capability probe reads them with the same code);
* ``driver``: completions sent through the official ``openai`` SDK, sync and async,
  streamed and not, each recording what arrived and when;
* ``checks``: the checks, functions of a ``harness.vllm.client.ServerClient``.

The checks run against real vLLM servers (tests/test_pause_resume.py) and against a
deliberately misbehaving stand-in (harness/testing/standin.py, tests/test_pause_selftest.py),
which shows that each of them fails when the behaviour it checks is broken.
"""

from __future__ import annotations

from typing import Any


class PauseCheckFailure(AssertionError):
    """A pause/resume check found the server misbehaving."""


def failure(msg: str, client: Any = None,
            kind: type[PauseCheckFailure] = PauseCheckFailure) -> PauseCheckFailure:
    """A ``kind`` of failure carrying the server's context (its log tail)."""
    ctx = client.context() if client is not None else ""
    return kind(msg + ("\n" + ctx if ctx else ""))
