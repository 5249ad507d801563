"""A blocking step of the trainer on a thread of its own, waited for with a deadline."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Step:
    """``fn()`` on a daemon thread (on ``device``: the current CUDA device is per
    thread). A call stuck inside NCCL cannot be interrupted: past its deadline it is
    left behind, and main() ends the process without waiting for it."""

    left_behind: list[Step] = []

    def __init__(self, name: str, fn: Callable[[], Any], device: str | None = None):
        self.name, self.value, self.error = name, None, None
        self.done = threading.Event()

        def body() -> None:
            try:
                if device and device.startswith("cuda"):
                    import torch

                    torch.cuda.set_device(torch.device(device))
                self.value = fn()
            except BaseException as e:
                self.error = e
            finally:
                self.done.set()

        self.thread = threading.Thread(target=body, name=name, daemon=True)
        self.thread.start()

    def result(self, timeout: float, peers: tuple[Step, ...] = ()) -> Any:
        """Wait; a peer that failed (the HTTP call on the other side of a collective)
        ends the wait after 5 s of grace instead of at the deadline."""
        deadline = time.monotonic() + timeout
        while not self.done.wait(0.1):
            failed = next((p for p in peers if p.done.is_set() and p.error is not None), None)
            if failed is not None and not self.done.wait(5.0):
                Step.left_behind.append(self)
                raise RuntimeError(f"{self.name}: still blocked after {failed.name} failed; "
                                   f"that failure was: {failed.error}") from failed.error
            if time.monotonic() > deadline:
                Step.left_behind.append(self)
                raise TimeoutError(f"{self.name}: not done within {timeout:.0f}s")
        if self.error is not None:
            raise self.error
        return self.value
