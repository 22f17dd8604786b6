"""The truncated sampling path (top-k, top-p nuclei and min-p drawn over a row's candidates only) against the
whole-vocabulary path it stands in for, on vocabularies wider than its candidates."""

from __future__ import annotations

import pytest
import torch

from llmserve.sampling import Sampler, SamplingBatch, SamplingParams, SequenceState, seeded_generator
from llmserve.sampling.logits_processors import MAX_CANDIDATES, apply_sampling_filters, truncated_candidates

CPU = torch.device("cpu")
# The torch path's two ways of drawing, compared: the native kernel (test_sampling_native.py) is kept out.
pytestmark = pytest.mark.usefixtures("torch_sampler")
VOCAB = 3 * MAX_CANDIDATES + 17

# Per row: (params, logit scale). Peaked rows keep a few tokens; the flat ones' top-p nucleus is wider than the
# candidates, and the plain temperature row is truncated by nothing: those two take the whole-vocabulary path.
ROWS = [
    (SamplingParams(temperature=0.8, top_k=50), 3.0),
    (SamplingParams(top_p=0.9), 3.0),
    (SamplingParams(temperature=0.7, top_k=40, top_p=0.8), 2.0),
    (SamplingParams(min_p=0.05), 3.0),
    (SamplingParams(temperature=1.3, top_k=1), 1.0),  # top_k 1: greedy
    (SamplingParams(top_p=0.99), 0.01),  # flat: the nucleus holds most of the vocabulary
    (SamplingParams(temperature=0.9), 3.0),  # nothing truncates
    (SamplingParams(top_k=7, min_p=0.2), 1.5),
    (SamplingParams(temperature=0.0), 1.0),  # greedy
]


def build(rows: list[tuple[SamplingParams, float]], seed: int = 0) -> tuple[torch.Tensor, SamplingBatch]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randn(VOCAB, generator=g) * scale for _, scale in rows])
    seqs = [SequenceState(p, [1], [], seeded_generator(seed + i, CPU) if p.seed is not None else None)
            for i, (p, _) in enumerate(rows)]
    return logits, SamplingBatch.build(seqs, VOCAB, CPU)


def test_candidates_carry_the_full_paths_distribution_where_they_cover_a_row() -> None:
    logits, batch = build(ROWS)
    want = apply_sampling_filters(logits.clone(), batch.filters).softmax(dim=-1)
    probs, ids, covered = truncated_candidates(logits.clone(), batch.filters)
    assert covered.tolist() == [True, True, True, True, False, False, False, True, False]
    assert bool((ids.diff(dim=-1) > 0).all())  # token-id order
    for row in covered.nonzero().squeeze(1).tolist():
        full = want[row]
        assert set(full.nonzero().squeeze(1).tolist()) == set(ids[row][probs[row] > 0].tolist())
        torch.testing.assert_close(probs[row], full[ids[row]], rtol=1e-5, atol=1e-7)
        assert abs(full[ids[row]].sum().item() - 1.0) < 1e-5  # nothing kept lies outside the candidates


def test_a_row_draws_the_same_token_on_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [(SamplingParams(**{**p.__dict__, "seed": 100 + i}), s) for i, (p, s) in enumerate(ROWS)
            if p.temperature > 0]
    logits, _ = build(rows)
    steps = []
    for path in ("truncated", "full"):
        if path == "full":  # every row through the whole-vocabulary path
            monkeypatch.setattr("llmserve.sampling.sampler.truncated_candidates", lambda *a: None)
        _, batch = build(rows)  # fresh generators per path: the same u per row and step
        steps.append([Sampler(seed=0)(logits.clone(), batch).token_ids for _ in range(20)])
    assert steps[0] == steps[1]
    assert len({t[0] for t in steps[0]}) > 1  # the draws move


def test_ties_at_the_edge_of_the_candidates_fall_back_to_the_full_path() -> None:
    # top_k 3 where the 3rd largest value is shared by many tokens: all ties are kept (transformers' semantics),
    # more than the candidates hold
    logits = torch.zeros(1, VOCAB)
    logits[0, :2] = torch.tensor([5.0, 4.0])
    _, batch = build([(SamplingParams(top_k=3), 1.0)])
    found = truncated_candidates(logits.clone(), batch.filters)
    assert found is None or not bool(found[2].any())
    many = SamplingBatch.build([SequenceState(SamplingParams(top_k=3), [1], [])] * 4000, VOCAB, CPU)
    tokens = Sampler(seed=1)(logits.expand(4000, -1).clone(), many).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert counts[2:].sum() > 0 and counts[2:].count_nonzero() > 10  # the tied tokens are drawn too


def test_no_filter_means_no_candidates() -> None:
    logits, batch = build([(SamplingParams(temperature=0.9), 1.0), (SamplingParams(), 1.0)])
    assert truncated_candidates(logits, batch.filters) is None


def test_a_top_k_past_the_cap_takes_the_full_path() -> None:
    vocab = 10 * MAX_CANDIDATES
    seqs = [SequenceState(SamplingParams(top_k=k), [1], []) for k in (5 * MAX_CANDIDATES, 5)]
    batch = SamplingBatch.build(seqs, vocab, CPU)
    assert truncated_candidates(torch.randn(2, vocab), batch.filters) is None
