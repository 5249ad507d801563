"""Requests sent while paused, per release: held up to 0.32, refused (HTTP 503,
retryable) in abort/wait mode from 0.33 on (harness/pause/admission.py), checked
against the stand-in server behaving either way."""

from __future__ import annotations

import pytest

from harness.pause import PauseCheckFailure, admission
from harness.pause import checks as pc
from harness.pause.openapi import discover_pause_api
from harness.testing.standin import StandinServer
from harness.vllm.client import ServerClient

PROMPT = list(range(3, 19))


@pytest.mark.parametrize("version,style,want", [
    ("0.32.0", "abort", "hold"), ("0.32.0+cpu", "wait", "hold"), ("0.27.1", None, "hold"),
    ("0.33.0", "abort", "refuse"), ("0.33.0", "wait", "refuse"), ("0.33.0", None, "refuse"),
    ("0.33.0", "keep", "hold"), ("0.34.1", "wait", "refuse"),
    ("0.33.0", "wait_for_inflight_requests", "hold"), (None, "abort", "hold"),
    ("not-a-version", "abort", "hold"),
])
def test_what_a_request_sent_while_paused_gets(version, style, want):
    assert admission.while_paused(version, style) == want


def _style(client, name):
    return discover_pause_api(client).style(name)


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_the_refusal_check_passes_on_a_refusing_server_and_fails_on_a_holding_one(mode):
    with StandinServer(refuse_while_paused=True) as s:
        c = ServerClient(s.url, timeout=30)
        obs = admission.check_request_refused_while_paused(c, PROMPT, style=_style(c, mode),
                                                           hold_seconds=5.0, timeout=30)
        assert obs["non-stream"].startswith("HTTP 503") and obs["stream"].startswith("HTTP 503")
        # the old expectation fails on the new behaviour ...
        with pytest.raises(PauseCheckFailure):
            pc.check_request_waits_for_resume(c, PROMPT, style=_style(c, mode),
                                              hold_seconds=1.0, timeout=30)
    with StandinServer() as s:  # ... and the new one on the old
        c = ServerClient(s.url, timeout=30)
        with pytest.raises(PauseCheckFailure, match="not refused|still had no answer"):
            admission.check_request_refused_while_paused(c, PROMPT, style=_style(c, mode),
                                                         hold_seconds=1.0, timeout=30)


def test_keep_still_holds_on_a_refusing_server():
    with StandinServer(refuse_while_paused=True) as s:
        c = ServerClient(s.url, timeout=30)
        pc.check_request_waits_for_resume(c, PROMPT, style=_style(c, "keep"), hold_seconds=1.0,
                                          timeout=30)
