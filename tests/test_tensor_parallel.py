"""A tensor-parallel server: every rank must take every update.

Each TP worker receives the full tensors of an update and keeps its own shard, so a
bug that updates one rank only (a wrong rank offset, a shard loaded into the wrong
rank, a rank left behind) leaves a server whose greedy text may still look right for a
while but whose logprobs do not: the checks here are teacher-forced logprobs at the
float32 tolerance after every round, not text.

`cpu-tp2` runs this path on any host (two CPU ranks, the reference backend);
`3gpu-tp2` is the GPU layout (ranks on GPUs 0-1, an NCCL trainer on GPU 2), selected
where three GPUs are visible.
"""

from __future__ import annotations

import pytest

from harness.oracles import parity

pytestmark = [pytest.mark.parity, pytest.mark.layouts("cpu-tp2", "3gpu-tp2"),
              pytest.mark.models("llama"), pytest.mark.dtypes("float32")]


@pytest.mark.fresh_server
def test_every_rank_takes_the_first_update(synced):
    assert synced.session.client.world_size() == synced.case.layout.tensor_parallel_size
    parity.assert_gibberish(synced.before)
    r = synced.after
    synced.session.record(**r.metrics())
    parity.assert_logprobs_close(r, decode=synced.session.decode)
    parity.assert_greedy_equal(r)


def test_every_rank_takes_every_later_update(session):
    """Three more rounds with different weights through the same group: a rank that
    took only the first update would still hold round one's weights in round three."""
    for i, seed in enumerate((701, 702, 703)):
        weights = session.perturbed(seed)
        ref = session.reference(weights)
        session.sync(weights)
        r = session.compare(ref)
        session.record(**{f"round{i + 1}_max_abs_dlogprob": r.max_abs})
        try:
            parity.assert_logprobs_close(r, decode=session.decode)
        except AssertionError as e:
            raise AssertionError(f"round {i + 1}: {e}") from None
