"""A run that starts servers says so on the terminal, a line when each server starts
and when it is up, under -q too: `pytest -q` printed nothing for minutes while its
servers started. Side by side, the workers' lines reach the controller's terminal
through the run's folder (pytest-xdist shows nothing a worker prints). Fakes only: no
server, no trainer process."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from harness.run import parallel


# The fakes, installed by the child session's conftest: a real pytest process, whose
# capture of file descriptor 1 during a test is real too.
FAKES = """
from types import SimpleNamespace

from harness.run import pool as pool_mod



class Server:
    def __init__(self, cfg, **kw):
        self.cfg, self.url, self.start_seconds, self.version = cfg, "", 0.0, "fake"
        self.log_path, self.attached = None, False

    def start(self):
        self.url, self.start_seconds = "http://127.0.0.1:1", 12.3

    def stop(self):
        pass

    def describe_failure(self):
        return ""


class Trainer:
    def __init__(self, spec, **kw):
        self.spares = False

    def prepare(self, weights, timeout):
        pass

    def close(self):
        pass

    def close_in_background(self):
        pass


pool_mod.VLLMServer, pool_mod.Trainer = Server, Trainer
pool_mod.Spares.spawn = staticmethod(lambda *a: SimpleNamespace(discard=lambda: None))
pool_mod.models.ensure_built = lambda model: None
pool_mod.reaper.reap = lambda: []
"""

# The server is asked for inside a test, while pytest captures what the test writes.
ONE_TEST = """
from harness import models
from harness.run.cases import server_config_for

def test_a(case, server_pool):
    server_pool.get(server_config_for(case, models.planned_path(case.model)))
"""


def test_each_server_start_is_a_line_even_under_q(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makeconftest(FAKES)
    pytester.makepyfile(test_one=ONE_TEST)
    r = pytester.runpytest_subprocess(
        "-q", "-p", "no:cacheprovider", "--vllm-backend", "shm", "--vllm-layout", "cpu",
        "--vllm-log-dir", str(pytester.path / "logs"), timeout=300)
    assert r.ret == 0, r.stdout.str()
    out = r.stdout.lines
    starting = [i for i, ln in enumerate(out)
                if ln.startswith("weight-sync-harness: vLLM server starting: ")]
    up = [i for i, ln in enumerate(out)
          if ln.startswith("weight-sync-harness: vLLM server up in 12s: ")]
    assert len(starting) == 1 and len(up) == 1 and starting[0] < up[0], r.stdout.str()
    assert "shm" in out[starting[0]] and "float32" in out[starting[0]]


def test_a_workers_lines_reach_the_controller(tmp_path, monkeypatch):
    monkeypatch.setenv(parallel.DIR_ENV, str(tmp_path))
    said: list[str] = []
    tail = parallel.LineTail(str(tmp_path), said.append)
    for wid in ("gw0", "gw1"):
        say = parallel.announcer(SimpleNamespace(workerinput={"workerid": wid}),
                                 lambda line: pytest.fail("a worker wrote to its terminal"))
        say(f"vLLM server starting: {wid}'s")
    (tmp_path / parallel.LINES_FILE.format("gw2")).write_text("[gw2] half a li")
    tail.poll()
    assert said == ["[gw0] vLLM server starting: gw0's", "[gw1] vLLM server starting: gw1's"]
    with open(tmp_path / parallel.LINES_FILE.format("gw2"), "a") as f:
        f.write("ne\n")
    tail.poll()
    assert said[2:] == ["[gw2] half a line"]
    mine: list[str] = []
    assert parallel.announcer(SimpleNamespace(), mine.append) == mine.append  # no worker
    assert os.environ[parallel.DIR_ENV] == str(tmp_path)
