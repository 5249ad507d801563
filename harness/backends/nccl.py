"""``nccl``: the trainer side of vLLM's NCCL weight-transfer engine.

The trainer is rank 0 of an NCCL group whose other ranks are the server's
workers (``/get_world_size`` of them, from rank 1 on). Two HTTP calls block in
the server until the trainer meets them inside NCCL, so each must be in flight
while the trainer does its part:

* ``/init_weight_transfer_engine`` returns once every rank has joined the group;
* ``/update_weights`` returns once the broadcast it announces has been received.

Which vLLM API does the trainer's part is decided in ``harness.vllm_api``:
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
import socket
import threading
import time
from typing import Any, Callable

from harness import vllm_api
from harness.backends import cuda_device_of

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


@dataclasses.dataclass
class _Plan:
    client: vllm_api.RecordingClient
    weights: list
    packed: bool
    device: Any
    master_address: str
    master_port: int
    world_size: int
    geometry: dict[str, int]   # packed_buffer_size_bytes / packed_num_buffers, if asked for
    timeout: float

    @property
    def rendezvous(self) -> dict[str, Any]:
        return {"master_address": self.master_address, "master_port": self.master_port,
                "world_size": self.world_size}


def send(client, weights: list[tuple[str, Any]], *, packed: bool, options: dict) -> dict:
    """Broadcast ``weights`` (exactly this list) to the server's workers over NCCL.

    Options: ``device``, ``master_address`` (127.0.0.1), ``nccl_port`` (default: a
    free port), ``packed_buffer_size_bytes``, ``packed_num_buffers`` (vLLM's
    defaults otherwise), ``step_timeout_s`` (default: the client's HTTP timeout
    plus 60 s, so that an HTTP timeout, which says more, fires first).
    """
    caps, path = vllm_api.sender_path("nccl", NcclSendError)
    # before any route: CPU tensors are refused up front
    device = cuda_device_of(weights, options, NcclSendError, "NCCL sends from a CUDA device")
    rc = vllm_api.RecordingClient(client)
    address = options.get("master_address") or "127.0.0.1"
    plan = _Plan(
        client=rc, weights=list(weights), packed=packed, device=device,
        master_address=address,
        master_port=int(options.get("nccl_port") or _free_port(address)),
        # the trainer is one extra rank next to every worker of every DP replica
        world_size=int(client._call("GET", "/get_world_size")["world_size"]) + 1,
        geometry={k: int(options[k]) for k in ("packed_buffer_size_bytes", "packed_num_buffers")
                  if options.get(k)},
        timeout=float(options.get("step_timeout_s") or getattr(client, "timeout", 300.0) + 60))
    chunks, api_path = {"factory": _via_factory, "static": _via_static, "raw": _via_raw}[path](
        plan, caps)
    return vllm_api.sender_stats(plan.weights, chunks=chunks, api_path=api_path, client=rc,
                                 path=path, world_size=plan.world_size,
                                 master_port=plan.master_port)


# --------------------------------------------------------------------------- the three paths

def _via_factory(plan: _Plan, caps: dict) -> tuple[int | None, str]:
    """vLLM's stateful trainer engine: it calls /init_weight_transfer_engine beside its
    rendezvous and /update_weights beside its broadcast, on threads of its own."""
    factory = vllm_api.lookup("WeightTransferTrainerFactory")
    init_cls = vllm_api.lookup("NCCLTrainerInitInfo")
    info = init_cls(rank=0, packed=plan.packed, **plan.rendezvous,
                    **_accepted(init_cls, plan.geometry))
    source = vllm_api.weight_source(plan.weights)
    engine = _Step("WeightTransferTrainerFactory.trainer_init (NCCL rendezvous with "
                   "/init_weight_transfer_engine)",
                   lambda: factory.trainer_init(info, client=plan.client, source=source),
                   plan.device).result(plan.timeout, plan.client)
    broadcasts = _count_broadcasts(getattr(engine, "model_update_group", None))
    _Step("send_weights (/start_weight_update, /update_weights with the NCCL broadcast, "
          "/finish_weight_update)", engine.send_weights, plan.device
          ).result(plan.timeout, plan.client)
    return (_chunks(plan, broadcasts),
            "vLLM trainer engine: WeightTransferTrainerFactory.trainer_init("
            "NCCLTrainerInitInfo) + send_weights")


def _via_static(plan: _Plan, caps: dict) -> tuple[int | None, str]:
    """0.26 / 0.27.1: vLLM opens the trainer's communicator and broadcasts; the routes,
    and the threads they need, are ours. ``packed`` and the buffer geometry ride the
    update info there (the worker reads them per round)."""
    open_group = vllm_api.lookup("nccl_common.trainer_init")
    send_weights = vllm_api.lookup("NCCLWeightTransferEngine.trainer_send_weights")
    args_cls = vllm_api.lookup("NCCLTrainerSendWeightsArgs")
    group = _rendezvous(plan, lambda: open_group(plan.rendezvous), "nccl_common.trainer_init")
    broadcasts = _count_broadcasts(group)
    # post_iter_func: NCCL reads numel elements from data_ptr(), so only contiguous
    # memory may be broadcast (0.26's unpacked path does not check).
    args = args_cls(group=group, src=0, packed=plan.packed,
                    post_iter_func=lambda item: item[1].contiguous(),
                    **_accepted(args_cls, plan.geometry))
    extra = {"packed": plan.packed, **plan.geometry}
    _round(plan, _update_info(plan.weights, extra, caps),
           lambda: send_weights(iter(plan.weights), args),
           "NCCLWeightTransferEngine.trainer_send_weights")
    return (_chunks(plan, broadcasts),
            "vLLM static API: nccl_common.trainer_init + NCCLWeightTransferEngine."
            "trainer_send_weights, HTTP routes driven by the harness")


def _via_raw(plan: _Plan, caps: dict) -> tuple[int | None, str]:
    """No trainer API in this vLLM: join with vLLM's own communicator and broadcast
    tensor by tensor, in the order the update info lists them. The packed wire
    format belongs to vLLM's helpers, so packed is refused here."""
    if plan.packed:
        raise NcclSendError("this vLLM has no NCCL trainer API (neither "
                            "WeightTransferTrainerFactory 'nccl' nor trainer_send_weights); "
                            "the harness's raw fallback sends unpacked only")
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    def open_group():
        pg = StatelessProcessGroup.create(host=plan.master_address, port=plan.master_port,
                                          rank=0, world_size=plan.world_size)
        return PyNcclCommunicator(pg, device=plan.device)

    group = _rendezvous(plan, open_group, "StatelessProcessGroup + PyNcclCommunicator")

    def broadcast() -> None:
        stream = torch.cuda.current_stream()
        for _, t in plan.weights:
            group.broadcast(t.contiguous(), src=0, stream=stream)

    _round(plan, _update_info(plan.weights, {"packed": False}, caps), broadcast,
           "PyNcclCommunicator.broadcast")
    return (plan.client.update_calls,
            "raw: vLLM PyNcclCommunicator broadcast, HTTP routes driven by the harness")


# --------------------------------------------------------------------------- shared steps

def _rendezvous(plan: _Plan, open_group: Callable[[], Any], what: str) -> Any:
    """Join the group as rank 0 while /init_weight_transfer_engine brings the workers."""
    init_info = {**plan.rendezvous, "rank_offset": 1}
    http = _Step("/init_weight_transfer_engine",
                 lambda: plan.client.init_weight_transfer_engine(init_info))
    group = _Step(f"{what} (NCCL rendezvous as rank 0 of {plan.world_size} at "
                  f"{plan.master_address}:{plan.master_port})", open_group, plan.device
                  ).result(plan.timeout, plan.client)
    http.result(plan.timeout, plan.client)
    return group


def _round(plan: _Plan, update_info: dict, broadcast: Callable[[], None], what: str) -> None:
    """One update: start, then /update_weights beside the broadcast, then finish."""
    import torch

    def trainer_side() -> None:
        broadcast()
        # Broadcasts are only enqueued; they must have left before the caller may free
        # or change the tensors (and a lost peer shows up here, inside the bound).
        torch.cuda.current_stream().synchronize()

    plan.client.start_weight_update()
    http = _Step("/update_weights", lambda: plan.client.update_weights(update_info))
    _Step(f"{what} (NCCL broadcast of {len(plan.weights)} tensors)", trainer_side,
          plan.device).result(plan.timeout, plan.client)
    http.result(plan.timeout, plan.client)
    plan.client.finish_weight_update()


def _update_info(weights: list, extra: dict, caps: dict) -> dict:
    """names / dtype_names / shapes, plus those of ``extra`` this vLLM's
    NCCLWeightTransferUpdateInfo declares (0.26 takes packed and the geometry)."""
    info = {"names": [n for n, _ in weights],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
            "shapes": [list(t.shape) for _, t in weights]}
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


def _chunks(plan: _Plan, broadcasts: list[int] | None) -> int | None:
    # Packed: the number of buffers broadcast. Unpacked: the number of update_weights calls.
    if plan.packed:
        return broadcasts[0] if broadcasts is not None else None
    return plan.client.update_calls


def _free_port(address: str) -> int:
    # Racy by nature (the port is free now, not necessarily when TCPStore binds it);
    # pass options["nccl_port"] where that matters.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]
