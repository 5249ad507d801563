"""Memory and processes, measured in one place: the processes of a server's tree,
their resident memory, and GPU memory (NVML, or ``nvidia-smi`` where NVML is missing).

* ``process_tree`` / ``tree_processes``: a server's API server, engine core and
  workers (``VLLMServer.pids`` and ``stop``, ``harness bench``, the fault tests);
* ``tree_rss``: their resident bytes together (the fault tests' growth checks);
* ``gpu_memory``: the GPU memory of some processes (the fault tests);
  ``ServerMemory``: a server's GPU memory sampled during a sync, its peak above the
  baseline (``harness bench``); ``gpu_used_mib``: each GPU's used memory (the pool's
  host-load samples);
* ``cpu_times`` / ``cpu_use``: what the host's cores did over a run (busy, idle,
  stolen by a hypervisor), so a report says whether the run was CPU-bound;
* a trainer's own GPU memory is read inside its process, by torch
  (``torch.cuda.max_memory_allocated``, harness/trainer/handle.py).

Nothing here imports torch or vLLM: the pytest process must never load CUDA.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
from typing import Callable, Iterable

MIB = 1 << 20


# ----------------------------------------------------------------------------- processes

def tree_processes(pid: int | None, *, orphans: bool = False) -> list:
    """``pid`` and its descendants (psutil processes; [] for None). With ``orphans``,
    where ``pid`` is gone, the processes still in its process group (a dead API
    server's engine core and workers)."""
    import psutil

    if pid is None:
        return []
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        if not orphans:
            return []
        group = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == pid:
                    group.append(p)
            except (ProcessLookupError, PermissionError, psutil.Error):
                pass
        return group


def process_tree(pid: int | None) -> set[int]:
    """The ids of ``pid`` and its descendants; empty once it is gone."""
    return {p.pid for p in tree_processes(pid)}


def processes(pids: Iterable[int]) -> list:
    """psutil processes for those of ``pids`` that still exist."""
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return out


def tree_rss(pids: Iterable[int]) -> int:
    """Resident bytes of these processes together (pages shared between them are
    counted in each: the figure tracks growth, not an exact total)."""
    import psutil

    total = 0
    for p in processes(pids):
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


# ----------------------------------------------------------------------------- GPU memory

def nvml():
    """NVML's Python binding (nvidia-ml-py, or the copy vLLM carries), initialised; None
    where there is neither or no driver."""
    import importlib

    for name in ("pynvml", "vllm.third_party.pynvml"):
        try:
            nv = importlib.import_module(name)
            nv.nvmlInit()
            return nv
        except Exception:
            continue
    return None


def _smi(gpus: Iterable[int] | None, query: str, timeout: float) -> str:
    ids = [] if gpus is None else ["-i", ",".join(map(str, gpus))]
    return subprocess.run(["nvidia-smi", *ids, query, "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=timeout).stdout


def gpu_used_mib(gpus: Iterable[int] | None = None, timeout: float = 10) -> list[int] | None:
    """The used memory of each GPU (all, or ``gpus``) in MiB, from ``nvidia-smi``; None
    without it or when it does not answer."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return [int(float(x)) for x in _smi(gpus, "--query-gpu=memory.used", timeout).split()]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def nvidia_smi_memory(gpus: Iterable[int] | None = None, timeout: float = 10
                      ) -> tuple[dict[int, int] | None, int | None]:
    """(bytes per process id, bytes used on the GPUs together) from ``nvidia-smi``, over
    all GPUs or ``gpus``; (None, None) without it."""
    if not shutil.which("nvidia-smi"):
        return None, None
    try:
        apps = _smi(gpus, "--query-compute-apps=pid,used_memory", timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    procs: dict[int, int] = {}
    for line in apps.splitlines():
        pid, _, mib = line.partition(",")
        try:
            procs[int(pid)] = procs.get(int(pid), 0) + int(float(mib)) * MIB
        except ValueError:
            continue
    used = gpu_used_mib(gpus, timeout)
    return procs, None if used is None else sum(used) * MIB


def gpu_memory(pids: Iterable[int]) -> int | None:
    """GPU memory used by these processes, in bytes, as ``nvidia-smi`` reports it;
    None without ``nvidia-smi`` (no GPU). A process in another PID namespace is not
    matched; then the used memory of every GPU is the fallback."""
    procs, device = nvidia_smi_memory(timeout=30)
    if procs is None:
        return None
    used = sum(v for p, v in procs.items() if p in set(pids))
    return used or device


class ServerMemory:
    """The server's GPU memory during a sync, sampled every ``interval`` seconds on a
    thread: NVML's per-process figure summed over the server's process tree, or, where
    NVML does not show those processes (another PID namespace), the whole GPU's used
    memory, which also counts a trainer on the same GPU. ``None`` figures without NVML
    and nvidia-smi. ``start()`` reads the baseline; ``stop()`` returns
    ``server_peak_extra_bytes`` (the peak above it), ``server_retained_bytes`` (what
    was still held after) and ``server_memory_method``."""

    def __init__(self, gpus: tuple[int, ...], pids: Callable[[], set[int]],
                 interval: float = 0.005):
        self.gpus, self.pids, self.interval = gpus, pids, interval
        self.method: str | None = None  # process | device | none (a GPU server unread)
        self._nvml = nvml() if gpus else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mine: set[int] | None = None  # the server's processes, read once per sync
        self.base = self.peak = None

    def read(self) -> int | None:
        if not self.gpus:
            return None
        procs, device = self._query()
        if procs is not None:
            mine = self._mine if self._mine is not None else self.pids()
            if mine & set(procs):
                self.method = "process"
                return sum(v for p, v in procs.items() if p in mine)
        self.method = "device" if device is not None else "none"
        return device

    def _query(self) -> tuple[dict[int, int] | None, int | None]:
        if self._nvml is not None:
            nv = self._nvml
            procs: dict[int, int] = {}
            device = 0
            for i in self.gpus:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                device += nv.nvmlDeviceGetMemoryInfo(h).used
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    procs[p.pid] = procs.get(p.pid, 0) + (p.usedGpuMemory or 0)
            return procs, device
        return nvidia_smi_memory(self.gpus)

    def start(self) -> None:
        self._mine = self.pids() if self.gpus else set()
        self.base = self.peak = self.read()
        if self.base is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="server-memory", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                v = self.read()
            except Exception:  # a process that ended between two calls
                continue
            if v is not None and (self.peak is None or v > self.peak):
                self.peak = v

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None
        if self.base is None:
            return {"server_peak_extra_bytes": None, "server_retained_bytes": None,
                    "server_memory_method": self.method}
        end = self.read()
        peak = max(v for v in (self.peak, end, self.base) if v is not None)
        return {"server_peak_extra_bytes": peak - self.base,
                "server_retained_bytes": None if end is None else end - self.base,
                "server_memory_method": self.method}


def host_load() -> dict:
    """What the host is doing right now: the 1-minute load average against the cores,
    and the memory used on each GPU (MiB; [] without nvidia-smi). The pool samples it
    while servers start, so a report says whether starts waited on CPU or on memory."""
    import os

    return {"load1": round(os.getloadavg()[0], 2), "cores": len(os.sched_getaffinity(0)),
            "gpu_used_mib": gpu_used_mib() or []}


# ----------------------------------------------------------------------------- CPU time

# /proc/stat's columns after "cpu", in clock ticks: user nice system idle iowait irq
# softirq steal (guest time is counted in user already)
_BUSY = (0, 1, 2, 5, 6)


def cpu_times(path: str = "/proc/stat") -> dict | None:
    """The host's CPU time since boot, in seconds, its cores together: ``busy`` (user,
    nice, system, irq, softirq), ``idle``, ``iowait`` and ``steal`` (time a virtual
    machine's cores were ready but ran the hypervisor's other guests), and ``cores``
    (the ``cpuN`` lines). None where there is no /proc/stat (not Linux)."""
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return None
    total = next((ln.split()[1:] for ln in lines if ln.startswith("cpu ")), None)
    if total is None:
        return None
    ticks = [int(x) for x in total] + [0] * 8
    hz = os.sysconf("SC_CLK_TCK")
    return {"cores": sum(1 for ln in lines if re.match(r"cpu\d+ ", ln)),
            "busy": sum(ticks[i] for i in _BUSY) / hz, "idle": ticks[3] / hz,
            "iowait": ticks[4] / hz, "steal": ticks[7] / hz}


def cpu_use(before: dict | None, after: dict | None) -> dict | None:
    """What the host's cores did between two ``cpu_times``: seconds of each kind, all
    cores together, and ``available``, their sum (about the wall time times the cores).
    ``busy / available`` near 1 means the run waited on CPU; every field adds up over
    the shards of one run."""
    if before is None or after is None:
        return None
    use = {k: round(after[k] - before[k], 1) for k in ("busy", "idle", "iowait", "steal")}
    return {"cores": after["cores"], **{f"{k}_seconds": v for k, v in use.items()},
            "available_seconds": round(sum(use.values()), 1)}
