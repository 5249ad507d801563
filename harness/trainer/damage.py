"""The damage a broken trainer does on purpose, applied in the trainer's child: its
tensors corrupted (``corrupt_weights``, built on ``harness.portable.corrupt``, which the
repro scripts share) and its update info lying about them (``lie_about``,
``LyingClient``)."""

from __future__ import annotations

from typing import Any

from harness.portable import corrupt as _portable_corrupt
from harness.trainer.handle import FAKE_GPU_UUID, LIES, RANK0_ONLY


# ----------------------------------------------------------------------------- corruptions

def corrupt_weights(weights: list[tuple[str, Any]], kind: str | None, target: str | None = None
                    ) -> tuple[list[tuple[str, Any]], str]:
    """Return (weights, description). Deliberate damage for the self-tests (the
    emitted repro script's own function, so a repro damages exactly what a test did),
    plus the fault tests' ``narrow``; the input list and its tensors are left unchanged."""
    if kind == "row":
        return _bump_last_embedding_row(weights, target)
    if kind != "narrow":
        return _portable_corrupt.corrupt_weights(weights, kind, target)
    names = [n for n, _ in weights]
    if target is not None and target not in names:
        raise ValueError(f"corruption target {target!r} is not a tensor of the model")
    mats = [n for n, t in weights if t.ndim == 2 and "embed" not in n and "wte" not in n]
    pick = target or (mats[len(mats) // 2] if mats else names[len(names) // 2])
    t = dict(weights)[pick]  # a shape the model does not have; the update info agrees
    if t.ndim != 2 or t.shape[1] < 2:
        raise ValueError(f"cannot narrow {pick} of shape {list(t.shape)}")
    return ([(n, t[:, :-1].contiguous() if n == pick else x) for n, x in weights],
            f"sent {pick} as {[t.shape[0], t.shape[1] - 1]} (the model's is {list(t.shape)})")


def _bump_last_embedding_row(weights: list[tuple[str, Any]], target: str | None
                             ) -> tuple[list[tuple[str, Any]], str]:
    names = [n for n, _ in weights]
    embeds = [n for n, t in weights if t.ndim == 2 and ("embed_tokens" in n or "wte" in n)]
    pick = target or (embeds[0] if embeds else None)
    if pick is None or pick not in names:
        raise ValueError(f"corruption 'row': no input embedding among {names[:4]}...")
    t = dict(weights)[pick].clone()
    t[-1] += 1.0
    return ([(n, t if n == pick else x) for n, x in weights],
            f"added 1.0 to row {t.shape[0] - 1} of {pick} (the last token id)")


# ----------------------------------------------------------------------------- lies

def nothing_for(update_info: dict) -> dict:
    """``update_info`` describing no tensor (its other fields, a bucket's path, kept)."""
    return {**update_info, "names": [], "dtype_names": [], "shapes": []}


def lie_about(update_info: dict, lie: str) -> tuple[dict, str]:
    """A copy of ``update_info`` that disagrees with the tensors it describes."""
    if lie not in LIES:
        raise ValueError(f"unknown lie {lie!r}; known: {', '.join(LIES)}")
    info = dict(update_info)
    names, shapes = list(info.get("names") or []), [list(x) for x in info.get("shapes") or []]
    if lie == RANK0_ONLY:
        raise ValueError(f"{RANK0_ONLY} is a lie about the ranks: LyingClient sends it")
    if lie != "gpu" and not names:
        return info, "nothing to lie about (no tensor in this update)"
    if lie == "names":
        info["names"] = ["model.no_such_module.weight"] + names[1:]
        return info, f"announced {names[0]} as model.no_such_module.weight"
    if lie == "shapes":
        shapes[0] = [shapes[0][0] + 1] + shapes[0][1:] if shapes[0] else [2]
        info["shapes"] = shapes
        return info, f"announced {names[0]} with shape {shapes[0]}"
    if lie == "dtypes":
        dtypes = list(info["dtype_names"])
        dtypes[0] = "bfloat16" if dtypes[0] != "bfloat16" else "float32"
        info["dtype_names"] = dtypes
        return info, f"announced {names[0]} as {dtypes[0]}"
    if lie == "count":
        info["shapes"] = shapes[:-1]
        return info, f"{len(names)} names, {len(shapes) - 1} shapes"
    # gpu: every IPC handle keyed by a GPU that does not exist
    import base64
    import pickle

    def rekey(h):
        return [rekey(x) for x in h] if isinstance(h, list) else \
            {FAKE_GPU_UUID: v for v in h.values()} if isinstance(h, dict) else h

    if info.get("ipc_handles_pickled"):
        handles = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(rekey(handles))).decode()
    elif info.get("ipc_handles") is not None:
        info["ipc_handles"] = rekey(info["ipc_handles"])
    else:
        return info, "no IPC handles to re-key (not an IPC update)"
    return info, f"IPC handles keyed by {FAKE_GPU_UUID}"


class LyingClient:
    """The trainer's client with ``lie`` applied to every ``/update_weights``; the
    other calls pass through. ``told`` lists what was said."""

    def __init__(self, client, lie: str):
        self._client, self.lie, self.told = client, lie, []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def update_weights(self, update_info):
        if self.lie == RANK0_ONLY:
            infos = (update_info if isinstance(update_info, list)
                     else [update_info] * self._client.world_size())
            out = [infos[0]] + [nothing_for(u) for u in infos[1:]]
            self.told.append(f"the update to global worker rank 0 only; ranks 1-"
                             f"{len(out) - 1} got one of no tensor")
            return self._client.update_weights(out)
        if isinstance(update_info, list):  # one entry per data-parallel rank
            out = [lie_about(u, self.lie) for u in update_info]
            self.told.append(out[0][1])
            return self._client.update_weights([u for u, _ in out])
        info, what = lie_about(update_info, self.lie)
        self.told.append(what)
        return self._client.update_weights(info)
