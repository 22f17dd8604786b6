"""Logprobs: log_softmax of the raw model logits, whatever processing the row's sampling applies. Values are compared
to torch's log_softmax up to float rounding: the native kernel sums in double and may differ in the last bit."""

from __future__ import annotations

import pytest
import torch

from llmserve.sampling import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    SamplingParams,
    SequenceState,
)

CPU = torch.device("cpu")
# Every test on both paths (conftest.py).
pytestmark = pytest.mark.usefixtures("sampler_path")


def approx(values: object) -> object:
    return pytest.approx(values, rel=1e-6, abs=1e-7)


def run(params: list[SamplingParams], logits: torch.Tensor, outputs: list[list[int]] | None = None) -> SamplerOutput:
    seqs = [SequenceState(p, [0], out, None) for p, out in zip(params, outputs or [[]] * len(params), strict=True)]
    return Sampler(seed=0)(logits.clone(), SamplingBatch.build(seqs, logits.shape[-1], CPU))


def test_logprobs_of_raw_logits() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)) * 2
    params = [
        SamplingParams(logprobs=5, temperature=0.5, top_k=10, repetition_penalty=1.5, logit_bias={3: 2.0}),
        SamplingParams(),
        SamplingParams(logprobs=3, temperature=0.0, presence_penalty=2.0),
    ]
    out = run(params, logits, [[1, 2], [], [int(logits[2].argmax())]])
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs[1] is None
    for row, n in ((0, 5), (2, 3)):
        lp = out.logprobs[row]
        token = out.token_ids[row]
        assert lp.token_id == token
        assert lp.logprob == approx(raw[row, token].item())
        assert lp.rank == 1 + int((raw[row] > raw[row, token]).sum())
        order = raw[row].argsort(descending=True)[:n].tolist()
        assert [t for t, _ in lp.top] == order
        assert [v for _, v in lp.top] == approx([raw[row, t].item() for t in order])
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    # The greedy row's presence penalty moved it off the raw argmax: rank 2 in the raw distribution.
    assert out.logprobs[2].rank == 2


def test_logprobs_fast_path_and_zero_top() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 1.0, 2.0]])
    out = run([SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.0, logprobs=9)], logits)
    raw = logits.log_softmax(dim=-1).tolist()
    assert out.token_ids == [1, 0]
    first, second = out.logprobs
    assert (first.token_id, first.logprob, first.rank, first.top) == (1, approx(raw[0][1]), 1, [])
    # Asking for more than the vocabulary returns all of it.
    assert (second.token_id, second.logprob, second.rank) == (0, approx(raw[1][0]), 1)
    assert [t for t, _ in second.top] == [0, 2, 1]
    assert [v for _, v in second.top] == approx([raw[1][0], raw[1][2], raw[1][1]])


def test_rank_of_sampled_token() -> None:
    # Token 7 forced by a bias: 7 raw tokens are more likely, so its rank is 8.
    logits = torch.arange(8, dtype=torch.float32).flip(0).unsqueeze(0)
    out = run([SamplingParams(logprobs=1, logit_bias={7: 100.0})], logits)
    assert (out.token_ids, out.logprobs[0].rank) == ([7], 8)
    [(top_id, top_value)] = out.logprobs[0].top
    assert (top_id, top_value) == (0, approx(logits.log_softmax(-1)[0, 0].item()))
