"""The seed flow, asserted: dummy weights give gibberish, a sync through the HTTP
control plane makes the server match Hugging Face, and generation pauses around it."""

import threading

import pytest

from harness.oracles import parity
from harness.run.server_weights import State


@pytest.mark.smoke
@pytest.mark.fresh_server
@pytest.mark.trainers("harness", "vllm", "user")  # vLLM's code too (-via-vllm), and yours
def test_gibberish_before_sync(synced):
    # Dummy weights: the server must be far from the trainer's model, by comparison
    # with the reference, not by a string heuristic.
    parity.assert_gibberish(synced.before)


@pytest.mark.smoke
@pytest.mark.fresh_server
@pytest.mark.parity
@pytest.mark.trainers("harness", "vllm", "user")  # vLLM's code too (-via-vllm), and yours
def test_parity_after_sync(synced):
    r = synced.after
    synced.session.record(**r.metrics())
    parity.assert_greedy_equal(r)
    parity.assert_logprobs_close(r, decode=synced.session.decode)


# ----------------------------------------------------------------------------- one server, many variants

def test_a_reset_brings_a_synced_server_back_to_gibberish(session):
    """The variants of one configuration share its server: each seed flow after the
    first runs on weights pushed back to dummy-equivalent ones (``reset_weights``), and
    its "gibberish before" must prove what it proves on a new server."""
    ref = session.reference()
    session.ensure_holds()
    parity.assert_greedy_equal(session.compare(ref))  # synced: the model's behaviour
    session.reset_weights()
    assert session.pool.weights_of(session.server_cfg).fresh
    parity.assert_gibberish(session.compare(ref))
    session.ensure_holds()


@pytest.mark.selftest
def test_the_gibberish_check_fails_after_a_reset_that_changes_nothing(session, monkeypatch):
    """The same check against a reset that pushes the model itself back (a reset that
    does nothing): the server still computes what the trainer's model computes, and
    "gibberish before" must say so."""
    from harness import models

    ref = session.reference()
    session.ensure_holds()
    monkeypatch.setattr(models, "dummy_copy", lambda src, dest_root=None: src)
    session.reset_weights()
    with pytest.raises(AssertionError, match="already matches the reference"):
        parity.assert_gibberish(session.compare(ref))
    session.pool.record_weights(session.server_cfg, State.SYNCED, session.model_path)


@pytest.mark.smoke
@pytest.mark.pause_resume
def test_request_while_paused_waits_for_resume(session):
    prompt = session.reference().prompts[0].prompt_ids
    session.client.pause()
    done = threading.Event()
    result = {}

    def request():
        try:
            result["completion"] = session.client.complete(prompt, max_tokens=4, timeout=120)
        except BaseException as e:  # surfaced below
            result["error"] = e
        done.set()

    t = threading.Thread(target=request, daemon=True)
    try:
        t.start()
        finished_while_paused = done.wait(timeout=3.0)
        assert session.client.is_paused()
    finally:
        session.client.resume()
    assert not finished_while_paused, f"a request sent while paused completed: {result}"
    assert done.wait(timeout=120), "the request held by /pause did not complete after /resume"
    assert "error" not in result, f"the held request failed: {result['error']}"
    c = result["completion"]
    assert c.finish_reason == "length" and len(c.token_ids) == 4, c
    assert not session.client.is_paused()


@pytest.mark.parity
@pytest.mark.models("llama-tied")
@pytest.mark.backends("shm")
def test_tied_lm_head_workaround_restores_parity(session):
    """Known issue cpu-tied-lm-head-stale-after-reload: the shm engine's opt-in
    re-processing of tied modules (what `harness demo` announces and uses on CPU)
    makes a tied model match Hugging Face after a sync, and after each of A -> B -> A
    (tests/test_parity.py's ``a_then_b_then_a``: a re-processing that held only once
    would show at B); on GPU it is a no-op."""
    from test_parity import AB_SEED, a_then_b_then_a  # tests/ is on sys.path

    a_then_b_then_a(session, session.model_path, session.perturbed(AB_SEED),
                    options={"reprocess_tied": True})


# ----------------------------------------------------------------------------- one group, many updates

ROUNDS = 50


@pytest.mark.parity
@pytest.mark.backends("shm", "nccl-packed", "nccl-unpacked", "ipc-packed", "ipc-unpacked")
@pytest.mark.trainers("harness", "vllm", "user")  # vLLM's code too (-via-vllm), and yours
def test_many_syncs_through_one_group(session):
    """RL trainers open the weight-transfer group once and push hundreds of updates
    through it. Fifty updates with different weights go through the server's one
    persistent trainer; after each, the server must compute exactly what that round's
    weights compute (teacher-forced logprobs within the dtype's tolerance, the same
    greedy tokens), so a stale or mixed update in any round fails here. On the vllm
    path each round loads its weights into the trainer's one live module, in place (as
    an optimizer step changes them), and the ModuleSource built at the first sync sends
    them."""
    prompt = session.reference().prompts[0].prompt
    first_init = None
    seconds = []
    for i in range(ROUNDS):
        weights = session.perturbed(seed=5000 + i)
        ref = session.reference(weights, prompts=(prompt,), max_tokens=4)
        result = session.sync(weights)
        if i == 0:
            first_init = result.get("first")
        else:
            assert not result["first"], f"round {i} started a new trainer (and group)"
        seconds.append(result["sync_seconds"])
        r = session.compare(ref)
        try:
            parity.assert_logprobs_close(r, decode=session.decode)
            parity.assert_greedy_equal(r)
        except AssertionError as e:
            raise AssertionError(f"round {i + 1} of {ROUNDS}: {e}") from None
    warm = sorted(seconds[1:])
    session.record(rounds=ROUNDS, first_sync_opened_group=first_init,
                   first_sync_seconds=seconds[0], warm_sync_median_seconds=warm[len(warm) // 2],
                   warm_sync_max_seconds=warm[-1])


@pytest.mark.parity
@pytest.mark.trainers("harness", "vllm", "user")  # vLLM's code too (-via-vllm), and yours
def test_first_sync_on_a_new_group(session):
    """The path every trainer takes once: a new process opens the group
    (/init_weight_transfer_engine) and its very first update must be complete."""
    weights = session.perturbed(seed=5999)
    ref = session.reference(weights)
    result = session.sync(weights, fresh_trainer=True)
    assert result["first"] and result.get("init_seconds") is not None
    r = session.compare(ref)
    session.record(**r.metrics())
    parity.assert_logprobs_close(r, decode=session.decode)
    parity.assert_greedy_equal(r)
