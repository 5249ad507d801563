"""The comparison math of harness.oracles.parity on hand-made references: top-k ties, non-finite
values, the exact server-to-server comparison, a stale continuation. No server."""

from __future__ import annotations

import pytest

from harness.oracles import parity


# ----------------------------------------------------------------------------- the checks themselves
# Pure logic, no server: what the comparison module accepts and what it reports.

def _ref(dtype="float32"):
    from harness.oracles.reference import PromptReference, Reference

    pr = PromptReference(
        prompt="p", prompt_ids=[1, 2], greedy_ids=[3, 4],
        token_logprobs=[None, -1.0, -0.5, -0.7],
        top_logprobs=[None, {2: -1.0, 5: -1.2, 6: -2.0}, {3: -0.5, 7: -1.5, 8: -3.0},
                      {4: -0.7, 9: -0.9, 10: -4.0}],
        greedy_text="")
    return Reference("(unit)", dtype, [pr])


def _rows(**changes):
    rows = [None, {2: -1.0, 5: -1.2, 6: -2.0}, {3: -0.5, 7: -1.5, 8: -3.0},
            {4: -0.7, 9: -0.9, 10: -4.0}]
    for key, row in changes.items():
        rows[int(key[1:])] = row
    return rows


def test_topk_tie_at_kth_place_is_allowed_a_real_miss_is_not():
    ref = _ref()
    # token 6 (hf -2.0) swaps with token 11 at the k-th place within the tolerance
    tie = parity.compare([parity.Observation([3, 4], _rows(p1={2: -1.0, 5: -1.2, 11: -2.00005}))], ref)
    parity.assert_topk_close(tie)
    # vLLM ranks token 11 at -1.3 where hf's 3rd is -2.0: hf cannot have it there
    miss = parity.compare([parity.Observation([3, 4], _rows(p1={2: -1.0, 5: -1.2, 11: -1.3}))], ref)
    with pytest.raises(AssertionError, match=r"position 1 .*vllm top-3 token 11"):
        parity.assert_topk_close(miss)
    # a shared candidate off by more than the tolerance names its position and both values
    off = parity.compare([parity.Observation([3, 4], _rows(p2={3: -0.5, 7: -1.6, 8: -3.0}))], ref)
    with pytest.raises(AssertionError, match=r"position 2 .*token 7: vllm logprob -1\.6, hf "
                                             r"logprob -1\.5"):
        parity.assert_topk_close(off)


def test_nonfinite_anywhere_in_a_row_is_reported():
    ref = _ref()
    r = parity.compare([parity.Observation([3, 4], _rows(p3={4: -0.7, 9: float("nan"),
                                                              10: -4.0}))], ref)
    with pytest.raises(AssertionError, match=r"position 3 .*non-finite vllm logprob nan"):
        parity.assert_finite(r)


def test_compare_servers_is_exact():
    ref = _ref()
    a = [parity.Observation([3, 4], _rows())]
    same = parity.compare_servers(a, [parity.Observation([3, 4], _rows())], ref)
    assert same.max_abs == 0.0 and same.tokens_compared == 9 and not same.missing
    parity.assert_logprobs_close(same, tolerance=0.0)
    ulp = -0.7 - 1.2e-16 * 4  # one float64 step away
    b = [parity.Observation([3, 4], _rows(p3={4: ulp, 9: -0.9, 10: -4.0}))]
    diff = parity.compare_servers(a, b, ref)
    assert diff.max_abs > 0
    with pytest.raises(AssertionError, match=r"position 3 .*synced logprob -0\.7, twin logprob"):
        parity.assert_logprobs_close(diff, tolerance=0.0)
    greedy = parity.compare_servers(a, [parity.Observation([3, 5], _rows())], ref)
    assert greedy.greedy_divergence and "generated token 1" in greedy.greedy_divergence[0]


def test_compare_generation_sees_a_stale_continuation():
    ref = _ref()
    fresh = parity.compare_generation([([3, 4], [-0.5, -0.7])], ref)
    parity.assert_logprobs_close(fresh)
    parity.assert_greedy_equal(fresh)
    stale = parity.compare_generation([([3, 4], [-0.5, -0.9])], ref)
    with pytest.raises(AssertionError, match=r"position 3 \(generated token 1\)"):
        parity.assert_logprobs_close(stale)
    diverged = parity.compare_generation([([7, 4], [-1.5, -0.7])], ref)
    with pytest.raises(AssertionError, match="no token was compared"):
        parity.assert_logprobs_close(diverged)
    with pytest.raises(AssertionError, match="generated token 0"):
        parity.assert_greedy_equal(diverged)
