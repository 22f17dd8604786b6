"""Pipeline.chat sessions reuse their KV through the prefix cache: turn 2 prefills only what is new,
answers exactly as a session that re-tokenizes the whole chat, and survives eviction by recomputing."""

from __future__ import annotations

import pytest

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.api import Pipeline, Session

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=6)
TURN1, TURN2 = "Hello world", "What is the capital of France?"


def chat_pipe(tiny_model_dir, num_blocks: int) -> Pipeline:
    return pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        dtype="float32", block_size=4, num_blocks=num_blocks, enable_prefix_caching=True))


def hit_tokens_of(pipe: Pipeline, prompt: str, session: Session) -> tuple[Session, int]:
    before = pipe.engine.kv.prefix_stats.hit_tokens
    session = pipe.chat(prompt, session, gen_config=GREEDY)
    return session, pipe.engine.kv.prefix_stats.hit_tokens - before


@pytest.fixture(scope="module")
def two_turns(tiny_model_dir) -> tuple[Session, Session, int]:
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        first = pipe.chat(TURN1, gen_config=GREEDY)
        turn1 = Session(first.session_id, list(first.history), first.response, list(first.token_ids), first.text)
        second, hits = hit_tokens_of(pipe, TURN2, first)
    return turn1, second, hits


def test_turn2_hits_every_full_block_of_turn1_prompt_and_answer(two_turns):
    turn1, _, hits = two_turns
    answer = turn1.response.token_ids
    assert len(turn1.token_ids) == 23 + 6 and turn1.token_ids[23:] == answer
    assert turn1.response.finish_reason == "length"
    # 29 tokens; the last answer token was sampled, never computed: 28 computed = 7 full blocks.
    assert hits == 28


def test_turn2_prompt_extends_turn1_ids_with_the_template_text_after_the_answer(two_turns, tiny_model_dir):
    turn1, second, _ = two_turns
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        suffix = pipe.tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{TURN2}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    turn2_prompt = turn1.token_ids + suffix
    assert second.token_ids == turn2_prompt + second.response.token_ids
    assert second.text.startswith(turn1.text)


def test_turn2_answer_equals_the_full_retokenization_fallback(two_turns, tiny_model_dir):
    turn1, second, _ = two_turns
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        fallback = Session(session_id=7, history=list(turn1.history))  # no token ids: re-tokenizes the chat
        fallback, hits = hit_tokens_of(pipe, TURN2, fallback)
    assert hits == 0  # a fresh pipeline: nothing cached
    assert fallback.response.token_ids == second.response.token_ids
    assert fallback.token_ids == second.token_ids


@pytest.mark.parametrize("filler, hits_left", [(50, 8), (58, 0)])
def test_evicted_session_recomputes_with_the_same_answer(two_turns, tiny_model_dir, filler, hits_left):
    _, second, _ = two_turns
    with chat_pipe(tiny_model_dir, num_blocks=16) as pipe:
        session = pipe.chat(TURN1, gen_config=GREEDY)  # 29 tokens: 8 blocks, 7 of them cached when it ends
        # 50 + 6 tokens take 14 blocks: the 8 never used, then 6 of the session's, tails evicted first,
        # so its first 2 blocks survive. 58 + 6 tokens take all 16.
        pipe({"input_ids": list(range(3, 3 + filler))}, gen_config=GREEDY)
        session, hits = hit_tokens_of(pipe, TURN2, session)
        assert pipe.engine.kv.usage().in_use == 0
    assert hits == hits_left  # the session holds no blocks: eviction is the cache's
    assert session.response.token_ids == second.response.token_ids


def test_a_rendering_that_rewrites_earlier_turns_falls_back_to_full_tokenization(tiny_model_dir):
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        stale = Session(session_id=1, token_ids=[5, 6, 7], text="<|im_start|>system\nold")
        text = pipe.chat_template.messages_to_prompt([{"role": "user", "content": TURN1}])
        assert pipe._session_prompt_ids(stale, text) == pipe.tokenizer.encode(text, add_special_tokens=False)
        matching = Session(session_id=2, token_ids=[5, 6, 7], text=text[:10])
        assert pipe._session_prompt_ids(matching, text) == [5, 6, 7] + pipe.tokenizer.encode(
            text[10:], add_special_tokens=False)


def test_answer_ids_are_kept_even_where_a_re_tokenization_would_merge_them(tiny_model_dir):
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        encode = pipe.tokenizer.encode
        turn1 = [{"role": "user", "content": TURN1}]
        text1 = pipe.chat_template.messages_to_prompt(turn1)
        split = [t for c in "Hello" for t in encode(c, add_special_tokens=False)]  # as a model may sample it
        assert split != encode("Hello", add_special_tokens=False)
        session = Session(session_id=1, token_ids=encode(text1, add_special_tokens=False) + split,
                          text=text1 + "Hello")
        text2 = pipe.chat_template.messages_to_prompt(
            [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": TURN2}])
        ids = pipe._session_prompt_ids(session, text2)
    assert ids[:len(session.token_ids)] == session.token_ids  # every block of turn 1 can be hit
    assert ids != encode(text2, add_special_tokens=False)
