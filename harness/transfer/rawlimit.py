"""Raw limits: how fast this host moves a sync's bytes along the same path without vLLM.

``harness bench`` divides each backend's throughput by the limit of its data path,
measured in the same run on the same devices, so the number it reports is the
fraction of the hardware a sync uses, not a rate that only means something next to
the hardware it came from:

* ``host`` (the shm backend): one host memory copy (``Tensor.copy_`` of bytes);
* ``d2d`` (CUDA IPC): one device-to-device copy on the server's GPU;
* ``nccl`` (NCCL): a broadcast from the trainer's GPU to the server's GPUs, one
  process per GPU (``torch.distributed``), as the trainer's group does it.

Each size is moved once to warm up, then ``reps`` times; the limit is the best
repetition (the median is kept beside it). Every measurement runs in a child process
(``python -m harness.transfer.rawlimit``), so the caller imports no CUDA library and a hung NCCL
rendezvous is killed at its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.core.facts import free_port

DESCRIPTION = {
    "host": "host memory copy (torch, {threads} threads)",
    "d2d": "device-to-device copy on GPU {device}",
    "nccl": "NCCL broadcast GPU {src} -> GPU {dst} (torch.distributed, one process per GPU)",
}
_TAG = "RAWLIMIT "


class RawLimitError(RuntimeError):
    pass


def summarize(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    """One size's record: the samples, the best and the median, and their rates. The
    limit (``gbps``) is the best repetition: what the path can do, which a busy host
    lowers only in the median."""
    med, best = statistics.median(seconds), min(seconds)
    return {"bytes": nbytes, "samples": [round(s, 6) for s in seconds],
            "seconds": best, "median_seconds": med,
            "gbps": nbytes / best / 1e9 if best > 0 else None,
            "median_gbps": nbytes / med / 1e9 if med > 0 else None}


def measure(path: str, sizes: list[int], *, reps: int = 5, device: int | None = None,
            src: int | None = None, dst: list[int] | None = None,
            timeout: float = 300.0) -> dict[str, Any]:
    """Measure ``path`` at every size (bytes) in a child process; returns
    ``{"path", "what", "sizes": [summarize(...)], "env": {...}}``. Raises
    ``RawLimitError`` with the child's output on a failure or a timeout."""
    argv = [sys.executable, "-m", "harness.transfer.rawlimit", path, "--reps", str(reps),
            "--bytes", ",".join(str(int(n)) for n in sizes)]
    if path == "d2d":
        argv += ["--device", str(device if device is not None else 0)]
    elif path == "nccl":
        if src is None or not dst:
            raise ValueError("nccl needs src (the trainer's GPU) and dst (the server's GPUs)")
        argv += ["--src", str(src), "--dst", ",".join(map(str, dst))]
    elif path != "host":
        raise ValueError(f"unknown path {path!r}; known: host, d2d, nccl")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, env=_env())
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        raise RawLimitError(f"raw limit {path}: not done within {timeout:.0f}s\n"
                            f"{out[-2000:]}") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_TAG)]
    if proc.returncode != 0 or not lines:
        out = proc.stdout + proc.stderr
        raise RawLimitError(f"raw limit {path}: {cause(out)} (exit {proc.returncode})\n"
                            f"{out[-3000:]}")
    return json.loads(lines[-1][len(_TAG):])


def cause(output: str) -> str:
    """The line of a child's output that says what went wrong: the last one naming an
    error (a traceback's last line, NCCL's "Last error:" detail), else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Last error:") and i + 1 < len(lines):
            return lines[i + 1]
    named = [ln for ln in lines if "Error" in ln.split(":")[0] or ln.startswith("Error")]
    return (named or lines or ["no output"])[-1][:300]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in env.get("PYTHONPATH", "")
                                                  .split(os.pathsep) if p])
    # the trainer imports vLLM, which turns NCCL's cuMem allocator off for its process;
    # the limit is taken the same way (a caller's own setting wins)
    env.setdefault("NCCL_CUMEM_ENABLE", "0")
    return env


# ----------------------------------------------------------------------------- children

def _host(sizes: list[int], reps: int) -> dict[str, Any]:
    import torch

    out = []
    for n in sizes:
        src = torch.ones(n, dtype=torch.uint8)
        dst = torch.zeros(n, dtype=torch.uint8)  # pages touched before timing
        dst.copy_(src)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        out.append(summarize(n, times))
        del src, dst
    return {"path": "host", "what": DESCRIPTION["host"].format(threads=torch.get_num_threads()),
            "sizes": out}


def _cuda(device: int):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device here (torch {torch.__version__})")
    if device >= torch.cuda.device_count():
        raise RuntimeError(f"no GPU {device}: {torch.cuda.device_count()} visible")
    return torch.device("cuda", device)


def _d2d(sizes: list[int], reps: int, device: int) -> dict[str, Any]:
    import torch

    dev = _cuda(device)
    torch.cuda.set_device(dev)
    out = []
    for n in sizes:
        src = torch.ones(n, dtype=torch.uint8, device=dev)
        dst = torch.zeros(n, dtype=torch.uint8, device=dev)
        dst.copy_(src)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out.append(summarize(n, times))
        del src, dst
        torch.cuda.empty_cache()
    return {"path": "d2d", "what": DESCRIPTION["d2d"].format(device=device), "sizes": out,
            "gpu": torch.cuda.get_device_name(dev)}


def _nccl(sizes: list[int], reps: int, src: int, dst: list[int], timeout: float) -> dict:
    """Start one rank per GPU (rank 0 on ``src``), wait for them; rank 0 reports."""
    port = free_port()
    gpus = [src] + dst
    procs = []
    for rank, gpu in enumerate(gpus):
        argv = [sys.executable, "-m", "harness.transfer.rawlimit", "nccl-rank", "--rank", str(rank),
                "--world", str(len(gpus)), "--port", str(port), "--device", str(gpu),
                "--reps", str(reps), "--bytes", ",".join(map(str, sizes))]
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, stdin=subprocess.DEVNULL, env=_env(),
                                      start_new_session=True))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        failed = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outputs))
                  if p.returncode]
        raise RawLimitError(f"NCCL broadcast GPU {src} -> GPU {','.join(map(str, dst))} failed: "
                            f"{cause(failed[0][2])}\n" + "\n".join(
                                f"--- rank {r} (exit {code}) ---\n{o[-2000:]}"
                                for r, code, o in failed))
    lines = [ln for ln in outputs[0].splitlines() if ln.startswith(_TAG)]
    if not lines:
        raise RawLimitError(f"NCCL rank 0 reported nothing:\n{outputs[0][-2000:]}")
    res = json.loads(lines[-1][len(_TAG):])
    res["what"] = DESCRIPTION["nccl"].format(src=src, dst=",".join(map(str, dst)))
    return res


def _nccl_rank(sizes: list[int], reps: int, rank: int, world: int, port: int,
               device: int) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    dev = _cuda(device)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    try:
        out = []
        for n in sizes:
            buf = torch.ones(n, dtype=torch.uint8, device=dev)
            dist.broadcast(buf, src=0)  # warm-up: connections and buffers
            times = []
            for _ in range(reps):
                dist.barrier()
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                dist.broadcast(buf, src=0)
                torch.cuda.synchronize(dev)
                took = torch.tensor([time.perf_counter() - t0], device=dev, dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # done when the last rank has it
                times.append(float(took.item()))
            out.append(summarize(n, times))
            del buf
            torch.cuda.empty_cache()
        return {"path": "nccl", "sizes": out, "gpu": torch.cuda.get_device_name(dev),
                "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.transfer.rawlimit",
                                description=__doc__.splitlines()[0])
    p.add_argument("path", choices=("host", "d2d", "nccl", "nccl-rank"))
    p.add_argument("--bytes", required=True, help="sizes in bytes, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--src", type=int)
    p.add_argument("--dst")
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args(argv)
    sizes = [int(x) for x in a.bytes.split(",") if x]
    if a.path == "host":
        res = _host(sizes, a.reps)
    elif a.path == "d2d":
        res = _d2d(sizes, a.reps, a.device)
    elif a.path == "nccl":
        res = _nccl(sizes, a.reps, a.src, [int(x) for x in a.dst.split(",")], a.timeout)
    else:
        res = _nccl_rank(sizes, a.reps, a.rank, a.world, a.port, a.device)
        if a.rank != 0:
            return 0
    print(_TAG + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
