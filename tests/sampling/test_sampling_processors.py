"""Logit bias, bans (bad words, min_tokens) and penalties: processed logits equal a direct formula.

Inputs are dyadic (k / 2^n), so every expected value is exact in float32 and compared with ==.
"""

from __future__ import annotations

import torch

from llmserve.sampling import SamplingBatch, SamplingParams, SequenceState
from llmserve.sampling.logits_processors import apply_logits_processors

CPU = torch.device("cpu")
NEG_INF = float("-inf")
LOGITS = [1.5, -1.0, 2.0, -0.5, 0.0, 3.0, -2.0, 0.25]


def process(seqs: list[SequenceState], logits: list[list[float]] | None = None) -> list[list[float]]:
    rows = logits if logits is not None else [LOGITS] * len(seqs)
    batch = SamplingBatch.build(seqs, len(rows[0]), CPU)
    return apply_logits_processors(torch.tensor(rows), batch).tolist()


def seq(prompt: list[int] | None = None, output: list[int] | None = None, **params: object) -> SequenceState:
    return SequenceState(SamplingParams(**params), prompt or [], output or [])


def penalised(x: float, token: int, prompt: list[int], output: list[int], rep: float, presence: float,
              frequency: float) -> float:
    if token in prompt or token in output:
        x = x / rep if x > 0 else x * rep
    count = output.count(token)
    return x - frequency * count - presence * (count > 0)


def test_penalties_match_formula() -> None:
    prompt, output = [0, 1, 6], [2, 2, 3, 5, 2]
    knobs = dict(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = process([seq(prompt, output, **knobs)])[0]
    expected = [penalised(x, t, prompt, output, 2.0, 0.5, 0.25) for t, x in enumerate(LOGITS)]
    assert out == expected
    # Spelled out for three tokens: prompt-only (repetition only), output x3, unseen.
    assert (out[0], out[2], out[4]) == (0.75, 2.0 / 2 - 0.25 * 3 - 0.5, 0.0)


def test_penalties_per_row() -> None:
    prompt, output = [1, 4], [3, 3, 7]
    out = process([
        seq(prompt, output),  # no penalty: untouched
        seq(prompt, output, repetition_penalty=0.5),  # < 1 favours seen tokens
        seq(prompt, output, presence_penalty=-1.0),
        seq(prompt, output, frequency_penalty=2.0),
    ])
    assert out[0] == LOGITS
    assert out == [
        [penalised(x, t, prompt, output, rep, pres, freq) for t, x in enumerate(LOGITS)]
        for rep, pres, freq in [(1.0, 0.0, 0.0), (0.5, 0.0, 0.0), (1.0, -1.0, 0.0), (1.0, 0.0, 2.0)]
    ]
    assert out[1][1] == -0.5 and out[2][3] == 0.5 and out[3][7] == 0.25 - 2.0


def test_penalties_touch_only_the_listed_tokens_of_each_row() -> None:
    # Rows of different lengths and knobs over a larger vocabulary, tokens repeated and shared between prompt and
    # output, logits of both signs and -inf: every logit equals the formula, untouched ones bit for bit.
    rng = torch.Generator().manual_seed(0)
    vocab = 64
    logits = (torch.randint(-64, 64, (5, vocab), generator=rng) / 8.0)
    logits[1, :4] = NEG_INF
    rows, seqs = [], []
    for i, knobs in enumerate([dict(repetition_penalty=4.0), dict(frequency_penalty=0.5, presence_penalty=0.25),
                               dict(), dict(repetition_penalty=0.5, frequency_penalty=-1.0), dict(presence_penalty=2.0)]):
        prompt = torch.randint(0, vocab, (3 + 7 * i,), generator=rng).tolist() + [1, 1]
        output = torch.randint(0, vocab, (2 + 5 * i,), generator=rng).tolist() + [1] + prompt[:2]
        seqs.append(seq(prompt, output, **knobs))
        rep, pres, freq = (knobs.get(k, d) for k, d in
                           [("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)])
        rows.append([penalised(x, t, prompt, output, rep, pres, freq) for t, x in enumerate(logits[i].tolist())])
    assert process(seqs, logits.tolist()) == rows


def test_logit_bias_applies_before_penalties() -> None:
    out = process([seq([], [5], logit_bias={5: 1.0, 1: -0.5}, repetition_penalty=2.0), seq([], [5])])
    assert out[0] == [1.5, -1.5, 2.0, -0.5, 0.0, (3.0 + 1.0) / 2.0, -2.0, 0.25]
    assert out[1] == LOGITS


def test_single_token_bad_word_always_banned() -> None:
    assert process([seq(bad_words_ids=[[5], [2]])])[0] == [1.5, -1.0, NEG_INF, -0.5, 0.0, NEG_INF, -2.0, 0.25]


def test_multi_token_bad_word_banned_after_its_prefix() -> None:
    words = [[3, 5], [1, 2, 7]]
    banned = [
        [t for t, x in enumerate(row) if x == NEG_INF]
        for row in process([
            seq([], [0, 3], bad_words_ids=words),  # ends with [3]: ban 5
            seq([], [1, 2], bad_words_ids=words),  # ends with [1, 2]: ban 7
            seq([], [3, 1, 2], bad_words_ids=words),  # ends with [1, 2], not with [3]: ban 7
            seq([], [2], bad_words_ids=words),  # prefix [1, 2] incomplete
            seq([], [3, 0], bad_words_ids=words),  # 3 not last
            seq([3], [], bad_words_ids=words),  # prompt is not matched, only the output
            seq([], [1, 2]),  # no bad words
        ])
    ]
    assert banned == [[5], [7], [7], [], [], [], []]


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    stops = frozenset({2, 5})
    rows = process([
        seq([], [], min_tokens=2, stop_token_ids=stops),
        seq([], [0], min_tokens=2, stop_token_ids=stops),
        seq([], [0, 1], min_tokens=2, stop_token_ids=stops),
        seq([], [], stop_token_ids=stops),
    ])
    banned = [[t for t, x in enumerate(row) if x == NEG_INF] for row in rows]
    assert banned == [[2, 5], [2, 5], [], []]


def test_out_of_vocab_ids_are_ignored() -> None:
    out = process([seq([], [], bad_words_ids=[[99]], stop_token_ids=frozenset({99}), min_tokens=1,
                       logit_bias={99: 1.0})])
    assert out == [LOGITS]


def test_unused_processors_are_not_built() -> None:
    batch = SamplingBatch.build([seq([1], [2], temperature=0.0), seq([1], [2], top_k=1)], 8, CPU)
    assert batch.all_greedy and not batch.has_processors
    assert (batch.greedy, batch.filters, batch.logprob_rows) == (None, None, None)
    only_presence = SamplingBatch.build([seq([1], [2], presence_penalty=0.5)], 8, CPU).penalties
    assert only_presence.seen is None and only_presence.repetition is None
    counts = only_presence.output_counts
    assert (counts.rows.tolist(), counts.cols.tolist(), counts.values.tolist()) == ([0], [2], [1.0])


def test_watermark_adds_delta_on_the_green_list_of_the_previous_token() -> None:
    """TGI's watermark, written out here: torch.randperm of the vocabulary from a CPU generator seeded with
    15485863 times the previous token (the prompt's last before any output), its first gamma * V ids + delta."""
    from llmserve.sampling.batch import WATERMARK_DELTA, WATERMARK_GAMMA

    vocab = 64
    seqs = [SequenceState(SamplingParams(watermark=True), [5, 7], []), SequenceState(SamplingParams(), [5, 7], []),
            SequenceState(SamplingParams(watermark=True), [5, 7], [11, 3])]
    logits = torch.zeros(3, vocab)
    batch = SamplingBatch.build(seqs, vocab, torch.device("cpu"))
    apply_logits_processors(logits, batch)
    for row, prev in ((0, 7), (2, 3)):
        green = torch.randperm(vocab, generator=torch.Generator().manual_seed(15485863 * prev))[:int(vocab * WATERMARK_GAMMA)]
        want = torch.zeros(vocab)
        want[green] = WATERMARK_DELTA
        assert torch.equal(logits[row], want)
    assert not logits[1].any()
    assert WATERMARK_GAMMA == 0.5 and WATERMARK_DELTA == 2.0  # TGI's defaults
