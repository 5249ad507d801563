"""The trainer's child process: ``python -m harness.trainer.child SPEC_JSON FD``, or a
spare started ahead (``--spare ENGINE CODE DEVICE FD``) that is told its spec later.

``harness.trainer.handle.Trainer`` starts it and sends it one command per line on its stdin
(``prepare``, ``sync``, ``describe``, ``exit``); each result goes back as one JSON line
on the pipe ``FD``. The child holds the weights on its device and, for the harness's
trainer code, the sender of its engine over a client that is timed per route and can
lie (``LyingClient``) or hold; for vLLM's own trainer code (``spec.code == "vllm"``) a
live Hugging Face module and ``harness.transfer.vllm_code.SeedTrainer``; for a trainer
of your own (any other code: ``harness.trainer.user``) the same live module and your
sender (those two: ``harness.trainer.module_codes``). The deliberate damage of the
tensors and of their update info (``harness.trainer.damage``) is applied here. Only this process imports torch and vLLM's trainer API.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

from harness import transfer
from harness.trainer.damage import LyingClient, corrupt_weights
from harness.trainer.device import CudaPeak, Weights
from harness.trainer.handle import API_KEY_ENV, TrainerSpec, recovers_in_place
from harness.trainer.module_codes import UserCode, VllmCode


# ----------------------------------------------------------------------------- child

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


def leave_out(named: list, globs) -> tuple[list, str]:
    """``named`` without the tensors whose names match one of ``globs`` (fnmatch, as
    vLLM's --sleep-preserve-parameter-names matches them): a trainer that updates only
    the trainable part. Raises ValueError when no name matches (a glob that misses
    would send the whole model and test nothing)."""
    globs = list(globs)
    kept = [(n, t) for n, t in named if not any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if len(kept) == len(named):
        raise ValueError(f"option exclude {globs} matches no tensor of the model")
    return kept, f"left out {len(named) - len(kept)} tensor(s) matching {', '.join(globs)}"


class _HarnessCode:
    """The child's state when ``spec.code == "harness"``: the harness's sender for the
    engine (``harness.transfer``) over its own HTTP client, timed per route, able to lie
    and to hold; the weights are lists of tensors (``Weights``), damaged on request."""

    def __init__(self, spec: TrainerSpec, options: dict):
        self.spec, self.options = spec, options
        self.sender: Any = None
        self.client: _TimedClient | None = None
        self.switch: _SwitchableClient | None = None  # below the timing: lies, holds
        self.opened = False  # the group: opened by the first sync, not by prepare
        self.weights: Weights | None = None

    @property
    def has_group(self) -> bool:
        return self.sender is not None

    def command(self, cmd: dict) -> dict[str, Any]:
        from harness.transfer import sender_class
        from harness.vllm.client import ServerClient

        spec, options = self.spec, self.options
        if cmd["op"] == "describe":
            raise ValueError("describe is an op of the vllm trainer code")
        result: dict[str, Any] = {}
        if self.weights is None:
            self.weights = Weights(spec.dtype, spec.device)
        t1 = time.monotonic()
        named, what = corrupt_weights(self.weights.get(cmd["weights_dir"]), cmd.get("corrupt"),
                                      cmd.get("corrupt_target"))
        if options.get("exclude"):  # frozen weights the trainer does not send
            named, left_out = leave_out(named, options["exclude"])
            what = f"{'' if what == 'none' else what + '; '}{left_out}"
        if options.get("wrap"):  # the names a wrapped module's named_parameters() gives
            from harness.transfer.vllm_code import WRAP_PREFIX

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
                hold_after_start_s=float(options.get("hold_after_start_s") or 0),
                draft=bool(options.get("draft")))
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
        peak = CudaPeak(spec.device)
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
    code = {"vllm": VllmCode, "harness": _HarnessCode}.get(spec.code, UserCode)(spec, options)
    first = True
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
                if first:  # torch's import and the CUDA context, unless a spare paid
                    result["cuda_init_seconds"], first = time.monotonic() - t0, False
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
                elif (cmd["op"] == "sync" and recovers_in_place(spec.engine)
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
    with the update open (fault tests kill the trainer there). ``draft`` (option): every
    update opens with /start_draft_weight_update, so it loads into the server's
    speculative-decoding draft model instead of the target (vLLM #46725)."""

    def __init__(self, client, hold_after_start_s: float = 0.0, draft: bool = False):
        self._honest = self._current = client
        self.hold_after_start_s = hold_after_start_s
        self.draft = draft

    def lie(self, kind: str | None) -> LyingClient | None:
        self._current = self._honest if kind is None else LyingClient(self._honest, kind)
        return None if kind is None else self._current

    def hold_after_start(self, seconds: float) -> None:
        """From now on wait ``seconds`` after each /start_weight_update."""
        self.hold_after_start_s = seconds

    def start_weight_update(self, *args, **kwargs):
        out = (self._current.start_draft_weight_update() if self.draft
               else self._current.start_weight_update(*args, **kwargs))
        if self.hold_after_start_s:
            print(f"trainer: /start_weight_update acknowledged, holding "
                  f"{self.hold_after_start_s}s", flush=True)
            time.sleep(self.hold_after_start_s)
        return out

    def __getattr__(self, name: str):
        return getattr(self._current, name)


def _warm_imports(engine: str, code: str, device: str) -> None:
    """What a trainer of ``engine`` and ``code`` on ``device`` does before its first
    sync, done by a spare while it waits: torch and the sender, for NCCL and IPC vLLM's
    trainer API, transformers' model loading (both trainer codes load the checkpoint
    through it), and on a CUDA device the context with a first copy to it. Best effort:
    what fails here fails again, with its context, where the trainer needs it."""
    import importlib

    backend = transfer.backend(engine)
    names = ["torch", "harness.vllm.client", "harness.oracles.reference",
             backend.sender.partition(":")[0]]
    if code == "vllm":
        names += ["harness.transfer.vllm_code"]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    try:
        importlib.import_module("transformers").AutoModelForCausalLM  # a lazy module's import
    except Exception:
        pass
    if backend.vllm_api is not None or code == "vllm":
        try:
            from harness.transfer import registry

            registry.probe()  # imports vLLM's engine modules, as the sender will
        except Exception:
            pass
    if device.startswith("cuda"):
        try:
            import torch

            torch.cuda.set_device(torch.device(device))
            torch.ones(1).to(device).cpu()
        except Exception:
            pass


def _spare_main(engine: str, code: str, device: str, result_fd: int) -> int:
    """A spare (``python -m harness.trainer.child --spare ENGINE CODE DEVICE FD``):
    imports and CUDA context done, it waits for its first line,
    ``{"op": "become", "spec": ...}``, and from then
    on is the trainer of that spec. A spare never taken exits when its stdin closes."""
    _warm_imports(engine, code, device)
    line = sys.stdin.readline()
    if not line:
        return 0
    cmd = json.loads(line)
    if cmd.get("op") != "become":
        print(f"trainer spare: expected 'become' first, got {cmd.get('op')!r}", flush=True)
        return 2
    spec = cmd["spec"]
    print(f"trainer spare: became the {spec['engine']} trainer of {spec['url']} "
          f"(code {spec['code']}, packed={spec['packed']}, {spec['device']})", flush=True)
    return _child_main(json.dumps(spec), result_fd)


if __name__ == "__main__":
    if sys.argv[1] == "--spare":
        sys.exit(_spare_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    sys.exit(_child_main(sys.argv[1], int(sys.argv[2])))
