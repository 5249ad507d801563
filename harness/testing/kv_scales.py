"""A vLLM worker extension (``--worker-extension-cls``) that reads and sets the KV-cache
scales of every attention layer, for the fp8-KV self-test (issue 58).

vLLM #57163: a level-2 sleep zeroed the KV scales of an fp8 KV cache, and the server
went on serving with them. The test of that row (tests/test_sleep.py) compares the
server's output after a level-2 sleep, a wake and a resync with its output before;
this extension lets its self-test zero the scales on purpose, through
``POST /collective_rpc``, to show that the comparison sees it, and put them back.

It runs inside vLLM's worker process, as a base class of the worker: ``self`` is the
worker, ``self.get_model()`` its model. Each attention layer holds its scales as the
buffers ``_k_scale`` / ``_v_scale`` (what the kernels read) and as the floats
``_k_scale_float`` / ``_v_scale_float`` (what some backends read); both are set.
Arguments arrive as strings (``/collective_rpc`` passes only strings)."""

from __future__ import annotations

import json


class KVScaleFaults:
    def harness_kv_scales(self, set_to: str = "") -> dict:
        """Every attention layer's (k, v) scale, after setting them to ``set_to`` (a
        float, or a JSON object of layer -> [k, v] as this method returned it) where
        one is given."""
        import torch

        wanted = json.loads(set_to) if set_to.strip().startswith("{") else None
        value = float(set_to) if set_to.strip() and wanted is None else None
        out: dict[str, list[float]] = {}
        with torch.no_grad():
            for name, module in self.get_model().named_modules():
                k, v = getattr(module, "_k_scale", None), getattr(module, "_v_scale", None)
                if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                    continue
                new = wanted.get(name) if wanted is not None else (
                    None if value is None else [value, value])
                if new is not None:
                    k.fill_(float(new[0]))
                    v.fill_(float(new[1]))
                    if hasattr(module, "_k_scale_float"):
                        module._k_scale_float = float(new[0])
                    if hasattr(module, "_v_scale_float"):
                        module._v_scale_float = float(new[1])
                out[name] = [float(k.flatten()[0]), float(v.flatten()[0])]
        return out
