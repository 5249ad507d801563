"""A ``harness bench`` result file (``bench.json``) and the numbers it holds.

``harness bench`` writes it and ``harness diff`` compares two of them; both read it
through this module, which imports nothing heavy. The file::

    {"kind": "harness-bench", "schema": 1,
     "header": {vllm, torch, harness, python, machine, cpu_model, cpu_count,
                gpus: {present, used, names}, options: {backends, layouts, sizes_gb,
                dtype, warm, ...}, argv, env, start_time, wall_seconds, complete},
     "models": [{size_gb, name, bytes, params, tensors, hidden_size, layers, ...}],
     "limits": [{path: host|d2d|nccl, what, devices, error,
                 sizes: [{bytes, samples, seconds, gbps, median_seconds, median_gbps}]}],
     "servers": [{config, engine, start_seconds, version, log, error}],
     "cases": [{backend, engine, packed, layout, dtype, size_gb, model, limit_path,
                bytes, tensors, chunks, api_path, prepare_seconds, error,
                cold: SYNC, warm: [SYNC, ...], summary: SUMMARY}]}

    SYNC: sync_seconds (the trainer's send), init_seconds (cold: opening the group),
          pause_seconds, resume_seconds, pause_to_resume_seconds,
          phases: {start, update, finish}, bytes, tensors, chunks, update_calls, gbps,
          trainer_peak_extra_bytes, trainer_peak_reserved_extra_bytes,
          trainer_retained_bytes, server_peak_extra_bytes, server_retained_bytes,
          server_memory_method (process | device | none; null on a CPU server)
    SUMMARY: see ``summarize_case``.

Sizes and rates are decimal: GB = 1e9 bytes, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable

from harness.core import reportfile

KIND = "harness-bench"
SCHEMA = 1
GB = 1e9
MIB = 1 << 20
PHASES = ("start", "update", "finish")


class BenchFileError(ValueError):
    """Not a bench file this harness can read; the message names the file and why."""


def stats(values: Iterable[float | None]) -> dict[str, Any] | None:
    """n, median, min, max, mean and the relative spread ((max - min) / median) of the
    values that are numbers; None when there are none."""
    vals = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not vals:
        return None
    med = statistics.median(vals)
    return {"n": len(vals), "median": med, "min": min(vals), "max": max(vals),
            "mean": statistics.fmean(vals),
            "spread": (max(vals) - min(vals)) / med if med > 0 else None}


def phases_from_spans(spans: list) -> dict[str, float] | None:
    """Phases of one update from the trainer's HTTP spans ``(route, start, end)``:
    start (``/start_weight_update``), update (from the end of start to the beginning of
    finish: every ``/update_weights`` and the data moved beside them), finish
    (``/finish_weight_update``). None when the update did not call both."""
    starts = [s for s in spans if s[0] == "/start_weight_update"]
    finishes = [s for s in spans if s[0] == "/finish_weight_update"]
    if not starts or not finishes:
        return None
    s, f = starts[0], finishes[-1]
    return {"start": s[2] - s[1], "update": max(0.0, f[1] - s[2]), "finish": f[2] - f[1]}


def rate(nbytes: int | None, seconds: float | None) -> float | None:
    """GB/s, or None without both numbers."""
    if not nbytes or not seconds or seconds <= 0:
        return None
    return nbytes / seconds / GB


def ratio(gbps: float | None, limit_gbps: float | None) -> float | None:
    """A sync's rate as a fraction of its path's raw limit."""
    if gbps is None or not limit_gbps:
        return None
    return gbps / limit_gbps


_TRAINER_MEM = ("trainer_peak_extra_bytes", "trainer_peak_reserved_extra_bytes",
                "trainer_retained_bytes")


def sync_record(result: dict, *, pause_seconds: float, resume_seconds: float,
                pause_to_resume_seconds: float, server_memory: dict | None = None) -> dict:
    """One sync, from the trainer's result and the times around it."""
    rec = {"sync_seconds": result.get("sync_seconds"),
           "init_seconds": result.get("init_seconds"),
           "pause_seconds": pause_seconds, "resume_seconds": resume_seconds,
           "pause_to_resume_seconds": pause_to_resume_seconds,
           "phases": phases_from_spans(result.get("http_spans") or []),
           "bytes": result.get("bytes"), "tensors": result.get("tensors"),
           "chunks": result.get("chunks"), "update_calls": result.get("update_calls"),
           "gbps": rate(result.get("bytes"), result.get("sync_seconds"))}
    rec.update({k: result[k] for k in _TRAINER_MEM if k in result})
    rec.update(server_memory or {})
    return rec


def _max(records: list[dict], key: str) -> Any:
    vals = [r.get(key) for r in records if isinstance(r.get(key), (int, float))]
    return max(vals) if vals else None


def summarize_case(cold: dict | None, warm: list[dict], limit_gbps: float | None) -> dict:
    """A case's numbers: ``gbps`` (bytes / the median warm send), ``limit_gbps`` and
    ``ratio`` (gbps over the limit); ``warm_sync_seconds`` and
    ``warm_pause_to_resume_seconds`` (``stats``); ``phases`` (warm medians); the cold
    sync's ``cold_init_seconds``, ``cold_sync_seconds``, ``cold_pause_to_resume_seconds``;
    the largest ``server_peak_extra_bytes``, ``server_retained_bytes`` and
    ``trainer_peak_extra_bytes`` of the warm syncs, and the cold sync's."""
    warm_sync = stats(r.get("sync_seconds") for r in warm)
    nbytes = (warm[0] if warm else cold or {}).get("bytes")
    gbps = rate(nbytes, warm_sync["median"]) if warm_sync else None
    phases = {}
    for name in PHASES:
        s = stats((r.get("phases") or {}).get(name) for r in warm)
        phases[name] = s["median"] if s else None
    cold = cold or {}
    return {
        "bytes": nbytes, "gbps": gbps, "limit_gbps": limit_gbps, "ratio": ratio(gbps, limit_gbps),
        "warm_sync_seconds": warm_sync,
        "warm_pause_to_resume_seconds": stats(r.get("pause_to_resume_seconds") for r in warm),
        "phases": phases,
        "cold_init_seconds": cold.get("init_seconds"),
        "cold_sync_seconds": cold.get("sync_seconds"),
        "cold_pause_to_resume_seconds": cold.get("pause_to_resume_seconds"),
        "server_peak_extra_bytes": _max(warm, "server_peak_extra_bytes"),
        "server_retained_bytes": _max(warm, "server_retained_bytes"),
        "trainer_peak_extra_bytes": _max(warm, "trainer_peak_extra_bytes"),
        "cold_server_peak_extra_bytes": cold.get("server_peak_extra_bytes"),
        "cold_trainer_peak_extra_bytes": cold.get("trainer_peak_extra_bytes"),
        "server_memory_method": next((r.get("server_memory_method") for r in warm
                                     if r.get("server_memory_method")), None),
    }


def limit_at(limits: list[dict], path: str, nbytes: int | None) -> dict | None:
    """The raw-limit record of ``path`` measured at ``nbytes`` (the nearest size)."""
    for lim in limits:
        if lim.get("path") == path and lim.get("sizes") and nbytes:
            return min(lim["sizes"], key=lambda s: abs(math.log(s["bytes"] / nbytes)))
    return None


def case_key(case: dict) -> tuple[str, str, str, float]:
    """What identifies a case across runs: backend, layout, dtype, requested size."""
    return (case["backend"], case["layout"], case["dtype"], round(float(case["size_gb"]), 6))


# ----------------------------------------------------------------------------- the file

def new_document(header: dict) -> dict:
    return {"kind": KIND, "schema": SCHEMA, "header": header, "models": [], "limits": [],
            "servers": [], "cases": []}


def load(path: Path) -> dict:
    """A bench file, checked; BenchFileError names what is wrong with it."""
    try:
        doc = json.loads(reportfile.read_text(path))
    except FileNotFoundError:
        raise BenchFileError(f"cannot read {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or e
        raise BenchFileError(f"cannot read {path}: {why}") from None
    except json.JSONDecodeError as e:
        raise BenchFileError(f"cannot read {path}: not JSON (line {e.lineno} column "
                             f"{e.colno})") from None
    except ValueError as e:  # gzip that does not decompress
        raise BenchFileError(f"cannot read {path}: {e}") from None
    check(doc, path)
    return doc


def check(doc: Any, path: Any = "bench file") -> None:
    """Refuse what is not a bench file of a schema this harness reads."""
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise BenchFileError(f"{path}: not a harness bench file (kind {KIND!r}; write one "
                             "with harness bench --out DIR)")
    if not isinstance(doc.get("schema"), int) or doc["schema"] > SCHEMA:
        raise BenchFileError(f"{path}: bench schema {doc.get('schema')!r}; this harness "
                             f"reads up to {SCHEMA}")
    if not isinstance(doc.get("cases"), list) or not isinstance(doc.get("header"), dict):
        raise BenchFileError(f"{path}: a bench file needs 'header' and 'cases'")
    for i, c in enumerate(doc["cases"]):
        if not isinstance(c, dict) or not all(k in c for k in ("backend", "layout", "dtype",
                                                                "size_gb")):
            raise BenchFileError(f"{path}: case {i} lacks backend, layout, dtype or size_gb")


def write_json(doc: dict, path: Path) -> None:
    """Written whole, then renamed: a run killed mid-write leaves the previous file."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    tmp.replace(path)
