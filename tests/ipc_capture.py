"""What CUDA IPC updates carry, read on the GPU: the harness's IPC sender and an emitted repro
script's ``send_ipc`` send the same weights, each to a client that opens every handle in a
process of its own (CUDA opens no handle in the process that made it), as vLLM's worker
does, and hashes each tensor's bytes. Prints one JSON line: per sender, the routes and, per
update, the names, dtypes, shapes and sha256 of every tensor.

    python tests/ipc_capture.py SCRIPT [--packed] [--drop-last]

``--drop-last``: the harness's sender leaves out the last tensor (the comparison's own
test). Runs in a process of its own, so that the test process holds no CUDA context."""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

# The opener: one line of base64-pickled (handles, packed, tensor_sizes) in, one JSON list
# of sha256 hex digests out, per update.
_OPENER = r"""
import base64, hashlib, json, pickle, sys
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor
device = torch.cuda.current_device()
uuid = str(torch.cuda.get_device_properties(device).uuid)
for line in sys.stdin:
    handles, packed, sizes = pickle.loads(base64.b64decode(line))
    views = []
    for by_gpu in handles if isinstance(handles, list) else [handles]:
        args = list(by_gpu[uuid])  # as vLLM's worker: this GPU's entry, its own index
        args[6] = device
        views.append(rebuild_cuda_tensor(*args).contiguous().view(-1).view(torch.uint8))
    if packed:  # one reused buffer: the update's tensors back to back from its start
        assert len(views) == 1, f"a packed update with {len(views)} handles"
        buf, views, at = views.pop(), [], 0
        for n in sizes:
            views.append(buf[at:at + n])
            at += n
    torch.cuda.synchronize()
    print(json.dumps([hashlib.sha256(v.cpu().numpy().tobytes()).hexdigest() for v in views]),
          flush=True)
    views = buf = None  # the sender may reuse its buffer once the opener lets go
"""


class OpeningClient:
    """The four weight-sync routes, recorded; each update's handles opened by the opener
    while the sender still holds them (the call is synchronous, as the server's is).
    ``packed``: the group's, which only 0.26 repeats in every update (0.27.1+ sends it in
    the init info alone)."""

    def __init__(self, opener: subprocess.Popen, packed: bool):
        self.opener, self.packed, self.calls = opener, packed, []

    def init_weight_transfer_engine(self, info: dict) -> None:
        self.calls.append(["/init_weight_transfer_engine", info])

    def start_weight_update(self) -> None:
        self.calls.append(["/start_weight_update", None])

    def update_weights(self, info: Any) -> None:
        from harness.portable.send_ipc import json_safe_update_info

        wire = json.loads(json.dumps(json_safe_update_info(info)))  # as the server gets it
        handles = pickle.loads(base64.b64decode(wire.pop("ipc_handles_pickled")))
        line = base64.b64encode(pickle.dumps((handles, self.packed,
                                              wire.get("tensor_sizes")))).decode()
        self.opener.stdin.write(line + "\n")
        self.opener.stdin.flush()
        digests = self.opener.stdout.readline()
        if not digests:
            raise RuntimeError(f"the handle opener died (exit {self.opener.poll()})")
        wire["sha256"] = json.loads(digests)
        self.calls.append(["/update_weights", wire])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(["/finish_weight_update", None])


def weights(device: Any) -> list:
    import torch

    g = torch.Generator().manual_seed(7)
    made = [("embed_tokens.weight", torch.randn(64, 32, generator=g)),
            ("layers.0.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16)),
            ("layers.0.mlp.weight", torch.randn(48, 32, generator=g)),
            ("lm_head.weight", torch.randn(64, 32, generator=g))]
    return [(n, t.to(device)) for n, t in made]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tests/ipc_capture.py")
    p.add_argument("script", type=Path)
    p.add_argument("--packed", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    a = p.parse_args(argv)
    import torch

    from harness.transfer import ipc

    device = torch.device("cuda", torch.cuda.current_device())
    spec = importlib.util.spec_from_file_location("emitted_ipc_script", a.script)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    sc = script.SCENARIO
    opener = subprocess.Popen([sys.executable, "-c", _OPENER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        ours, theirs = OpeningClient(opener, a.packed), OpeningClient(opener, a.packed)
        sender = ipc.Sender(ours, packed=a.packed, options={"device": str(device)})
        sender.init()
        sent = weights(device)
        result = sender.send(sent[:-1] if a.drop_last else sent)
        sender.close()
        api = script.send_ipc(theirs, weights(device), {**sc, "packed": a.packed}, 60)
    finally:
        opener.stdin.close()
        opener.wait(timeout=60)
    print(json.dumps({"harness": ours.calls, "script": theirs.calls, "harness_path": sender.path,
                      "harness_api": result.api_path, "script_api": api,
                      "names": [n for n, _ in weights("cpu")],
                      "sha256": [hashlib.sha256(t.contiguous().view(-1).view(torch.uint8)
                                                .numpy().tobytes()).hexdigest()
                                 for _, t in weights("cpu")]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
