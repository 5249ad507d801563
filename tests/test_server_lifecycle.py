"""VLLMServer's lifecycle with a real vLLM process that fails: it is reported fast,
with its log, and leaves nothing behind."""

import json
import time

import psutil
import pytest

from harness.vllm.server import ServerConfig, ServerError, VLLMServer


def test_crashing_server_fails_fast_with_its_log_and_leaves_nothing(tmp_path):
    """A real vLLM process that dies at start-up: the error must come well before the
    start timeout, carry the log tail, and no process of it may survive."""
    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    srv = VLLMServer(ServerConfig(model=str(bad)), log_dir=tmp_path / "logs", start_timeout=300)
    before = {p.pid for p in psutil.process_iter()}
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        srv.start()
    elapsed = time.monotonic() - t0
    assert "exited with code" in str(e.value) and "last 60 log lines" in str(e.value)
    assert "no-such-architecture" in str(e.value)
    assert elapsed < 200, f"took {elapsed:.0f}s to notice a dead server"
    time.sleep(1)
    # this server's processes all name its model directory (other runs may share the host)
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if p.pid not in before and str(bad) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, leftovers
