"""``nccl``: the trainer side of vLLM's NCCL weight-transfer engine.

The trainer is rank 0 of an NCCL group whose other ranks are the server's
workers (``/get_world_size`` of them, from rank 1 on). Two HTTP calls block in
the server until the trainer meets them inside NCCL, so each must be in flight
while the trainer does its part:

* ``/init_weight_transfer_engine`` returns once every rank has joined the group;
* ``/update_weights`` returns once the broadcast it announces has been received.

Which vLLM API does the trainer's part is decided in ``harness.vllm.api``:
``factory`` (the stateful trainer engine, which runs those calls on its own
threads) and ``static`` (0.26 / 0.27.1: vLLM's rendezvous and broadcast helpers,
the routes driven beside them) are ``harness.portable.send_nccl.NcclSender``, the
one NCCL sender, which the emitted repro scripts copy too; ``raw`` (no trainer API
at all: vLLM's communicator and our own tensor-by-tensor broadcast; unpacked
only) is here, a subclass of that sender with a group and a broadcast of its own.
Since the sender was made one (docs/costs.md) it has run only against CPU stand-ins
(tests/unit/test_repro_emit.py): on two GPUs it is a hypothesis until a run shows it.

Nothing may wait forever. Every blocking step runs on a daemon thread that is
joined with a timeout (``NcclSender.steps``), and a failed HTTP
call (``RecordingClient.failed``) ends the wait early: a trainer blocked in a
collective whose peer has given up would otherwise wait for it until the NCCL or
TCPStore timeout. The error names the
step. A thread stuck inside NCCL cannot be interrupted; it is left behind, and
the trainer process is expected to exit once it has reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

from harness import transfer
from harness.core.facts import free_port
from harness.portable.base import Unusable
from harness.portable.send_nccl import NcclSender, StepTimeout  # the scripts' own
from harness.transfer import Backend, BackendVariant, ScriptSender, check_on_device, cuda_device
from harness.vllm import api as vllm_api

ENGINE = "nccl"
_MODULE = "vllm.distributed.weight_transfer.nccl_engine"
VLLM_API = vllm_api.EngineApi(
    module=_MODULE, init_info="NCCLTrainerInitInfo", update_info="NCCLWeightTransferUpdateInfo",
    extra=(("NCCLTrainerSendWeightsArgs", _MODULE, "NCCLTrainerSendWeightsArgs"),
           ("NCCLWeightTransferEngine.trainer_send_weights", _MODULE,
            "NCCLWeightTransferEngine.trainer_send_weights"),
           ("NCCLWeightTransferEngine.trainer_init", _MODULE,
            "NCCLWeightTransferEngine.trainer_init"),
           ("nccl_common.trainer_init", "vllm.distributed.weight_transfer.nccl_common",
            "trainer_init")),
    static=("nccl_common.trainer_init", "NCCLWeightTransferEngine.trainer_send_weights"),
    static_sender="NCCLWeightTransferEngine.trainer_send_weights",
    no_factory_words=("has no NCCL trainer engine in its trainer factory (its NCCL trainer API "
                      "is the static nccl_common.trainer_init + trainer_send_weights, with the "
                      "routes and their threads written by the trainer); the vllm trainer path "
                      "runs NCCL only through the factory, the harness path covers the static one"))


def user_init_info(url: str, timeout: float, api_key: str | None, scratch: str) -> dict:
    """A trainer of your own joins the group as rank 0 beside every server rank."""
    from harness.vllm.client import ServerClient

    world = ServerClient(url, timeout=timeout, api_key=api_key).world_size()
    return {"master_address": "127.0.0.1", "master_port": free_port("127.0.0.1"),
            "world_size": world + 1, "rank_offset": 1}


BACKEND = Backend(
    engine=ENGINE,
    description="vLLM's NCCL engine: the trainer on a GPU of its own broadcasts to every rank",
    variants=(BackendVariant("nccl-packed", ENGINE, True, True, False,
                             "NCCL broadcast of packed buffers, trainer on its own GPU"),
              BackendVariant("nccl-unpacked", ENGINE, False, True, False,
                             "NCCL broadcast tensor by tensor, trainer on its own GPU")),
    sender="harness.transfer.nccl:Sender",
    layouts=("2gpu-split", "3gpu-tp2"),
    shorthand="nccl-packed",
    vllm_api=VLLM_API,
    # A failed sync leaves the group mid-collective: the trainer is ended, not reused.
    recovers_in_place=False,
    # A twin takes no update, so its engine is only a launch flag: NCCL cases share the
    # IPC server's twin on one GPU layout, one start fewer in a run that selects both.
    twin_engine="ipc",
    user_init_info=user_init_info,
    script=ScriptSender(("send_nccl", "trainer_api")),
    raw_limit="nccl",
    raw_limit_words="NCCL broadcast",
)

API_WORDS = {"factory": "trainer engine", "static": "static API"}
# Where each path hands vLLM the packed-buffer geometry (0.26 reads it in each update too,
# where the update info declares it).
GEOMETRY_TAKEN_BY = {"factory": ("NCCLTrainerInitInfo",), "static": ("NCCLTrainerSendWeightsArgs",)}


class NcclSendError(RuntimeError):
    pass


class Sender:
    """Rank 0 of an NCCL group with the server's workers, kept for many updates.

    ``init()`` opens the group (the rendezvous beside ``/init_weight_transfer_engine``);
    every ``send()`` is one update through it. Options: ``device``, ``master_address``
    (127.0.0.1), ``nccl_port`` (default: a free port), ``packed_buffer_size_bytes``,
    ``packed_num_buffers`` (vLLM's defaults otherwise), ``step_timeout_s`` (default:
    the client's HTTP timeout plus 60 s, so that an HTTP timeout, which says more,
    fires first), ``world_size`` (the group's size; default: the server's ranks plus
    the trainer; fault tests give a wrong one), ``hold_before_broadcast_s`` (wait that
    long with /update_weights in flight before broadcasting: fault tests kill the
    trainer there; the harness-driven paths only), ``weight_version`` (sent with every
    ``/finish_weight_update``).
    """

    def __init__(self, client, *, packed: bool, options: dict):
        self.caps, self.path = vllm_api.sender_path(ENGINE, {ENGINE: VLLM_API}, NcclSendError)
        # before any route: a CPU trainer is refused up front
        self.device = cuda_device(options, NcclSendError, "NCCL sends from a CUDA device")
        if packed and self.path == "raw":
            raise NcclSendError("this vLLM has no NCCL trainer API (neither "
                                "WeightTransferTrainerFactory 'nccl' nor trainer_send_weights);"
                                " the harness's raw fallback sends unpacked only")
        self.client = vllm_api.RecordingClient(client, options.get("weight_version"))
        self.packed = packed
        self.master_address = options.get("master_address") or "127.0.0.1"
        self.master_port = int(options.get("nccl_port") or free_port(self.master_address))
        self.geometry = {k: int(options[k]) for k in ("packed_buffer_size_bytes",
                                                      "packed_num_buffers") if options.get(k)}
        for name in GEOMETRY_TAKEN_BY.get(self.path, ()) if self.geometry else ():
            # a geometry option this vLLM does not know is an error, not dropped silently
            fields = {f.name for f in dataclasses.fields(vllm_api.lookup(name, {ENGINE: VLLM_API}))}
            unknown = sorted(set(self.geometry) - fields)
            if unknown:
                raise NcclSendError(f"{name} has no field(s) {unknown} in this vLLM")
        self.timeout = float(options.get("step_timeout_s")
                             or getattr(client, "timeout", 300.0) + 60)
        self.forced_world_size = int(options["world_size"]) if options.get("world_size") else None
        self.hold_before_broadcast_s = float(options.get("hold_before_broadcast_s") or 0)
        hold_after_start = getattr(client, "hold_after_start", None)  # the trainer's client
        if self.hold_before_broadcast_s and self.path == "factory" and callable(hold_after_start):
            # vLLM's trainer engine broadcasts by itself: hold after /start_weight_update
            hold_after_start(self.hold_before_broadcast_s)
        self.vllm: NcclSender | None = None  # the group, once init() has opened it
        self.broadcasts: list[int] | None = None

    @property
    def world_size(self) -> int | None:
        return None if self.vllm is None else self.vllm.rendezvous["world_size"]

    # ----------------------------------------------------------------- init
    def init(self) -> None:
        # the trainer is one extra rank next to every worker of every DP replica
        world_size = self.forced_world_size or int(self.client.world_size()) + 1
        # raw drives the routes as the static path does, around a group and broadcast of its own
        sender = _RawSender if self.path == "raw" else NcclSender
        self.vllm = sender(self.client, engine=ENGINE, packed=self.packed,
                           api="static" if self.path == "raw" else self.path,
                           device=self.device, world_size=world_size, timeout=self.timeout,
                           master_port=self.master_port)
        self.vllm.rendezvous["master_address"] = self.master_address
        self.vllm.watch = self.client
        if self.path != "raw":  # the raw path broadcasts tensor by tensor, no buffers
            self.vllm.geometry = self.geometry
        self.vllm.hold_before_broadcast_s = self.hold_before_broadcast_s
        if self.path == "raw":
            self.vllm.fields = self.caps.get("nccl_update_info_fields") or []
        with _as_send_error():
            self.vllm.init()
        if self.path != "raw":
            self.broadcasts = _count_broadcasts(
                self.vllm.group if self.path == "static"
                else getattr(self.vllm.engine, "model_update_group", None))

    # ----------------------------------------------------------------- updates
    def send(self, weights: list[tuple[str, Any]]):
        if self.vllm is None:
            raise NcclSendError("send() before init(): the NCCL group is not open")
        weights = list(weights)
        check_on_device(weights, self.device, NcclSendError)
        self.client.reset()
        if self.broadcasts is not None:
            self.broadcasts[0] = 0
        with _as_send_error():
            api = self.vllm.send(weights)
        api_path = api if self.path == "raw" else f"vLLM {API_WORDS[self.path]}: {api}"
        # Packed: the number of buffers broadcast. Unpacked: update_weights calls.
        if self.packed:
            chunks = self.broadcasts[0] if self.broadcasts is not None else None
        else:
            chunks = self.client.update_calls
        return transfer.send_result(weights, chunks=chunks, api_path=api_path,
                                    client=self.client, path=self.path,
                                    world_size=self.world_size, master_port=self.master_port)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.group = self.vllm.engine = None

    def repeat_metadata(self) -> None:
        """The next update carries its names, dtypes and shapes even when unchanged:
        vLLM 0.33's trainer engine elides them otherwise, and a lie about metadata
        that is not sent tells nothing (``vllm_api.forget_sent_metadata``)."""
        engine = getattr(self.vllm, "engine", None)  # the factory's, once init() has run
        if engine is not None:
            vllm_api.forget_sent_metadata(engine)


class _RawSender(NcclSender):
    """No trainer API in this vLLM: rank 0 through vLLM's own communicator, a broadcast
    tensor by tensor in the order the update info lists them; unpacked only. The routes
    around them are the static path's."""

    def open_group(self) -> Any:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        r = self.rendezvous
        pg = StatelessProcessGroup.create(host=r["master_address"], port=r["master_port"],
                                          rank=0, world_size=r["world_size"])
        return PyNcclCommunicator(pg, device=self.device)

    def broadcaster(self, weights: list) -> Callable[[], None]:
        import torch

        def broadcast() -> None:
            stream = torch.cuda.current_stream()
            for _, t in weights:
                self.group.broadcast(t.contiguous(), src=0, stream=stream)
        return broadcast

    def _send_static(self, weights: list) -> str:
        super()._send_static(weights)
        return "raw: vLLM PyNcclCommunicator broadcast, HTTP routes driven by the harness"


@contextlib.contextmanager
def _as_send_error():
    """The shared sender's own refusals and waits as NcclSendError, naming the step;
    an error raised inside a step (vLLM's, the server's) passes as it is."""
    try:
        yield
    except (StepTimeout, Unusable) as e:
        raise NcclSendError(str(e)) from (e.__cause__ or e)


# --------------------------------------------------------------------------- counting

def _count_broadcasts(group: Any) -> list[int] | None:
    """Count ``group.broadcast`` calls (one per packed buffer when packed) by wrapping the
    method on this one communicator. None when the communicator is not reachable."""
    if group is None or not callable(getattr(group, "broadcast", None)):
        return None
    count, inner = [0], group.broadcast

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return inner(*args, **kwargs)

    try:
        group.broadcast = counting
    except AttributeError:
        return None
    return count
