"""The trainer, in its own process, alive as long as its transfer group.

NCCL groups and CUDA IPC handles must never live in the pytest process, and a hung
or crashed trainer must be killable. Real RL trainers open the weight-transfer group
once and push hundreds of updates through it, so a ``Trainer`` does the same: it
spawns ``python -m harness.trainer`` once, the child opens the group
(``/init_weight_transfer_engine``, and the NCCL rendezvous) on its first update, and
every ``sync()`` is then one command over a pipe: which weights, which deliberate
corruption. Imports, the CUDA context and the group are paid for once.

Every command is bounded by a timeout. On a timeout the child is asked to dump its
stacks (SIGUSR1, faulthandler) into its log and is killed. A failed sync leaves its
group in an unknown state: an IPC or shm trainer closes that group and stays (the next
``sync()`` opens a new group in the same process, without paying again for imports,
the CUDA context and the weights); an NCCL trainer, whose group may be stuck in a
collective, is killed, and the next ``sync()`` starts a new child. Either way the
error carries the child's log tail and the server's.

The child carries the run's owner tag (``harness.reaper``) and a scratch directory of
its own (the shm backend's buckets), which the parent removes when the child is gone,
however it went. The server's API key reaches it through its environment, never its
command line. Besides the deliberate corruptions of the tensors (``corrupt``), a sync
can lie about them (``lie``): the update info then disagrees with what is sent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path
from typing import Any, Callable

from harness.facts import torch_dtype_name
from harness.portable import corrupt as _portable_corrupt

CORRUPTIONS = _portable_corrupt.CORRUPTIONS  # ("drop", "scale", "swap", "nothing", "nan")
# Damage the model cannot even take, for the fault tests (not a parity self-test, so not
# in CORRUPTIONS, which harness repro offers): narrow sends a 2-D weight one column short,
# its update info agreeing.
SHAPE_FAULTS = ("narrow",)
# Damage the logits of the usual prompts do not see, for the checksum oracle's tests:
# row adds 1.0 to the last row of the input embedding (a token id no zoo prompt uses;
# on a tensor-parallel server that row lives on the last rank).
UNSEEN_FAULTS = ("row",)
# Metadata that disagrees with the tensors sent (the tensors themselves are right):
# names (the first tensor announced under a name the model lacks), shapes (its first
# dimension announced one larger), dtypes (announced as the other float dtype), count
# (one shape fewer than names), gpu (CUDA IPC handles keyed by a GPU that is not there).
LIES = ("names", "shapes", "dtypes", "count", "gpu")
FAKE_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"
API_KEY_ENV = "HARNESS_TRAINER_API_KEY"
# The vllm trainer code (TrainerSpec.code "vllm", harness.backends.vllm_code) sends what a
# ModuleSource over its live module yields, through vLLM's own client: the damage it can
# take is a source that leaves a parameter out (corrupt "drop"); options {"wrap": ...}
# hand ModuleSource a wrapped module. DROP_ENV applies a drop to every sync of that code
# ("auto": the parameter corrupt "drop" would pick, or a name), so that a run shows its
# checks failing without editing a test.
VLLM_CODE_CORRUPTIONS = ("drop",)
DROP_ENV = "HARNESS_VLLM_TRAINER_DROP"
# The options the vllm trainer code has (vllm_code.SeedTrainer's, wrap, and the child's);
# any other (a fault test's hold or delay) is the harness path's only.
VLLM_CODE_OPTIONS = ("device", "packed_buffer_size_bytes", "packed_num_buffers", "bucket_bytes",
                     "reprocess_tied", "master_address", "nccl_port", "wrap", "recover_in_place")
# Engines whose trainer survives a failed sync: it closes its group and opens a new one
# with the next sync (see _child_main); an NCCL trainer is ended instead, and so is any
# trainer whose options say {"recover_in_place": False}.
RECOVERS_IN_PLACE = ("ipc", "shm")
SCRATCH_ENV = "HARNESS_TRAINER_SCRATCH"


class TrainerError(RuntimeError):
    pass


class TrainerCodeUnavailable(TrainerError, unittest.SkipTest):
    """The trainer code asked for cannot run on this release or host (vLLM's trainer
    code for an engine its release has no trainer API for, or cannot register); the
    message says why. A ``unittest.SkipTest``: pytest reports a test that meets it as
    skipped with that reason, without this module knowing pytest."""


@dataclasses.dataclass(frozen=True)
class TrainerSpec:
    """What makes two trainers different: one trainer per server and backend variant
    (and per set of init options)."""

    url: str
    engine: str                      # shm | nccl | ipc
    packed: bool
    dtype: str = "float32"
    device: str = "cpu"
    code: str = "harness"            # whose trainer code: harness | vllm (cases.TRAINERS)
    timeout: float = 300.0           # per HTTP call
    options: tuple[tuple[str, Any], ...] = ()  # the sender's options (hashable)

    @classmethod
    def make(cls, *, options: dict | None = None, **kw: Any) -> "TrainerSpec":
        return cls(options=tuple(sorted((options or {}).items())), **kw)


# ----------------------------------------------------------------------------- corruptions

def corrupt_weights(weights: list[tuple[str, Any]], kind: str | None, target: str | None = None
                    ) -> tuple[list[tuple[str, Any]], str]:
    """Return (weights, description). Deliberate damage for the self-tests (the
    emitted repro script's own function, so a repro damages exactly what a test did),
    plus the fault tests' ``narrow``; the input list and its tensors are left unchanged."""
    if kind == "row":
        return _bump_last_embedding_row(weights, target)
    if kind != "narrow":
        return _portable_corrupt.corrupt_weights(weights, kind, target)
    names = [n for n, _ in weights]
    if target is not None and target not in names:
        raise ValueError(f"corruption target {target!r} is not a tensor of the model")
    mats = [n for n, t in weights if t.ndim == 2 and "embed" not in n and "wte" not in n]
    pick = target or (mats[len(mats) // 2] if mats else names[len(names) // 2])
    t = dict(weights)[pick]  # a shape the model does not have; the update info agrees
    if t.ndim != 2 or t.shape[1] < 2:
        raise ValueError(f"cannot narrow {pick} of shape {list(t.shape)}")
    return ([(n, t[:, :-1].contiguous() if n == pick else x) for n, x in weights],
            f"sent {pick} as {[t.shape[0], t.shape[1] - 1]} (the model's is {list(t.shape)})")


def _bump_last_embedding_row(weights: list[tuple[str, Any]], target: str | None
                             ) -> tuple[list[tuple[str, Any]], str]:
    names = [n for n, _ in weights]
    embeds = [n for n, t in weights if t.ndim == 2 and ("embed_tokens" in n or "wte" in n)]
    pick = target or (embeds[0] if embeds else None)
    if pick is None or pick not in names:
        raise ValueError(f"corruption 'row': no input embedding among {names[:4]}...")
    t = dict(weights)[pick].clone()
    t[-1] += 1.0
    return ([(n, t if n == pick else x) for n, x in weights],
            f"added 1.0 to row {t.shape[0] - 1} of {pick} (the last token id)")


# ----------------------------------------------------------------------------- lies

def lie_about(update_info: dict, lie: str) -> tuple[dict, str]:
    """A copy of ``update_info`` that disagrees with the tensors it describes."""
    if lie not in LIES:
        raise ValueError(f"unknown lie {lie!r}; known: {', '.join(LIES)}")
    info = dict(update_info)
    names, shapes = list(info.get("names") or []), [list(x) for x in info.get("shapes") or []]
    if lie != "gpu" and not names:
        return info, "nothing to lie about (no tensor in this update)"
    if lie == "names":
        info["names"] = ["model.no_such_module.weight"] + names[1:]
        return info, f"announced {names[0]} as model.no_such_module.weight"
    if lie == "shapes":
        shapes[0] = [shapes[0][0] + 1] + shapes[0][1:] if shapes[0] else [2]
        info["shapes"] = shapes
        return info, f"announced {names[0]} with shape {shapes[0]}"
    if lie == "dtypes":
        dtypes = list(info["dtype_names"])
        dtypes[0] = "bfloat16" if dtypes[0] != "bfloat16" else "float32"
        info["dtype_names"] = dtypes
        return info, f"announced {names[0]} as {dtypes[0]}"
    if lie == "count":
        info["shapes"] = shapes[:-1]
        return info, f"{len(names)} names, {len(shapes) - 1} shapes"
    # gpu: every IPC handle keyed by a GPU that does not exist
    import base64
    import pickle

    def rekey(h):
        return [rekey(x) for x in h] if isinstance(h, list) else \
            {FAKE_GPU_UUID: v for v in h.values()} if isinstance(h, dict) else h

    if info.get("ipc_handles_pickled"):
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(rekey(handles))).decode()
    elif info.get("ipc_handles") is not None:
        info["ipc_handles"] = rekey(info["ipc_handles"])
    else:
        return info, "no IPC handles to re-key (not an IPC update)"
    return info, f"IPC handles keyed by {FAKE_GPU_UUID}"


class LyingClient:
    """The trainer's client with ``lie`` applied to every ``/update_weights``; the
    other calls pass through. ``told`` lists what was said."""

    def __init__(self, client, lie: str):
        self._client, self.lie, self.told = client, lie, []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def update_weights(self, update_info):
        if isinstance(update_info, list):  # one entry per data-parallel rank
            out = [lie_about(u, self.lie) for u in update_info]
            self.told.append(out[0][1])
            return self._client.update_weights([u for u, _ in out])
        info, what = lie_about(update_info, self.lie)
        self.told.append(what)
        return self._client.update_weights(info)


# ----------------------------------------------------------------------------- child

class _Weights:
    """The trainer's models, loaded on its device, the last two kept: a test that
    switches between two weight sets does not reload either."""

    def __init__(self, dtype: str, device: str):
        self.dtype, self.device = dtype, device
        self.cache: dict[str, list] = {}

    def get(self, weights_dir: str) -> list[tuple[str, Any]]:
        if weights_dir not in self.cache:
            from harness import models

            if models.is_weightless(weights_dir):  # harness bench: sizes, not values
                self.cache[weights_dir] = models.random_weights(weights_dir, self.dtype,
                                                                self.device)
            else:
                from harness.reference import load_hf_model

                model = load_hf_model(weights_dir, self.dtype, self.device)
                self.cache[weights_dir] = [(n, p.detach()) for n, p in model.named_parameters()]
            while len(self.cache) > 2:
                self.cache.pop(next(iter(self.cache)))
        return self.cache[weights_dir]


class _VllmCode:
    """The child's state when ``spec.code == "vllm"``: the trainer code vLLM's examples
    teach (``harness.backends.vllm_code.SeedTrainer``: vLLM's HTTPVLLMWeightSyncClient,
    its trainer API for this release) over one live Hugging Face module, held for the
    trainer's whole life as an RL trainer holds its model. The ``ModuleSource`` over it
    is built when the group opens; a sync of other weights loads them into the same
    parameters in place (what an optimizer step does to them), and the next
    ``send_weights()`` sends the new values."""

    def __init__(self, spec: TrainerSpec, options: dict):
        self.spec, self.options = spec, options
        self.module: Any = None
        self.holds: str | None = None
        self.trainer: Any = None
        self.source: Any = None  # the examples' ModuleSource(model), built at init

    def load(self, weights_dir: str) -> None:
        from harness import models
        from harness.reference import load_hf_model

        if self.holds == weights_dir:
            return
        if models.is_weightless(weights_dir):
            raise ValueError("the vllm trainer code sends a live Hugging Face module; "
                             f"{weights_dir} has no weights")
        new = load_hf_model(weights_dir, self.spec.dtype, self.spec.device)
        if self.module is None:
            self.module = new
        else:  # in place: the source and the engine keep pointing at the same tensors
            import torch

            mine, theirs = dict(self.module.named_parameters()), dict(new.named_parameters())
            if list(mine) != list(theirs) or any(mine[n].shape != theirs[n].shape for n in mine):
                raise ValueError(f"{weights_dir} is not the architecture the trainer holds")
            with torch.no_grad():
                for n, p in mine.items():
                    p.copy_(theirs[n])
            del new
        self.holds = weights_dir

    def _drop(self, corrupt: str | None, target: str | None) -> tuple[str | None, str]:
        how = "sync"
        if corrupt is None and os.environ.get(DROP_ENV):
            corrupt, how = "drop", f"{DROP_ENV}={os.environ[DROP_ENV]}"
            target = None if os.environ[DROP_ENV] == "auto" else os.environ[DROP_ENV]
        if corrupt is None:
            return None, "none"
        if corrupt not in VLLM_CODE_CORRUPTIONS:
            from harness.backends.vllm_code import Unavailable

            raise Unavailable(f"the vllm trainer code sends a ModuleSource over its live module;"
                              f" of the corruptions it takes only "
                              f"{', '.join(VLLM_CODE_CORRUPTIONS)} (a source that leaves a "
                              f"parameter out), not {corrupt!r}")
        named = [(n, p) for n, p in self.module.named_parameters()]
        _, what = corrupt_weights(named, "drop", target)  # the harness path's own pick
        name = what.removeprefix("dropped ")
        return name, (f"left {name} out of the ModuleSource"
                      + ("" if how == "sync" else f" (deliberate break: {how})"))

    def command(self, cmd: dict) -> dict[str, Any]:
        from harness.backends import vllm_code

        if cmd["op"] == "describe":
            return self.describe(cmd["weights_dir"])
        result: dict[str, Any] = {}
        if cmd.get("lie"):
            raise vllm_code.Unavailable("the vllm trainer code posts through vLLM's own client: "
                                        "it cannot be made to lie about its tensors (lie is the "
                                        "harness path's)")
        other = sorted(set(self.options) - set(VLLM_CODE_OPTIONS))
        if other:
            raise vllm_code.Unavailable(f"the vllm trainer code has no option {', '.join(other)} "
                                        "(the harness path's)")
        t1 = time.monotonic()
        self.load(cmd["weights_dir"])
        result["load_seconds"] = time.monotonic() - t1
        if self.trainer is None:
            t1 = time.monotonic()
            self.trainer = vllm_code.SeedTrainer(
                self.spec.url, engine=self.spec.engine, packed=self.spec.packed,
                device=self.spec.device, timeout=self.spec.timeout, options=self.options,
                api_key=os.environ.get(API_KEY_ENV) or None)
            result["sender_seconds"] = time.monotonic() - t1
        if cmd["op"] == "prepare":
            return result
        drop, what = self._drop(cmd.get("corrupt"), cmd.get("corrupt_target"))
        wrap = self.options.get("wrap")
        if drop and wrap:
            raise ValueError("drop and wrap together are not offered")
        if self.source is None:
            t1 = time.monotonic()
            self.source = vllm_code.module_source(self.module)
            self.trainer.init(self.source)
            result["init_seconds"] = time.monotonic() - t1
        source = self.source
        if drop or wrap:
            source = vllm_code.module_source(self.module, drop=drop, wrap=wrap)
            if wrap:
                what = (f"ModuleSource over the module wrapped by {wrap} (names prefixed "
                        f"{vllm_code.WRAP_PREFIX[wrap]!r})")
        result["corruption"] = what
        peak = _CudaPeak(self.spec.device)
        result.update(self.trainer.send(source))
        result["sync_seconds"] = result["send_seconds"]
        result.update(peak.facts())
        result["http_spans"] = []  # vLLM's client is not wrapped: no per-route times
        return result

    def describe(self, weights_dir: str) -> dict[str, Any]:
        """What ModuleSource over the live module sends, what the harness path sends for
        the same directory (its own loader), what the checkpoint holds, what a wrapped
        module's source would announce. Calls no route."""
        from harness.backends import vllm_code
        from harness.reference import load_hf_model

        module = load_hf_model(weights_dir, self.spec.dtype, self.spec.device)
        source = vllm_code.module_source(module)
        harness_list = _Weights(self.spec.dtype, self.spec.device).get(weights_dir)
        checkpoint: dict[str, list[int]] = {}
        from safetensors import safe_open

        for f in sorted(Path(weights_dir).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    checkpoint[k] = list(st.get_slice(k).get_shape())
        wraps = {}
        for w in vllm_code.WRAPS:
            names = [n for n, _, _ in vllm_code.sent(vllm_code.module_source(module, wrap=w))]
            wraps[w] = {"count": len(names), "first": names[:2]}
        return {"module_source": vllm_code.sent(source),
                "harness": [(n, torch_dtype_name(t), list(t.shape)) for n, t in harness_list],
                "checkpoint": checkpoint, "wraps": wraps, **vllm_code.describe(module)}

    @property
    def has_group(self) -> bool:
        return self.trainer is not None

    def close_group(self) -> None:
        """After a failed sync: the next one opens a new group (trainer_init again)."""
        try:
            if self.trainer is not None:
                self.trainer.close()
        finally:
            self.trainer = self.source = None

    def close(self) -> None:
        self.close_group()


class _TimedClient:
    """The sender's client with the time of every control-plane call recorded:
    ``(route, start, end)`` in ``time.monotonic()`` seconds, which is one clock for
    every process of the host. vLLM's trainer engines call some routes from threads of
    their own; appending to a list is atomic."""

    def __init__(self, client: Any):
        self._client = client
        self.spans: list[tuple[str, float, float]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _timed(self, route: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.spans.append((route, t0, time.monotonic()))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._timed("/init_weight_transfer_engine", self._client.init_weight_transfer_engine,
                    init_info)

    def start_weight_update(self) -> None:
        self._timed("/start_weight_update", self._client.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        self._timed("/update_weights", self._client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        args = () if weight_version is None else (weight_version,)
        self._timed("/finish_weight_update", self._client.finish_weight_update, *args)


class _CudaPeak:
    """The trainer's extra CUDA memory during one update: peak allocated (and reserved)
    above what was allocated when it was made, and what the update kept. Nothing on a
    CPU trainer."""

    def __init__(self, device: str):
        self.device = device if device.startswith("cuda") else None
        if self.device:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated = torch.cuda.memory_allocated(self.device)
            self.reserved = torch.cuda.memory_reserved(self.device)

    def facts(self) -> dict[str, int]:
        if not self.device:
            return {}
        import torch

        torch.cuda.synchronize(self.device)
        return {"trainer_peak_extra_bytes":
                torch.cuda.max_memory_allocated(self.device) - self.allocated,
                "trainer_peak_reserved_extra_bytes":
                torch.cuda.max_memory_reserved(self.device) - self.reserved,
                "trainer_retained_bytes": torch.cuda.memory_allocated(self.device) - self.allocated}


class _HarnessCode:
    """The child's state when ``spec.code == "harness"``: the harness's sender for the
    engine (``harness.backends``) over its own HTTP client, timed per route, able to lie
    and to hold; the weights are lists of tensors (``_Weights``), damaged on request."""

    def __init__(self, spec: TrainerSpec, options: dict):
        self.spec, self.options = spec, options
        self.sender: Any = None
        self.client: _TimedClient | None = None
        self.switch: _SwitchableClient | None = None  # below the timing: lies, holds
        self.opened = False  # the group: opened by the first sync, not by prepare
        self.weights: _Weights | None = None

    @property
    def has_group(self) -> bool:
        return self.sender is not None

    def command(self, cmd: dict) -> dict[str, Any]:
        from harness.backends import sender_class
        from harness.client import ServerClient

        spec, options = self.spec, self.options
        if cmd["op"] == "describe":
            raise ValueError("describe is an op of the vllm trainer code")
        result: dict[str, Any] = {}
        if self.weights is None:
            self.weights = _Weights(spec.dtype, spec.device)
        t1 = time.monotonic()
        named, what = corrupt_weights(self.weights.get(cmd["weights_dir"]), cmd.get("corrupt"),
                                      cmd.get("corrupt_target"))
        if options.get("wrap"):  # the names a wrapped module's named_parameters() gives
            from harness.backends.vllm_code import WRAP_PREFIX

            prefix = WRAP_PREFIX[options["wrap"]]
            named = [(prefix + n, t) for n, t in named]
            what = f"names prefixed {prefix!r} (a module wrapped by {options['wrap']})"
        result.update(corruption=what, load_seconds=time.monotonic() - t1)
        if self.sender is None:
            # building the sender imports vLLM's trainer API and calls no route
            t1 = time.monotonic()
            self.switch = _SwitchableClient(
                ServerClient(spec.url, timeout=spec.timeout,
                             api_key=os.environ.get(API_KEY_ENV) or None),
                hold_after_start_s=float(options.get("hold_after_start_s") or 0))
            self.client = _TimedClient(self.switch)
            self.sender = sender_class(spec.engine)(self.client, packed=spec.packed,
                                                    options=options)
            result["sender_seconds"] = time.monotonic() - t1
        if cmd["op"] == "prepare":  # everything but the group and the update
            return result
        self.client.spans = []
        if not self.opened:
            t1 = time.monotonic()
            self.sender.init()
            self.opened = True
            result["init_seconds"] = time.monotonic() - t1
        peak = _CudaPeak(spec.device)
        t1 = time.monotonic()
        if cmd.get("lie") and hasattr(self.sender, "repeat_metadata"):
            self.sender.repeat_metadata()  # elided metadata cannot lie (vLLM 0.33)
        liar = self.switch.lie(cmd.get("lie"))
        try:
            result.update(self.sender.send(named).as_dict())
        finally:
            self.switch.lie(None)
            if liar is not None:
                result["lie"] = "; ".join(dict.fromkeys(liar.told)) or "nothing sent"
        result["sync_seconds"] = time.monotonic() - t1
        result.update(peak.facts())
        result["http_spans"] = [(r, a - t1, b - t1) for r, a, b in self.client.spans]
        return result

    def close_group(self) -> None:
        try:
            if self.sender is not None:
                self.sender.close()
        finally:
            self.sender, self.opened = None, False

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


def _child_main(spec_json: str, result_fd: int) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    out = os.fdopen(result_fd, "w", buffering=1)
    spec = TrainerSpec(**{**json.loads(spec_json)})
    options = dict(spec.options)
    code = (_VllmCode if spec.code == "vllm" else _HarnessCode)(spec, options)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            result: dict[str, Any] = {"ok": False}
            t0 = time.monotonic()
            try:
                import torch

                if spec.device.startswith("cuda"):
                    torch.cuda.set_device(torch.device(spec.device))
                result.update(code.command(cmd))
                result["ok"] = True
            except BaseException as e:  # report everything, KeyboardInterrupt included
                result["error"] = f"{type(e).__name__}: {e}"
                result["traceback"] = traceback.format_exc()
                result["unavailable"] = bool(getattr(e, "unavailable", False))
                # A sync that failed leaves its group in an unknown state. Where the
                # group is only the trainer's own (IPC handles, shm buckets), closing it
                # is enough: the next sync opens a new one in this same process, which
                # keeps its imports, CUDA context and weights. An NCCL group may be
                # wedged in a collective, and a failure outside a sync is not ours to
                # judge: this trainer is done.
                if result["unavailable"]:  # refused before anything was sent: nothing to undo
                    result["alive"] = True
                elif (cmd["op"] == "sync" and spec.engine in RECOVERS_IN_PLACE
                        and options.get("recover_in_place", True)
                        and isinstance(e, Exception) and code.has_group):
                    try:
                        code.close_group()
                        result["alive"] = True
                    except Exception as close_error:
                        result["error"] += f" (closing its group failed too: {close_error})"
            result["seconds"] = time.monotonic() - t0
            out.write(json.dumps(result, default=str) + "\n")
            if not result["ok"] and not result.get("alive"):
                return 1
    finally:
        code.close()
    return 0


class _SwitchableClient:
    """The sender's client for the trainer's whole life; ``lie(kind)`` routes the next
    updates through a ``LyingClient`` (``lie(None)`` stops lying). Senders keep the
    client they were built with, so the switch is made here, below them.
    ``hold_after_start_s`` (option): wait that long once /start_weight_update answered,
    with the update open (fault tests kill the trainer there)."""

    def __init__(self, client, hold_after_start_s: float = 0.0):
        self._honest = self._current = client
        self.hold_after_start_s = hold_after_start_s

    def lie(self, kind: str | None) -> LyingClient | None:
        self._current = self._honest if kind is None else LyingClient(self._honest, kind)
        return None if kind is None else self._current

    def hold_after_start(self, seconds: float) -> None:
        """From now on wait ``seconds`` after each /start_weight_update."""
        self.hold_after_start_s = seconds

    def start_weight_update(self, *args, **kwargs):
        out = self._current.start_weight_update(*args, **kwargs)
        if self.hold_after_start_s:
            print(f"trainer: /start_weight_update acknowledged, holding "
                  f"{self.hold_after_start_s}s", flush=True)
            time.sleep(self.hold_after_start_s)
        return out

    def __getattr__(self, name: str):
        return getattr(self._current, name)


# ----------------------------------------------------------------------------- parent

class Trainer:
    """One trainer process for one server and backend variant; ``sync`` many times."""

    def __init__(self, spec: TrainerSpec, *, log_dir: Path,
                 context: Callable[[], str] | None = None, env: dict | None = None,
                 api_key: str | None = None):
        self.spec = spec
        self.log_dir = Path(log_dir)
        self.context = context or (lambda: "")
        self.env = env
        self.api_key = api_key
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.scratch: Path | None = None
        self.syncs = 0
        self._results: int | None = None
        self._buf = b""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        fd, self.log_path = tempfile.mkstemp(
            prefix=f"trainer-{self.spec.engine}-", suffix=".log", dir=self.log_dir)
        os.close(fd)
        self.log_path = Path(self.log_path)
        read_end, write_end = os.pipe()
        from harness import reaper

        env = reaper.tagged(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        self.scratch = reaper.make_scratch(f"trainer-{self.spec.engine}")
        env[SCRATCH_ENV] = str(self.scratch)
        spec_json = json.dumps(dataclasses.asdict(self.spec), default=str)
        with open(self.log_path, "w") as log:
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "harness.trainer", spec_json, str(write_end)],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                    pass_fds=(write_end,), start_new_session=True)
            finally:
                os.close(write_end)
        self._results, self._buf, self.syncs = read_end, b"", 0

    def prepare(self, weights_dir: str, *, timeout: float = 600.0) -> dict:
        """Start the process and do all a first sync does short of calling the server:
        imports, the CUDA context, ``weights_dir``'s tensors on the device, the sender.
        ``harness bench`` prepares its trainers side by side, so that a cold sync times
        the group's opening and the first update, not Python's imports."""
        return self._command({"op": "prepare", "weights_dir": str(weights_dir)}, timeout)

    def sync(self, weights_dir: str, *, corrupt: str | None = None,
             corrupt_target: str | None = None, lie: str | None = None,
             timeout: float = 600.0) -> dict:
        """Push ``weights_dir`` (optionally damaged, or described by a lying update
        info: ``lie``, one of LIES) through this trainer's group; return its result
        dict (``first`` says whether it opened the group) or raise ``TrainerError``,
        after which the trainer is gone."""
        if lie is not None and lie not in LIES:
            raise ValueError(f"unknown lie {lie!r}; known: {', '.join(LIES)}")
        result = self._command({"op": "sync", "weights_dir": str(weights_dir),
                                "corrupt": corrupt, "corrupt_target": corrupt_target,
                                "lie": lie}, timeout)
        result["first"] = "init_seconds" in result  # this sync opened the group
        self.syncs += 1
        return result

    def describe(self, weights_dir: str, *, timeout: float = 600.0) -> dict:
        """vllm trainer code only: what a ``ModuleSource`` over ``weights_dir``'s model
        announces, next to the harness path's list for it, the checkpoint's names, the
        tied parameters and buffers ``named_parameters()`` leaves out, and the names a
        wrapped module's source would announce. Calls no route."""
        return self._command({"op": "describe", "weights_dir": str(weights_dir)}, timeout)

    def _command(self, cmd: dict, timeout: float) -> dict:
        if not self.alive():
            self.close()
            self._start()
        try:
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            self.proc.stdin.flush()
            result = self._read_result(timeout)
        except BaseException:
            self.kill()
            raise
        result["trainer_log"] = str(self.log_path)
        if not result["ok"]:
            if not result.get("alive"):
                self.kill()
            if result.get("unavailable"):
                raise TrainerCodeUnavailable(f"{self.spec.code} trainer code, {self._what()}: "
                                             f"{result['error'].split(': ', 1)[-1]}")
            error = TrainerError(f"trainer ({self._what()}) failed: {result['error']}\n"
                                 f"{result.get('traceback', '')}\n{self.context()}")
            error.child_error = result["error"]  # what the trainer code itself raised
            raise error
        return result

    def _what(self) -> str:
        return f"{self.spec.engine}, packed={self.spec.packed}, {self.spec.device}"

    def _read_result(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready = select.select([self._results], [], [], max(0.0, left))[0] if left > 0 else []
            if not ready:
                self._dump_stacks()
                self.kill()
                raise TrainerError(f"trainer ({self._what()}) did not finish within "
                                   f"{timeout:.0f}s; its stacks and output:\n"
                                   f"{self.log_tail()}\n{self.context()}") from None
            chunk = os.read(self._results, 1 << 16)
            if not chunk:
                code = self.proc.wait(timeout=30)
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise TrainerError(f"trainer ({self._what()}, pid {self.proc.pid}) {how} "
                                   f"during the sync, without a result:\n{self.log_tail()}\n"
                                   f"{self.context()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _dump_stacks(self) -> None:
        try:
            self.proc.send_signal(signal.SIGUSR1)  # every thread's stack, into the log
            time.sleep(2)
        except (ProcessLookupError, AttributeError):
            pass

    def log_tail(self, lines: int = 80) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no trainer output)"

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to close its group and exit; kill it if it does not."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            for f in (self.proc.stdin,):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None
        if self._results is not None:
            os.close(self._results)
            self._results = None
        if self.scratch is not None:  # what a killed child could not remove itself
            import shutil

            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def run_trainer(spec: TrainerSpec, weights_dir: str, *, corrupt: str | None = None,
                corrupt_target: str | None = None, lie: str | None = None,
                timeout: float = 600.0, log_dir: Path | None = None,
                context: Callable[[], str] | None = None, api_key: str | None = None) -> dict:
    """One sync by a trainer of its own (a fresh process and group), then gone."""
    with tempfile.TemporaryDirectory(prefix="harness-trainer-") as tmp:
        t = Trainer(spec, log_dir=log_dir or Path(tmp), context=context, api_key=api_key)
        try:
            return t.sync(weights_dir, corrupt=corrupt, corrupt_target=corrupt_target,
                          lie=lie, timeout=timeout)
        finally:
            t.close()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
