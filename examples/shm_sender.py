"""A weight sender as an RL framework writes one, run by the harness as trainer code:

    .venv/bin/python -m pytest --vllm-trainer examples.shm_sender:ShmSender -k shm

The harness builds ``ShmSender(ctx)`` in its trainer process (``ctx``: what
harness/trainer/user.py's ``TrainerContext`` holds), calls ``init()`` once,
``send(model)`` after every training step and ``close()`` at the end. The control plane
is vLLM's HTTP routes, posted with requests; the data plane is the harness's CPU
``shm`` engine: each bucket of tensors is a safetensors file under the root the server
was given at init, and /update_weights names it. For NCCL or CUDA IPC only
``_transfer`` changes: broadcast the bucket in the group ``init`` joined, or post its
IPC handles, with the same names, dtypes and shapes.

SHM_SENDER_DROP=<parameter name> leaves that parameter out of every update: a bug on
purpose, which the harness's checks must catch.
"""

import os

import requests
from safetensors.torch import save_file

from harness.core.facts import update_info  # names, dtype_names, shapes: vLLM's update info
from harness.portable.bucketing import buckets

BUCKET_BYTES = 16 << 20


class ShmSender:
    def __init__(self, ctx):
        if ctx.backend != "shm":
            raise ValueError(f"ShmSender speaks shm; this server's engine is {ctx.backend}")
        self.ctx, self.updates = ctx, 0
        self.headers = {"Authorization": f"Bearer {ctx.api_key}"} if ctx.api_key else {}
        self.drop = os.environ.get("SHM_SENDER_DROP")

    def _post(self, route: str, body: dict) -> None:
        r = requests.post(self.ctx.url + route, json=body, headers=self.headers,
                          timeout=self.ctx.timeout)
        if not r.ok:  # the server's reason is in the body: keep it
            raise RuntimeError(f"{route}: HTTP {r.status_code}: {r.text[:500]}")

    def init(self) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": self.ctx.init_info})

    def send(self, model) -> dict:
        params = [(n, p.detach()) for n, p in model.named_parameters()]
        if self.drop:
            if self.drop not in dict(params):
                raise ValueError(f"SHM_SENDER_DROP={self.drop}: no such parameter")
            params = [(n, p) for n, p in params if n != self.drop]
        self._post("/start_weight_update", {})
        for i, bucket in enumerate(buckets(params, BUCKET_BYTES)):
            self._transfer(i, bucket)
        self._post("/finish_weight_update", {})
        self.updates += 1
        return {"tensors": len(params),
                "corruption": f"left {self.drop} out (SHM_SENDER_DROP)" if self.drop else "none"}

    def _transfer(self, i: int, bucket: list) -> None:
        path = os.path.join(self.ctx.init_info["root"], f"update-{self.updates}-{i}.safetensors")
        save_file({n: t.to("cpu").contiguous() for n, t in bucket}, path)
        try:
            self._post("/update_weights", {"update_info": update_info(bucket, path=path)})
        finally:
            os.remove(path)  # the server has loaded it (or refused it)

    def close(self) -> None:
        pass  # nothing held: the next group's init replaces this one on the server
