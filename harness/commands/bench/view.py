"""``harness bench``'s views of a bench file: the text table and the plot.

``render_table`` is what a run prints and writes to ``bench.txt``; ``write_plot``
draws ``bench.png`` (matplotlib, ``pip install '.[bench]'``); ``plot_series`` is the
plot as numbers. ``harness bench --replot`` calls them on a finished run's file.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from harness.commands.bench.benchfile import GB, MIB, PHASES, rate
from harness import transfer
from harness.core import text
from harness.transfer import registry

WIDTH = 120


# ----------------------------------------------------------------------------- table

def _f(v: Any, fmt: str = "{:.3g}", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return fmt.format(v)


def _mib(v: Any) -> str:
    return "-" if v is None else f"{v / MIB:.0f}"


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Columns at their natural widths (a bench table is read whole, never wrapped)."""
    return text.table(headers, rows, None, right=right)


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

# One colour per variant, in the registry's order; a raw limit takes its backend's first.
_PALETTE = ("#1f77b4", "#6baed6", "#2ca02c", "#98df8a", "#d62728", "#ff9896", "#9467bd",
            "#c5b0d5", "#8c564b", "#c49c94")


def _color(variant_id: str) -> str:
    ids = list(transfer.VARIANTS)
    return _PALETTE[ids.index(variant_id) % len(_PALETTE)] if variant_id in ids else "gray"


def _limit_style(path_name: str) -> tuple[str, str]:
    """(colour, words) of a raw-limit path, from the backend that measures it."""
    for b in registry.backends().values():
        if b.raw_limit == path_name:
            return _color(b.variants[0].id), b.raw_limit_words or path_name
    return "gray", path_name


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
        color = _color(name)
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
        (color, words), style = _limit_style(path_name), "--"
        ax.plot(lim["x"], lim["y"], linestyle=style, color=color, alpha=0.6, marker="x",
                label=f"limit: {words}")
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
