"""Temperature, top-k, top-p and min-p: exact filter results, and sampled frequencies against the
exact filtered distribution computed here in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.sampling import Sampler, SamplingBatch, SamplingParams, SequenceState
from llmserve.sampling.logits_processors import apply_sampling_filters

CPU = torch.device("cpu")
# Every test on both token-choice paths (conftest.py).
pytestmark = pytest.mark.usefixtures("sampler_path")
NEG_INF = float("-inf")
# Distinct values, deliberately not sorted, so a filter that confuses ranks with ids shows.
LOGITS = [0.3, 2.0, -0.9, 1.2, 0.8, -1.5, 1.7, 0.0, 1.5, -0.4, 0.5, 1.0]
DRAWS = 20_000


def make_batch(params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
    return SamplingBatch.build([SequenceState(p, [], []) for p in params], vocab_size, CPU)


def f32(values: list[float]) -> list[float]:
    return torch.tensor(values, dtype=torch.float32).tolist()


def filtered(logits: list[float], params: SamplingParams) -> list[float]:
    out = apply_sampling_filters(torch.tensor([logits]), make_batch([params], len(logits)).filters)
    return out[0].tolist()


def exact_distribution(logits: list[float], p: SamplingParams) -> list[float]:
    # Written independently of the sampler: walk tokens from most to least likely.
    z = [x / p.temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    if p.top_k:
        order = order[: p.top_k]
    total = sum(math.exp(z[i]) for i in order)
    probs = {i: math.exp(z[i]) / total for i in order}
    if p.top_p < 1.0:
        kept, mass = [], 0.0
        for i in order:
            kept.append(i)
            mass += probs[i]
            if mass >= p.top_p:
                break
        probs = {i: probs[i] / mass for i in kept}
    if p.min_p > 0.0:
        threshold = p.min_p * max(probs.values())
        probs = {i: q for i, q in probs.items() if q >= threshold}
        total = sum(probs.values())
        probs = {i: q / total for i, q in probs.items()}
    return [probs.get(i, 0.0) for i in range(len(logits))]


def sampled_frequencies(groups: list[SamplingParams], seed: int) -> list[list[float]]:
    # One batch of DRAWS unseeded rows per group: also checks per-row parameters in one call.
    params = [p for p in groups for _ in range(DRAWS)]
    logits = torch.tensor([LOGITS]).expand(len(params), -1).contiguous()
    tokens = torch.tensor(Sampler(seed=seed)(logits, make_batch(params, len(LOGITS))).token_ids)
    # Token t of group g counts in bin g * V + t.
    bins = tokens + torch.arange(len(groups)).repeat_interleave(DRAWS) * len(LOGITS)
    counts = torch.bincount(bins, minlength=len(groups) * len(LOGITS))
    return (counts.view(len(groups), len(LOGITS)).double() / DRAWS).tolist()


def assert_matches(freqs: list[float], expected: list[float]) -> None:
    # Each count is Binomial(DRAWS, p): 5 standard deviations (<= 0.018 at DRAWS = 20k) bound the
    # deviation with failure odds ~1e-6 per token, far below the >= 0.05 shifts a wrong filter makes
    # here (e.g. one token too many or too few). Filtered tokens must never be drawn at all.
    for token, (f, p) in enumerate(zip(freqs, expected, strict=True)):
        if p == 0.0:
            assert f == 0.0, f"token {token} is filtered out but was drawn ({f})"
        else:
            assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / DRAWS), f"token {token}: {f} vs {p}"


def test_frequencies_topk_path() -> None:
    # No row uses top-p: top-k goes through topk() rather than a sort.
    groups = [
        SamplingParams(temperature=0.5),
        SamplingParams(top_k=4),
        SamplingParams(min_p=0.33),
        SamplingParams(temperature=1.5, top_k=6, min_p=0.5),
    ]
    for params, freqs in zip(groups, sampled_frequencies(groups, seed=1), strict=True):
        assert_matches(freqs, exact_distribution(LOGITS, params))


def test_frequencies_sort_path() -> None:
    groups = [
        SamplingParams(top_p=0.7),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.8),
        SamplingParams(temperature=1.5, top_k=8, top_p=0.8, min_p=0.55),
        SamplingParams(temperature=2.0),  # neutral top_p in a batch that sorts
    ]
    for params, freqs in zip(groups, sampled_frequencies(groups, seed=2), strict=True):
        assert_matches(freqs, exact_distribution(LOGITS, params))


def test_exact_distribution_is_not_trivial() -> None:
    # Guards the statistical tests: every filter used above removes tokens (none sits within 0.01
    # of its threshold, so float rounding cannot move the boundary), and temperature reshapes.
    def support(**kw: float) -> int:
        return sum(p > 0 for p in exact_distribution(LOGITS, SamplingParams(**kw)))

    assert support(min_p=0.33) == 5
    assert support(temperature=1.5, top_k=6, min_p=0.5) == 5
    assert support(top_p=0.7) == 5
    assert support(temperature=0.8, top_k=5, top_p=0.8) == 4
    assert support(temperature=1.5, top_k=8, top_p=0.8) == 6
    assert support(temperature=1.5, top_k=8, top_p=0.8, min_p=0.55) == 4
    full = exact_distribution(LOGITS, SamplingParams())
    assert max(exact_distribution(LOGITS, SamplingParams(temperature=0.5))) > max(full) + 0.1


def test_top_k_keeps_ties_with_kth() -> None:
    assert filtered([1.0, 3.0, 3.0, 2.0], SamplingParams(top_k=2)) == [NEG_INF, 3.0, 3.0, NEG_INF]
    assert filtered([1.0, 3.0, 3.0, 2.0], SamplingParams(top_k=3)) == [NEG_INF, 3.0, 3.0, 2.0]
    # top_k >= V disables it.
    assert filtered([1.0, 3.0, 3.0, 2.0], SamplingParams(top_k=4)) == [1.0, 3.0, 3.0, 2.0]


def test_top_p_breaks_ties_by_lower_id() -> None:
    # Probabilities 0.1, 0.3, 0.3, 0.3: mass 0.5 needs two of the three tied tokens.
    logits = f32([0.0, math.log(3.0), math.log(3.0), math.log(3.0)])
    assert filtered(logits, SamplingParams(top_p=0.5)) == [NEG_INF, logits[1], logits[2], NEG_INF]
    assert filtered(logits, SamplingParams(top_p=0.95)) == logits


def test_top_p_keeps_at_least_one_token() -> None:
    assert filtered([0.0, 1.0, 0.5], SamplingParams(top_p=1e-6)) == [NEG_INF, 1.0, NEG_INF]


@pytest.mark.parametrize(("min_p", "kept"), [(0.5, 2), (0.25, 3), (0.05, 4)])
def test_min_p_threshold_relative_to_top(min_p: float, kept: int) -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: kept iff p >= min_p * 0.5.
    logits = f32([math.log(p) for p in (0.5, 0.3, 0.15, 0.05)])
    out = filtered(logits, SamplingParams(min_p=min_p))
    assert out == logits[:kept] + [NEG_INF] * (4 - kept)


def test_temperature_divides() -> None:
    assert filtered([1.0, -2.0, 0.5], SamplingParams(temperature=0.5)) == [2.0, -4.0, 1.0]


def test_unused_filters_are_not_built() -> None:
    filters = make_batch([SamplingParams(), SamplingParams(temperature=0.0, top_p=0.5, top_k=3)], 8).filters
    # The greedy row's top_p/top_k do not matter; the sampled row uses nothing.
    assert (filters.temperature, filters.top_k, filters.top_p, filters.min_p) == (None, None, None, None)


# Locally typical sampling: what transformers' TypicalLogitsWarper keeps, on both paths and in batches mixed with
# other filters (it runs after temperature, top-k, top-p and min-p, as in transformers' generate and TGI).
TYPICAL = [
    SamplingParams(typical_p=0.5),
    SamplingParams(typical_p=0.9, temperature=0.7),
    SamplingParams(typical_p=0.3, top_k=8, top_p=0.95),
    SamplingParams(top_p=0.7),  # no typical_p, in a batch that has one
]


def transformers_typical(logits: list[float], p: SamplingParams) -> list[float]:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    scores = torch.tensor([logits], dtype=torch.float32)
    warpers = [TemperatureLogitsWarper(p.temperature)] if p.temperature != 1.0 else []
    warpers += [TopKLogitsWarper(p.top_k)] if p.top_k else []
    warpers += [TopPLogitsWarper(p.top_p)] if p.top_p < 1.0 else []
    warpers += [MinPLogitsWarper(p.min_p)] if p.min_p > 0.0 else []
    warpers += [TypicalLogitsWarper(p.typical_p)] if p.typical_p < 1.0 else []
    for w in warpers:
        scores = w(None, scores)
    return scores.softmax(dim=-1)[0].tolist()


def test_typical_p_keeps_what_transformers_keeps() -> None:
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 300, generator=g) * 3
    logits[2, :40] = NEG_INF  # tokens a grammar or a ban removed before the filters
    params = [SamplingParams(typical_p=m) for m in (0.2, 0.5, 0.8, 0.95, 0.6, 0.999)]
    ours = apply_sampling_filters(logits.clone(), make_batch(params, 300).filters)
    for row, p in enumerate(params):
        want = torch.tensor(transformers_typical(logits[row].tolist(), p)) > 0
        assert torch.equal(torch.isfinite(ours[row]), want), row
        assert 1 <= int(want.sum()) < 300 - (40 if row == 2 else 0)  # each keeps some and drops some


def test_typical_p_is_not_a_prefix_of_the_likeliest_tokens() -> None:
    # A peaked distribution's likeliest token can be less typical than the next ones (its surprisal is far below the
    # entropy): typical sampling may drop it, which no top-k / top-p path can express.
    logits = [4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0]
    kept = [i for i, q in enumerate(filtered(logits, SamplingParams(typical_p=0.5))) if q != NEG_INF]
    assert kept == [i for i, q in enumerate(transformers_typical(logits, SamplingParams(typical_p=0.5))) if q > 0]
    assert 0 not in kept


def test_frequencies_typical_p() -> None:
    for params, freqs in zip(TYPICAL, sampled_frequencies(TYPICAL, seed=3), strict=True):
        assert_matches(freqs, transformers_typical(LOGITS, params))
    assert all(sum(q > 0 for q in transformers_typical(LOGITS, p)) < len(LOGITS) for p in TYPICAL)
