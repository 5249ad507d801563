"""Blocking trainer calls on threads of their own, with a deadline."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

LEFT_BEHIND: list[threading.Thread] = []  # calls still blocked (in NCCL) past their wait
GRACE_S = 5.0  # after one call failed, the time the others get to end


def in_flight(timeout: float, device: str, *calls: tuple[str, Callable[[], Any]]) -> list:
    """Run each (name, fn) at once on a daemon thread (on ``device``: the current CUDA device is
    per thread): their results, else the first failure, else TimeoutError after ``timeout`` s. A
    call stuck in NCCL cannot be interrupted: it is left behind, and main() exits without it."""
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    def body(name: str, fn: Callable[[], Any]) -> None:
        try:
            if device.startswith("cuda"):
                import torch

                torch.cuda.set_device(torch.device(device))
            results[name] = fn()
        except BaseException as e:
            errors[name] = e

    threads = [threading.Thread(target=body, args=c, name=c[0], daemon=True) for c in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while not errors and time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.1)
    for t in threads:
        t.join(GRACE_S if errors else 0)
    stuck = [t for t in threads if t.is_alive()]
    LEFT_BEHIND.extend(stuck)
    if errors:
        failed, error = next(iter(errors.items()))
        if stuck:
            raise RuntimeError(f"{stuck[0].name}: still blocked after {failed} failed; that "
                               f"failure was: {error}") from error
        raise error
    if stuck:
        raise TimeoutError(f"{stuck[0].name}: not done within {timeout:.0f}s")
    return [results[name] for name, _ in calls]
