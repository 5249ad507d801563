"""``nccl``: the trainer side of vLLM's NCCL weight-transfer engine.

The trainer is rank 0 of an NCCL group whose other ranks are the server's
workers (``/get_world_size`` of them, from rank 1 on). Two HTTP calls block in
the server until the trainer meets them inside NCCL, so each must be in flight
while the trainer does its part:

* ``/init_weight_transfer_engine`` returns once every rank has joined the group;
* ``/update_weights`` returns once the broadcast it announces has been received.

Which vLLM API does the trainer's part is decided in ``harness.vllm.api``:
``factory`` (the stateful trainer engine, which runs those calls on its own
threads), ``static`` (0.26 / 0.27.1: vLLM's rendezvous and broadcast helpers,
with this module driving the routes) or ``raw`` (no trainer API at all: vLLM's
communicator and our own tensor-by-tensor broadcast; unpacked only).

Nothing may wait forever. Every blocking step runs on a daemon thread that is
joined with a timeout, and a failed HTTP call (``RecordingClient.failed``) ends
the wait early: a trainer blocked in a collective whose peer has given up would
otherwise wait for it until the NCCL or TCPStore timeout. The error names the
step. A thread stuck inside NCCL cannot be interrupted; it is left behind, and
the trainer process is expected to exit once it has reported.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from harness import transfer
from harness.core.facts import free_port, update_info
from harness.transfer import check_on_device, cuda_device
from harness.portable.trainer_api import weight_source  # the scripts' own
from harness.vllm import api as vllm_api

GRACE_S = 5.0  # how long a step may take to fail on its own once its HTTP peer failed


class NcclSendError(RuntimeError):
    pass


class _Step:
    """``fn()`` on a daemon thread; ``result()`` waits for it with a bound."""

    def __init__(self, name: str, fn: Callable[[], Any], device: Any = None):
        self.name = name
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

        def body() -> None:
            try:
                if device is not None:
                    # The current CUDA device is per thread: without this a trainer on
                    # cuda:1 would open its communicator and streams on cuda:0.
                    import torch
                    torch.cuda.set_device(device)
                self._value = fn()
            except BaseException as e:
                self._error = e
            finally:
                self._done.set()

        threading.Thread(target=body, name=f"nccl: {name}", daemon=True).start()

    def result(self, timeout: float, watch: vllm_api.RecordingClient) -> Any:
        deadline = time.monotonic() + timeout
        while not self._done.wait(0.1):
            if watch.failed.is_set() and not self._done.wait(GRACE_S):
                raise NcclSendError(
                    f"{self.name}: still blocked {GRACE_S:.0f}s after {watch.error_route} "
                    f"failed, so the server side will not join it; that failure was: "
                    f"{watch.error}") from watch.error
            if time.monotonic() > deadline:
                raise NcclSendError(
                    f"{self.name}: not done within {timeout:.0f}s (HTTP calls so far: "
                    f"{', '.join(watch.calls) or 'none'}); its thread is left blocked")
        if self._error is not None:
            raise self._error
        return self._value


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
    trainer there; the harness-driven paths only).
    """

    def __init__(self, client, *, packed: bool, options: dict):
        self.caps, self.path = vllm_api.sender_path("nccl", NcclSendError)
        # before any route: a CPU trainer is refused up front
        self.device = cuda_device(options, NcclSendError, "NCCL sends from a CUDA device")
        if packed and self.path == "raw":
            raise NcclSendError("this vLLM has no NCCL trainer API (neither "
                                "WeightTransferTrainerFactory 'nccl' nor trainer_send_weights);"
                                " the harness's raw fallback sends unpacked only")
        self.client = vllm_api.RecordingClient(client)
        self.packed = packed
        self.master_address = options.get("master_address") or "127.0.0.1"
        self.master_port = int(options.get("nccl_port") or free_port(self.master_address))
        self.geometry = {k: int(options[k]) for k in ("packed_buffer_size_bytes",
                                                      "packed_num_buffers") if options.get(k)}
        self.timeout = float(options.get("step_timeout_s")
                             or getattr(client, "timeout", 300.0) + 60)
        self.world_size: int | None = None
        self.forced_world_size = int(options["world_size"]) if options.get("world_size") else None
        self.hold_before_broadcast_s = float(options.get("hold_before_broadcast_s") or 0)
        hold_after_start = getattr(client, "hold_after_start", None)  # the trainer's client
        if self.hold_before_broadcast_s and self.path == "factory" and callable(hold_after_start):
            # vLLM's trainer engine broadcasts by itself: hold after /start_weight_update
            hold_after_start(self.hold_before_broadcast_s)
        self.group: Any = None      # static / raw: the trainer's communicator
        self.engine: Any = None     # factory: vLLM's trainer engine
        self.broadcasts: list[int] | None = None

    @property
    def rendezvous(self) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": self.master_port,
                "world_size": self.world_size}

    # ----------------------------------------------------------------- init
    def init(self) -> None:
        # the trainer is one extra rank next to every worker of every DP replica
        self.world_size = self.forced_world_size or int(self.client.world_size()) + 1
        if self.path == "factory":
            factory = vllm_api.lookup("WeightTransferTrainerFactory")
            init_cls = vllm_api.lookup("NCCLTrainerInitInfo")
            info = init_cls(rank=0, packed=self.packed, **self.rendezvous,
                            **_accepted(init_cls, self.geometry))
            source = weight_source([])
            # vLLM's trainer engine calls /init_weight_transfer_engine beside its
            # rendezvous, on a thread of its own
            self.engine = _Step("WeightTransferTrainerFactory.trainer_init (NCCL rendezvous "
                                "with /init_weight_transfer_engine)",
                                lambda: factory.trainer_init(info, client=self.client,
                                                             source=source),
                                self.device).result(self.timeout, self.client)
            self.broadcasts = _count_broadcasts(getattr(self.engine, "model_update_group",
                                                        None))
        elif self.path == "static":
            open_group = vllm_api.lookup("nccl_common.trainer_init")
            self.group = self._rendezvous(lambda: open_group(self.rendezvous),
                                          "nccl_common.trainer_init")
            self.broadcasts = _count_broadcasts(self.group)
        else:
            self.group = self._rendezvous(self._open_raw_group,
                                          "StatelessProcessGroup + PyNcclCommunicator")

    def _open_raw_group(self) -> Any:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        pg = StatelessProcessGroup.create(host=self.master_address, port=self.master_port,
                                          rank=0, world_size=self.world_size)
        return PyNcclCommunicator(pg, device=self.device)

    def _rendezvous(self, open_group: Callable[[], Any], what: str) -> Any:
        """Join the group as rank 0 while /init_weight_transfer_engine brings the workers."""
        init_info = {**self.rendezvous, "rank_offset": 1}
        http = _Step("/init_weight_transfer_engine",
                     lambda: self.client.init_weight_transfer_engine(init_info))
        group = _Step(f"{what} (NCCL rendezvous as rank 0 of {self.world_size} at "
                      f"{self.master_address}:{self.master_port})", open_group, self.device
                      ).result(self.timeout, self.client)
        http.result(self.timeout, self.client)
        return group

    # ----------------------------------------------------------------- updates
    def send(self, weights: list[tuple[str, Any]]):
        if self.world_size is None:
            raise NcclSendError("send() before init(): the NCCL group is not open")
        weights = list(weights)
        check_on_device(weights, self.device, NcclSendError)
        self.client.reset()
        if self.broadcasts is not None:
            self.broadcasts[0] = 0
        api_path = {"factory": self._via_factory, "static": self._via_static,
                    "raw": self._via_raw}[self.path](weights)
        # Packed: the number of buffers broadcast. Unpacked: update_weights calls.
        if self.packed:
            chunks = self.broadcasts[0] if self.broadcasts is not None else None
        else:
            chunks = self.client.update_calls
        return transfer.send_result(weights, chunks=chunks, api_path=api_path,
                                    client=self.client, path=self.path,
                                    world_size=self.world_size, master_port=self.master_port)

    def close(self) -> None:
        self.group = self.engine = None

    def repeat_metadata(self) -> None:
        """The next update carries its names, dtypes and shapes even when unchanged:
        vLLM 0.33's trainer engine elides them otherwise, and a lie about metadata
        that is not sent tells nothing (``vllm_api.forget_sent_metadata``)."""
        if self.engine is not None:
            vllm_api.forget_sent_metadata(self.engine)

    def _via_factory(self, weights) -> str:
        """vLLM's stateful trainer engine: /update_weights beside its broadcast, on
        threads of its own."""
        self.engine.source = weight_source(weights)
        _Step("send_weights (/start_weight_update, /update_weights with the NCCL broadcast, "
              "/finish_weight_update)", self.engine.send_weights, self.device
              ).result(self.timeout, self.client)
        return ("vLLM trainer engine: WeightTransferTrainerFactory.trainer_init("
                "NCCLTrainerInitInfo) + send_weights")

    def _via_static(self, weights) -> str:
        """0.26 / 0.27.1: vLLM broadcasts; the routes, and the threads they need, are
        ours. ``packed`` and the buffer geometry ride the update info there (the worker
        reads them per round)."""
        send_weights = vllm_api.lookup("NCCLWeightTransferEngine.trainer_send_weights")
        args_cls = vllm_api.lookup("NCCLTrainerSendWeightsArgs")
        # post_iter_func: NCCL reads numel elements from data_ptr(), so only contiguous
        # memory may be broadcast (0.26's unpacked path does not check).
        args = args_cls(group=self.group, src=0, packed=self.packed,
                        post_iter_func=lambda item: item[1].contiguous(),
                        **_accepted(args_cls, self.geometry))
        self._round(_update_info(weights, {"packed": self.packed, **self.geometry}, self.caps),
                    lambda: send_weights(iter(weights), args),
                    f"NCCLWeightTransferEngine.trainer_send_weights of {len(weights)} tensors")
        return ("vLLM static API: nccl_common.trainer_init + NCCLWeightTransferEngine."
                "trainer_send_weights, HTTP routes driven by the harness")

    def _via_raw(self, weights) -> str:
        """No trainer API in this vLLM: broadcast tensor by tensor with vLLM's own
        communicator, in the order the update info lists them."""
        import torch

        def broadcast() -> None:
            stream = torch.cuda.current_stream()
            for _, t in weights:
                self.group.broadcast(t.contiguous(), src=0, stream=stream)

        self._round(_update_info(weights, {"packed": False}, self.caps), broadcast,
                    f"PyNcclCommunicator.broadcast of {len(weights)} tensors")
        return "raw: vLLM PyNcclCommunicator broadcast, HTTP routes driven by the harness"

    def _round(self, info: dict, broadcast: Callable[[], None], what: str) -> None:
        """One update: start, then /update_weights beside the broadcast, then finish."""
        import torch

        def trainer_side() -> None:
            if self.hold_before_broadcast_s:
                print(f"nccl: /update_weights in flight, holding {self.hold_before_broadcast_s}s "
                      "before the broadcast", flush=True)
                time.sleep(self.hold_before_broadcast_s)
            broadcast()
            # Broadcasts are only enqueued; they must have left before the caller may
            # free or change the tensors (and a lost peer shows up here, in the bound).
            torch.cuda.current_stream().synchronize()

        self.client.start_weight_update()
        http = _Step("/update_weights", lambda: self.client.update_weights(info))
        _Step(what, trainer_side, self.device).result(self.timeout, self.client)
        http.result(self.timeout, self.client)
        self.client.finish_weight_update()


# --------------------------------------------------------------------------- shared steps

def _update_info(weights: list, extra: dict, caps: dict) -> dict:
    """names / dtype_names / shapes, plus those of ``extra`` this vLLM's
    NCCLWeightTransferUpdateInfo declares (0.26 takes packed and the geometry)."""
    info = update_info(weights)
    fields = caps.get("nccl_update_info_fields") or []
    if extra.get("packed") and "packed" not in fields:
        raise NcclSendError("packed requested, but this vLLM's NCCLWeightTransferUpdateInfo "
                            f"has no 'packed' field (fields: {fields})")
    return {**info, **{k: v for k, v in extra.items() if k in fields}}


def _accepted(cls: Any, values: dict) -> dict:
    """The entries of ``values`` that dataclass ``cls`` has fields for; a geometry option
    this vLLM does not know is an error, not something to drop silently."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise NcclSendError(f"{cls.__name__} has no field(s) {unknown} in this vLLM")
    return dict(values)


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
