"""The native token choice (kernels/cpu/sampling.cpp) against the torch reference's filtered distribution: for
every row and uniform u, the kernel's token is the one whose interval of the reference's cumulative distribution (in
token-id order) holds u times the total, never a token the filters remove. Rows cover peaked, flat, tied and banned
logits, vocabularies that are not a multiple of 16, and every filter alone and combined."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.sampling import Sampler, SamplingBatch, SamplingParams, SequenceState
from llmserve.sampling.logits_processors import apply_sampling_filters
from llmserve.sampling.logprobs import logprobs_of_logits
from llmserve.sampling.sampler import _native_choice, _native_filters

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(native.load() is None, reason="the native CPU kernels do not build here")


@pytest.fixture(autouse=True, params=["avx512", "scalar"])
def passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test on both versions of the kernel's passes over a row (scalar: CPUs without AVX-512)."""
    if request.param == "scalar":
        monkeypatch.setenv("LLMSERVE_SAMPLING_AVX512", "0")
    else:
        monkeypatch.delenv("LLMSERVE_SAMPLING_AVX512", raising=False)
    return request.param

PARAMS = [
    SamplingParams(temperature=0.8, top_k=50),
    SamplingParams(top_p=0.9),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.8),
    SamplingParams(min_p=0.05),
    SamplingParams(temperature=0.6, top_p=0.95, min_p=0.1),
    SamplingParams(top_k=7, min_p=0.2),
    SamplingParams(temperature=1.3),  # nothing truncates: the whole vocabulary
    SamplingParams(top_p=0.3, top_k=3),
    SamplingParams(temperature=0.0),  # greedy rows in a sampled batch
    SamplingParams(temperature=0.9, top_k=1),  # top_k 1 is greedy too
    SamplingParams(top_k=2),
    SamplingParams(top_p=0.999, temperature=2.0),  # a nucleus of most of the vocabulary
]


def logits_of(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g)
    if kind == "peaked":
        return x * 4.0
    if kind == "flat":
        return x * 0.05
    if kind == "tied":  # few distinct values: ties at every boundary (k-th, top-p, min-p)
        return (x * 2.0).round()
    if kind == "banned":  # most of the vocabulary -inf, as bans and logit_bias leave it
        x = x * 3.0
        x[torch.rand(rows, vocab, generator=g) < 0.9] = float("-inf")
        x[:, 0] = 1.0  # every row keeps a finite token
        return x
    raise AssertionError(kind)


def reference_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The torch sampler's distribution per row (greedy rows: one-hot on their argmax), float64."""
    probs = apply_sampling_filters(logits.clone(), batch.filters).softmax(dim=-1).double()
    if batch.greedy is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(batch.greedy.unsqueeze(1), one_hot, probs)
    return probs


def assert_draws_follow(logits: torch.Tensor, params: list[SamplingParams], us: list[float]) -> None:
    batch = SamplingBatch.build([SequenceState(p, [], []) for p in params], logits.shape[1], CPU)
    probs = reference_probs(logits, batch)
    cdf = probs.cumsum(dim=-1)
    for u in us:
        ids = _native_choice(logits, batch, torch.full((len(params),), u))
        assert ids is not None
        for row, token in enumerate(ids.tolist()):
            p = probs[row, token].item()
            assert p > 0.0, f"row {row} ({params[row]}): token {token} is filtered out (u={u})"
            if batch.greedy is not None and bool(batch.greedy[row]):
                continue
            target, hi = u * cdf[row, -1].item(), cdf[row, token].item()
            assert hi - p - 1e-5 <= target <= hi + 1e-5, f"row {row} ({params[row]}): u={u} -> {token}"


@pytest.mark.parametrize("kind", ["peaked", "flat", "tied", "banned"])
@pytest.mark.parametrize("vocab", [8, 1000 + 7, 49_152])
def test_each_token_holds_its_u_in_the_reference_cdf(kind: str, vocab: int) -> None:
    params = PARAMS if vocab > 50 else [p for p in PARAMS if p.top_k <= 7]
    logits = logits_of(kind, len(params), vocab, seed=vocab)
    assert_draws_follow(logits, params, [0.0, 0.013, 0.25, 0.5, 0.77, 0.999, 1.0 - 2 ** -24])


def test_u_at_the_ends_picks_the_lowest_and_highest_kept_ids() -> None:
    # The draw runs in token-id order, as the reference's: u = 0 takes the first kept id, u -> 1 the last. Flat
    # logits, so the last kept token's share is well above u's distance from 1.
    params = [p for p in PARAMS if p.temperature > 0 and p.top_k != 1]
    logits = logits_of("flat", len(params), 777, seed=3)
    batch = SamplingBatch.build([SequenceState(p, [], []) for p in params], 777, CPU)
    kept = reference_probs(logits, batch) > 0
    first = _native_choice(logits, batch, torch.zeros(len(params)))
    last = _native_choice(logits, batch, torch.full((len(params),), 1.0 - 2 ** -24))
    for row in range(len(params)):
        ids = kept[row].nonzero().squeeze(1)
        assert (first[row].item(), last[row].item()) == (ids[0].item(), ids[-1].item())
    assert int((kept.sum(dim=-1) > 1).sum()) == len(params) - 1  # real ranges (top_p 0.3 of 3 near-equal: one)


def test_ties_at_the_kth_are_kept_and_top_p_prefers_lower_ids() -> None:
    # Five tokens tied at the top: top_k=2 keeps all five (ties with the k-th), top_p takes the lower ids first.
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0, -2.0, 3.0, 3.0]] * 2)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.3)]
    batch = SamplingBatch.build([SequenceState(p, [], []) for p in params], 8, CPU)
    draws = {tuple(_native_choice(logits, batch, torch.full((2,), u)).tolist()) for u in torch.linspace(0, 0.999, 50)}
    assert {d[0] for d in draws} == {1, 3, 4, 6, 7}
    assert {d[1] for d in draws} == {1, 3}  # 0.2 each: the nucleus stops at the second, the lowest ids


def test_rows_the_kernel_leaves_go_to_the_torch_path_whole() -> None:
    # A NaN row and an all -inf row come back -1 from the kernel; the sampler then takes the torch path for the
    # batch, so every other row gets the reference's token for its u.
    logits = logits_of("peaked", 4, 300, seed=5)
    logits[1, 7] = float("nan")
    logits[2] = float("-inf")
    temperature, top_k = torch.tensor([0.8, 1.0, 1.0, 0.0]), torch.tensor([20, 300, 5, 300])
    ids = native.sample_rows(logits, temperature, top_k, torch.full((4,), float("inf")), torch.zeros(4),
                             torch.full((4,), 0.5))
    assert ids[1].item() == -1 and ids[2].item() == -1 and ids[0].item() >= 0
    assert ids[3].item() == logits[3].argmax().item()
    assert native.argmax_rows(logits).tolist()[1:3] == [-1, 0]
    params = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(), SamplingParams(top_k=5),
              SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build([SequenceState(p, [], []) for p in params], 300, CPU)
    assert _native_choice(logits, batch, torch.full((4,), 0.5)) is None
    out = Sampler(seed=3)(logits.clone(), batch).token_ids
    assert out[0] in logits[0].topk(20).indices.tolist() and out[3] == logits[3].argmax().item()


def test_the_sampler_picks_the_same_tokens_on_both_paths(passes: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same u per row, so the same tokens (rounding decides nothing here).
    if passes == "scalar" or not native.sampling_usable():
        pytest.skip("the sampler takes the kernel only where its passes run on AVX-512")
    logits = torch.cat([logits_of("peaked", len(PARAMS), 4096, seed=9), logits_of("tied", len(PARAMS), 4096, seed=9)])
    seqs = [SequenceState(p, [], []) for p in PARAMS * 2]

    def run() -> list[list[int]]:
        sampler = Sampler(seed=42)
        return [sampler(logits.clone(), SamplingBatch.build(seqs, 4096, CPU)).token_ids for _ in range(10)]

    native_tokens = run()
    monkeypatch.setenv("LLMSERVE_SAMPLER", "torch")
    assert run() == native_tokens
    assert len({tuple(step) for step in native_tokens}) > 5  # fresh u each step


def test_all_greedy_argmax_matches_torch() -> None:
    logits = logits_of("tied", 64, 49_152, seed=1)  # ties: the first maximum wins
    assert native.argmax_rows(logits).tolist() == logits.argmax(dim=-1).tolist()
    short = logits[:, :21].contiguous()
    assert native.argmax_rows(short).tolist() == short.argmax(dim=-1).tolist()


@pytest.mark.parametrize("kind", ["peaked", "flat", "tied"])
def test_a_rejected_draft_is_replaced_from_the_rest_of_the_distribution(kind: str) -> None:
    # u just below 1 rejects every draft (no token here holds all the mass); the replacement drawn with u2 must hold
    # u2 in the reference's cumulative distribution with the draft's probability taken out, in id order.
    params = [p for p in PARAMS if p.temperature > 0 and p.top_k != 1 and p.top_k != 2 and p.top_p > 0.3]
    vocab = 1000 + 7
    logits = logits_of(kind, len(params), vocab, seed=11)
    batch = SamplingBatch.build([SequenceState(p, [], []) for p in params], vocab, CPU)
    probs = reference_probs(logits, batch)
    drafts = probs.argmax(dim=-1)  # the most likely token: its removal moves every later boundary
    drafts[::2] = probs[::2].argsort(dim=-1, descending=True)[:, 1]  # and the second most likely on half the rows
    residual = probs.scatter(1, drafts.unsqueeze(1), 0.0)
    cdf = residual.cumsum(dim=-1)
    for u2 in (0.0, 0.3, 0.61, 0.999):
        tokens, accepted = native.verify_rows(logits, *_native_filters(logits, batch), torch.full((len(params),), 1.0 - 2 ** -24),
                                              drafts, torch.full((len(params),), u2))
        assert not accepted.any()
        for row, token in enumerate(tokens.tolist()):
            assert token != drafts[row].item() and residual[row, token].item() > 0.0, (row, token)
            target, hi = u2 * cdf[row, -1].item(), cdf[row, token].item()
            assert hi - residual[row, token].item() - 1e-5 <= target <= hi + 1e-5, (row, u2, token)
    # u = 0 accepts exactly the drafts the filters keep (a peaked row's nucleus can hold the top token alone)
    tokens, accepted = native.verify_rows(logits, *_native_filters(logits, batch), torch.zeros(len(params)), drafts,
                                          torch.zeros(len(params)))
    kept = probs.gather(1, drafts.unsqueeze(1)).squeeze(1) > 0
    assert accepted.tolist() == kept.tolist() and tokens[kept].tolist() == drafts[kept].tolist()


@pytest.mark.parametrize("kind", ["peaked", "flat", "tied", "banned"])
@pytest.mark.parametrize("vocab", [8, 1000 + 7, 49_152])
def test_logprobs_match_log_softmax(kind: str, vocab: int) -> None:
    # Against float64: torch's own fp32 log_softmax is off by up to 4e-6 on the peaked 49,152-wide rows, the kernel
    # (double sums) by 2e-7.
    logits = logits_of(kind, 6, vocab, seed=vocab + 1)
    raw = logits.double().log_softmax(dim=-1).float()
    tokens = torch.tensor([0, vocab - 1, 3, 5, int(logits[4].argmax()), int(logits[5].argmin())])
    top_n = min(20, vocab)
    token_lp, ranks, top_values, top_ids = native.logprob_rows(logits, tokens, top_n)
    torch.testing.assert_close(token_lp, raw.gather(1, tokens.unsqueeze(1)).squeeze(1), rtol=1e-6, atol=1e-6)
    assert ranks.tolist() == (1 + (logits > logits.gather(1, tokens.unsqueeze(1))).sum(dim=-1)).tolist()
    want = raw.topk(top_n, dim=-1).values
    torch.testing.assert_close(top_values, want, rtol=1e-6, atol=1e-6)  # most likely first (ties: any order)
    torch.testing.assert_close(raw.gather(1, top_ids), top_values, rtol=1e-6, atol=1e-6)  # each id has its value


def test_logprobs_of_a_row_the_kernel_leaves_come_from_log_softmax() -> None:
    logits = logits_of("peaked", 3, 100, seed=2)
    logits[1, 9] = float("nan")
    ranks = native.logprob_rows(logits, torch.tensor([1, 2, 3]), 4)[1]
    assert ranks.tolist()[1] == -1 and min(ranks.tolist()[0::2]) >= 1
    out = logprobs_of_logits(logits, torch.tensor([1, 2, 3]), [4, 4, 0])
    raw = logits.log_softmax(dim=-1)
    assert out[0].logprob == raw[0, 1].item() and out[2].top == []  # log_softmax's own answer, bit for bit
