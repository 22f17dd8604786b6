"""Structured output through the whole engine on the tiny random model: outputs always match their grammar, and
a constrained request's tokens do not change with batching, chunked prefill, the prefix cache, preemption or
speculative decoding; unconstrained requests beside it are unaffected."""

from __future__ import annotations

import re

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, InvalidRequestError, pipeline
from llmserve.structured import spec
from tests.tiny_models import tiny_tokenizer

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=24)
SAMPLED = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24, random_seed=3)
REGEX = "(The|A) (quick|lazy) [a-z]{2,8}"
CHOICES = ["Paris", "capital", "the lazy dog"]
GRAMMAR = 'root ::= "[" item ("," item){0,2} "]"\nitem ::= [0-9] | "fox"'


def prompt(n: int, seed: int) -> dict:
    return {"input_ids": torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()}


def matches(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"\[(\d|fox)(,(\d|fox)){0,2}\]", text) is not None


FORMATS = {"regex": spec.regex(REGEX, "response_format"), "choice": spec.choice(CHOICES, "response_format"),
           "grammar": spec.grammar(GRAMMAR, "response_format")}


def make(tiny_model_dir, **engine) -> object:
    config = {"dtype": "float32", "block_size": 4, "num_blocks": 256, **engine}
    return pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(**config))


@pytest.fixture(scope="module")
def pipe(tiny_model_dir):
    with make(tiny_model_dir) as p:
        yield p


@pytest.fixture(scope="module")
def reference(pipe) -> dict:
    """Each format's output alone, greedy and sampled, for 3 prompts."""
    return {(kind, name, i): pipe(prompt(10 + 7 * i, i), gen_config=gen.replace(response_format=fmt)).token_ids
            for kind, fmt in FORMATS.items() for name, gen in (("greedy", GREEDY), ("sampled", SAMPLED))
            for i in range(3)}


def test_outputs_match_and_stop(pipe, reference):
    tok = tiny_tokenizer()
    for (kind, _, _), ids in reference.items():
        assert matches(kind, tok.decode(ids)), (kind, tok.decode(ids))
    r = pipe(prompt(10, 0), gen_config=GREEDY.replace(response_format=FORMATS["choice"]))
    assert r.finish_reason == "stop" and r.text in CHOICES
    assert pipe.engine.kv.usage().in_use == 0


def test_batched_with_unconstrained_requests(pipe, reference):
    """All formats and plain requests in one batch: each output equals its run alone."""
    plain = [pipe(prompt(5 + i, 50 + i), gen_config=GREEDY).token_ids for i in range(3)]
    gens = [(kind, i) for kind in FORMATS for i in range(3)]
    engine = pipe.engine
    for j, (kind, i) in enumerate(gens):
        engine.add_request(f"c{j}", prompt(10 + 7 * i, i)["input_ids"], GREEDY.replace(response_format=FORMATS[kind]))
    for i in range(3):
        engine.add_request(f"p{i}", prompt(5 + i, 50 + i)["input_ids"], GREEDY)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for j, (kind, i) in enumerate(gens):
        assert got[f"c{j}"] == reference[(kind, "greedy", i)]
    assert [got[f"p{i}"] for i in range(3)] == plain


@pytest.mark.parametrize("engine", [
    {"max_prefill_token_num": 8},  # prompts prefilled in chunks
    {"num_blocks": 14},  # a pool too small for all at once: preemption by recompute
    {"speculative_method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
], ids=["chunked", "preempted", "ngram-speculative"])
def test_same_tokens_under_engine_features(tiny_model_dir, reference, engine):
    with make(tiny_model_dir, **engine) as p:
        for kind, fmt in FORMATS.items():
            prompts = [prompt(10 + 7 * i, i) for i in range(3)]
            for name, gen in (("greedy", GREEDY), ("sampled", SAMPLED)):
                if name == "sampled" and "speculative_method" in engine:
                    continue  # sampled speculation keeps the distribution, not the tokens (checked below)
                out = p(prompts, gen_config=gen.replace(response_format=fmt))
                assert [r.token_ids for r in out] == [reference[(kind, name, i)] for i in range(3)], kind
        if "num_blocks" in engine:
            assert p.engine.scheduler.num_preemptions > 0
        if "speculative_method" in engine:
            assert p.engine.spec_stats.num_draft_tokens > 0 and p.engine.spec_stats.num_accepted_tokens > 0
        assert p.engine.kv.usage().in_use == 0


def test_prefix_cache_hit_gives_the_same_tokens(pipe, reference):
    before = pipe.engine.kv.prefix_stats.hit_tokens
    again = pipe(prompt(24, 2), gen_config=GREEDY.replace(response_format=FORMATS["regex"])).token_ids
    assert again == reference[("regex", "greedy", 2)] and pipe.engine.kv.prefix_stats.hit_tokens > before


def test_speculative_sampled_outputs_match(tiny_model_dir):
    tok = tiny_tokenizer()
    with make(tiny_model_dir, speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1) as p:
        for kind, fmt in FORMATS.items():
            for seed in range(4):
                r = p(prompt(12, seed), gen_config=SAMPLED.replace(response_format=fmt, random_seed=seed))
                assert matches(kind, tok.decode(r.token_ids)), (kind, r.text)


def test_n_and_best_of_each_sequence_has_its_grammar(pipe):
    tok = tiny_tokenizer()
    for gen in (SAMPLED.replace(n=4), SAMPLED.replace(n=2, best_of=4)):
        out = pipe(prompt(9, 4), gen_config=gen.replace(response_format=FORMATS["regex"]))
        assert len(out) == gen.n
        assert all(matches("regex", tok.decode(r.token_ids)) for r in out)


def test_session_turns_are_constrained(pipe):
    tok = tiny_tokenizer()
    first = prompt(12, 9)["input_ids"]
    a = list(pipe.stream_infer({"input_ids": first}, gen_config=GREEDY.replace(response_format=FORMATS["choice"]),
                               session_id="s1"))
    ids = [t for r in a for t in r.token_ids]
    second = first + ids + prompt(5, 10)["input_ids"]
    b = list(pipe.stream_infer({"input_ids": second}, gen_config=GREEDY.replace(response_format=FORMATS["regex"]),
                               session_id="s1"))
    assert tok.decode(ids) in CHOICES and matches("regex", tok.decode([t for r in b for t in r.token_ids]))
    assert pipe.end_session_id("s1")


def test_a_grammar_that_never_ends_stops_at_max_tokens(pipe):
    r = pipe(prompt(8, 1), gen_config=GREEDY.replace(max_new_tokens=12, response_format=spec.regex("(ab|ba)+", "r")))
    assert r.finish_reason == "length" and r.generate_token_len == 12
    assert re.fullmatch("(ab|ba)*a?b?", r.text) is not None


def test_refusals_leave_the_engine_serving(pipe, reference):
    with pytest.raises(InvalidRequestError, match="could not be compiled"):
        pipe(prompt(8, 1), gen_config=GREEDY.replace(response_format={"type": "regex_schema", "regex_schema": "(a"}))
    with pytest.raises(InvalidRequestError, match="beam search"):
        pipe(prompt(8, 1), gen_config=GREEDY.replace(response_format=FORMATS["choice"], use_beam_search=True,
                                                     beam_width=2))
    assert pipe.engine.kv.usage().in_use == 0 and not pipe.engine.has_unfinished_requests()
    again = pipe(prompt(10, 0), gen_config=GREEDY.replace(response_format=FORMATS["choice"])).token_ids
    assert again == reference[("choice", "greedy", 0)]
