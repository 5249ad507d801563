"""``harness bench``: how fast a weight sync is, and what fraction of its data path's limit.

    harness bench --vllm-backend ipc-packed --vllm-backend ipc-unpacked --sizes 0.5,1,2,4 \\
        --warm 5 --out reports/bench/h200

For every backend and model size (GB of weights in ``--vllm-dtype``): a server started with
dummy weights of a Llama scaled to that size, a trainer that draws random weights of
the same shapes on its own device, then one cold sync (the group is opened: the
``/init_weight_transfer_engine`` call and the NCCL rendezvous) and ``--warm`` warm ones,
each between ``/pause`` and ``/resume``. Measured per sync:

* seconds from ``/pause`` to ``/resume``, and the trainer's send (``/start_weight_update``
  to the end of ``/finish_weight_update``) split into phases: start, update (from the
  end of start to the beginning of finish: the data plane), finish; init on the cold one;
* bytes, tensors, ``/update_weights`` calls, and GB/s (bytes / send seconds);
* the server's peak extra GPU memory during the sync (NVML per process, sampled) and
  the trainer's (``torch.cuda.max_memory_allocated`` in its process).

In the same run, the raw limit of each data path at the same byte counts
(``harness.rawlimit``): a host memory copy (shm), a device-to-device copy on the
server's GPU (IPC), an NCCL broadcast between the trainer's and the server's GPUs
(NCCL). Each sync's GB/s is divided by its path's limit.

Servers of one run start side by side (``--vllm-max-servers`` at once), trainers are
prepared side by side (imports, CUDA context, weights), and only then is anything timed,
one sync at a time. Output: a progress line per sync, a table, ``DIR/bench.json``
(rewritten after every case, ``header.complete`` false until the end),
``DIR/bench.txt`` (the table) and ``DIR/bench.png`` (throughput against size per
backend, the raw limits dashed; needs matplotlib: ``pip install '.[bench]'``).
``--replot DIR/bench.json`` prints the table and draws the plot of a finished run.
``harness diff A/bench.json B/bench.json`` compares two runs.

Exit code: 0 every case measured, 1 a case failed (its error is in the JSON and the
table) or the run was interrupted (Ctrl-C, ``timeout --signal=INT``: the servers are
stopped, and the table and plot show what was measured), 2 bad input (one line on
stderr: an unknown backend, a size that is not a positive number, GPU backends on a
host without the GPUs they need...).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .facts import run_command
from .sync import paused_sync
from .benchfile import (GB, MIB, PHASES, BenchFileError, limit_at, new_document, rate,
                        summarize_case, sync_record, write_json)
from .benchfile import load as load_file

CPU_SIZES = "0.05,0.1,0.25"
GPU_SIZES = "0.5,1,2,4"
MAX_SIZE_GB = 1000.0
DEFAULT_OUT = ".harness-cache/bench"
WIDTH = 120


class BadInput(Exception):
    """The command cannot run as asked: one line on stderr, exit code 2."""


# ----------------------------------------------------------------------------- input

def parse_sizes(text: str) -> list[float]:
    """``"0.1,0.5,1"`` -> [0.1, 0.5, 1.0] (GB, sorted, unique); BadInput otherwise."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise BadInput(f"--sizes: {part!r} is not a number of GB (e.g. --sizes 0.1,0.5,1)"
                           ) from None
        if not (v > 0 and math.isfinite(v)) or v > MAX_SIZE_GB:
            raise BadInput(f"--sizes: {part} is not a size in GB between 0 and {MAX_SIZE_GB:g}")
        out.append(v)
    if not out:
        raise BadInput("--sizes: no size given (e.g. --sizes 0.1,0.5,1)")
    return sorted(set(out))


# ----------------------------------------------------------------------------- table

def _f(v: Any, fmt: str = "{:.3g}", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return fmt.format(v)


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / MIB:.0f}"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def render_table(doc: dict) -> str:
    """The run as text: what ran where, the raw limits, then two tables (speed; phases
    and memory), one row per backend and size, and the errors."""
    h = doc.get("header") or {}
    v = (h.get("vllm") or {}).get("version")
    gpus = h.get("gpus") or {}
    where = (f"{gpus.get('used')} x {', '.join(sorted(set(gpus.get('names') or []))) or 'GPU'}"
             if gpus.get("used") else "CPU only")
    opts = h.get("options") or {}
    out = [f"harness bench: vLLM {v}, {opts.get('dtype')}, {where}, {h.get('cpu_count')} CPUs, "
           f"{opts.get('warm')} warm syncs per case"
           + ("" if h.get("complete", True) else "  (INCOMPLETE: the run did not finish)")]
    def para(text: str) -> list[str]:
        return textwrap.wrap(text, WIDTH, subsequent_indent="    ")

    models = doc.get("models") or []
    if models:
        out += para("models: " + "; ".join(
            f"{m['size_gb']:g} GB = {m['bytes'] / GB:.3f} GB, {m['tensors']} tensors "
            f"(hidden {m['hidden_size']}, {m['layers']} layers)" for m in models))
    for lim in doc.get("limits") or []:
        if lim.get("error"):
            out += para(f"limit {lim['path']}: not measured: {lim['error'].splitlines()[0]}")
        else:
            out += para(f"limit {lim['path']}: {lim.get('what')}: " + ", ".join(
                f"{s['bytes'] / GB:.3g} GB {_f(s['gbps'], '{:.1f}')} GB/s" for s in lim["sizes"]))
    cases = sorted(doc.get("cases") or [], key=lambda c: (c["backend"], c["size_gb"]))
    rows, rows2, errors = [], [], []
    for c in cases:
        s = c.get("summary") or {}
        w = s.get("warm_sync_seconds") or {}
        p = s.get("warm_pause_to_resume_seconds") or {}
        name, size = c["backend"], f"{c['size_gb']:g}"
        if c.get("error"):
            errors.append(f"{name} {size} GB: {c['error'].splitlines()[0][:WIDTH - 20]}")
        rows.append([name, size,
                     _f(s.get("cold_pause_to_resume_seconds"), "{:.2f}"),
                     _f(s.get("cold_init_seconds"), "{:.2f}"),
                     (f"{w['median']:.3f} [{w['min']:.3f}-{w['max']:.3f}]" if w else "-"),
                     _f(p.get("median"), "{:.3f}"),
                     _f(s.get("gbps"), "{:.2f}"), _f(s.get("limit_gbps"), "{:.1f}"),
                     _f(s.get("ratio"), "{:.1%}")])
        ph = s.get("phases") or {}
        rows2.append([name, size] + [_f(ph.get(k), "{:.3f}") for k in PHASES]
                     + [_f((c.get("warm") or [{}])[0].get("update_calls"), "{}"),
                        _f(c.get("tensors"), "{}"),
                        _mib(s.get("server_peak_extra_bytes")),
                        _mib(s.get("trainer_peak_extra_bytes")),
                        _mib(s.get("cold_server_peak_extra_bytes")),
                        s.get("server_memory_method") or "-"])
    out.append("")
    out += _table(["backend", "GB", "cold s", "init s", "warm send s: median [min-max]",
                   "pause->resume s", "GB/s", "limit GB/s", "of limit"], rows,
                  right={1, 2, 3, 5, 6, 7, 8})
    out.append("")
    out += _table(["backend", "GB", "start s", "update s", "finish s", "updates", "tensors",
                   "server +MiB", "trainer +MiB", "cold server +MiB", "server memory"], rows2,
                  right={1, 2, 3, 4, 5, 6, 7, 8, 9})
    out.append("")
    out += textwrap.wrap(
        "cold s: /pause to /resume of the first sync, init s (opening the group) included. "
        "warm send: /start_weight_update to the end of /finish_weight_update; start, update, "
        "finish: its phases (medians). GB/s: bytes / median warm send. of limit: GB/s / the "
        "path's raw limit at the same bytes. +MiB: peak extra GPU memory during a warm sync "
        "(the largest); server memory: how it was read.", WIDTH)
    for e in errors:
        out.append(f"FAILED {e}")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- plot

_COLORS = {"nccl-packed": "#1f77b4", "nccl-unpacked": "#6baed6", "ipc-packed": "#2ca02c",
           "ipc-unpacked": "#98df8a", "shm": "#d62728"}
_LIMIT_STYLE = {"nccl": ("#1f77b4", "--"), "d2d": ("#2ca02c", "--"), "host": ("#d62728", "--")}
_LIMIT_NAME = {"nccl": "NCCL broadcast", "d2d": "device-to-device copy",
               "host": "host memory copy"}


def plot_series(doc: dict) -> dict:
    """What the plot draws, as numbers: per backend the GB of each size, its GB/s (median
    warm send) with the distances to the slowest and fastest warm send, and the
    percentage of the limit; per raw limit, its GB and GB/s."""
    backends: dict[str, dict] = {}
    for c in sorted(doc.get("cases") or [], key=lambda c: c.get("size_gb", 0)):
        s = c.get("summary") or {}
        if not s.get("gbps"):
            continue
        w = s["warm_sync_seconds"]
        b = backends.setdefault(c["backend"], {"x": [], "y": [], "lo": [], "hi": [],
                                               "ratio": []})
        x = s["bytes"] / GB
        b["x"].append(x)
        b["y"].append(s["gbps"])
        b["lo"].append(s["gbps"] - rate(s["bytes"], w["max"]))
        b["hi"].append(rate(s["bytes"], w["min"]) - s["gbps"])
        if s.get("ratio"):
            b["ratio"].append((x, 100 * s["ratio"]))
    limits = {}
    for lim in doc.get("limits") or []:
        if lim.get("error") or not lim.get("sizes"):
            continue
        limits[lim["path"]] = {"x": [z["bytes"] / GB for z in lim["sizes"]],
                               "y": [z["gbps"] for z in lim["sizes"]]}
    return {"backends": dict(sorted(backends.items())), "limits": limits}


def _tick(v: float, unit: str = "") -> str:
    """A log axis's label: only at 1, 2 and 5 times a power of ten."""
    if v <= 0:
        return ""
    lead = round(v / 10 ** math.floor(math.log10(v) + 1e-9), 6)
    return f"{v:g}{unit}" if lead in (1, 2, 5) else ""


def write_plot(doc: dict, path: Path) -> Path:
    """Throughput against the bytes synced, one line per backend (median warm send, bars:
    slowest and fastest), each data path's raw limit dashed; beside it, the percentage
    of the limit. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    series = plot_series(doc)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5.2))
    for k, (name, b) in enumerate(series["backends"].items()):
        color = _COLORS.get(name)
        ax.errorbar(b["x"], b["y"], yerr=[b["lo"], b["hi"]], marker="o", capsize=3,
                    color=color, label=name)
        if b["ratio"]:
            ax2.plot([x for x, _ in b["ratio"]], [r for _, r in b["ratio"]], marker="o",
                     color=color, label=name)
            for x, r in b["ratio"]:
                ax2.annotate(f"{r:.0f}%" if r >= 10 else f"{r:.1f}%", (x, r), fontsize=7,
                             textcoords="offset points", xytext=(5, 4 - 10 * (k % 2)),
                             color=color)  # alternate sides: neighbouring lines stay legible
    for path_name, lim in series["limits"].items():
        color, style = _LIMIT_STYLE.get(path_name, ("gray", "--"))
        ax.plot(lim["x"], lim["y"], linestyle=style, color=color, alpha=0.6, marker="x",
                label=f"limit: {_LIMIT_NAME.get(path_name, path_name)}")
    ratios = [r for b in series["backends"].values() for _, r in b["ratio"]]
    wide = bool(ratios) and max(ratios) > 20 * min(ratios)  # else a linear axis from 0 reads better
    if ratios and not wide:
        ax2.set_ylim(0, max(ratios) * 1.25)
    sizes = sorted({x for b in series["backends"].values() for x in b["x"]})
    for a, unit in ((ax, ""), (ax2, "%")):
        a.set_xscale("log")
        a.set_xlabel("weights synced (GB)")
        a.grid(True, which="both", alpha=0.3)
        if sizes:  # a tick at every size measured, in plain numbers
            a.set_xticks(sizes, [f"{x:.2g}" for x in sizes])
            a.xaxis.set_minor_formatter(NullFormatter())
        if a is ax or wide:
            a.set_yscale("log")  # 0.1, 0.2, 0.5, 1, 2 ... rather than 10^x
            a.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: _tick(v, u)))
            a.yaxis.set_minor_formatter(FuncFormatter(lambda v, _, u=unit: _tick(v, u)))
        else:
            a.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: f"{v:g}{u}"))
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    ax.set_ylabel("GB/s (bytes / warm send; median, bars: min-max)")
    ax2.set_ylabel("% of the path's raw limit")
    h = doc.get("header") or {}
    gpus = h.get("gpus") or {}
    where = (f"{gpus.get('used')} x {', '.join(sorted(set(gpus.get('names') or [])))}"
             if gpus.get("used") else f"CPU ({h.get('cpu_count')} cores)")
    opts = h.get("options") or {}
    fig.suptitle(f"vLLM {(h.get('vllm') or {}).get('version')} weight sync, {opts.get('dtype')}, "
                 f"{where}, {opts.get('warm')} warm syncs per point")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- GPU memory

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
        self._nvml = _nvml() if gpus else None
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
        return _nvidia_smi(self.gpus)

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


def _nvml():
    """NVML's Python binding (nvidia-ml-py, or the copy vLLM carries), initialised; None
    where there is neither or no driver."""
    for name in ("pynvml", "vllm.third_party.pynvml"):
        try:
            import importlib

            nv = importlib.import_module(name)
            nv.nvmlInit()
            return nv
        except Exception:
            continue
    return None


def _nvidia_smi(gpus: tuple[int, ...]) -> tuple[dict[int, int] | None, int | None]:
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None, None
    ids = ",".join(map(str, gpus))
    try:
        apps = subprocess.run(["nvidia-smi", "-i", ids, "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10).stdout
        used = subprocess.run(["nvidia-smi", "-i", ids, "--query-gpu=memory.used",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    procs: dict[int, int] = {}
    for line in apps.splitlines():
        try:
            pid, mib = (int(x.strip()) for x in line.split(","))
        except ValueError:
            continue
        procs[pid] = procs.get(pid, 0) + mib * MIB
    try:
        device = sum(int(x.strip()) for x in used.splitlines() if x.strip()) * MIB
    except ValueError:
        device = None
    return procs, device


def process_tree(pid: int | None) -> set[int]:
    import psutil

    if pid is None:
        return set()
    try:
        root = psutil.Process(pid)
        return {root.pid} | {c.pid for c in root.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


# ----------------------------------------------------------------------------- progress

class Progress:
    """One line per step (a sync), with the count of steps and the elapsed time, and
    notes between them (servers started, trainers prepared), on stderr: the table goes
    to stdout."""

    def __init__(self, total: int, stream=None):
        self.total, self.done = total, 0
        self.t0 = time.monotonic()
        self.stream = stream or sys.stderr

    def note(self, msg: str) -> None:
        print(f"[{self._clock()}] {msg}", file=self.stream, flush=True)

    def step(self, msg: str) -> None:
        self.done += 1
        print(f"[{self._clock()} {self.done:>{len(str(self.total))}}/{self.total}] {msg}",
              file=self.stream, flush=True)

    def _clock(self) -> str:
        s = int(time.monotonic() - self.t0)
        return f"{s // 60:d}:{s % 60:02d}"


# ----------------------------------------------------------------------------- the run

@dataclasses.dataclass
class Plan:
    cases: list            # harness.cases.Case, one per backend x size
    sizes: list[float]
    dtype: str
    warm: int
    gpus_needed: int


def make_plan(backends: list[str], sizes_text: str | None, dtype: str, layout: str | None,
              warm: int, gpus_visible: int) -> Plan:
    """Everything the run will do, checked before anything starts; BadInput otherwise."""
    from . import facts
    from .backends import VARIANTS
    from .cases import make_case

    try:
        dtype = facts.canonical_dtype(dtype)
    except facts.UnknownDtype as e:
        raise BadInput(f"--vllm-dtype: {e}") from None
    if warm < 1:
        raise BadInput(f"--warm: at least one warm sync is needed, got {warm}")
    if not backends:
        backends = [v.id for v in VARIANTS.values() if v.needs_gpu] if gpus_visible else ["shm"]
        if gpus_visible == 1:
            backends = [b for b in backends if VARIANTS[b].engine != "nccl"]
    backends = list(dict.fromkeys(backends))
    unknown = [b for b in backends if b not in VARIANTS]
    if unknown:
        raise BadInput(f"--vllm-backend: unknown {', '.join(unknown)}; known: "
                       f"{', '.join(VARIANTS)}")
    cases_by_backend = []
    for b in backends:
        try:
            cases_by_backend.append(make_case(b, layout, dtype, "sized"))
        except ValueError as e:
            raise BadInput(f"--vllm-layout: {e}") from None
    short = [f"{c.backend.id} needs {c.layout.gpus_needed} (layout {c.layout.name})"
             for c in cases_by_backend if c.layout.gpus_needed > gpus_visible]
    if short:
        raise BadInput(f"this host has {gpus_visible} GPU{'s' if gpus_visible != 1 else ''} "
                       f"visible; {'; '.join(short)}. Run the GPU backends on a GPU host, "
                       "or --vllm-backend shm here")
    gpu = any(c.layout.server_gpus for c in cases_by_backend)
    sizes = parse_sizes(sizes_text or (GPU_SIZES if gpu else CPU_SIZES))
    return Plan(cases=cases_by_backend, sizes=sizes, dtype=dtype, warm=warm,
                gpus_needed=max(c.layout.gpus_needed for c in cases_by_backend))


def host_header(plan: Plan, args: argparse.Namespace, gpus_visible: int) -> dict:
    from . import layouts
    from .facts import dist_version, installed_vllm

    version, dist = installed_vllm()
    return {
        "vllm": {"version": version, "dist": dist},
        "torch": dist_version("torch"), "transformers": dist_version("transformers"),
        "harness": dist_version("weight-sync-harness"),
        "python": platform.python_version(), "platform": platform.platform(),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "gpus": {"present": gpus_visible, "used": plan.gpus_needed,
                 "names": layouts.gpu_names()[:plan.gpus_needed]},
        "options": {"backends": [c.backend.id for c in plan.cases],
                    "layouts": sorted({c.layout.name for c in plan.cases}),
                    "sizes_gb": plan.sizes, "dtype": plan.dtype, "warm": plan.warm,
                    "limit_reps": args.limit_reps, "max_servers": args.vllm_max_servers,
                    "start_timeout": args.vllm_start_timeout,
                    "sync_timeout": args.vllm_sync_timeout},
        "argv": ["harness"] + sys.argv[1:],
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("NCCL_", "CUDA_VISIBLE_DEVICES", "HARNESS_"))},
        "start_time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "complete": False,
    }


class BenchRun:
    """One ``harness bench`` run: models, raw limits, servers in waves, trainers, syncs."""

    def __init__(self, plan: Plan, args: argparse.Namespace, doc: dict, out: Path):
        self.plan, self.args, self.doc, self.out = plan, args, doc, out
        self.json_path = out / "bench.json"
        self.progress = Progress(total=len(plan.cases) * len(plan.sizes) * (1 + plan.warm))
        self.t0 = time.monotonic()

    def save(self) -> None:
        self.doc["header"]["wall_seconds"] = round(time.monotonic() - self.t0, 1)
        write_json(self.doc, self.json_path)

    # ------------------------------------------------------------------ models, limits
    def build_models(self) -> dict[float, Path]:
        from . import models

        per = {"float32": 4, "bfloat16": 2}[self.plan.dtype]
        dirs = {}
        for gb in self.plan.sizes:
            d = models.sized_model_dir(int(gb * GB), self.plan.dtype)
            cfg = models.sized_config(int(gb * GB), self.plan.dtype)
            params = models.config_params(cfg)
            self.doc["models"].append({
                "size_gb": gb, "name": d.name, "bytes": params * per, "params": params,
                "tensors": 2 + cfg["num_hidden_layers"] * 9 + 1,
                "hidden_size": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                "vocab_size": cfg["vocab_size"], "intermediate_size": cfg["intermediate_size"]})
            dirs[gb] = d
        self.progress.note("models: " + ", ".join(
            f"{m['size_gb']:g} GB ({m['tensors']} tensors)" for m in self.doc["models"]))
        return dirs

    def measure_limits(self) -> None:
        from .rawlimit import PATH_OF_ENGINE, RawLimitError, measure

        sizes = [m["bytes"] for m in self.doc["models"]]
        wanted: dict[tuple, dict] = {}
        for c in self.plan.cases:
            path = PATH_OF_ENGINE[c.backend.engine]
            lay = c.layout
            if path == "host":
                kw: dict = {}
            elif path == "d2d":
                kw = {"device": lay.server_gpus[0]}
            else:
                kw = {"src": lay.trainer_gpu, "dst": list(lay.server_gpus)}
            wanted.setdefault((path, json.dumps(kw, sort_keys=True)), kw)
        for (path, _), kw in wanted.items():
            t = time.monotonic()
            try:
                res = measure(path, sizes, reps=self.args.limit_reps,
                              timeout=self.args.vllm_sync_timeout, **kw)
                res["error"] = None
                rates = ", ".join(f"{s['gbps']:.1f}" for s in res["sizes"])
                self.progress.note(f"raw limit {path}: {res['what']}: {rates} GB/s "
                                   f"({time.monotonic() - t:.0f}s)")
            except RawLimitError as e:
                res = {"path": path, "sizes": [], "error": str(e)}
                self.progress.note(f"raw limit {path}: FAILED: {str(e).splitlines()[0]}")
            res["devices"] = kw
            self.doc["limits"].append(res)
        self.save()

    # ------------------------------------------------------------------ servers, syncs
    def run(self) -> bool:
        """Measure every case; True when one failed (its error is in its record)."""
        from .cases import server_config_for
        from .pool import ServerPool

        dirs = self.build_models()
        self.measure_limits()
        work = []  # (case, size, server config), servers of one engine/size shared
        for gb in self.plan.sizes:
            for c in self.plan.cases:
                work.append((c, gb, server_config_for(c, str(dirs[gb]))))
        configs = list(dict.fromkeys(cfg for _, _, cfg in work))
        gpu = any(cfg.device_ids for cfg in configs)
        per_wave = self.args.vllm_max_servers or min(len(configs), 8 if gpu else 3)
        pool = ServerPool(Path(self.args.vllm_log_dir).resolve(),
                          start_timeout=self.args.vllm_start_timeout, max_alive=per_wave)
        failed = False
        try:
            for i in range(0, len(configs), per_wave):
                wave = configs[i:i + per_wave]
                failed |= self._wave(pool, wave, [w for w in work if w[2] in wave], dirs)
        finally:
            try:
                pool.stop_all()
            except Exception as e:  # never hide the results behind a shutdown problem
                self.progress.note(f"WARNING: stopping the servers: {e}")
            self.save()
        return failed

    def _wave(self, pool, wave: list, work: list, dirs: dict) -> bool:
        from .client import ServerClient
        from .rawlimit import PATH_OF_ENGINE
        from .server import ServerError
        from .trainer import TrainerError, TrainerSpec

        pool.plan(wave)
        t = time.monotonic()
        self.progress.note(f"starting {len(wave)} server{'s' if len(wave) > 1 else ''} side by "
                           f"side: " + "; ".join(cfg.describe() for cfg in wave))
        servers, down = {}, {}
        for cfg in wave:
            try:
                servers[cfg] = pool.get(cfg)
            except ServerError as e:
                down[cfg] = str(e)
            self.doc["servers"].append({
                "config": cfg.describe(), "engine": cfg.backend,
                "start_seconds": servers[cfg].start_seconds if cfg in servers else None,
                "version": servers[cfg].version if cfg in servers else None,
                "log": _rel(servers[cfg].log_path) if cfg in servers else None,
                "error": down.get(cfg, "").splitlines()[0] if cfg in down else None})
        self.progress.note(f"servers ready after {time.monotonic() - t:.0f}s"
                           + (f"; {len(down)} failed to start" if down else ""))
        records, trainers = [], {}
        for case, gb, cfg in work:
            rec = {**case.as_dict(), "model": dirs[gb].name, "size_gb": gb,
                   "limit_path": PATH_OF_ENGINE[case.backend.engine], "error": None,
                   "cold": None, "warm": []}
            records.append(rec)
            self.doc["cases"].append(rec)
            if cfg in down:
                rec["error"] = f"server did not start: {down[cfg]}"
                continue
            srv = servers[cfg]
            spec = TrainerSpec.make(url=srv.url, engine=case.backend.engine,
                                    packed=case.backend.packed, dtype=case.dtype,
                                    device=case.layout.trainer_device,
                                    timeout=self.args.vllm_sync_timeout,
                                    options={"device": case.layout.trainer_device})
            trainers[id(rec)] = pool.trainer(cfg, spec)

        # trainers side by side: imports, CUDA contexts and weights, no route called
        t = time.monotonic()
        ready = [r for r in records if id(r) in trainers]
        with cf.ThreadPoolExecutor(max_workers=max(1, len(ready))) as ex:
            futures = {ex.submit(trainers[id(r)].prepare, str(dirs[r["size_gb"]]),
                                 timeout=self.args.vllm_sync_timeout): r for r in ready}
            for f in cf.as_completed(futures):
                rec = futures[f]
                try:
                    rec["prepare_seconds"] = f.result().get("seconds")
                except (TrainerError, OSError) as e:
                    rec["error"] = f"trainer could not be prepared: {e}"
        if ready:
            self.progress.note(f"{len(ready)} trainer{'s' if len(ready) > 1 else ''} prepared "
                               f"side by side in {time.monotonic() - t:.0f}s")
        self.save()

        failed = bool(down)
        for (case, gb, cfg), rec in zip(work, records):
            if rec["error"]:
                failed = True
                self.progress.done += 1 + self.plan.warm
                continue
            srv = servers[cfg]
            client = ServerClient(srv.url, timeout=self.args.vllm_sync_timeout,
                                  context=srv.describe_failure)
            mem = ServerMemory(cfg.device_ids, lambda srv=srv: process_tree(
                srv.proc.pid if srv.proc else None))
            try:
                self._measure(rec, trainers[id(rec)], client, mem, dirs[gb])
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                failed = True
                self.progress.done += 1 + self.plan.warm - (rec["cold"] is not None) \
                    - len(rec["warm"])  # the syncs it will not make
                self.progress.note(f"{rec['backend']} {gb:g} GB: FAILED: {str(e).splitlines()[0]}")
                # the failed trainer is gone (its group's state is unknown); the server's
                # other variant still gets its turn, with a trainer of its own
            self.save()
        for cfg in wave:
            pool.release(cfg)
        return failed

    def _measure(self, rec: dict, trainer, client, mem: ServerMemory, weights: Path) -> None:
        lim = limit_at(self.doc["limits"], rec["limit_path"],
                       next((m["bytes"] for m in self.doc["models"]
                             if m["size_gb"] == rec["size_gb"]), None))
        try:
            self._syncs(rec, trainer, client, mem, weights)
        finally:  # what was measured before a failure still counts
            rec["summary"] = summarize_case(rec["cold"], rec["warm"],
                                            lim["gbps"] if lim else None)

    def _syncs(self, rec: dict, trainer, client, mem: ServerMemory, weights: Path) -> None:
        label = f"{rec['backend']} {rec['size_gb']:g} GB"
        for i in range(1 + self.plan.warm):
            memory: dict = {}

            def push() -> dict:
                try:
                    return trainer.sync(str(weights), timeout=self.args.vllm_sync_timeout)
                finally:
                    memory.update(mem.stop())

            mem.start()
            run = paused_sync(client, push)
            result, t = run.result, run.timings
            r = sync_record(result, pause_seconds=t.pause_seconds,
                            resume_seconds=t.resume_seconds,
                            pause_to_resume_seconds=t.pause_to_resume_seconds,
                            server_memory=memory)
            if i == 0:
                rec["cold"] = r
                for k in ("tensors", "bytes", "chunks", "api_path"):
                    rec[k] = result.get(k)
                what = (f"cold: {r['pause_to_resume_seconds']:.2f}s pause->resume "
                        f"(init {_f(r['init_seconds'], '{:.2f}')}s)")
            else:
                rec["warm"].append(r)
                what = (f"warm {i}/{self.plan.warm}: send {r['sync_seconds']:.3f}s, "
                        f"{_f(r['gbps'], '{:.2f}')} GB/s")
            self.progress.step(f"{label}: {what}")


def _rel(p: Path | None) -> str | None:
    """A path as the JSON records it: relative to the working directory when under it
    (committed results must not name the machine's directories), else its name."""
    if p is None:
        return None
    try:
        return str(Path(p).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return Path(p).name


# ----------------------------------------------------------------------------- cli

def _uses():
    """The options it shares with pytest, from the one table (harness.settings.OPTIONS)."""
    from .settings import Use

    return (
        Use("vllm_backend", default=None, repeatable=True,
            shown="what this host can run: the GPU backends on a GPU host, else shm"),
        Use("vllm_dtype", default="bfloat16",
            why="the dtype RL trainers sync in, and half the bytes; the tests default to "
                "float32, whose parity tolerance is tight"),
        Use("vllm_layout", default=None,
            shown="each backend's own: cpu for shm, 1gpu-colocated for ipc, 2gpu-split for "
                  "nccl"),
        Use("vllm_max_servers", shown="all of the run, at most 8, on GPUs; 3 on the CPU"),
        Use("vllm_start_timeout"),
        Use("vllm_sync_timeout",
            why="it also bounds a trainer's preparation and one raw-limit measurement"),
        Use("vllm_log_dir", default=".harness-cache/logs/bench"),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .settings import add_command_options

    p.epilog = ("exit code: 0 every case measured, 1 a case failed, 2 bad input. "
                "Compare two runs with: harness diff A/bench.json B/bench.json")
    add_command_options(p, _uses())
    p.add_argument("--sizes", default=None,
                   help=f"model sizes in GB of weights, comma-separated; default {GPU_SIZES} "
                        f"on GPU layouts, {CPU_SIZES} on the CPU")
    p.add_argument("--warm", type=int, default=None,
                   help="warm syncs after the cold one (default 5)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"where bench.json, bench.txt and bench.png go (default {DEFAULT_OUT})")
    p.add_argument("--limit-reps", type=int, default=None,
                   help="timed repetitions of each raw-limit measurement (default 5)")
    p.add_argument("--replot", type=Path, default=None, metavar="BENCH_JSON",
                   help="measure nothing: print the table of a bench file and draw its plot "
                        "(into --out if given, else beside the file)")


def _finish(doc: dict, out: Path) -> None:
    """The table on stdout and in bench.txt; the plot, where matplotlib is installed."""
    text = render_table(doc)
    sys.stdout.write(text)
    (out / "bench.txt").write_text(text)
    try:
        print(f"plot: {write_plot(doc, out / 'bench.png')}")
    except ImportError:
        print("plot: not drawn, matplotlib is not installed (pip install '.[bench]'); "
              f"draw it later with: harness bench --replot {out / 'bench.json'}")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except BadInput as e:
        print(f"harness bench: {e}", file=sys.stderr)
        return 2


# What only a measuring run uses: with --replot, giving one is a mistake.
MEASURING = ("sizes", "warm", "limit_reps")


def _run(args: argparse.Namespace) -> int:
    from .settings import SettingsError, resolve_command

    uses = _uses()
    given = [f"--{n.replace('_', '-')}" for n in [u.name for u in uses] + list(MEASURING)
             if getattr(args, n, None) not in (None, [])]  # on the command line
    try:
        for note in resolve_command(args, uses):
            print(f"harness bench: {note}", file=sys.stderr)
    except SettingsError as e:
        raise BadInput(str(e)) from None
    if args.replot is not None and given:
        raise BadInput(f"--replot measures nothing, so {', '.join(given)} would be ignored "
                       "(--out is the only option it takes)")
    args.warm = 5 if args.warm is None else args.warm
    args.limit_reps = 5 if args.limit_reps is None else args.limit_reps
    if args.replot is not None:
        try:
            doc = load_file(args.replot)
        except BenchFileError as e:
            raise BadInput(str(e)) from None
        out = args.out or args.replot.parent
        out.mkdir(parents=True, exist_ok=True)
        _finish(doc, out)
        return 0
    from . import layouts
    from .facts import installed_vllm

    gpus = layouts.gpu_count()
    plan = make_plan(args.vllm_backend or [], args.sizes, args.vllm_dtype, args.vllm_layout,
                     args.warm, gpus)
    if args.limit_reps < 1:
        raise BadInput(f"--limit-reps: must be at least 1, got {args.limit_reps}")
    if installed_vllm()[0] is None:
        raise BadInput("vLLM is not installed in this Python environment (CPU: bash "
                       "ci/setup.sh; GPU: pip install -e '.[gpu]')")
    out = Path(args.out or DEFAULT_OUT)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--out: {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    doc = new_document(host_header(plan, args, gpus))
    bench = BenchRun(plan, args, doc, out)
    bench.progress.note(f"harness bench: {', '.join(c.id for c in plan.cases)}; sizes "
                        f"{', '.join(f'{s:g}' for s in plan.sizes)} GB; {plan.warm} warm syncs; "
                        f"results in {out}")
    try:
        failed = bench.run()
        doc["header"]["complete"] = True
    except KeyboardInterrupt:  # a job's time limit: keep and show what was measured
        print("harness bench: interrupted; the cases measured so far follow", file=sys.stderr)
        failed = True
    finally:
        bench.save()
    _finish(doc, out)
    print(f"results: {bench.json_path}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return run_command("harness bench", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
