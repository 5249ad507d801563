"""The trainer code vLLM's RLHF examples teach, run as written.

vLLM's ``rlhf_http_ipc.py`` (0.27.1 on) pushes a live model, with OPT in bfloat16 on
the trainer's GPU:

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=IPCTrainerInitInfo(rank=0, packed=False),
        client=HTTPVLLMWeightSyncClient(BASE_URL),
        source=ModuleSource(train_model),
    )
    engine.send_weights()             # after every optimizer step

``SeedTrainer`` is that code for the installed release (``vllm_api.trainer_code_path``
chooses): the factory with the engine's init info (IPC from 0.27.1, NCCL on 0.32, the
harness's ``shm`` trainer engine wherever the factory takes a registration, 0.26's
``trainer_init(backend, config, init_info)`` included), or on 0.26 IPC the static
``IPCWeightTransferEngine.trainer_send_weights(iter(source), {"send_mode": "http",
...})`` between the client's ``start_weight_update`` and ``finish_weight_update``.
The source is ``ModuleSource`` over the module the trainer holds, built once; an
update after a training step is another ``send_weights()`` over the same source.

No harness client sits between vLLM's client and the server, so an error is what a
user's trainer sees (``requests``' ``HTTPError`` or ``ConnectionError``), and the
per-route timings of the harness path are not known: the trainer process times the
whole send. vLLM's client sends no API key in the releases read (0.26, 0.32: its
constructor takes ``base_url`` and ``timeout`` only); should a release take
``api_key`` or ``headers``, the key is passed, as a user would.

What can go wrong on the user's side, on purpose (``sources``): ``drop`` leaves one
parameter out of the source (a ``ModuleSource`` that loses a name: the class of bug
vllm#56689 reports, a stale tensor on the server), ``wrap`` hands ``ModuleSource`` a
wrapped module (``compile``: ``torch.compile``, every name prefixed ``_orig_mod.``;
``data_parallel``: ``torch.nn.DataParallel``, prefixed ``module.``).

Imported in the trainer process only (vLLM and torch load on first use).
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from typing import Any

from harness import transfer
from harness.core.facts import free_port, torch_dtype_name
from harness.transfer import ipc, registry, shm
from harness.vllm import api as vllm_api

WRAPS = ("compile", "data_parallel")
WRAP_PREFIX = {"compile": "_orig_mod.", "data_parallel": "module."}


class SeedCodeError(RuntimeError):
    pass


class Unavailable(SeedCodeError):
    """This release (or host) cannot run vLLM's trainer code for the engine; the
    message says why. The trainer's parent raises ``TrainerCodeUnavailable`` on it
    (tests skip with the reason)."""

    unavailable = True


# --------------------------------------------------------------------------- sources

def wrapped(module: Any, wrap: str | None) -> Any:
    """``module`` as a trainer may hold it when it builds its source."""
    if wrap is None:
        return module
    import torch

    if wrap == "compile":
        return torch.compile(module)  # compiles on first call; names change at once
    if wrap == "data_parallel":
        return torch.nn.DataParallel(module)
    raise ValueError(f"unknown wrap {wrap!r}; known: {', '.join(WRAPS)}")


@functools.cache
def _leaving_out_cls() -> type:
    from vllm.distributed.weight_transfer.base import ModuleSource

    class LeavingOut(ModuleSource):
        """A ``ModuleSource`` that loses one parameter, in both channels (metadata
        and iteration agree, as vLLM's contract asks): deliberate damage."""

        def __init__(self, module: Any, left_out: str):
            super().__init__(module)
            self.left_out = left_out

        def metadata(self):
            return [m for m in super().metadata() if m.name != self.left_out]

        def __iter__(self):
            return ((n, t) for n, t in super().__iter__() if n != self.left_out)

    return LeavingOut


def module_source(module: Any, *, drop: str | None = None, wrap: str | None = None) -> Any:
    """vLLM's ``ModuleSource`` over ``module`` (wrapped first if asked); with ``drop``,
    one that leaves that parameter out."""
    target = wrapped(module, wrap)
    if drop is not None:
        names = {n for n, _ in target.named_parameters()}
        if drop not in names:
            raise ValueError(f"cannot leave out {drop!r}: not a parameter name of the source")
        return _leaving_out_cls()(target, drop)
    return vllm_api.lookup("ModuleSource")(target)


def sent(source: Any) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of what ``source`` announces, in order."""
    return [(m.name, str(m.dtype).removeprefix("torch."), list(m.shape))
            for m in source.metadata()]


def describe(module: Any) -> dict[str, Any]:
    """What ``named_parameters()`` of a live module leaves out, and so what
    ``ModuleSource`` never sends: parameters that alias another (tied weights: the
    later name of the pair) and buffers (persistent or not)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    buffers = []
    for mod_name, mod in module.named_modules():
        for b_name, b in getattr(mod, "_buffers", {}).items():
            if b is None:
                continue
            persistent = b_name not in getattr(mod, "_non_persistent_buffers_set", set())
            buffers.append({"name": f"{mod_name}.{b_name}" if mod_name else b_name,
                            "dtype": torch_dtype_name(b), "shape": list(b.shape),
                            "persistent": persistent})
    return {"tied": aliases, "buffers": buffers,
            "tie_word_embeddings": bool(getattr(getattr(module, "config", None),
                                                "tie_word_embeddings", False))}


# --------------------------------------------------------------------------- the trainer

def http_client(url: str, *, timeout: float, api_key: str | None) -> tuple[Any, dict]:
    """vLLM's ``HTTPVLLMWeightSyncClient(url)``, as the examples build it (with the
    trainer's timeout, the constructor's own parameter); the key only where the
    constructor takes one. Returns (client, facts)."""
    cls = vllm_api.lookup("HTTPVLLMWeightSyncClient")
    params = inspect.signature(cls).parameters
    kw: dict[str, Any] = {}
    if "timeout" in params:
        kw["timeout"] = timeout
    key_param = next((k for k in ("api_key", "headers") if k in params), None)
    if api_key and key_param == "api_key":
        kw["api_key"] = api_key
    elif api_key and key_param == "headers":
        kw["headers"] = {"Authorization": f"Bearer {api_key}"}
    facts = {"client": f"HTTPVLLMWeightSyncClient({', '.join(['url'] + list(kw))})",
             "client_timeout": kw.get("timeout"),
             "client_parameters": [p for p in params if p != "self"],
             "api_key_given": bool(api_key),
             "api_key_sent": bool(api_key) and key_param is not None}
    if api_key and key_param is None:
        facts["api_key_not_sent_because"] = (
            "HTTPVLLMWeightSyncClient takes no API key or headers "
            f"(its parameters: {', '.join(facts['client_parameters'])})")
    return cls(url, **kw), facts


class SeedTrainer:
    """vLLM's trainer code for ``engine`` against the server at ``url``: ``init(source)``
    once (``trainer_init``: the group), ``send(source)`` per update, ``close()``.
    Options: ``device``, ``packed_buffer_size_bytes`` (IPC and NCCL), ``bucket_bytes``,
    ``reprocess_tied`` (shm's init info), ``master_address``, ``nccl_port`` (NCCL)."""

    def __init__(self, url: str, *, engine: str, packed: bool, device: str, timeout: float,
                 options: dict, api_key: str | None = None):
        self.url, self.engine_name, self.packed = url.rstrip("/"), engine, packed
        self.device, self.options = device, options
        self.registration = None
        backend = transfer.backend(engine)
        self.api = backend.vllm_api
        if engine == shm.BACKEND_NAME:  # vLLM's factory takes the shm trainer engine once registered
            ok, self.registration = shm.register_trainer()
            if not ok:
                raise Unavailable(f"vLLM's trainer code cannot run shm here: "
                                  f"{self.registration}")
        self.caps = registry.probe()
        self.path, self.what = registry.trainer_code_path(engine, self.caps)
        if self.path is None:
            raise Unavailable(self.what)
        if backend.needs_gpu:
            import torch

            if not device.startswith("cuda") or not torch.cuda.is_available():
                raise SeedCodeError(f"{engine} sends from a CUDA device; the trainer is on "
                                    f"{device}")
            torch.cuda.set_device(torch.device(device))  # vLLM reads the current device
        self.client, self.client_facts = http_client(self.url, timeout=timeout,
                                                     api_key=api_key)
        self.engine: Any = None
        self.source: Any = None  # static path: what the last init was given

    @property
    def api_path(self) -> str:
        return f"vLLM trainer code ({self.path}): {self.what}"

    def init(self, source: Any) -> None:
        """``trainer_init`` (the factory paths: it calls /init_weight_transfer_engine)
        or, on the static path, the client's ``init_weight_transfer_engine({})``."""
        self.source = source
        if self.path == "static":
            self.client.init_weight_transfer_engine({})  # 0.26's IPC init info has no field
            return
        factory = vllm_api.lookup("WeightTransferTrainerFactory")
        info = self._init_info()
        if self.path == "factory":
            self.engine = factory.trainer_init(init_info=info, client=self.client,
                                               source=source)
        else:  # factory-by-backend: 0.26's signature
            from vllm.config.weight_transfer import WeightTransferConfig

            self.engine = factory.trainer_init(self.engine_name,
                                               WeightTransferConfig(backend=self.engine_name),
                                               info, client=self.client, source=source)

    def _lookup(self, name: str) -> Any:
        return vllm_api.lookup(name, {self.engine_name: self.api})

    def _init_info(self) -> Any:
        o = self.options
        if self.engine_name == shm.BACKEND_NAME:
            from harness.transfer.shm_trainer_engine import ShmTrainerInitInfo

            kw: dict[str, Any] = {"packed": self.packed}
            if o.get("bucket_bytes"):
                kw["bucket_bytes"] = int(o["bucket_bytes"])
            if o.get("reprocess_tied"):
                kw["reprocess_tied"] = True
            return ShmTrainerInitInfo(rank=0, **kw)
        geometry = {k: int(o[k]) for k in ("packed_buffer_size_bytes", "packed_num_buffers")
                    if o.get(k)}
        if self.engine_name == ipc.ENGINE:
            return self._lookup(self.api.init_info)(rank=0, packed=self.packed, **geometry)
        import requests  # as the examples ask the server for its ranks

        world = int(requests.get(f"{self.url}/get_world_size", timeout=60).json()["world_size"])
        address = o.get("master_address") or "127.0.0.1"
        return self._lookup(self.api.init_info)(
            rank=0, master_address=address, master_port=int(o.get("nccl_port")
                                                            or free_port(address)),
            world_size=world + 1, packed=self.packed, **geometry)

    def send(self, source: Any) -> dict[str, Any]:
        """One update of what ``source`` holds now; returns what was sent."""
        t0 = time.monotonic()
        if self.path == "static":
            send_weights = self._lookup(self.api.static_sender)
            geometry = {k: int(self.options[k]) for k in ("packed_buffer_size_bytes",)
                        if self.options.get(k)}
            self.client.start_weight_update()
            send_weights(iter(source), {"send_mode": "http", "url": self.url,
                                        "packed": self.packed, **geometry})
            self.client.finish_weight_update()
        else:
            # The examples build the engine with the source once and call send_weights()
            # after each step; a round with another source (deliberate damage) swaps it in.
            self.engine.source = source
            self.engine.send_weights()
        seconds = time.monotonic() - t0
        meta = source.metadata()
        out: dict[str, Any] = {"send_seconds": seconds, "path": self.path,
                               "api_path": self.api_path, "sent_names": [m.name for m in meta],
                               "tensors": len(meta),
                               "bytes": sum(math.prod(m.shape) * m.dtype.itemsize for m in meta),
                               **self.client_facts}
        last = getattr(self.engine, "last", None)  # the shm trainer engine's own count
        if last is not None:
            out.update(chunks=last["buckets"], update_calls=last["buckets"])
        return out

    def close(self) -> None:
        if self.engine is not None:
            try:
                self.engine.shutdown()
            finally:
                self.engine = None
