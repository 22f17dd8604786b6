"""Compiling (cache, errors) and following a grammar (masks, drafts, the end) against the tiny tokenizer."""

from __future__ import annotations

import random
import re
import threading

import pytest

from llmserve import InvalidRequestError
from llmserve.structured import spec
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import GrammarState
from tests.tiny_models import VOCAB_SIZE, tiny_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(tiny_tokenizer(), VOCAB_SIZE, [EOS])


def allowed(state: GrammarState) -> list[int]:
    return [t for t in range(VOCAB_SIZE) if state.allows(t)]


def walk(state: GrammarState, rng: random.Random, limit: int = 200) -> list[int]:
    """Random allowed tokens until the grammar is finished."""
    out: list[int] = []
    while not state.finished and len(out) < limit:
        choices = allowed(state)
        assert choices, "a live grammar always allows some token"
        token = rng.choice(choices)
        assert state.accept(token)
        if token != EOS:
            out.append(token)
    return out


def test_compile_is_cached_by_source(compiler):
    s = spec.regex("[a-c]{2}", "r")
    before = compiler.stats.compiled
    first = compiler.compile(s)
    assert compiler.compile(spec.regex("[a-c]{2}", "other field")) is first  # the key ignores the field name
    assert compiler.stats.compiled == before + 1 and compiler.is_cached(s)


def test_concurrent_compiles_of_one_source_share_it(compiler):
    s = spec.regex("x(y|z)+w", "r")
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(compiler.compile(s))) for _ in range(6)]
    before = compiler.stats.compiled
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.stats.compiled == before + 1 and len({id(r) for r in results}) == 1


@pytest.mark.parametrize("bad, words", [
    (spec.regex("(ab", "guided_regex"), "regex could not be compiled: .*parenthesis is not closed"),
    (spec.grammar("root ::= foo", "guided_grammar"), "grammar could not be compiled: .*Rule \"foo\" is not defined"),
    (spec.json_schema({"type": "objectx"}, "guided_json"), "JSON schema could not be compiled: Unsupported type"),
    (spec.structural_tag({"format": {"type": "nonsense"}}, "response_format"), "structural tag could not be compiled"),
])
def test_refused_sources_name_the_field_and_are_not_cached(compiler, bad, words):
    with pytest.raises(InvalidRequestError, match=words) as e:
        compiler.compile(bad)
    assert e.value.param == bad.param and "/project/cpp" not in str(e.value)
    assert not compiler.is_cached(bad)


def test_random_walks_match_the_regex(compiler):
    tok = tiny_tokenizer()
    rng = random.Random(0)
    for pattern in ["[a-z]{2,5}", "(cat|dog)s?", r"\d{1,3}(\.\d)?", "The (quick|lazy) [a-z]+"]:
        compiled = compiler.compile(spec.regex(pattern, "r"))
        for _ in range(10):
            state = GrammarState(compiled, [EOS], VOCAB_SIZE)
            text = tok.decode(walk(state, rng))
            assert re.fullmatch(pattern, text), (pattern, text)


def test_only_eos_left_finishes_without_sampling_it(compiler):
    tok = tiny_tokenizer()
    state = GrammarState(compiler.compile(spec.choice(["Paris", "Par"], "c")), [EOS], VOCAB_SIZE)
    for t in tok.encode("Par"):
        assert state.accept(t)
    assert not state.finished and state.allows(EOS)  # "Par" may end here or go on to "Paris"
    for t in tok.encode("is"):
        assert state.accept(t)
    assert state.finished and allowed(state) == [EOS]


def test_refused_token_leaves_the_state(compiler):
    tok = tiny_tokenizer()
    state = GrammarState(compiler.compile(spec.choice(["dog"], "c")), [EOS], VOCAB_SIZE)
    before = allowed(state)
    assert not state.accept(tok.encode("cat")[0])
    assert allowed(state) == before


def test_drafts_cut_and_masks_equal_step_by_step(compiler):
    tok = tiny_tokenizer()
    compiled = compiler.compile(spec.regex("(the|a) (quick|lazy) (fox|dog)", "r"))
    state = GrammarState(compiled, [EOS], VOCAB_SIZE)
    good = tok.encode("the quick fox")
    bad = tok.encode("the slow")
    assert state.valid_prefix(good + [EOS, 5]) == good + [EOS]  # nothing after the end
    cut = state.valid_prefix(bad)
    assert cut == bad[:len(cut)] and len(cut) < len(bad)
    masks = state.masks_with_drafts(good[:-1])
    reference = GrammarState(compiled, [EOS], VOCAB_SIZE)
    for i, token in enumerate(good[:-1]):
        assert masks[i].tolist() == reference.next_mask[0].tolist()
        reference.accept(token)
    assert masks[-1].tolist() == reference.next_mask[0].tolist()
    assert state.next_mask.tolist() == GrammarState(compiled, [EOS], VOCAB_SIZE).next_mask.tolist()  # rolled back
    for t in good:
        assert state.accept(t)
    assert state.finished


def test_json_object_means_an_object(compiler):
    tok = tiny_tokenizer()
    state = GrammarState(compiler.compile(spec.any_json("response_format")), [EOS], VOCAB_SIZE)
    assert not any(state.allows(t) for t in tok.encode("[")) and state.allows(tok.encode("{")[0])


def test_length_bounded_strings_are_valid_json(compiler):
    """xgrammar 0.2.8 lets such strings hold raw control characters (invalid JSON); the compiler patches that."""
    import json

    import jsonschema

    tok = tiny_tokenizer()
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8},
                                               "t": {"type": "string", "minLength": 1, "maxLength": 3}},
              "required": ["s", "t"], "additionalProperties": False}
    compiled = compiler.compile(spec.json_schema(schema, "response_format", any_whitespace=False))
    rng = random.Random(3)
    for _ in range(30):
        text = tok.decode(walk(GrammarState(compiled, [EOS], VOCAB_SIZE), rng, limit=400))
        value = json.loads(text)
        # A random walk over byte tokens can spell a UTF-8-encoded surrogate (ED A5 BB), one character to xgrammar
        # and three replacement characters to Python: only such outputs may look longer than maxLength.
        if "\ufffd" not in text:
            jsonschema.validate(value, schema)
