"""What a trainer holds on its device: its weights (``Weights``, the last two weight
sets loaded, so that a test switching between two reloads neither) and the peak of its
CUDA memory during a sync (``CudaPeak``)."""

from __future__ import annotations

from typing import Any


class Weights:
    """The trainer's models, loaded on its device, the last two kept: a test that
    switches between two weight sets does not reload either."""

    def __init__(self, dtype: str, device: str):
        self.dtype, self.device = dtype, device
        self.cache: dict[str, list] = {}

    def get(self, weights_dir: str) -> list[tuple[str, Any]]:
        if weights_dir not in self.cache:
            from harness.models import sized

            if sized.is_weightless(weights_dir):  # harness bench: sizes, not values
                self.cache[weights_dir] = sized.random_weights(weights_dir, self.dtype,
                                                                self.device)
            else:
                from harness.oracles.reference import load_hf_model

                model = load_hf_model(weights_dir, self.dtype, self.device)
                self.cache[weights_dir] = [(n, p.detach()) for n, p in model.named_parameters()]
            while len(self.cache) > 2:
                self.cache.pop(next(iter(self.cache)))
        return self.cache[weights_dir]



class CudaPeak:
    """The trainer's extra CUDA memory during one update: peak allocated (and reserved)
    above what was allocated when it was made, and what the update kept. Nothing on a
    CPU trainer."""

    def __init__(self, device: str):
        self.device = device if device.startswith("cuda") else None
        if self.device:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated = torch.cuda.memory_allocated(self.device)
            self.reserved = torch.cuda.memory_reserved(self.device)

    def facts(self) -> dict[str, int]:
        if not self.device:
            return {}
        import torch

        torch.cuda.synchronize(self.device)
        return {"trainer_peak_extra_bytes":
                torch.cuda.max_memory_allocated(self.device) - self.allocated,
                "trainer_peak_reserved_extra_bytes":
                torch.cuda.max_memory_reserved(self.device) - self.reserved,
                "trainer_retained_bytes": torch.cuda.memory_allocated(self.device) - self.allocated}
