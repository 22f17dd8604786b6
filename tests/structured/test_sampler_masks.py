"""The sampler never produces a token the row's grammar forbids: random grammars and logits, every row kind
(greedy, sampled with each filter, penalties, bans), speculative verification, on both sampler paths."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve.sampling.batch import SamplingBatch, SequenceState
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import Sampler
from llmserve.structured import spec
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import GrammarState
from tests.tiny_models import VOCAB_SIZE, tiny_tokenizer

EOS = 2
ATOMS = ["a", "b", "[a-f]", "[0-9]", "(cat|dog)", "x", " ", "The", "quick"]


def random_regex(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 4)):
        atom = rng.choice(ATOMS)
        parts.append(atom + rng.choice(["", "?", "+", "{1,3}", "*"]))
    body = "".join(parts)
    return f"({body}|{rng.choice(ATOMS)})" if rng.random() < 0.3 else body


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.2, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={5: 30.0}),
    SamplingParams(temperature=0.0, logit_bias={7: 50.0}),
]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer(), VOCAB_SIZE, [EOS])


def advanced_state(compiler: GrammarCompiler, rng: random.Random) -> GrammarState:
    """A grammar at a random live position."""
    while True:
        state = GrammarState(compiler.compile(spec.regex(random_regex(rng), "r")), [EOS], VOCAB_SIZE)
        for _ in range(rng.randint(0, 3)):
            choices = [t for t in range(VOCAB_SIZE) if state.allows(t) and t != EOS]
            if not choices:
                break
            state.accept(rng.choice(choices))
        if not state.finished:
            return state


def test_no_masked_token_is_ever_chosen(compiler, sampler_path):
    rng = random.Random(1)
    torch.manual_seed(1)
    sampler = Sampler(seed=5)
    for _ in range(40):
        rows = rng.randint(1, 12)
        states, grammars = [], []
        for _ in range(rows):
            g = advanced_state(compiler, rng) if rng.random() < 0.7 else None
            grammars.append(g)
            states.append(SequenceState(rng.choice(PARAMS), [1, 3], [4, 5, 6],
                                        token_mask=None if g is None else g.next_mask[0]))
        logits = torch.randn(rows, VOCAB_SIZE) * rng.choice([0.5, 3.0, 10.0])
        out = sampler(logits, SamplingBatch.build(states, VOCAB_SIZE, torch.device("cpu")))
        for g, token in zip(grammars, out.token_ids):
            assert g is None or g.allows(token), token


def test_greedy_takes_the_best_allowed_token(compiler, sampler_path):
    state = GrammarState(compiler.compile(spec.choice(["cat", "dog"], "c")), [EOS], VOCAB_SIZE)
    allowed = [t for t in range(VOCAB_SIZE) if state.allows(t)]
    logits = torch.randn(2, VOCAB_SIZE)
    logits[:, 0] = 100.0  # the unconstrained favourite, forbidden by the grammar
    states = [SequenceState(SamplingParams(temperature=0.0), [1], [], token_mask=state.next_mask[0]),
              SequenceState(SamplingParams(temperature=0.0), [1], [])]
    out = Sampler()(logits.clone(), SamplingBatch.build(states, VOCAB_SIZE, torch.device("cpu")))
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[1] == 0  # the unconstrained row is untouched


def test_grammar_wins_when_bans_forbid_everything_it_allows(compiler, sampler_path):
    tok = tiny_tokenizer()
    state = GrammarState(compiler.compile(spec.choice(["dog"], "c")), [EOS], VOCAB_SIZE)
    only = [t for t in range(VOCAB_SIZE) if state.allows(t)]
    params = SamplingParams(temperature=0.0, bad_words_ids=[[t] for t in only])
    seq = SequenceState(params, [1], [], token_mask=state.next_mask[0])
    out = Sampler()(torch.randn(1, VOCAB_SIZE), SamplingBatch.build([seq], VOCAB_SIZE, torch.device("cpu")))
    assert out.token_ids[0] in only and tok.decode(out.token_ids).startswith(tok.decode(out.token_ids))


def test_verify_rows_stay_in_the_grammar(compiler, sampler_path):
    rng = random.Random(2)
    for _ in range(30):
        state = advanced_state(compiler, rng)
        choices = [t for t in range(VOCAB_SIZE) if state.allows(t) and t != EOS]
        drafts = state.valid_prefix([rng.choice(choices)] + [rng.randrange(VOCAB_SIZE) for _ in range(3)])
        masks = state.masks_with_drafts(drafts)
        params = rng.choice(PARAMS)
        states = [SequenceState(params, [1], list(drafts[:i]), token_mask=masks[i]) for i in range(len(drafts) + 1)]
        logits = torch.randn(len(states), VOCAB_SIZE) * 3
        out = Sampler(seed=3).verify(logits, SamplingBatch.build(states, VOCAB_SIZE, torch.device("cpu")),
                                     list(drafts) + [-1])
        for i, token in enumerate(out.token_ids):
            row_mask = masks[i]
            word, bit = divmod(token, 32)
            assert (int(row_mask[word]) >> bit) & 1, (i, token)


@pytest.mark.parametrize("vocab", [320, 49152, 1007])
@pytest.mark.parametrize("avx512", ["1", "0"])
def test_native_mask_equals_xgrammars(vocab, avx512, monkeypatch):
    """The sampler's native bitmask kernel against xgrammar's own, on random masks (whole words allowed or banned,
    and mixed), a vocabulary that is not a multiple of 32, and rows left out."""
    import xgrammar as xgr

    from llmserve.kernels import native

    if native.load() is None:
        pytest.skip("the native kernels need a C++ compiler")
    monkeypatch.setenv("LLMSERVE_SAMPLING_AVX512", avx512)
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0
    bitmask[2] = -1
    bitmask[3, : words // 2] = 0
    logits = torch.randn(6, vocab, generator=gen)
    rows = torch.tensor([0, 1, 2, 3, 5])
    ours, theirs = logits.clone(), logits.clone()
    native.apply_token_bitmask_(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows.tolist())
    assert torch.equal(ours, theirs) and torch.equal(ours[4], logits[4])
