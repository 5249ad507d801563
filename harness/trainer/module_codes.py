"""The trainer codes that push a live Hugging Face module, as an RL trainer holds its
model: vLLM's own trainer code (``VllmCode``: ``harness.transfer.vllm_code.SeedTrainer``)
and a trainer of your own (``UserCode``: ``harness.trainer.user``). The child process
(``harness.trainer.child``) runs one of them, or the harness's own code, per trainer.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from harness import transfer
from harness.core.facts import torch_dtype_name
from harness.trainer.damage import corrupt_weights
from harness.trainer.device import CudaPeak, Weights
from harness.trainer.handle import (API_KEY_ENV, DROP_ENV, USER_CODE_OPTIONS,
                                    VLLM_CODE_CORRUPTIONS, VLLM_CODE_OPTIONS, TrainerSpec)
from harness.trainer.spares import SCRATCH_ENV


class VllmCode:
    """The child's state when ``spec.code == "vllm"``: the trainer code vLLM's examples
    teach (``harness.transfer.vllm_code.SeedTrainer``: vLLM's HTTPVLLMWeightSyncClient,
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
        from harness.models import sized
        from harness.oracles.reference import load_hf_model

        if self.holds == weights_dir:
            return
        if sized.is_weightless(weights_dir):
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
            from harness.transfer.vllm_code import Unavailable

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
        from harness.transfer import vllm_code

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
        peak = CudaPeak(self.spec.device)
        result.update(self.trainer.send(source))
        result["sync_seconds"] = result["send_seconds"]
        result.update(peak.facts())
        result["http_spans"] = []  # vLLM's client is not wrapped: no per-route times
        return result

    def describe(self, weights_dir: str) -> dict[str, Any]:
        """What ModuleSource over the live module sends, what the harness path sends for
        the same directory (its own loader), what the checkpoint holds, what a wrapped
        module's source would announce. Calls no route."""
        from harness.oracles.reference import load_hf_model
        from harness.transfer import vllm_code

        module = load_hf_model(weights_dir, self.spec.dtype, self.spec.device)
        source = vllm_code.module_source(module)
        harness_list = Weights(self.spec.dtype, self.spec.device).get(weights_dir)
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


class UserCode(VllmCode):
    """The child's state for a trainer of your own (``spec.code`` neither harness nor
    vllm: ``harness.trainer.user``): your sender class, built once per group with a
    ``TrainerContext``, over one live Hugging Face module held as the vllm trainer code
    holds it (each sync's weights loaded into its parameters in place). It sends what it
    sends: the harness's damage, lies and options are refused before any route is called
    (``Unavailable``: the test skips with the reason)."""

    def __init__(self, spec: TrainerSpec, options: dict):
        super().__init__(spec, options)
        self.sender: Any = None
        self.opened = False

    def command(self, cmd: dict) -> dict[str, Any]:
        from harness.trainer import user as trainer_plugin
        from harness.transfer.vllm_code import Unavailable

        what = f"a trainer of your own ({self.spec.code})"
        if cmd["op"] == "describe":
            raise Unavailable(f"{what}: describe is an op of the vllm trainer code")
        if cmd.get("corrupt") or cmd.get("lie"):
            raise Unavailable(f"{what} sends what it sends: the harness cannot damage it or "
                              f"make it lie ({cmd.get('corrupt') or cmd.get('lie')!r} is the "
                              "harness path's); break it by a switch of its own")
        other = sorted(set(self.options) - set(USER_CODE_OPTIONS))
        if other:
            raise Unavailable(f"{what} takes no harness option ({', '.join(other)})")
        result: dict[str, Any] = {}
        t1 = time.monotonic()
        self.load(cmd["weights_dir"])
        result["load_seconds"] = time.monotonic() - t1
        if self.sender is None:
            t1 = time.monotonic()
            self.sender = trainer_plugin.load(self.spec.code)(self._context())
            result["sender_seconds"] = time.monotonic() - t1
        if cmd["op"] == "prepare":
            return result
        if not self.opened:
            t1 = time.monotonic()
            self.sender.init()
            self.opened = True
            result["init_seconds"] = time.monotonic() - t1
        peak = CudaPeak(self.spec.device)
        t1 = time.monotonic()
        told = self.sender.send(self.module)
        result["sync_seconds"] = time.monotonic() - t1
        if told is not None and not isinstance(told, dict):
            raise TypeError(f"{what}: send() returned {type(told).__name__}; a dict or None")
        params = list(self.module.named_parameters())
        result.update({"tensors": len(params), "corruption": "none",
                       "bytes": sum(p.numel() * p.element_size() for _, p in params),
                       "api_path": f"trainer of your own: {trainer_plugin.target(self.spec.code)}",
                       **(told or {})})
        result.update(peak.facts())
        result["http_spans"] = []  # your client is not wrapped: no per-route times
        return result

    def _context(self) -> Any:
        import tempfile

        from harness.trainer.user import TrainerContext

        spec, key = self.spec, os.environ.get(API_KEY_ENV) or None
        scratch = tempfile.mkdtemp(prefix="user-trainer-", dir=os.environ.get(SCRATCH_ENV))
        make_info = transfer.backend(spec.engine).user_init_info
        info: dict[str, Any] = (make_info(spec.url, spec.timeout, key, scratch)
                                if make_info is not None else {})
        return TrainerContext(url=spec.url, urls=(spec.url,), backend=spec.engine,
                              packed=spec.packed, init_info=info, device=spec.device,
                              dtype=spec.dtype, timeout=spec.timeout, api_key=key,
                              scratch=scratch, options={})

    @property
    def has_group(self) -> bool:
        return self.sender is not None

    def close_group(self) -> None:
        try:
            if self.sender is not None:
                self.sender.close()
        finally:
            self.sender, self.opened = None, False
