"""A trainer of your own (harness/trainer/user.py): ``--vllm-trainer MODULE:ATTRIBUTE``
or an entry point name is loaded and checked before anything starts, and a bad one is
one usage error (exit 4) without a traceback; its cases' ids end ``-via-<label>``; the
``user`` pin of a trainers marker runs a test over it; the trainer process refuses what
only the harness's sender can do; the example sends every parameter through the four
routes (against a stand-in) and, broken on purpose, leaves one out.

No vLLM server starts here (the example's run is against a stdlib stand-in).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import harness
from harness.run import settings
from harness.trainer import user as trainer_plugin
from harness.trainer.handle import TrainerSpec, run_trainer

REPO = Path(harness.__file__).resolve().parents[1]
EXAMPLE = "examples.shm_sender:ShmSender"

SENDERS = '''
class Good:
    def __init__(self, ctx):
        self.ctx = ctx
    def init(self):
        pass
    def send(self, model):
        return {}
    def close(self):
        pass

class NoSend:
    def __init__(self, ctx):
        pass
    def init(self):
        pass
    def close(self):
        pass

class NoContext:
    def __init__(self):
        pass
    def init(self):
        pass
    def send(self, model):
        pass
    def close(self):
        pass

def a_function(ctx):
    pass
'''

SAMPLE = '''
import pytest

def test_plain(case):
    pass

@pytest.mark.trainers("harness", "vllm", "user")
def test_any_trainer(case):
    pass

@pytest.mark.trainers("vllm")
def test_vllm_only(case):
    pass
'''


@pytest.fixture
def project(pytester, monkeypatch):
    for opt in settings.OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.syspath_prepend(str(pytester.path))
    pytester.makepyfile(senders=SENDERS, broken_on_import="raise RuntimeError('boom')\n",
                        test_sample=SAMPLE)
    return pytester


BAD = [
    ("nosuchmodule:Sender", "trainer 'nosuchmodule:Sender': cannot import nosuchmodule: "
                            "No module named 'nosuchmodule'"),
    ("senders:Missing", "trainer 'senders:Missing': senders has no attribute 'Missing'"),
    ("senders:a_function", "trainer 'senders:a_function': function"),
    ("senders:NoSend", "trainer 'senders:NoSend': NoSend has no send method"),
    ("senders:NoContext", "trainer 'senders:NoContext': NoContext(ctx) cannot be called"),
    ("broken_on_import:X", "trainer 'broken_on_import:X': importing broken_on_import raised "
                           "RuntimeError: boom"),
    ("nosuchname", "unknown trainer 'nosuchname': not harness or vllm, not MODULE:ATTRIBUTE, "
                   "and no entry point of group weight_sync_harness.trainers has that name"),
]


@pytest.mark.parametrize("value, message", BAD, ids=[v for v, _ in BAD])
def test_a_bad_trainer_is_one_usage_error(project, value, message):
    r = project.runpytest("--collect-only", "-q", "--vllm-trainer", value)
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    err = r.stderr.str()
    assert f"ERROR: --vllm-trainer: {message}" in err, err
    assert "Traceback" not in err + r.stdout.str()
    assert len([ln for ln in err.splitlines() if ln.strip()]) <= 2, err


def _collected(r) -> set[str]:
    return {ln.split("::", 1)[1] for ln in r.stdout.lines if ln.startswith("test_sample.py::")}


def test_your_trainer_takes_the_tests_and_the_user_pin(project):
    r = project.runpytest("--collect-only", "-q", "--vllm-trainer", "senders:Good")
    assert r.ret == 0, r.stdout.str() + r.stderr.str()
    assert _collected(r) == {"test_plain[shm-cpu-fp32-llama-via-Good]",
                             "test_any_trainer[shm-cpu-fp32-llama-via-Good]"}


def test_without_the_option_the_user_pin_adds_nothing(project):
    r = project.runpytest("--collect-only", "-q")
    assert _collected(r) == {"test_plain[shm-cpu-fp32-llama]",
                             "test_any_trainer[shm-cpu-fp32-llama]",
                             "test_any_trainer[shm-cpu-fp32-llama-via-vllm]",
                             "test_vllm_only[shm-cpu-fp32-llama-via-vllm]"}


def test_an_entry_point_names_a_trainer_and_its_ids(project, monkeypatch):
    eps = [EntryPoint("mine", "senders:Good", trainer_plugin.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(trainer_plugin, "_entry_points", lambda: eps)
    r = project.runpytest("--collect-only", "-q", "--vllm-trainer", "harness,mine")
    assert r.ret == 0, r.stdout.str() + r.stderr.str()
    assert "test_plain[shm-cpu-fp32-llama-via-mine]" in _collected(r)
    assert "test_plain[shm-cpu-fp32-llama]" in _collected(r)
    r = project.runpytest("--collect-only", "-q", "--vllm-trainer", "theirs")
    assert "(installed: mine)" in r.stderr.str()


def test_labels_and_pins():
    assert trainer_plugin.label("mypkg.sync:MySender") == "MySender"
    assert trainer_plugin.label("mine") == "mine"
    assert trainer_plugin.pin(("harness", "user"), ("harness", "m:S")) == ("harness", "m:S")
    assert trainer_plugin.pin(("harness", "vllm"), ("m:S",)) == ("harness", "vllm")
    assert trainer_plugin.pin(None, ("m:S",)) is None


def test_the_trainer_process_refuses_what_only_the_harness_sender_does():
    from harness.trainer.module_codes import UserCode
    from harness.transfer.vllm_code import Unavailable

    code = UserCode(TrainerSpec(url="http://127.0.0.1:1", engine="shm", packed=False,
                                 code="senders:Good"), {})
    for cmd in ({"op": "sync", "weights_dir": "x", "corrupt": "drop"},
                {"op": "sync", "weights_dir": "x", "lie": "names"}, {"op": "describe"}):
        with pytest.raises(Unavailable):
            code.command(cmd)
    code = UserCode(TrainerSpec(url="http://127.0.0.1:1", engine="shm", packed=False,
                                 code="senders:Good"), {"hold_after_start_s": 5})
    with pytest.raises(Unavailable, match="takes no harness option .hold_after_start_s"):
        code.command({"op": "sync", "weights_dir": "x"})


# ----------------------------------------------------------------------------- the example

class _Routes(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        self.server.calls.append((self.path, body))
        if self.path == "/update_weights":  # the file must be there while the route runs
            assert Path(body["update_info"]["path"]).exists()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.fixture
def stand_in():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Routes)
    srv.calls = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


def _example_sync(stand_in, tmp_path) -> list:
    from harness import models

    url = f"http://127.0.0.1:{stand_in.server_address[1]}"
    spec = TrainerSpec.make(url=url, engine="shm", packed=False, code=EXAMPLE,
                            options={"device": "cpu"})
    run_trainer(spec, str(models.resolve_model("llama")[1]), timeout=300, log_dir=tmp_path)
    return stand_in.calls


@pytest.mark.slow_unit  # two trainer processes and a Hugging Face model
def test_the_example_sends_every_parameter_and_broken_leaves_one_out(stand_in, tmp_path,
                                                                     monkeypatch):
    """Against a stand-in for the routes: init with the context's bucket directory, then
    one update naming every parameter of the model; with SHM_SENDER_DROP, one fewer."""
    from harness import models
    from harness.oracles.reference import load_hf_model

    monkeypatch.chdir(REPO)  # the trainer imports examples/ as python -m does, from here
    names = [n for n, _ in load_hf_model(str(models.resolve_model("llama")[1]), "float32",
                                         "cpu").named_parameters()]
    calls = _example_sync(stand_in, tmp_path)
    routes = [r for r, _ in calls]
    assert routes[:2] == ["/init_weight_transfer_engine", "/start_weight_update"], routes
    assert routes[-1] == "/finish_weight_update" and "/update_weights" in routes, routes
    assert "root" in calls[0][1]["init_info"], calls[0]
    sent = [n for r, b in calls if r == "/update_weights" for n in b["update_info"]["names"]]
    assert sent == names
    stand_in.calls.clear()
    monkeypatch.setenv("SHM_SENDER_DROP", names[3])
    sent = [n for r, b in _example_sync(stand_in, tmp_path) if r == "/update_weights"
            for n in b["update_info"]["names"]]
    assert sent == names[:3] + names[4:]
