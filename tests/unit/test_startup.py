"""A start's phases read from its log (harness.vllm.startup): the gaps between the first
line of each process and vLLM's own messages."""

import datetime as dt

from harness.vllm import startup

LOG = """# python -m vllm.entrypoints.openai.api_server --model m
(APIServer pid=1) INFO 12-03 09:44:38 [api_utils.py:347] version 0.32.0
(APIServer pid=1) INFO 12-03 09:44:39 [model.py:733] Resolved architecture
(EngineCore pid=2) INFO 12-03 09:45:18 [core.py:133] Initializing a V1 LLM engine
(Worker pid=3) INFO 12-03 09:46:11 [parallel_state.py:1906] world_size=1
(Worker pid=3) INFO 12-03 09:46:12 [base_loader.py:82] Initializing model took 1.09 seconds
(EngineCore pid=2) INFO 12-03 09:46:21 [core.py:402] init engine (profile, create kv cache, warmup model) took 5.69 s
(APIServer pid=1) INFO 12-03 09:46:26 [entry.py:140] Starting vLLM server on http://127.0.0.1:1
"""


def _epoch(hms: str) -> float:
    at = dt.datetime.strptime(f"2026-12-03 {hms}", "%Y-%m-%d %H:%M:%S")
    return at.replace(tzinfo=dt.datetime.now().astimezone().tzinfo).timestamp()


def test_each_phase_is_the_gap_to_its_mark(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(LOG)
    launched = _epoch("09:44:01")
    p = startup.profile(log, launched, ready_seconds=147.0)
    assert p == {"api_server_imports": 37.0, "engine_core_imports": 40.0,
                 "worker_imports": 53.0, "model_load": 1.0, "engine_init": 9.0,
                 "api_routes": 5.0, "until_healthy": 2.0}
    assert sum(p.values()) == 147.0


def test_a_missing_mark_ends_the_profile_rather_than_guessing(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(line for line in LOG.splitlines() if "Worker" not in line))
    p = startup.profile(log, _epoch("09:44:01"))
    assert list(p) == ["api_server_imports", "engine_core_imports"]
    assert startup.profile(tmp_path / "missing.log", 0.0) == {}
