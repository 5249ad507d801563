"""A trainer of your own (``--vllm-trainer MODULE:ATTRIBUTE``, harness/trainer/user.py),
held to the harness's checks: the example an RL framework would write,
``examples/shm_sender.py``, on the default CPU tier's llama float32 server (no server of
its own): the seed flow (gibberish before, parity after), repeated syncs through one
group, an update while requests are held. Broken on purpose (``SHM_SENDER_DROP``: one
parameter left out of every update), it must fail the parity check.

``--vllm-trainer examples.shm_sender:ShmSender`` runs every trainer-neutral test over it
instead (tests/test_sync.py, test_parity.py, test_pause_resume.py: the ``user`` pin).
"""

from __future__ import annotations

import pytest

from harness.oracles import parity
from harness.run.server_weights import State

EXAMPLE = "examples.shm_sender:ShmSender"
DROP_ENV = "SHM_SENDER_DROP"
# The only weight of its module: left out, the layer keeps what it held (a stale tensor).
DROP_TARGET = "model.layers.0.mlp.down_proj.weight"
ROUNDS = 5

# the default CPU tier's llama float32 server: no server of its own
pytestmark = [pytest.mark.backends("shm"), pytest.mark.layouts("cpu"), pytest.mark.models("llama"),
              pytest.mark.dtypes("float32"), pytest.mark.trainers(EXAMPLE)]


@pytest.mark.fresh_server
@pytest.mark.parity
def test_the_example_seed_flow(synced):
    """Dummy weights give gibberish; the example's sync makes the server match Hugging
    Face (greedy tokens and teacher-forced logprobs)."""
    parity.assert_gibberish(synced.before)
    r = synced.after
    synced.session.record(**r.metrics(), trainer_api=synced.trainer.get("api_path"))
    parity.assert_greedy_equal(r)
    parity.assert_logprobs_close(r, decode=synced.session.decode)


@pytest.mark.parity
def test_the_example_syncs_again_through_one_group(session):
    """Rounds of new weights through the example's one group (init once); after each the
    server computes what that round's weights compute."""
    prompt = session.reference().prompts[0].prompt
    for i in range(ROUNDS):
        weights = session.perturbed(seed=7000 + i)
        ref = session.reference(weights, prompts=(prompt,), max_tokens=4)
        result = session.sync(weights)
        assert i == 0 or not result["first"], f"round {i} opened a new group"
        r = session.compare(ref)
        try:
            parity.assert_logprobs_close(r, decode=session.decode)
            parity.assert_greedy_equal(r)
        except AssertionError as e:
            raise AssertionError(f"round {i + 1} of {ROUNDS}: {e}") from None


@pytest.mark.pause_resume
def test_the_example_updates_while_requests_are_held(session):
    """tests/test_pause_resume.py's check (keep mode: requests held by /pause, the
    example's update, /resume; new requests see the new weights), over the example."""
    import test_pause_resume  # tests/ is on sys.path (pytest's rootdir-relative import)

    test_pause_resume.test_weight_update_while_requests_held(session, "keep", 13)


@pytest.mark.selftest
def test_the_example_broken_on_purpose_fails_the_parity_check(session):
    """The example with its drop switch on (``SHM_SENDER_DROP``) leaves one parameter
    out: after weights that differ from the model in every tensor, its sync of the model
    leaves that one stale, and the parity check must fail, naming the position."""
    s = session
    ref = s.reference()
    full = s.sync(s.perturbed(seed=7100))  # every tensor differs from the reference now
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DROP_ENV, DROP_TARGET)
        broken = s.sync(fresh_trainer=True)  # a new trainer process, with the switch on
    s.pool.record_weights(s.server_cfg, State.CORRUPTED, s.model_path)  # repaired afterwards
    assert broken["tensors"] == full["tensors"] - 1, (broken["tensors"], full["tensors"])
    assert DROP_TARGET in broken["corruption"], broken["corruption"]
    report = s.compare(ref)
    s.record(corruption=broken["corruption"], corrupted_max_abs_dlogprob=report.max_abs)
    with pytest.raises(AssertionError) as excinfo:
        parity.assert_logprobs_close(report, decode=s.decode)
    assert f"position {report.worst.position}" in str(excinfo.value), str(excinfo.value)
