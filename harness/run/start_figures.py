"""Figures of a run's server starts, from the pool's records (``ServerPool.started``,
or the workers' merged): how many, their sum, the wall time during which one was
starting, and per serving mode."""

from __future__ import annotations


def start_seconds_by_mode(started: list[dict]) -> dict[str, dict]:
    """Per serving mode: servers started and their start seconds (mean, max), for
    what each mode costs; starts side by side contend for the cores, so compare modes
    within one run."""
    out: dict[str, dict] = {}
    for mode in sorted({s.get("mode", "eager") for s in started}):
        secs = [s["start_seconds"] for s in started
                if s.get("mode", "eager") == mode and s.get("start_seconds") is not None]
        if secs:
            out[mode] = {"servers": len(secs), "mean": round(sum(secs) / len(secs), 1),
                         "max": round(max(secs), 1)}
    return out


def start_figures(started: list[dict]) -> dict:
    total = sum(s["start_seconds"] or 0 for s in started)
    wall, end = 0.0, None
    for a, b in sorted((s["started_at"], s["ready_at"]) for s in started if "ready_at" in s):
        if end is None or a > end:
            wall += b - a
            end = b
        elif b > end:
            wall += b - end
            end = b
    return {"servers_started": len(started), "start_seconds_sum": round(total, 1),
            "start_wall_seconds": round(wall, 1),
            "restarts": sum(1 for s in started if "restart_reason" in s)}
