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
(``harness.transfer.rawlimit``): a host memory copy (shm), a device-to-device copy on the
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

Where it is: the plan and the command line here; the run in ``harness.commands.bench.run``
(each sync through ``harness.run.sync.paused_sync``); the server's GPU memory in
``harness.core.measure``; the table and plot in ``harness.commands.bench.view``; the file format in
``harness.commands.bench.benchfile``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

from harness.commands.bench.benchfile import BenchFileError, new_document
from harness.commands.bench.benchfile import load as load_file
from harness.commands.bench.run import BenchRun, Plan
from harness.commands.bench.view import render_table, write_plot
from harness.core.facts import run_command

CPU_SIZES = "0.05,0.1,0.25"
GPU_SIZES = "0.5,1,2,4"
MAX_SIZE_GB = 1000.0
DEFAULT_OUT = ".harness-cache/bench"


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


# ----------------------------------------------------------------------------- the run

def make_plan(backends: list[str], sizes_text: str | None, dtype: str, layout: str | None,
              warm: int, gpus_visible: int) -> Plan:
    """Everything the run will do, checked before anything starts; BadInput otherwise."""
    from harness.core import facts
    from harness.run.cases import make_case
    from harness.run.layouts import LAYOUTS
    from harness.transfer import VARIANTS, registry

    def layout_gpus(name: str) -> int:
        return LAYOUTS[name].gpus_needed

    try:
        dtype = facts.canonical_dtype(dtype)
    except facts.UnknownDtype as e:
        raise BadInput(f"--vllm-dtype: {e}") from None
    if warm < 1:
        raise BadInput(f"--warm: at least one warm sync is needed, got {warm}")
    if not backends:
        if gpus_visible:  # every GPU variant whose default layout this host holds
            backends = [v.id for v in VARIANTS.values() if v.needs_gpu and layout_gpus(
                registry.backend(v.engine).default_layout) <= gpus_visible]
        else:
            backends = [registry.backend(registry.DEFAULT_ENGINE).variants[0].id]
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
    from harness.core import environment
    from harness.run import layouts

    return {
        **environment.versions(), **environment.host(),
        "gpus": {"present": gpus_visible, "used": plan.gpus_needed,
                 "names": layouts.gpu_names()[:plan.gpus_needed]},
        "options": {"backends": [c.backend.id for c in plan.cases],
                    "layouts": sorted({c.layout.name for c in plan.cases}),
                    "sizes_gb": plan.sizes, "dtype": plan.dtype, "warm": plan.warm,
                    "limit_reps": args.limit_reps, "max_servers": args.vllm_max_servers,
                    "start_timeout": args.vllm_start_timeout,
                    "sync_timeout": args.vllm_sync_timeout},
        "argv": ["harness"] + sys.argv[1:],
        "env": environment.env_vars(("NCCL_", "CUDA_VISIBLE_DEVICES", "HARNESS_")),
        "start_time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "complete": False,
    }


# ----------------------------------------------------------------------------- cli

def _uses():
    """The options it shares with pytest, from the one table (harness.run.settings.OPTIONS)."""
    from harness.commands.options import Use

    return (
        Use("vllm_backend", default=None, repeatable=True,
            shown="what this host can run: the GPU backends on a GPU host, else shm"),
        Use("vllm_dtype", default="bfloat16",
            why="the dtype RL trainers sync in, and half the bytes; the tests default to "
                "float32, whose parity tolerance is tight"),
        Use("vllm_layout", default=None,
            shown="each backend's own (the first of its layouts: harness/transfer/<engine>.py)"),
        Use("vllm_max_servers", shown="all of the run, at most 8, on GPUs; 3 on the CPU"),
        Use("vllm_start_timeout"),
        Use("vllm_sync_timeout",
            why="it also bounds a trainer's preparation and one raw-limit measurement"),
        Use("vllm_log_dir", default=".harness-cache/logs/bench"),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from harness.commands.options import add_command_options

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
    from harness.commands.options import resolve_command
    from harness.run.settings import SettingsError

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
    from harness.core.facts import installed_vllm
    from harness.run import layouts

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
