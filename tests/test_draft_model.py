"""Draft-model weights (speculative decoding) through the weight-sync routes.

A server with a draft model (feature ``draft``: ``--speculative-config`` with method
``draft_model``, the test's model as its own draft, both dummy-loaded) proposes
``DRAFT_TOKENS`` tokens a step that the target verifies. vLLM #46725 added
``POST /start_draft_weight_update``: it opens an update like /start_weight_update, and
the /update_weights calls until /finish_weight_update load into the draft model. The
trainer's option ``draft`` opens its updates there.

SkyRL #2194 and miles #1926: a trainer that updates the target only leaves the draft
stale. The target answers right, so no parity check on the target sees it; the
acceptance rate (vLLM's ``vllm:spec_decode_num_accepted_tokens`` over
``vllm:spec_decode_num_draft_tokens``, over a fixed greedy workload) collapses. The
check: after an update of both, the acceptance is what a server whose draft holds the
target's weights has (the model in both, as a fresh server loaded from one checkpoint
for both holds it), within ``ACCEPTANCE_NOISE``; the target matches Hugging Face. Its
self-test updates the target only and must see the check fail, naming the stale draft.

Where the release has no /start_draft_weight_update (it is in 0.26.0 already) the tests
skip saying so; the server's own refusal (an engine that cannot update its draft) is
a failure with vLLM's answer.
"""

from __future__ import annotations

import pytest

from harness.oracles import parity
from harness.vllm.server import DRAFT_TOKENS

pytestmark = [pytest.mark.features("draft"), pytest.mark.models("llama"),
              pytest.mark.dtypes("bfloat16"), pytest.mark.layouts("cpu", "1gpu-colocated"),
              pytest.mark.backends("shm", "ipc-packed")]

ROUTE = "/start_draft_weight_update"
SEEDS = {"both": 4601, "stale": 4611}
# Greedy tokens generated per prompt of the workload, and the widest gap between two
# acceptance rates of the same target and draft that is still noise.
WORKLOAD_TOKENS = 32
ACCEPTANCE_NOISE = 0.1
# How far the target moves in the self-test's training step (perturbed_copy's scale).
STALE_SCALE = 0.05
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PROPOSED = "vllm:spec_decode_num_draft_tokens_total"


def offered(s) -> None:
    paths = s.client.openapi().get("paths", {})
    if ROUTE not in paths:
        pytest.skip(f"{ROUTE} (a draft model's weight update, vLLM #46725): not in vLLM "
                    f"{s.server.version}; first in vLLM 0.26.0")


def spec_counters(s) -> tuple[float, float]:
    got = {ACCEPTED: 0.0, PROPOSED: 0.0}
    for name, _, value in s.client.metrics():
        if name in got:
            got[name] += value
    return got[ACCEPTED], got[PROPOSED]


def acceptance(s, ref) -> float:
    """Accepted / proposed draft tokens over greedy completions of the reference's
    prompts, ``WORKLOAD_TOKENS`` each."""
    a0, p0 = spec_counters(s)
    for pr in ref.prompts:
        s.client.complete(pr.prompt_ids, max_tokens=WORKLOAD_TOKENS)
    a1, p1 = spec_counters(s)
    assert p1 > p0, (f"the server proposed no draft token over {len(ref.prompts)} completions "
                     f"({PROPOSED} {p0} -> {p1}): speculative decoding is not running")
    return (a1 - a0) / (p1 - p0)


def sync_draft(s, weights) -> dict:
    """An update of the draft model (the trainer's option ``draft``)."""
    return s.sync(weights, options={"draft": True})


def assert_draft_current(got: float, expected: float, what: str) -> None:
    if abs(got - expected) > ACCEPTANCE_NOISE:
        raise AssertionError(
            f"{what}: acceptance {got:.3f}, not the {expected:.3f} of a server whose draft "
            f"holds the target's weights (noise {ACCEPTANCE_NOISE}): the draft model is "
            "stale, it does not hold the weights the target was updated to")


def baseline(s, ref_model) -> float:
    """The acceptance of the model as target and as draft (both pushed): the figure an
    update of both must give again."""
    s.sync(s.model_path)
    sync_draft(s, s.model_path)
    return acceptance(s, ref_model)


def test_target_and_draft_updates_keep_the_acceptance_rate(session):
    """The model in both, then new weights in both: the acceptance is the model's within
    noise, the target matches Hugging Face, and the draft proposes tokens at the rate
    of a current draft (DRAFT_TOKENS a step)."""
    s = session
    offered(s)
    ref_model = s.reference()
    expected = baseline(s, ref_model)
    weights = s.perturbed(SEEDS["both"])
    ref = s.reference(weights)
    s.sync(weights)
    sync_draft(s, weights)
    got = acceptance(s, ref)
    s.record(acceptance_model_in_both=round(expected, 4), acceptance_after_both=round(got, 4),
             draft_tokens=DRAFT_TOKENS)
    assert_draft_current(got, expected, "after an update of the target and of the draft")
    parity.assert_parity(s.compare(ref), decode=s.decode,
                         what="the target after an update of the target and of the draft")


@pytest.mark.selftest
def test_a_target_only_update_leaves_a_stale_draft_that_the_check_names(session):
    """SkyRL #2194: the draft holds the model, the target gets new weights, the draft
    does not. The target still matches Hugging Face; the acceptance check must fail,
    naming the stale draft."""
    s = session
    offered(s)
    expected = baseline(s, s.reference())
    weights = s.perturbed(SEEDS["stale"], scale=STALE_SCALE)
    ref = s.reference(weights)
    s.sync(weights)  # the target only
    got = acceptance(s, ref)
    s.record(acceptance_model_in_both=round(expected, 4), acceptance_stale_draft=round(got, 4))
    parity.assert_parity(s.compare(ref), decode=s.decode,
                         what="the target after a target-only update")
    with pytest.raises(AssertionError, match="the draft model is stale"):
        assert_draft_current(got, expected, "after an update of the target only")
    sync_draft(s, weights)  # the next test finds target and draft alike
