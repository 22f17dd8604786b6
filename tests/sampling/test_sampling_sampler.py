"""Sampler: greedy rows, mixed batches, bias and bans end to end, per-sequence seeds."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.sampling import Sampler, SamplingBatch, SamplingParams, SequenceState, seeded_generator

CPU = torch.device("cpu")
# Every test on both token-choice paths (conftest.py).
pytestmark = pytest.mark.usefixtures("sampler_path")


def sample(seqs: list[SequenceState], logits: torch.Tensor, sampler: Sampler | None = None) -> list[int]:
    batch = SamplingBatch.build(seqs, logits.shape[-1], CPU)
    return (sampler or Sampler(seed=0))(logits.clone(), batch).token_ids


def seq(output: list[int] | None = None, generator: torch.Generator | None = None, **params: object) -> SequenceState:
    return SequenceState(SamplingParams(**params), [0, 1], output or [], generator)


def random_logits(rows: int, vocab_size: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * scale


def test_all_greedy_batch_is_argmax() -> None:
    logits = random_logits(5, 100, seed=0)
    seqs = [seq(temperature=0.0), seq(top_k=1), seq(temperature=0.0, top_p=0.3), seq(top_k=1, temperature=2.0),
            seq(temperature=0.0, seed=3, generator=seeded_generator(3, CPU))]
    assert sample(seqs, logits) == logits.argmax(dim=-1).tolist()


def test_greedy_rows_in_mixed_batch() -> None:
    # Rows 0, 3, 5 are greedy; the others sample from a flat distribution.
    params = [dict(temperature=0.0), {}, dict(top_p=0.9), dict(top_k=1, temperature=1.5), dict(min_p=0.01),
              dict(temperature=0.0, top_k=4)]
    sampler = Sampler(seed=0)
    sampled_differs = 0
    for step in range(20):
        logits = random_logits(len(params), 50, seed=step, scale=0.3)
        tokens = sample([seq(**p) for p in params], logits, sampler)
        argmax = logits.argmax(dim=-1).tolist()
        assert [tokens[i] for i in (0, 3, 5)] == [argmax[i] for i in (0, 3, 5)]
        sampled_differs += sum(tokens[i] != argmax[i] for i in (1, 2, 4))
    assert sampled_differs > 30  # of 60 draws; each is the argmax with probability ~0.03


def test_greedy_takes_argmax_of_processed_logits() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]] * 4)
    seqs = [
        seq([1], temperature=0.0, repetition_penalty=2.0),  # 3.0 -> 1.5: token 2 wins
        seq([], temperature=0.0, logit_bias={3: 2.5}),  # 1.0 -> 3.5
        seq([], temperature=0.0, bad_words_ids=[[1]]),
        seq([], temperature=0.0, min_tokens=1, stop_token_ids=frozenset({1, 2})),
    ]
    assert sample(seqs, logits) == [2, 3, 2, 3]


def test_logit_bias_when_sampling() -> None:
    logits = random_logits(1, 16, seed=1).expand(1000, -1)
    token_ids = sample([seq(logit_bias={int(logits[0].argmax()): -100.0, 7: 0.5}) for _ in range(1000)], logits)
    assert int(logits[0].argmax()) not in token_ids and 7 in token_ids
    assert set(sample([seq(logit_bias={7: 100.0}) for _ in range(1000)], logits)) == {7}


def test_min_tokens_when_sampling() -> None:
    logits = torch.tensor([[0.0, 0.5, 4.0, 0.0, 0.2, 4.0]]).expand(2000, -1)  # stop ids 2 and 5 dominate
    stops = frozenset({2, 5})
    before = sample([seq([3] * (i % 3), min_tokens=3, stop_token_ids=stops) for i in range(2000)], logits)
    assert stops.isdisjoint(before) and set(before) == {0, 1, 3, 4}
    after = sample([seq([3, 3, 3], min_tokens=3, stop_token_ids=stops) for _ in range(2000)], logits)
    assert after.count(2) + after.count(5) > 1800  # mass of the stop ids ~0.97


def test_bad_words_never_generated() -> None:
    words = [[7], [2, 3], [4, 5, 6]]
    boost = torch.tensor([0.0, 0.0, 1.0, 1.5, 1.0, 1.0, 1.5, 2.0])  # make the bad words likely
    sampler = Sampler(seed=0)
    outputs: list[list[int]] = [[] for _ in range(16)]
    for step in range(40):
        logits = random_logits(16, 8, seed=100 + step) + boost
        tokens = sample([seq(out, bad_words_ids=words) for out in outputs], logits, sampler)
        for out, token in zip(outputs, tokens, strict=True):
            out.append(token)
    texts = [" " + " ".join(map(str, out)) + " " for out in outputs]
    assert not any(bad in text for text in texts for bad in (" 7 ", " 2 3 ", " 4 5 6 "))
    # Non-trivial: the last tokens of multi-token words do occur, where no prefix precedes them.
    assert all(any(t in out for out in outputs) for t in (3, 6))


def generate(target_pos: int, companions: list[SequenceState], seed: int, steps: int = 8) -> list[int]:
    # Runs `steps` steps of one seeded row placed at `target_pos` among `companions`; the target's
    # logits at step s are fixed, the companions' are random and differ from run to run.
    generator = seeded_generator(seed, CPU)
    sampler = Sampler(seed=len(companions))
    output: list[int] = []
    for step in range(steps):
        target = SequenceState(SamplingParams(seed=seed, temperature=0.9, top_p=0.95), [5, 6], list(output),
                               generator)
        seqs = companions[:target_pos] + [target] + companions[target_pos:]
        logits = random_logits(len(seqs), 64, seed=1000 * len(seqs) + step, scale=0.5)
        logits[target_pos] = random_logits(1, 64, seed=step, scale=0.5)[0]
        output.append(sample(seqs, logits, sampler)[target_pos])
    return output


def test_seeded_row_independent_of_companions() -> None:
    alone = generate(0, [], seed=1234)
    companion_sets = [
        (1, [seq(), seq(seed=7, generator=seeded_generator(7, CPU), top_k=5)]),
        (2, [seq(temperature=0.0), seq(top_p=0.5, min_p=0.1, repetition_penalty=1.3)]),
        (0, [seq(seed=1234, generator=seeded_generator(1234, CPU)) for _ in range(3)]),
    ]
    for pos, companions in companion_sets:
        assert generate(pos, companions, seed=1234) == alone
    assert len(set(alone)) > 4  # steps draw fresh noise
    assert generate(0, [], seed=4321) != alone


def test_seeded_rows_follow_the_distribution() -> None:
    # 2000 rows, each with its own generator: one draw each. Bound as in the filter tests (5 sigma).
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0, 0.5]])
    seqs = [seq(seed=i, generator=seeded_generator(i, CPU)) for i in range(2000)]
    counts = torch.bincount(torch.tensor(sample(seqs, logits.expand(2000, -1))), minlength=5)
    for f, p in zip((counts / 2000).tolist(), logits[0].softmax(-1).tolist(), strict=True):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / 2000)


def test_unseeded_rows_reproducible_with_sampler_seed() -> None:
    logits = random_logits(8, 32, seed=5)
    seqs = [seq() for _ in range(8)]
    assert sample(seqs, logits, Sampler(seed=11)) == sample(seqs, logits, Sampler(seed=11))
    assert sample(seqs, logits, Sampler(seed=11)) != sample(seqs, logits, Sampler(seed=12))


def test_seed_without_generator_is_refused() -> None:
    with pytest.raises(ValueError, match="seed 3 but no generator"):
        SamplingBatch.build([seq(seed=3)], 8, CPU)
