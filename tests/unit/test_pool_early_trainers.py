"""A server's planned trainers start their processes beside its start (their imports
then overlap the server's), and each takes its trainer over once the server is up; a
start that fails leaves none of them running. Fakes only: no server, no process."""

from __future__ import annotations

import pytest

from harness.run import pool as pool_mod
from harness.trainer.handle import TrainerSpec
from harness.vllm.server import ServerConfig, ServerError


class _Spare:
    def __init__(self, events):
        self.events, self.discarded = events, False

    def discard(self):
        self.discarded = True
        self.events.append("spare discarded")


def _pool(tmp_path, monkeypatch, *, start_fails=False):
    events: list[str] = []
    spares: list[_Spare] = []

    def spawn(spec, env, log_dir):
        events.append(f"spawn {spec.engine}")
        spares.append(_Spare(events))
        return spares[-1]

    class Server:
        def __init__(self, cfg, **kw):
            self.url, self.start_seconds, self.version, self.log_path = "", 0.0, "x", None

        def start(self):
            events.append("server start")
            if start_fails:
                raise ServerError("no")
            self.url = "http://127.0.0.1:1"

        def describe_failure(self):
            return ""

    class Trainer:
        def __init__(self, spec, *, spare=None, **kw):
            self.spec, self.spare, self.spares = spec, spare, False
            events.append(f"trainer for {spec.url} takes {'a' if spare else 'no'} spare")

        def prepare(self, weights, timeout):
            events.append("prepare")

    monkeypatch.setattr(pool_mod.Spares, "spawn", staticmethod(spawn))
    monkeypatch.setattr(pool_mod, "VLLMServer", Server)
    monkeypatch.setattr(pool_mod, "Trainer", Trainer)
    monkeypatch.setattr(pool_mod.models, "ensure_built", lambda model: None)
    p = pool_mod.ServerPool(tmp_path, start_timeout=1, max_alive=1, reap=False)
    cfg = ServerConfig(model="/m")
    p._warm = {cfg: [(TrainerSpec.make(url="", engine="shm", packed=False), "/w")]}
    return p, cfg, events, spares


def test_the_trainer_process_starts_before_the_server_and_takes_the_trainer_over(
        tmp_path, monkeypatch):
    p, cfg, events, spares = _pool(tmp_path, monkeypatch)
    p._start(cfg)
    assert events == ["spawn shm", "server start",
                      "trainer for http://127.0.0.1:1 takes a spare", "prepare"]
    trainer = next(iter(p.trainers.values()))
    assert trainer.spare is spares[0] and not spares[0].discarded


def test_a_failed_start_leaves_no_trainer_process(tmp_path, monkeypatch):
    p, cfg, events, spares = _pool(tmp_path, monkeypatch, start_fails=True)
    with pytest.raises(ServerError):
        p._start(cfg)
    assert events == ["spawn shm", "server start", "spare discarded"]
    assert p.trainers == {}


def test_a_trainer_given_a_spare_tells_it_its_spec_and_keeps_its_process(tmp_path):
    import json
    import os
    import subprocess

    from harness.trainer.handle import Trainer
    from harness.trainer.spares import Spare

    out = tmp_path / "stdin.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=f,
                                start_new_session=True)
    read_end, write_end = os.pipe()
    os.close(write_end)
    spare = Spare(proc, tmp_path / "spare.log", tmp_path / "scratch", read_end)
    spec = TrainerSpec.make(url="http://127.0.0.1:1", engine="shm", packed=False)
    t = Trainer(spec, log_dir=tmp_path, spares=False, spare=spare)
    try:
        t._start()
        assert t.proc is proc and t._started["spare"] is True
        t.proc.stdin.close()
        proc.wait(timeout=10)
        first = json.loads(out.read_text().splitlines()[0])
        assert first["op"] == "become" and first["spec"]["url"] == "http://127.0.0.1:1"
    finally:
        t.kill()
        if proc.poll() is None:
            proc.kill()
