"""Comparing what vLLM produces with the Hugging Face reference.

Two views of the same weights:
- teacher-forced: vLLM scores the reference's token sequence (prompt logprobs);
  every position is compared with Hugging Face's logprob of the same token, so one
  early difference does not hide the rest, and the worst index is named;
- greedy: vLLM's own continuation must be the reference's token for token, except
  where the reference itself is a near-tie (top-2 margin under ``tie_margin``),
  which numerics may legitimately flip; such ties are reported, not hidden.

Beyond the actual token, every teacher-forced row is checked for non-finite
values and its top-k is compared with the reference's top-k (membership, with
near-ties at the k-th place allowed, and the logprob of every shared candidate).

Three comparisons share one report type (``ParityReport``) and one set of asserts:
- ``compare``: a server's observations vs the Hugging Face reference (tolerance per
  dtype, ``harness.oracles.tolerances``);
- ``compare_servers``: one server vs another on the same sequences (e.g. a synced
  server vs a disk-loaded twin), every logprob of every row; meant for tolerance 0;
- ``compare_generation``: logprobs of generated tokens (completions, which unlike
  prompt-logprob requests can be served from the prefix cache) vs the reference.

Pure comparison: asking a server for the observations is ``harness.run.flow.observe``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from harness.oracles.reference import PromptReference, Reference
# the commands and the tests read the table through this module (``parity.tolerance_for``)
from harness.oracles.tolerances import (ARCHITECTURE_TOLERANCES, GIBBERISH_MIN_MEAN_ABS,  # noqa: F401
                                        TOLERANCES, Tolerance, model_type_of, tolerance_for)


def _reference_tolerance(ref: Reference) -> float:
    return tolerance_for(ref.dtype, model_type_of(str(ref.model_dir))).max_abs_logprob


def report_tolerance(report: "ParityReport") -> float:
    """The tolerance a report is judged by: its reference's architecture and dtype."""
    return (report.tolerance if report.tolerance is not None
            else tolerance_for(report.dtype).max_abs_logprob)


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
    actual: float          # vLLM (or the first server)
    expected: float        # Hugging Face (or the second server)
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
    # top-k beyond the actual token (defaults keep older constructors valid)
    topk_max_abs: float = math.nan     # max |Δ| over reference top-k candidates vLLM also ranked
    topk_worst: Worst | None = None
    topk_misses: list[str] = dataclasses.field(default_factory=list)  # unexplained by a k-th tie
    nonfinite_where: list[str] = dataclasses.field(default_factory=list)  # first few, explained
    names: tuple[str, str] = ("vllm", "hf")
    tolerance: float | None = None     # the reference's (tolerance_for); None: the dtype's

    def metrics(self) -> dict:
        return {"max_abs_dlogprob": self.max_abs, "mean_abs_dlogprob": self.mean_abs,
                "topk_max_abs_dlogprob": self.topk_max_abs,
                "tokens_compared": self.tokens_compared, "nonfinite": self.nonfinite,
                "topk_overlap": self.topk_overlap, "topk_misses": len(self.topk_misses),
                "greedy_identical": sum(self.greedy_identical),
                "greedy_prompts": len(self.greedy_identical), "greedy_ties": len(self.greedy_ties),
                "greedy_match_fraction": self.greedy_match_fraction}

    def summary(self) -> str:
        s = (f"{self.tokens_compared} tokens, max |Δlogprob| {self.max_abs:.3g}, mean "
             f"{self.mean_abs:.3g}, top-k overlap {self.topk_overlap:.2f} (max |Δ| over shared "
             f"candidates {self.topk_max_abs:.3g}), greedy identical "
             f"{sum(self.greedy_identical)}/{len(self.greedy_identical)}")
        if self.greedy_ties:
            s += f" ({len(self.greedy_ties)} at reference near-ties)"
        return s


def _fmt_tok(tok: int, decode) -> str:
    return f"{tok} {decode(tok)!r}" if decode else str(tok)


def _where(pi: int, pr: PromptReference, pos: int) -> str:
    gi = pos - len(pr.prompt_ids)
    inside = f"generated token {gi}" if gi >= 0 else "inside the prompt"
    return f"prompt {pi} {pr.prompt!r}, position {pos} ({inside})"


def _greedy_check(pi: int, pr: PromptReference, got: list[int], exp_ids: list[int],
                  tie_margin: float, decode, names: tuple[str, str],
                  ties: list[str], divergences: list[str]) -> tuple[bool, int]:
    """Compare one greedy continuation; returns (identical, tokens matched)."""
    matched = sum(a == b for a, b in zip(got, exp_ids))
    same = got == exp_ids
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
        what = (f"prompt {pi} {pr.prompt!r}: greedy diverges at generated token {j}: "
                f"{names[0]} {got_tok} vs {names[1]} {exp_tok}; shared prefix {exp_ids[:j]}")
        if margin is not None and margin < tie_margin:
            ties.append(what + f" (reference top-2 margin {margin:.2g} < {tie_margin:.2g})")
        else:
            divergences.append(what + (f" (reference top-2 margin {margin:.3g})"
                                       if margin is not None else ""))
    return same, matched


def _report(ref: Reference, diffs: list[float], worst, nonfinite: int, missing: int,
            overlaps: list[float], identical: list[bool], ties: list[str],
            divergences: list[str], matched: int, total_gen: int, **extra) -> ParityReport:
    """The summary statistics every comparison ends with."""
    finite = [d for d in diffs if math.isfinite(d)]
    return ParityReport(
        dtype=ref.dtype, tolerance=_reference_tolerance(ref), tokens_compared=len(diffs),
        max_abs=max(diffs) if diffs else math.nan,
        mean_abs=sum(finite) / len(finite) if finite else math.nan,
        worst=worst, nonfinite=nonfinite, missing=missing,
        topk_overlap=sum(overlaps) / len(overlaps) if overlaps else math.nan,
        greedy_identical=identical, greedy_ties=ties, greedy_divergence=divergences,
        greedy_match_fraction=matched / total_gen if total_gen else math.nan, **extra)


def compare(observations: Sequence[Observation], ref: Reference, *,
            tie_margin: float | None = None, decode=None) -> ParityReport:
    if len(observations) != len(ref.prompts):
        raise ValueError(f"{len(observations)} observations for {len(ref.prompts)} prompts")
    tol = _reference_tolerance(ref)
    tie_margin = tie_margin if tie_margin is not None else 2 * tol
    names = ("vllm", "hf")
    diffs: list[float] = []
    worst: Worst | None = None
    topk_worst: Worst | None = None
    topk_diffs: list[float] = []
    topk_misses: list[str] = []
    nonfinite_where: list[str] = []
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
            gi = pos - len(pr.prompt_ids)
            gi = gi if gi >= 0 else None
            if row is None or tok not in row:
                missing += 1
                continue
            bad = [t for t, v in row.items() if not math.isfinite(v)]
            if bad:
                nonfinite += len(bad)
                if len(nonfinite_where) < 5:
                    nonfinite_where.append(f"{_where(pi, pr, pos)}: non-finite {names[0]} logprob"
                                           f" {row[bad[0]]} for token {_fmt_tok(bad[0], decode)}")
            actual = row[tok]
            d = abs(actual - expected) if math.isfinite(actual) else math.inf
            diffs.append(d)
            if worst is None or d > worst.abs_diff:
                worst = Worst(pi, pr.prompt, pos, gi, tok, actual, expected, d)
            ref_top = pr.top_logprobs[pos]
            if ref_top:
                k = len(ref_top)
                ours = sorted(row, key=row.get, reverse=True)[:k]
                overlaps.append(len(set(ours) & set(ref_top)) / k)
                kth = row[ours[-1]] if len(ours) == k else -math.inf
                for t, lp in ref_top.items():
                    if t in row:
                        dt = abs(row[t] - lp) if math.isfinite(row[t]) else math.inf
                        topk_diffs.append(dt)
                        if topk_worst is None or dt > topk_worst.abs_diff:
                            topk_worst = Worst(pi, pr.prompt, pos, gi, t, row[t], lp, dt)
                    # absent from vLLM's top-k: fine only if it sits at the k-th place within
                    # the tolerance (vLLM's value for it is <= its k-th best)
                    if t not in ours and lp - kth > tol:
                        topk_misses.append(
                            f"{_where(pi, pr, pos)}: hf top-{k} token {_fmt_tok(t, decode)} (hf "
                            f"logprob {lp:.7g}) is not in vllm's top-{k} (vllm's k-th logprob "
                            f"{kth:.7g}{', its own ' + format(row[t], '.7g') if t in row else ''})")
                # and the other way round: a vLLM top-k token Hugging Face ranks lower
                # (its hf logprob is <= hf's k-th) must not sit above hf's k-th by > tol
                ref_kth = min(ref_top.values())
                for t in ours:
                    if t not in ref_top and row[t] - ref_kth > tol:
                        topk_misses.append(
                            f"{_where(pi, pr, pos)}: vllm top-{k} token {_fmt_tok(t, decode)} "
                            f"(vllm logprob {row[t]:.7g}) is not in hf's top-{k} (hf's k-th "
                            f"logprob {ref_kth:.7g})")
        exp_ids, got = pr.greedy_ids, obs.greedy_ids
        total_gen += len(exp_ids)
        same, m = _greedy_check(pi, pr, got, exp_ids, tie_margin, decode, names, ties, divergences)
        identical.append(same)
        matched += m
    return _report(ref, diffs, worst, nonfinite, missing, overlaps, identical, ties,
                   divergences, matched, total_gen,
                   topk_max_abs=max(topk_diffs) if topk_diffs else math.nan,
                   topk_worst=topk_worst, topk_misses=topk_misses,
                   nonfinite_where=nonfinite_where, names=names)


def compare_servers(actual: Sequence[Observation], expected: Sequence[Observation],
                    ref: Reference, *, names: tuple[str, str] = ("synced", "twin"),
                    decode=None) -> ParityReport:
    """One server vs another on the reference's sequences: every logprob of every
    teacher-forced row (the actual token and all top-k candidates, the union of both
    rows; a token one row has and the other lacks counts as missing) and the greedy
    continuations, which must be identical (no tie allowance: ``tie_margin`` 0).
    Meant for ``assert_logprobs_close(report, tolerance=0.0)``."""
    if not (len(actual) == len(expected) == len(ref.prompts)):
        raise ValueError(f"{len(actual)} / {len(expected)} observations for "
                         f"{len(ref.prompts)} prompts")
    diffs: list[float] = []
    worst: Worst | None = None
    nonfinite = missing = 0
    nonfinite_where: list[str] = []
    overlaps: list[float] = []
    identical: list[bool] = []
    ties: list[str] = []
    divergences: list[str] = []
    matched = total_gen = 0
    for pi, (a, b, pr) in enumerate(zip(actual, expected, ref.prompts)):
        seq = pr.sequence
        for o, n in ((a, names[0]), (b, names[1])):
            if len(o.prompt_logprobs) != len(seq):
                raise ValueError(f"prompt {pi}: {n} has {len(o.prompt_logprobs)} logprob rows "
                                 f"for a sequence of {len(seq)} tokens")
        for pos in range(1, len(seq)):
            ra, rb = a.prompt_logprobs[pos], b.prompt_logprobs[pos]
            gi = pos - len(pr.prompt_ids)
            gi = gi if gi >= 0 else None
            if ra is None or rb is None:
                missing += 1
                continue
            for t in sorted(set(ra) | set(rb), key=lambda t: (t != seq[pos], t)):
                if t not in ra or t not in rb:
                    missing += 1
                    continue
                va, vb = ra[t], rb[t]
                if not (math.isfinite(va) and math.isfinite(vb)):
                    nonfinite += 1
                    if len(nonfinite_where) < 5:
                        nonfinite_where.append(f"{_where(pi, pr, pos)}: token "
                                               f"{_fmt_tok(t, decode)}: {names[0]} {va}, "
                                               f"{names[1]} {vb}")
                d = abs(va - vb) if (math.isfinite(va) and math.isfinite(vb)) else (
                    0.0 if va == vb else math.inf)
                diffs.append(d)
                if worst is None or d > worst.abs_diff:
                    worst = Worst(pi, pr.prompt, pos, gi, t, va, vb, d)
            k = min(len(ra), len(rb))
            if k:
                ta = sorted(ra, key=ra.get, reverse=True)[:k]
                tb = sorted(rb, key=rb.get, reverse=True)[:k]
                overlaps.append(len(set(ta) & set(tb)) / k)
        total_gen += len(b.greedy_ids)
        same, m = _greedy_check(pi, pr, a.greedy_ids, b.greedy_ids, 0.0, decode, names, ties,
                                divergences)
        identical.append(same)
        matched += m
    return _report(ref, diffs, worst, nonfinite, missing, overlaps, identical, ties,
                   divergences, matched, total_gen,
                   topk_max_abs=max(diffs) if diffs else math.nan, topk_worst=worst,
                   nonfinite_where=nonfinite_where, names=names)


def compare_generation(completions: Sequence[tuple[list[int], list[float] | None]],
                       ref: Reference, *, tie_margin: float | None = None,
                       decode=None) -> ParityReport:
    """Generated tokens (ids, sampled-token logprobs) vs the reference continuation.

    Unlike prompt-logprob requests, which never read the prefix cache, completions
    reuse cached KV blocks of their prompt: this is the view in which a stale prefix
    cache shows. Each generated token's logprob is compared while the continuation
    still follows the reference (after a divergence the contexts differ)."""
    if len(completions) != len(ref.prompts):
        raise ValueError(f"{len(completions)} completions for {len(ref.prompts)} prompts")
    tol = _reference_tolerance(ref)
    tie_margin = tie_margin if tie_margin is not None else 2 * tol
    names = ("vllm", "hf")
    diffs: list[float] = []
    worst: Worst | None = None
    nonfinite = missing = 0
    nonfinite_where: list[str] = []
    identical: list[bool] = []
    ties: list[str] = []
    divergences: list[str] = []
    matched = total_gen = 0
    for pi, ((ids, lps), pr) in enumerate(zip(completions, ref.prompts)):
        for j, tok in enumerate(ids[:len(pr.greedy_ids)]):
            if tok != pr.greedy_ids[j]:
                break
            pos = len(pr.prompt_ids) + j
            if lps is None or j >= len(lps) or lps[j] is None:
                missing += 1
                continue
            actual, expected = lps[j], pr.token_logprobs[pos]
            if not math.isfinite(actual):
                nonfinite += 1
                if len(nonfinite_where) < 5:
                    nonfinite_where.append(f"{_where(pi, pr, pos)}: non-finite vllm logprob "
                                           f"{actual}")
            d = abs(actual - expected) if math.isfinite(actual) else math.inf
            diffs.append(d)
            if worst is None or d > worst.abs_diff:
                worst = Worst(pi, pr.prompt, pos, j, tok, actual, expected, d)
        total_gen += len(pr.greedy_ids)
        same, m = _greedy_check(pi, pr, list(ids), pr.greedy_ids, tie_margin, decode, names,
                                ties, divergences)
        identical.append(same)
        matched += m
    return _report(ref, diffs, worst, nonfinite, missing, [], identical, ties,
                   divergences, matched, total_gen, nonfinite_where=nonfinite_where,
                   names=names)


def describe_worst(w: Worst | None, decode=None, names: tuple[str, str] = ("vllm", "hf")) -> str:
    if w is None:
        return "no position compared"
    where = (f"generated token {w.generated_index}" if w.generated_index is not None
             else "inside the prompt")
    return (f"prompt {w.prompt_index} {w.prompt!r}, position {w.position} ({where}), token "
            f"{_fmt_tok(w.token, decode)}: {names[0]} logprob {w.actual:.7g}, {names[1]} logprob "
            f"{w.expected:.7g}, |Δ| {w.abs_diff:.3g}")


def assert_logprobs_close(report: ParityReport, *, tolerance: float | None = None,
                          name_actual: str | None = None, name_expected: str | None = None,
                          decode=None) -> None:
    """Fail unless every compared position is within ``tolerance`` and nothing is missing."""
    tol = tolerance if tolerance is not None else report_tolerance(report)
    names = (name_actual or report.names[0], name_expected or report.names[1])
    problems = []
    if report.tokens_compared == 0:
        problems.append("no token was compared")
    if report.missing:
        problems.append(f"{report.missing} positions had no {names[0]} logprob for the "
                        "reference token")
    if report.nonfinite:
        problems.append(f"{report.nonfinite} non-finite {names[0]} logprobs (NaN/inf)")
    if not (report.max_abs <= tol):
        problems.append(f"max |Δlogprob| {report.max_abs:.3g} > tolerance {tol:.3g} "
                        f"({report.dtype})")
    if problems:
        raise AssertionError(
            f"teacher-forced logprobs: {names[0]} vs {names[1]} differ: "
            + "; ".join(problems) + f"\nworst: {describe_worst(report.worst, decode, names)}"
            + "".join(f"\nnon-finite: {w}" for w in report.nonfinite_where)
            + f"\n{report.summary()}")


def assert_finite(report: ParityReport) -> None:
    """Every logprob the server returned (actual token and top-k candidates) is finite."""
    if report.nonfinite:
        raise AssertionError(f"{report.nonfinite} non-finite {report.names[0]} logprobs "
                             "(NaN/inf):\n  " + "\n  ".join(report.nonfinite_where)
                             + f"\n{report.summary()}")


def assert_topk_close(report: ParityReport, *, tolerance: float | None = None,
                      decode=None) -> None:
    """The server's top-k is the reference's top-k (a candidate may drop out only at a
    k-th-place tie within the tolerance), and every candidate both rank agrees within
    the tolerance."""
    tol = tolerance if tolerance is not None else report_tolerance(report)
    problems = []
    if report.topk_misses:
        problems.append(f"{len(report.topk_misses)} reference top-k candidates missing from "
                        f"{report.names[0]}'s top-k:\n  " + "\n  ".join(report.topk_misses[:10]))
    if not (report.topk_max_abs <= tol):
        problems.append(f"max |Δlogprob| over shared top-k candidates {report.topk_max_abs:.3g}"
                        f" > tolerance {tol:.3g} ({report.dtype}); worst: "
                        + describe_worst(report.topk_worst, decode, report.names))
    if problems:
        raise AssertionError("top-k: " + "\n".join(problems) + f"\n{report.summary()}")


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


class NonFiniteOutput(AssertionError):
    """The server computed NaN/inf logprobs. vLLM cannot put them in JSON and answers
    HTTP 400 "Out of range float values are not JSON compliant", so no report exists:
    this is a parity failure, not a transport error."""


def within_tolerance(report: ParityReport) -> bool:
    """Every token compared, all finite, and within the dtype's logprob tolerance."""
    return (report.tokens_compared > 0 and not report.missing and not report.nonfinite
            and report.max_abs <= report_tolerance(report))


def assert_parity(report: ParityReport, *, decode=None, what: str = "") -> None:
    """Every check of this module, in the order that explains a failure best; ``what``
    says what was compared."""
    try:
        assert_finite(report)
        assert_logprobs_close(report, decode=decode)
        assert_topk_close(report, decode=decode)
        assert_greedy_equal(report)
    except AssertionError as e:
        if what:
            raise AssertionError(f"{what}: {e}") from None
        raise
