"""NCCL: the trainer joins the server's workers as rank 0; /init_weight_transfer_engine and
/update_weights wait for it, so each runs in flight beside it.

One sender for the harness (harness/transfer/nccl.py wraps it, and its raw path overrides
``open_group``, ``broadcaster`` and ``fields``) and the repro scripts. Its blocking calls run
on threads of their own, with a deadline (``steps``)."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

from harness.portable.base import Unusable, free_port, say
from harness.portable.trainer_api import _wt, engine_module, factory_for, weight_source


class NcclSender:
    """Rank 0 of one server's NCCL group: ``init()`` joins it, ``send(weights)`` is one update."""

    geometry: dict = {}  # vLLM's packed-buffer fields (the harness's options)
    watch: Any = None    # the harness's client: a failed route ends every wait (steps)
    # [region harness]
    hold_before_broadcast_s = 0.0  # fault tests kill the trainer in this wait
    # [end]

    def __init__(self, client: Any, *, engine: str, packed: bool, api: str, device: Any,
                 world_size: int, timeout: float, master_port: int | None = None):
        self.engine_name, self.client, self.packed = engine, client, packed  # engine: vLLM's name
        self.api, self.device, self.timeout = api, str(device), timeout
        self.rendezvous = {"master_address": "127.0.0.1", "world_size": world_size,
                           "master_port": master_port or free_port()}

    def init(self) -> None:
        r = self.rendezvous
        say(f"NCCL group: rank 0 of {r['world_size']} on {self.device}, port {r['master_port']}")
        getattr(self, f"_init_{self.api}")()

    def send(self, weights: list) -> str:  # one update; which vLLM API did it, in words
        return getattr(self, f"_send_{self.api}")(weights)
    # [region factory]

    def _init_factory(self) -> None:  # 0.28.0+: vLLM's trainer engine, which calls the routes
        cls = engine_module(self.engine_name).NCCLTrainerInitInfo
        info = cls(rank=0, packed=self.packed, **self.rendezvous, **self.geometry)
        factory, source = factory_for(self.engine_name), weight_source([])
        self.engine, = self.steps((
            "WeightTransferTrainerFactory.trainer_init (with /init_weight_transfer_engine)",
            lambda: factory.trainer_init(info, client=self.client, source=source)))

    def _send_factory(self, weights: list) -> str:
        self.engine.source = weight_source(weights)
        self.steps(("send_weights (/start_weight_update, /update_weights beside the broadcast, "
                    "/finish_weight_update)", self.engine.send_weights))
        return "WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo) + send_weights"
    # [end]
    # [region static]

    fields: list | None = None  # the update info's fields, where known without vLLM's class

    def open_group(self) -> Any:  # rank 0's communicator
        return _wt("nccl_common").trainer_init(dict(self.rendezvous))

    def broadcaster(self, weights: list) -> Callable[[], None]:  # built before any route
        mod = engine_module(self.engine_name)
        args = {"group": self.group, "src": 0, "packed": self.packed, **self.geometry,
                "post_iter_func": lambda item: item[1].contiguous()}  # NCCL reads data_ptr()
        args = getattr(mod, "NCCLTrainerSendWeightsArgs", dict)(**args)
        return lambda: mod.NCCLWeightTransferEngine.trainer_send_weights(iter(weights), args)

    def _init_static(self) -> None:  # 0.26, 0.27.1: rank 0's group; the routes called here
        r = self.rendezvous
        _, self.group = self.steps(
            ("/init_weight_transfer_engine",
             lambda: self.client.init_weight_transfer_engine({**r, "rank_offset": 1})),
            (f"NCCL rendezvous at {r['master_address']}:{r['master_port']}", self.open_group))

    def _send_static(self, weights: list) -> str:
        fields = self.fields if self.fields is not None else [f.name for f in dataclasses.fields(
            engine_module(self.engine_name).NCCLWeightTransferUpdateInfo)]  # 0.26: packed in each
        if self.packed and "packed" not in fields:
            raise Unusable(f"NCCLWeightTransferUpdateInfo has no 'packed' field here: {fields}")
        update = {k: v for k, v in dict(self.geometry, packed=self.packed).items() if k in fields}
        update.update(names=[n for n, _ in weights], shapes=[list(t.shape) for _, t in weights],
                      dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in weights])
        broadcast = self.broadcaster(weights)

        def trainer_side() -> None:
            # [region harness]
            if self.hold_before_broadcast_s:
                print(f"nccl: /update_weights in flight, holding {self.hold_before_broadcast_s}s "
                      "before the broadcast", flush=True)
                time.sleep(self.hold_before_broadcast_s)
            # [end]
            broadcast()
            if self.device.startswith("cuda"):  # enqueued is not sent: wait before they change
                import torch

                torch.cuda.current_stream().synchronize()

        self.client.start_weight_update()
        self.steps(("/update_weights", lambda: self.client.update_weights(update)),
                   (f"broadcast of {len(weights)} tensors", trainer_side))
        self.client.finish_weight_update()
        return "nccl_common.trainer_init + NCCLWeightTransferEngine.trainer_send_weights"
    # [end]

    def steps(self, *calls: tuple[str, Callable[[], Any]]) -> list:
        """Run each (name, fn) at once on a daemon thread on ``device``: their results, else the
        first failure, else StepTimeout after ``timeout`` s; a call stuck in NCCL is left behind."""
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        watch = self.watch
        peer_failed = watch.failed if watch else threading.Event()

        def body(name: str, fn: Callable[[], Any]) -> None:
            try:
                if self.device.startswith("cuda"):
                    import torch

                    torch.cuda.set_device(torch.device(self.device))
                results[name] = fn()
            except BaseException as e:
                errors[name] = e

        threads = [threading.Thread(target=body, args=c, name=c[0], daemon=True) for c in calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout
        while not errors and not peer_failed.is_set() and time.monotonic() < deadline \
                and any(t.is_alive() for t in threads):
            time.sleep(0.1)
        for t in threads:
            t.join(GRACE_S if errors or peer_failed.is_set() else 0)
        stuck = [t for t in threads if t.is_alive()]
        LEFT_BEHIND.extend(stuck)
        # [region harness]
        if stuck and not errors and peer_failed.is_set():
            raise StepTimeout(f"{stuck[0].name}: still blocked {GRACE_S:.0f}s after "
                              f"{watch.error_route} failed, so the server side will not join it; "
                              f"that failure was: {watch.error}") from watch.error
        # [end]
        if errors:
            failed, error = next(iter(errors.items()))
            if stuck:
                raise StepTimeout(f"{stuck[0].name}: still blocked after {failed} failed; "
                                  f"that failure was: {error}") from error
            raise error
        if stuck:
            said = f" (HTTP calls so far: {', '.join(watch.calls) or 'none'})" if watch else ""
            raise StepTimeout(f"{stuck[0].name}: not done within {self.timeout:.0f}s{said}")
        return [results[name] for name, _ in calls]


LEFT_BEHIND: list[threading.Thread] = []  # calls still blocked (in NCCL) past their wait
GRACE_S = 5.0  # after one call failed, the time the others get to end


class StepTimeout(TimeoutError):
    """A call was not done in time, or still blocked after another one failed."""


def send_nccl(client: Any, weights: list, sc: dict[str, Any], timeout: float) -> str:
    """The script's sync: a group of the server's ranks and this one, one update."""
    world_size = int(client.call("GET", "/get_world_size")["world_size"]) + 1
    sender = NcclSender(client, engine=sc["engine"], packed=sc["packed"], api=sc["trainer_api"],
                        device=sc["trainer_device"], world_size=world_size, timeout=timeout)
    sender.init()
    return sender.send(weights)
