"""Comparing what vLLM produces with the Hugging Face reference.

Two views of the same weights:
- teacher-forced: vLLM scores the reference's token sequence (prompt logprobs);
  every position is compared with Hugging Face's logprob of the same token, so one
  early difference does not hide the rest, and the worst index is named;
- greedy: vLLM's own continuation must be the reference's token for token, except
  where the reference itself is a near-tie (top-2 margin under ``tie_margin``),
  which numerics may legitimately flip; such ties are reported, not hidden.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from .reference import Reference


@dataclasses.dataclass(frozen=True)
class Tolerance:
    max_abs_logprob: float
    reason: str


# One table, one reason per number. |Δ| is in nats on log-softmax values.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(1e-4, "float32 on both sides: only summation order differs between "
                               "vLLM's kernels and PyTorch's (measured 1e-6..4e-6 on CPU and "
                               "on H200 with FLEX_ATTENTION); 1e-4 leaves 25x headroom and "
                               "still catches a single perturbed tensor"),
    "bfloat16": Tolerance(0.15, "bfloat16 keeps 8 mantissa bits: each matmul rounds at ~4e-3 "
                                "relative, and vLLM fuses/reorders differently from PyTorch. "
                                "Calibrated from measurements (docs/tolerances.md): observed max "
                                "stays well under 0.15 on the zoo; gibberish is > 1"),
    "float16": Tolerance(0.05, "float16 keeps 11 mantissa bits; between bf16 and fp32"),
}
GIBBERISH_MIN_MEAN_ABS = 1.0  # nats; dummy weights sit at ~log(vocab) from every reference token


def tolerance_for(dtype: str) -> Tolerance:
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype!r}; known: {', '.join(TOLERANCES)}") from None


@dataclasses.dataclass
class Observation:
    """What the server produced for one reference prompt."""

    greedy_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None]  # over the reference sequence
    text: str = ""


@dataclasses.dataclass
class Worst:
    prompt_index: int
    prompt: str
    position: int          # index in prompt+continuation
    generated_index: int | None  # index in the continuation, None inside the prompt
    token: int
    actual: float          # vLLM
    expected: float        # Hugging Face
    abs_diff: float


@dataclasses.dataclass
class ParityReport:
    dtype: str
    tokens_compared: int
    max_abs: float
    mean_abs: float
    worst: Worst | None
    nonfinite: int
    missing: int                       # positions where vLLM gave no logprob for the token
    topk_overlap: float                # mean |top-k(vLLM) ∩ top-k(HF)| / k
    greedy_identical: list[bool]
    greedy_ties: list[str]             # divergences at reference near-ties, explained
    greedy_divergence: list[str]       # real divergences, explained
    greedy_match_fraction: float       # fraction of generated tokens equal to the reference

    def metrics(self) -> dict:
        return {"max_abs_dlogprob": self.max_abs, "mean_abs_dlogprob": self.mean_abs,
                "tokens_compared": self.tokens_compared, "nonfinite": self.nonfinite,
                "topk_overlap": self.topk_overlap,
                "greedy_identical": sum(self.greedy_identical),
                "greedy_prompts": len(self.greedy_identical), "greedy_ties": len(self.greedy_ties),
                "greedy_match_fraction": self.greedy_match_fraction}

    def summary(self) -> str:
        s = (f"{self.tokens_compared} tokens, max |Δlogprob| {self.max_abs:.3g}, mean "
             f"{self.mean_abs:.3g}, top-k overlap {self.topk_overlap:.2f}, greedy identical "
             f"{sum(self.greedy_identical)}/{len(self.greedy_identical)}")
        if self.greedy_ties:
            s += f" ({len(self.greedy_ties)} at reference near-ties)"
        return s


def _fmt_tok(tok: int, decode) -> str:
    return f"{tok} {decode(tok)!r}" if decode else str(tok)


def compare(observations: Sequence[Observation], ref: Reference, *,
            tie_margin: float | None = None, decode=None) -> ParityReport:
    if len(observations) != len(ref.prompts):
        raise ValueError(f"{len(observations)} observations for {len(ref.prompts)} prompts")
    tie_margin = tie_margin if tie_margin is not None else 2 * tolerance_for(ref.dtype).max_abs_logprob
    diffs: list[float] = []
    worst: Worst | None = None
    nonfinite = missing = 0
    overlaps: list[float] = []
    identical: list[bool] = []
    ties: list[str] = []
    divergences: list[str] = []
    matched = total_gen = 0
    for pi, (obs, pr) in enumerate(zip(observations, ref.prompts)):
        seq = pr.sequence
        if len(obs.prompt_logprobs) != len(seq):
            raise ValueError(f"prompt {pi}: {len(obs.prompt_logprobs)} logprob rows for a "
                             f"sequence of {len(seq)} tokens")
        for pos in range(1, len(seq)):
            row, tok, expected = obs.prompt_logprobs[pos], seq[pos], pr.token_logprobs[pos]
            if row is None or tok not in row:
                missing += 1
                continue
            actual = row[tok]
            if not math.isfinite(actual):
                nonfinite += 1
                d = math.inf
            else:
                d = abs(actual - expected)
            diffs.append(d)
            if worst is None or d > worst.abs_diff:
                gi = pos - len(pr.prompt_ids)
                worst = Worst(pi, pr.prompt, pos, gi if gi >= 0 else None, tok, actual, expected, d)
            ref_top = pr.top_logprobs[pos]
            if ref_top:
                k = len(ref_top)
                ours = sorted(row, key=row.get, reverse=True)[:k]
                overlaps.append(len(set(ours) & set(ref_top)) / k)
        # greedy continuation
        exp_ids, got = pr.greedy_ids, obs.greedy_ids
        total_gen += len(exp_ids)
        matched += sum(a == b for a, b in zip(got, exp_ids))
        same = got == exp_ids
        identical.append(same)
        if not same:
            j = next((i for i, (a, b) in enumerate(zip(got, exp_ids)) if a != b),
                     min(len(got), len(exp_ids)))
            top = pr.top_logprobs[len(pr.prompt_ids) + j] if j < len(exp_ids) else None
            margin = None
            if top and len(top) >= 2:
                best = sorted(top.values(), reverse=True)
                margin = best[0] - best[1]
            got_tok = _fmt_tok(got[j], decode) if j < len(got) else "(end)"
            exp_tok = _fmt_tok(exp_ids[j], decode) if j < len(exp_ids) else "(end)"
            what = (f"prompt {pi} {pr.prompt!r}: greedy diverges at generated token {j}: vllm "
                    f"{got_tok} vs hf {exp_tok}; shared prefix {exp_ids[:j]}")
            if margin is not None and margin < tie_margin:
                ties.append(what + f" (reference top-2 margin {margin:.2g} < {tie_margin:.2g})")
            else:
                divergences.append(what + (f" (reference top-2 margin {margin:.3g})"
                                           if margin is not None else ""))
    finite = [d for d in diffs if math.isfinite(d)]
    return ParityReport(
        dtype=ref.dtype, tokens_compared=len(diffs),
        max_abs=max(diffs) if diffs else math.nan,
        mean_abs=sum(finite) / len(finite) if finite else math.nan,
        worst=worst, nonfinite=nonfinite, missing=missing,
        topk_overlap=sum(overlaps) / len(overlaps) if overlaps else math.nan,
        greedy_identical=identical, greedy_ties=ties, greedy_divergence=divergences,
        greedy_match_fraction=matched / total_gen if total_gen else math.nan)


def describe_worst(w: Worst | None, decode=None) -> str:
    if w is None:
        return "no position compared"
    where = (f"generated token {w.generated_index}" if w.generated_index is not None
             else "inside the prompt")
    return (f"prompt {w.prompt_index} {w.prompt!r}, position {w.position} ({where}), token "
            f"{_fmt_tok(w.token, decode)}: vllm logprob {w.actual:.7g}, hf logprob "
            f"{w.expected:.7g}, |Δ| {w.abs_diff:.3g}")


def assert_logprobs_close(report: ParityReport, *, tolerance: float | None = None,
                          name_actual: str = "vllm", name_expected: str = "hf", decode=None) -> None:
    """Fail unless every compared position is within ``tolerance`` and nothing is missing."""
    tol = tolerance if tolerance is not None else tolerance_for(report.dtype).max_abs_logprob
    problems = []
    if report.tokens_compared == 0:
        problems.append("no token was compared")
    if report.missing:
        problems.append(f"{report.missing} positions had no {name_actual} logprob for the "
                        "reference token")
    if report.nonfinite:
        problems.append(f"{report.nonfinite} non-finite {name_actual} logprobs (NaN/inf)")
    if not (report.max_abs <= tol):
        problems.append(f"max |Δlogprob| {report.max_abs:.3g} > tolerance {tol:.3g} "
                        f"({report.dtype})")
    if problems:
        raise AssertionError(
            f"teacher-forced logprobs: {name_actual} vs {name_expected} differ: "
            + "; ".join(problems) + f"\nworst: {describe_worst(report.worst, decode)}"
            + f"\n{report.summary()}")


def assert_greedy_equal(report: ParityReport) -> None:
    if report.greedy_divergence:
        raise AssertionError("greedy token ids differ from the reference:\n  "
                             + "\n  ".join(report.greedy_divergence))


def assert_gibberish(report: ParityReport) -> None:
    """Before a sync the server must NOT behave like the trainer's model."""
    if not (report.mean_abs >= GIBBERISH_MIN_MEAN_ABS) or all(report.greedy_identical):
        raise AssertionError(
            "before sync the server already matches the reference (mean |Δlogprob| "
            f"{report.mean_abs:.3g} < {GIBBERISH_MIN_MEAN_ABS} or all greedy continuations equal):"
            " dummy weights were not dummy, or the server was not fresh\n" + report.summary())


def observe(client, ref: Reference, *, top_k: int | None = None) -> list[Observation]:
    """Ask the server for the greedy continuation and the teacher-forced scores of
    every reference prompt (prompts are sent as token ids: no tokenizer in between)."""
    out = []
    for pr in ref.prompts:
        k = top_k or max((len(t) for t in pr.top_logprobs if t), default=5)
        c = client.complete(pr.prompt_ids, max_tokens=len(pr.greedy_ids))
        out.append(Observation(c.token_ids, client.prompt_logprobs(pr.sequence, top_k=k), c.text))
    return out
