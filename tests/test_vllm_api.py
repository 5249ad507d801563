"""Pure-logic tests of harness.vllm.api and the NCCL / IPC senders' plumbing.

None of these needs a GPU or a server: they check the capability probe on the
installed vLLM, the WeightSource adapter against vLLM's own consistency check,
the JSON-safe encoding of IPC handles against vLLM's own decoder, and that every
wait in the NCCL sender is bounded.
"""

from __future__ import annotations

import base64
import json
import pickle
import threading
import time

import pytest

from harness import transfer
from harness.portable.send_ipc import update_info_as_dict
from harness.portable.trainer_api import weight_source
from harness.vllm import api as vllm_api

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

PROBE_BOOLS = [
    "WeightTransferTrainerFactory", "WeightSource", "ModuleSource", "ParamMeta",
    "HTTPVLLMWeightSyncClient", "NCCLTrainerInitInfo", "IPCTrainerInitInfo",
    "NCCLWeightTransferEngine.trainer_send_weights", "IPCWeightTransferEngine.trainer_send_weights",
    "nccl_common.trainer_init", "NCCLWeightTransferEngine.trainer_init",
]


# --------------------------------------------------------------------------- probe


def test_static_sender_stub_does_not_count_as_the_api():
    # 0.27.1 keeps IPCWeightTransferEngine.trainer_send_weights as a (*args, **kwargs)
    # stub that raises; only the real (iterator, trainer_args) form counts.
    def stub(*args, **kwargs):
        raise NotImplementedError

    def real(iterator, trainer_args):
        pass

    assert not vllm_api._takes_iterator_and_args(stub)
    assert vllm_api._takes_iterator_and_args(real)
    assert vllm_api._takes_iterator_and_args(staticmethod(real).__func__)


def test_path_choice_per_generation():
    base = {k: False for k in PROBE_BOOLS} | {"errors": {}, "trainer_factory_backends": [],
                                                "factory_takes_backend": False}
    v026 = base | {"nccl_common.trainer_init": True, "factory_takes_backend": True,
                   "NCCLWeightTransferEngine.trainer_send_weights": True,
                   "IPCWeightTransferEngine.trainer_send_weights": True}
    v0271 = base | {"nccl_common.trainer_init": True, "IPCTrainerInitInfo": True,
                    "NCCLWeightTransferEngine.trainer_send_weights": True,
                    "trainer_factory_backends": ["ipc"]}
    v032 = base | {"NCCLTrainerInitInfo": True, "IPCTrainerInitInfo": True,
                   "nccl_common.trainer_init": True, "trainer_factory_backends": ["ipc", "nccl"]}
    no_ray = v026 | {"errors": {transfer.backend("ipc").vllm_api.module: "ModuleNotFoundError: ray"}}

    def paths(caps):
        return (vllm_api._path(caps, "nccl", transfer.backend("nccl").vllm_api),
                vllm_api._path(caps, "ipc", transfer.backend("ipc").vllm_api))

    assert paths(v026) == ("static", "static")
    assert paths(v0271) == ("static", "factory")
    assert paths(v032) == ("factory", "factory")
    assert paths(no_ray) == ("static", "unimportable")
    assert paths(base) == ("raw", "raw")


# --------------------------------------------------------------------------- backend_importable


def test_backend_importable_names_a_missing_module():
    ok, why = vllm_api.backend_importable("carrier_pigeon_engine", timeout=60)
    assert not ok and "No module named 'carrier_pigeon_engine'" in why


# --------------------------------------------------------------------------- WeightSource adapter

def _weights():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(8, 4, generator=g)),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(6, 4, generator=g)),
            ("model.layers.0.mlp.down_proj.weight", torch.randn(4, 6, generator=g).bfloat16()),
            ("model.layers.1.mlp.up_proj.weight", torch.randn(6, 4, generator=g)),
            ("model.norm.weight", torch.ones(4))]


def test_weight_source_metadata_matches_iteration():
    from vllm.distributed.weight_transfer.base import WeightSource

    weights = _weights()
    source = weight_source(weights)
    assert isinstance(source, WeightSource)
    meta = source.metadata()
    for _ in range(2):  # re-iterable: one fresh pass per round
        pairs = list(source)
        assert [n for n, _ in pairs] == [m.name for m in meta] == [n for n, _ in weights]
        assert [t.dtype for _, t in pairs] == [m.dtype for m in meta]
        assert [tuple(t.shape) for _, t in pairs] == [m.shape for m in meta]
        assert all(a is b for (_, a), (_, b) in zip(pairs, weights))  # the same tensors


def test_weight_source_passes_vllms_own_consistency_checks():
    weights = _weights()
    source = weight_source(weights)
    if not hasattr(source, "iter_groups"):
        pytest.skip("this vLLM's WeightSource has no iter_groups (added after 0.27.1)")
    batches = list(source.iter_groups())  # checks iteration order against metadata()
    assert sum(len(names) for names, _ in batches) == len(weights)
    try:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine
    except ImportError:
        pytest.skip("this vLLM has no NCCLTrainerWeightTransferEngine")
    checked = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
    assert [n for n, _ in checked] == [n for n, _ in weights]


def test_weight_source_sends_corrupted_lists_as_given():
    weights = _weights()
    swapped = [(weights[3][0], weights[1][1]), (weights[1][0], weights[3][1])]
    for given in ([], weights[:2], swapped):
        source = weight_source(given)
        assert [m.name for m in source.metadata()] == [n for n, _ in given]
        assert [n for n, _ in source] == [n for n, _ in given]


# --------------------------------------------------------------------------- IPC payloads

def _fake_handles(n):
    # The shape of reduce_tensor's args: non-JSON things (a class, bytes, a dtype).
    return [{"GPU-uuid-0": (torch.Tensor, (4, 4), (4, 1), 0, torch.UntypedStorage, torch.float32,
                            0, b"\x00\x01handle%d" % i, 64, 0, False, b"ref", 0, b"", True)}
            for i in range(n)]


def test_json_safe_update_info_pickles_handles():
    info = {"names": ["a", "b"], "dtype_names": ["float32"] * 2, "shapes": [[4, 4]] * 2,
            "ipc_handles": _fake_handles(2), "ipc_handles_pickled": None, "tensor_sizes": None}
    before = dict(info)
    out = vllm_api.json_safe_update_info(info)
    assert info == before  # the input is not modified
    assert "ipc_handles" not in out
    assert {k: out[k] for k in ("names", "dtype_names", "shapes", "tensor_sizes")} == \
           {k: info[k] for k in ("names", "dtype_names", "shapes", "tensor_sizes")}
    json.dumps(out)  # postable
    assert pickle.loads(base64.b64decode(out["ipc_handles_pickled"])) == info["ipc_handles"]


def test_json_safe_update_info_leaves_other_payloads_alone():
    nccl = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]}
    assert vllm_api.json_safe_update_info(nccl) is nccl
    both = {"ipc_handles": _fake_handles(1), "ipc_handles_pickled": "x"}
    with pytest.raises(ValueError, match="both"):
        vllm_api.json_safe_update_info(both)
    many = vllm_api.json_safe_update_info([nccl, {"ipc_handles": _fake_handles(1)}])
    assert many[0] is nccl and "ipc_handles_pickled" in many[1]


def test_json_safe_update_info_is_what_vllms_worker_decodes(monkeypatch):
    try:
        from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    except ImportError as e:
        pytest.skip(f"vLLM's ipc_engine does not import here: {e}")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    handles = _fake_handles(2)
    sent = IPCWeightTransferUpdateInfo(names=["a", "b"], dtype_names=["float32"] * 2,
                                       shapes=[[4, 4]] * 2, ipc_handles=handles)
    wire = json.loads(json.dumps(vllm_api.json_safe_update_info(
        update_info_as_dict(sent))))
    received = IPCWeightTransferUpdateInfo(**wire)  # unpickles ipc_handles_pickled
    assert received.ipc_handles == handles and received.names == ["a", "b"]


class FakeServerClient:
    url = "http://fake"

    def __init__(self, fail_on: str | None = None):
        self.posted: list[tuple[str, tuple]] = []
        self.fail_on = fail_on

    def _record(self, route, *args):
        self.posted.append((route, args))
        if route == self.fail_on:
            raise RuntimeError(f"{route} failed with HTTP 500")

    def init_weight_transfer_engine(self, init_info):
        self._record("init", init_info)

    def start_weight_update(self):
        self._record("start")

    def update_weights(self, update_info):
        json.dumps(update_info)  # what requests would do with it
        self._record("update", update_info)

    def finish_weight_update(self, weight_version=None):
        self._record("finish", *(() if weight_version is None else (weight_version,)))


def test_recording_client_records_and_pickles():
    fake = FakeServerClient()
    rc = vllm_api.RecordingClient(fake)
    assert rc.url == "http://fake"  # everything else is the wrapped client's
    rc.init_weight_transfer_engine({"packed": True})
    rc.start_weight_update()
    rc.update_weights({"names": ["a"], "ipc_handles": _fake_handles(1)})
    rc.update_weights({"names": ["b"], "ipc_handles": _fake_handles(1)})
    rc.finish_weight_update()
    assert rc.calls == ["/init_weight_transfer_engine", "/start_weight_update",
                        "/update_weights", "/update_weights", "/finish_weight_update"]
    assert rc.update_calls == 2 and not rc.failed.is_set()
    assert "ipc_handles_pickled" in fake.posted[2][1][0]
    assert fake.posted[-1] == ("finish", ())


def test_recording_client_keeps_the_first_failure():
    rc = vllm_api.RecordingClient(FakeServerClient(fail_on="update"))
    rc.start_weight_update()
    with pytest.raises(RuntimeError, match="HTTP 500"):
        rc.update_weights({"names": []})
    assert rc.failed.is_set() and rc.error_route == "/update_weights"
    assert "HTTP 500" in str(rc.error)


def test_send_result_shape():
    rc = vllm_api.RecordingClient(FakeServerClient())
    rc.update_weights({"names": []})
    res = transfer.send_result(_weights(), chunks=3, api_path="x", client=rc, path="static")
    stats = res.as_dict()
    assert stats["tensors"] == 5 and stats["chunks"] == 3 and stats["api_path"] == "x"
    assert stats["bytes"] == sum(t.numel() * t.element_size() for _, t in _weights())
    assert stats["vllm_version"] and stats["update_calls"] == 1 and stats["path"] == "static"
    assert stats["http_calls"] == ["/update_weights"]
    rc.reset()  # a persistent sender's next round starts a new record
    assert rc.calls == [] and rc.update_calls == 0 and not rc.failed.is_set()


# --------------------------------------------------------------------------- NCCL plumbing

def _steps(timeout: float, watch):
    """The shared NCCL sender's ``steps`` on the CPU, watching the harness's client ``watch``."""
    from harness.portable.send_nccl import NcclSender

    sender = NcclSender(watch, engine="nccl", packed=False, api="static", device="cpu", world_size=2,
                        timeout=timeout)
    sender.watch = watch
    return sender.steps


def test_nccl_step_returns_and_raises():
    rc = vllm_api.RecordingClient(FakeServerClient())
    assert _steps(5, rc)(("add", lambda: 1 + 1)) == [2]

    def boom():
        raise ValueError("trainer side broke")

    with pytest.raises(ValueError, match="trainer side broke"):
        _steps(5, rc)(("boom", boom))


def test_nccl_step_times_out_naming_the_step():
    rc = vllm_api.RecordingClient(FakeServerClient())
    never = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"NCCL rendezvous: not done within 1s \(HTTP "
                                           r"calls so far: none\)"):
        _steps(1, rc)(("NCCL rendezvous", never.wait))
    assert time.monotonic() - t0 < 5
    never.set()


def test_nccl_step_stops_waiting_when_the_http_side_fails(monkeypatch):
    """vLLM's trainer engine calls /update_weights on a thread of its own: its failure,
    seen through the client, ends the wait for a broadcast that will never be met."""
    from harness.portable import send_nccl

    monkeypatch.setattr(send_nccl, "GRACE_S", 0.2)
    rc = vllm_api.RecordingClient(FakeServerClient(fail_on="update"))
    never = threading.Event()
    with pytest.raises(RuntimeError, match="HTTP 500"):
        rc.update_weights({"names": []})  # as vLLM's own thread would
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"broadcast: still blocked 0s after /update_weights "
                                           r"failed.*HTTP 500"):
        _steps(60, rc)(("broadcast", never.wait))
    assert time.monotonic() - t0 < 5
    never.set()


def test_the_harness_nccl_sender_names_a_stuck_step_as_its_own_error(monkeypatch):
    """The shared sender's waits surface from the harness's Sender as NcclSendError."""
    from harness.portable.send_nccl import StepTimeout
    from harness.transfer import nccl

    with pytest.raises(nccl.NcclSendError, match="not done within") as e:
        with nccl._as_send_error():
            raise StepTimeout("rendezvous: not done within 1s")
    assert isinstance(e.value.__cause__, StepTimeout)
    for own in (ValueError("vLLM's own"), TimeoutError("a socket's own")):  # a step's error
        with pytest.raises(type(own), match="own"):                         # passes as it is
            with nccl._as_send_error():
                raise own


def test_nccl_update_info_follows_the_dataclass_fields():
    from harness.portable.base import Unusable
    from harness.portable.send_nccl import NcclSender

    class Recorder:
        def __init__(self):
            self.updates = []

        start_weight_update = finish_weight_update = lambda self: None

        def update_weights(self, info):
            self.updates.append(info)

    def sent(packed, fields, geometry):
        sender = NcclSender(Recorder(), engine="nccl", packed=packed, api="static", device="cpu",
                            world_size=2, timeout=5)
        sender.geometry = geometry
        sender.broadcaster = lambda weights: lambda: None
        sender.fields = fields
        sender.send(_weights())
        return sender.client.updates[0]

    old = ["names", "dtype_names", "shapes", "packed", "packed_buffer_size_bytes",
           "packed_num_buffers"]
    info = sent(True, old, {"packed_buffer_size_bytes": 64})
    assert info["packed"] is True and info["packed_buffer_size_bytes"] == 64
    assert info["dtype_names"][2] == "bfloat16" and info["shapes"][2] == [4, 6]
    new = ["names", "dtype_names", "shapes"]
    assert set(sent(False, new, {})) == {"names", "dtype_names", "shapes"}
    with pytest.raises(Unusable, match="no 'packed' field"):
        sent(True, new, {})


def test_nccl_counts_broadcasts_on_one_communicator():
    from harness.transfer import nccl

    class Group:
        def broadcast(self, tensor, src=0, stream=None):
            return tensor

    group = Group()
    count = nccl._count_broadcasts(group)
    group.broadcast(1)
    group.broadcast(2, src=0)
    assert count == [2]
    assert nccl._count_broadcasts(None) is None


@pytest.mark.parametrize("engine", ["nccl", "ipc"])
def test_senders_refuse_a_cpu_trainer(engine, monkeypatch):
    from harness.transfer import sender_class

    monkeypatch.setattr(vllm_api, "probe", lambda engines, isolated=False: {
        f"{engine}_path": "static", "errors": {}})
    rc_fake = FakeServerClient()
    with pytest.raises(RuntimeError, match="the trainer is on cpu"):
        sender_class(engine)(rc_fake, packed=False, options={"device": "cpu"})
    assert rc_fake.posted == []  # refused before any route was called


def test_tensors_off_the_senders_device_are_refused():
    import torch

    from harness.transfer import check_on_device

    with pytest.raises(ValueError, match=r"2 tensor\(s\) are not on cuda:0, e.g. a on cpu"):
        check_on_device([("a", torch.zeros(1)), ("b", torch.zeros(1))],
                        torch.device("cuda", 0), ValueError)


@pytest.mark.parametrize("engine, error", [("nccl", "NcclSendError"), ("ipc", "IpcSendError")])
def test_senders_name_the_import_failure_of_vllms_engine(engine, error, monkeypatch):
    # vLLM 0.26.0's ipc_engine imports ray at module level: the sender must say so
    # before touching the server, not fail somewhere inside vLLM.
    import importlib

    module = importlib.import_module(f"harness.transfer.{engine}")
    cause = "ModuleNotFoundError: No module named 'ray'"
    monkeypatch.setattr(vllm_api, "probe", lambda engines, isolated=False: {
        f"{engine}_path": "unimportable", "errors": {transfer.backend(engine).vllm_api.module: cause}})
    rc_fake = FakeServerClient()
    with pytest.raises(getattr(module, error),
                       match=f"vLLM's {engine.upper()} engine module cannot be imported: {cause}"):
        module.Sender(rc_fake, packed=False, options={"device": "cuda:0"})
    assert rc_fake.posted == []


@pytest.mark.parametrize("server_ranks", [1, 2, 4])
def test_nccl_group_spans_every_server_rank_with_the_trainer_at_rank_0(server_ranks,
                                                                       monkeypatch):
    """A tensor-parallel server (3gpu-tp2: TP=2) joins the trainer's group with every
    worker: world size = the server's ranks + 1, the trainer is rank 0 and the workers
    start at rank_offset 1. Checked here on the 0.26 (static) path, without GPUs: the
    communicator is a fake that records how it was opened."""
    import types

    import torch

    from harness.portable import send_nccl
    from harness.transfer import nccl

    opened = []
    monkeypatch.setattr(vllm_api, "probe", lambda engines, isolated=False: {
        "nccl_path": "static", "errors": {}})
    monkeypatch.setattr(nccl, "cuda_device", lambda options, error, why: "cuda:2")
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # each step's thread
    monkeypatch.setattr(send_nccl, "_wt", lambda module: types.SimpleNamespace(
        trainer_init=lambda rendezvous: opened.append(dict(rendezvous)) or object()))

    class Server(FakeServerClient):
        def world_size(self):
            return server_ranks

    server = Server()
    sender = nccl.Sender(server, packed=True, options={"device": "cuda:2", "nccl_port": 29555})
    sender.init()
    expected = {"master_address": "127.0.0.1", "master_port": 29555,
                "world_size": server_ranks + 1}
    assert opened == [expected]
    assert server.posted == [("init", ({**expected, "rank_offset": 1},))]


def test_a_weight_version_rides_the_bare_finish_of_vllms_trainer_engines():
    """vLLM's trainer engines call finish_weight_update() without a version; the IPC and
    NCCL senders publish the sync's weight_version through the recording client."""
    calls = []

    class Client:
        def finish_weight_update(self, *args):
            calls.append(args)

    vllm_api.RecordingClient(Client(), "v7").finish_weight_update()
    vllm_api.RecordingClient(Client(), "v7").finish_weight_update("named")
    vllm_api.RecordingClient(Client()).finish_weight_update()
    assert calls == [("v7",), ("named",), ()]
