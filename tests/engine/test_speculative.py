"""Speculative decoding: greedy outputs identical with and without it, through the whole engine
(batched, chunked, preempted, prefix-cached), for n-gram and draft-model proposals; sampled tokens
follow the target distribution (rejection sampling, checked statistically)."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.engine.speculative import NgramProposer, SpecStats
from llmserve.sampling.batch import SamplingBatch, SequenceState
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import Sampler

NEW_TOKENS = 24


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    out = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (3, 9, 17, 30, 41)]
    # Repetitive prompts, so that the n-gram proposer finds matches from the first step.
    out.append([5, 6, 7, 8, 9] * 6)
    out.append(list(range(10, 30)) + list(range(10, 25)))
    return out


GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "plain": dict(),
    "chunked": dict(max_prefill_token_num=7),  # drafts compete with prefill chunks for a small budget
    "preempted": dict(num_blocks=24, block_size=4),
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),
}


def run(model_dir: str, prompts_: list[list[int]], gen: GenerationConfig = GREEDY, **engine) -> tuple[list, object]:
    config = EngineConfig(dtype="float32", **{"block_size": 8, **engine})
    with pipeline(model_dir, backend_config=config) as pipe:
        out = pipe([{"input_ids": p} for p in prompts_], gen_config=gen)
        if engine.get("enable_prefix_caching"):
            again = pipe([{"input_ids": p} for p in prompts_], gen_config=gen)
            assert [r.token_ids for r in again] == [r.token_ids for r in out]
        pipe.engine.kv.check_invariants()
        assert pipe.engine.kv.usage().in_use == 0
        return out, pipe.engine


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[list[int]]]:
    return {arch: [r.token_ids for r in run(tiny_model_dir(arch), prompts())[0]] for arch in ("llama", "qwen2")}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ngram_greedy_identical(arch, mode, tiny_model_dir, reference):
    out, engine = run(tiny_model_dir(arch), prompts(), speculative_method="ngram", num_speculative_tokens=3,
                      prompt_lookup_min=1, **MODES[mode])
    assert [r.token_ids for r in out] == reference[arch]
    assert all(r.generate_token_len == NEW_TOKENS and r.finish_reason == "length" for r in out)
    stats: SpecStats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # speculation really ran
    assert 1.0 < stats.mean_tokens_per_step <= 4.0
    if mode == "preempted":
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("mode", ["plain", "chunked", "preempted"])
def test_draft_model_greedy_identical(mode, tiny_model_dir, reference):
    # A different random model as the draft: proposals are mostly wrong, outputs must not change.
    out, engine = run(tiny_model_dir("llama"), prompts(), speculative_model=tiny_model_dir("qwen3"),
                      num_speculative_tokens=3, **MODES[mode])
    assert [r.token_ids for r in out] == reference["llama"]
    assert engine.spec_stats.num_draft_tokens > 0
    if mode == "preempted":
        assert engine.scheduler.num_preemptions > 0


def test_draft_model_same_as_target_accepts_everything(tiny_model_dir, reference):
    out, engine = run(tiny_model_dir("llama"), prompts(), speculative_model=tiny_model_dir("llama"),
                      num_speculative_tokens=4)
    assert [r.token_ids for r in out] == reference["llama"]
    stats = engine.spec_stats
    assert stats.acceptance_rate == 1.0  # the draft is the target: every greedy draft is its argmax
    assert stats.mean_tokens_per_step > 4.0  # 5 per step, except where max_new_tokens caps the lookahead


def test_stop_token_among_accepted_drafts(tiny_model_dir, reference):
    # Stop at a token the reference produces mid-output: the engine must cut there even when the
    # token arrives inside a run of accepted drafts, and free everything.
    ref = reference["llama"][-1]
    stop = ref[10]
    gen = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, stop_token_ids=[stop])
    out, _ = run(tiny_model_dir("llama"), [prompts()[-1]], gen, speculative_model=tiny_model_dir("llama"))
    assert out[0].token_ids == ref[:ref.index(stop)]
    assert out[0].finish_reason == "stop"


def test_draft_vocab_mismatch_is_refused(tiny_model_dir, tmp_path):
    from tests.tiny_models import make_tiny_model

    other = make_tiny_model("llama", tmp_path / "big-vocab", vocab_size=400)
    with pytest.raises(Exception, match="vocabulary"):
        pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", speculative_model=other))


def test_bad_speculative_config_is_refused():
    from llmserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="speculative_method"):
        EngineConfig(speculative_method="medusa")
    with pytest.raises(InvalidRequestError, match="speculative_model"):
        EngineConfig(speculative_method="draft_model")
    with pytest.raises(InvalidRequestError, match="prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)


# --- n-gram lookup -----------------------------------------------------------------------------


def test_ngram_lookup_takes_latest_longest_match():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # latest occurrence of [1, 2, 3]
    assert p.lookup([4, 5, 6, 4, 5], 3) == [6, 4, 5]
    assert p.lookup([1, 2, 3], 3) == []  # no earlier occurrence
    assert p.lookup([8, 1, 2, 8], 5) == [1, 2, 8]  # a 1-gram match, proposals stop at the end
    assert NgramProposer(2, 3).lookup([8, 1, 2, 8], 5) == []  # min_n 2: the 1-gram is not enough
    assert p.lookup([1, 1, 1, 1], 2) == [1]  # overlapping match ending just before the suffix


# --- rejection sampling ------------------------------------------------------------------------


def _batch(params: SamplingParams, rows: int) -> SamplingBatch:
    states = [SequenceState(params, [1], []) for _ in range(rows)]
    return SamplingBatch.build(states, 8, torch.device("cpu"))


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from llmserve.sampling.logits_processors import apply_sampling_filters

    batch = _batch(params, 1)
    return apply_sampling_filters(logits.clone().unsqueeze(0), batch.filters).softmax(-1)[0]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8)],
                         ids=["t1", "t0.7-topk5", "t1.3-topp0.8"])
@pytest.mark.parametrize("draft", [0, 3, 7, -1])
def test_verify_follows_target_distribution(params, draft, sampler_path):
    """Whatever the (deterministic) draft, the emitted token of a verified row is distributed as the
    target: accepted with probability p(draft), otherwise drawn from the residual. A row without a draft (-1)
    samples from the target and accepts nothing."""
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.2, -0.3, -1.0, 1.5, 0.0])
    p = _target(logits, params)
    rows = 40_000
    out = Sampler(seed=1).verify(logits.repeat(rows, 1), _batch(params, rows), [draft] * rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8).double()
    accepted = torch.tensor(out.accepted)
    assert accepted.double().mean().item() == pytest.approx(p[draft].item() if draft >= 0 else 0.0, abs=0.015)
    # Accepted rows emit the draft; rejected rows never do.
    assert (torch.tensor(out.token_ids)[accepted] == draft).all()
    assert (torch.tensor(out.token_ids)[~accepted] != draft).all()
    expected = p.double() * rows
    used = expected > 0
    assert (counts[~used] == 0).all()  # filtered-out tokens are never emitted
    chi2 = (((counts - expected) ** 2)[used] / expected[used]).sum().item()
    assert chi2 < 30.0  # 7 degrees of freedom at most: p ~ 1e-4


def test_verify_greedy_rows_accept_the_argmax(sampler_path):
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    states = [SequenceState(SamplingParams(temperature=0.0), [1], []) for _ in range(3)]
    out = Sampler().verify(logits, SamplingBatch.build(states, 3, torch.device("cpu")), [1, 2, -1])
    assert out.token_ids == [1, 1, 1]
    assert out.accepted == [True, False, False]


def test_verify_mixed_batch_and_a_row_left_to_torch(sampler_path):
    # Greedy and sampled rows, with and without drafts, in one batch; then the same batch with a NaN row, which the
    # kernel leaves to the torch path for the batch: either way every row's token is one its rule allows.
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0]] * 5)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=2),
              SamplingParams(temperature=0.0), SamplingParams(top_p=0.5), SamplingParams(temperature=0.9)]
    states = [SequenceState(p, [1], []) for p in params]
    for nan_row in (None, 4):
        rows = logits.clone()
        if nan_row is not None:
            rows[nan_row, 2] = float("nan")
        out = Sampler(seed=3).verify(rows, SamplingBatch.build(states, 4, torch.device("cpu")), [1, 2, 0, 1, -1])
        assert out.token_ids[:4] == [1, out.token_ids[1], 1, 1] and out.token_ids[1] in (1, 2)
        assert out.accepted[:4] == [True, out.token_ids[1] == 2, False, True] and out.accepted[4] is False
