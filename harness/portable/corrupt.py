"""The deliberate corruptions of the parity self-tests.

The harness's trainer damages its weights with these, and so does an emitted repro script,
which holds only its scenario's kind (region ``corrupt_<kind>``) and none of what only
the harness asks for (region ``harness``: no corruption, a named target)."""

from __future__ import annotations

from typing import Any

# [region harness]
CORRUPTIONS = ("drop", "scale", "swap", "nothing", "nan")
# [end]


def corrupt_weights(weights: list[tuple[str, Any]], kind: str | None, target: str | None = None
                    ) -> tuple[list[tuple[str, Any]], str]:
    """Deliberate damage, as the harness's trainer does it; returns (weights, what)."""
    # [region harness]
    if kind is None:
        return weights, "none"
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; known: {', '.join(CORRUPTIONS)}")
    # [end]
    # [region harness corrupt_drop corrupt_scale corrupt_nan corrupt_swap]
    names = [n for n, _ in weights]
    # [region harness]
    if target is not None and target not in names:
        raise ValueError(f"corruption target {target!r} is not a tensor of the model")
    # [end]
    # the middle matrix, embeddings aside
    mats = [n for n, t in weights if t.ndim == 2 and "embed" not in n and "wte" not in n]
    pick = target or (mats[len(mats) // 2] if mats else names[len(names) // 2])
    # [end]
    # [region corrupt_nothing]
    if kind == "nothing":
        return [], "sent no tensor at all"
    # [end]
    # [region corrupt_drop]
    if kind == "drop":
        return [(n, t) for n, t in weights if n != pick], f"dropped {pick}"
    # [end]
    # [region corrupt_scale]
    if kind == "scale":
        return [(n, t * 1.01 if n == pick else t) for n, t in weights], f"scaled {pick} by 1.01"
    # [end]
    # [region corrupt_nan]
    if kind == "nan":  # what a diverged training step pushes
        return [(n, t * float("nan") if n == pick else t) for n, t in weights], f"set {pick} to NaN"
    # [end]
    # [region corrupt_swap]
    # swap: ``pick`` and the first other tensor of its shape trade names (where none has its
    # shape, the first two tensors that share one do)
    shape = {n: tuple(t.shape) for n, t in weights}
    same = [n for n in names if n != pick and shape[n] == shape[pick]]
    # [region harness]
    if target is not None and not same:
        raise ValueError(f"no other tensor has the shape of {target}: cannot swap it")
    # [end]
    pairs = ((a, b) for i, a in enumerate(names) for b in names[i + 1:] if shape[a] == shape[b])
    a, b = (pick, same[0]) if same else next(pairs, (None, None))
    if b is None:
        raise ValueError("no two tensors share a shape: cannot swap")
    return [(b if n == a else a if n == b else n, t) for n, t in weights], f"swapped {a} and {b}"
    # [end]
