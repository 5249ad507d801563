"""Blocking trainer calls on threads of their own, with a deadline."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

LEFT_BEHIND: list[threading.Thread] = []  # calls still blocked (in NCCL) past their wait
GRACE_S = 5.0  # after one call failed, the time the others get to end


class StepTimeout(TimeoutError):
    """A call was not done in time, or still blocked after another one failed."""


def in_flight(timeout: float, device: str, *calls: tuple[str, Callable[[], Any]],
              watch: Any = None) -> list:
    """Run each (name, fn) at once on a daemon thread (on ``device``: the current CUDA device is
    per thread): their results, else the first failure, else StepTimeout after ``timeout`` s. A
    call stuck in NCCL cannot be interrupted: it is left behind, and main() exits without it.
    ``watch``: the harness's client, whose ``failed`` event ends the wait as a failure does."""
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

    def peer_failed() -> bool:  # a route vLLM called on a thread of its own failed
        return watch is not None and watch.failed.is_set()

    threads = [threading.Thread(target=body, args=c, name=c[0], daemon=True) for c in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    while not errors and not peer_failed() and time.monotonic() < deadline \
            and any(t.is_alive() for t in threads):
        time.sleep(0.1)
    for t in threads:
        t.join(GRACE_S if errors or peer_failed() else 0)
    stuck = [t for t in threads if t.is_alive()]
    LEFT_BEHIND.extend(stuck)
    # [region harness]
    if stuck and not errors and peer_failed():
        raise StepTimeout(f"{stuck[0].name}: still blocked {GRACE_S:.0f}s after "
                           f"{watch.error_route} failed, so the server side will not join it; "
                           f"that failure was: {watch.error}") from watch.error
    # [end]
    if errors:
        failed, error = next(iter(errors.items()))
        if stuck:
            raise StepTimeout(f"{stuck[0].name}: still blocked after {failed} failed; "
                               f"that failure was: {error}") from error
        raise error
    if stuck:
        said = f" (HTTP calls so far: {', '.join(watch.calls) or 'none'})" if watch else ""
        raise StepTimeout(f"{stuck[0].name}: not done within {timeout:.0f}s{said}")
    return [results[name] for name, _ in calls]
