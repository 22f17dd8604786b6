"""Pipeline.chat sessions keep their KV in the engine (an engine session per chat): turn 2 prefills only
what is new, with prefix caching off, answers exactly as a session that re-tokenizes the whole chat, and
survives eviction by recomputing (then the prefix cache, when on, still serves what it kept)."""

from __future__ import annotations

import pytest

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.api import Pipeline, Session

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=6)
TURN1, TURN2 = "Hello world", "What is the capital of France?"


def chat_pipe(tiny_model_dir, num_blocks: int, caching: bool = True) -> Pipeline:
    return pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        dtype="float32", block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching))


def hit_tokens_of(pipe: Pipeline, prompt: str, session: Session) -> tuple[Session, int]:
    """The next turn, and how many of its prompt tokens came from the prefix cache."""
    before = pipe.engine.kv.prefix_stats.hit_tokens
    session = pipe.chat(prompt, session, gen_config=GREEDY)
    return session, pipe.engine.kv.prefix_stats.hit_tokens - before


@pytest.fixture(scope="module")
def two_turns(tiny_model_dir) -> tuple[Session, Session, int, int]:
    """Two turns with prefix caching off: the reuse is the engine session's alone."""
    with chat_pipe(tiny_model_dir, num_blocks=64, caching=False) as pipe:
        first = pipe.chat(TURN1, gen_config=GREEDY)
        turn1 = Session(first.session_id, list(first.history), first.response, list(first.token_ids), first.text)
        computed = pipe.engine.scheduler.num_prefill_tokens
        second = pipe.chat(TURN2, first, gen_config=GREEDY)
        computed = pipe.engine.scheduler.num_prefill_tokens - computed
        reused = pipe.engine.sessions.hit_tokens
        # The session now holds turn 2's computed tokens (all but the last sampled one), 4 per block.
        assert pipe.engine.kv.usage().in_use == -(-(len(second.token_ids) - 1) // 4) == 15
        assert pipe.end_session(second) and not pipe.end_session(second)
        assert pipe.engine.kv.usage().in_use == 0
    return turn1, second, reused, computed


def test_turn2_reuses_every_computed_token_of_turn1_without_the_prefix_cache(two_turns):
    turn1, second, reused, computed = two_turns
    answer = turn1.response.token_ids
    assert len(turn1.token_ids) == 23 + 6 and turn1.token_ids[23:] == answer
    assert turn1.response.finish_reason == "length"
    # 29 tokens; the last answer token was sampled, never computed: 28 computed, reused as they are.
    assert reused == 28
    num_prompt = len(second.token_ids) - len(second.response.token_ids)
    assert computed == num_prompt - 28  # the last answer token and the template text of turn 2


def test_turn2_prompt_extends_turn1_ids_with_the_template_text_after_the_answer(two_turns, tiny_model_dir):
    turn1, second, _, _ = two_turns
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        suffix = pipe.tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{TURN2}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    turn2_prompt = turn1.token_ids + suffix
    assert second.token_ids == turn2_prompt + second.response.token_ids
    assert second.text.startswith(turn1.text)


def test_turn2_answer_equals_the_full_retokenization_fallback(two_turns, tiny_model_dir):
    turn1, second, _, _ = two_turns
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        fallback = Session(session_id=7, history=list(turn1.history))  # no token ids: re-tokenizes the chat
        fallback, hits = hit_tokens_of(pipe, TURN2, fallback)
    assert hits == 0  # a fresh pipeline: nothing cached
    assert fallback.response.token_ids == second.response.token_ids
    assert fallback.token_ids == second.token_ids


@pytest.mark.parametrize("filler, hits_left", [(50, 8), (58, 0)])
def test_evicted_session_recomputes_with_the_same_answer(two_turns, tiny_model_dir, filler, hits_left):
    _, second, _, _ = two_turns
    with chat_pipe(tiny_model_dir, num_blocks=16) as pipe:
        session = pipe.chat(TURN1, gen_config=GREEDY)  # 28 computed tokens: the session holds 7 blocks
        assert pipe.engine.kv.usage().in_use == 7
        # The filler needs 13 or 15 blocks, 9 are free: the session is evicted (no preemption), its
        # blocks freed through the normal path, tails first, so they stay in the prefix cache. 50 + 6
        # tokens take 14 blocks: the 9 never used, then 5 of the session's, so its first 2 survive.
        # 58 + 6 tokens take all 16.
        pipe({"input_ids": list(range(3, 3 + filler))}, gen_config=GREEDY)
        assert len(pipe.engine.sessions) == 0 and pipe.engine.scheduler.num_preemptions == 0
        session, hits = hit_tokens_of(pipe, TURN2, session)
        assert pipe.engine.sessions.hit_tokens == 0
        assert pipe.end_session(session) and pipe.engine.kv.usage().in_use == 0
    assert hits == hits_left
    assert session.response.token_ids == second.response.token_ids


def test_a_rendering_that_rewrites_earlier_turns_falls_back_to_full_tokenization(tiny_model_dir):
    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        stale = Session(session_id=1, token_ids=[5, 6, 7], text="<|im_start|>system\nold")
        text = pipe.chat_template.messages_to_prompt([{"role": "user", "content": TURN1}])
        assert pipe.session_prompt_ids(stale, text) == pipe.tokenizer.encode(text, add_special_tokens=False)
        matching = Session(session_id=2, token_ids=[5, 6, 7], text=text[:10])
        assert pipe.session_prompt_ids(matching, text) == [5, 6, 7] + pipe.tokenizer.encode(
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
        ids = pipe.session_prompt_ids(session, text2)
    assert ids[:len(session.token_ids)] == session.token_ids  # every block of turn 1 can be hit
    assert ids != encode(text2, add_special_tokens=False)


def test_stream_infer_refuses_a_session_over_several_sequences(tiny_model_dir):
    from llmserve.errors import InvalidRequestError

    with chat_pipe(tiny_model_dir, num_blocks=64) as pipe:
        for prompts, gen in ((["a", "b"], GREEDY), ("a", GREEDY.replace(n=2)),
                             ("a", GREEDY.replace(use_beam_search=True, beam_width=2))):
            with pytest.raises(InvalidRequestError, match="session_id: a session continues one sequence"):
                next(pipe.stream_infer(prompts, gen_config=gen, session_id="x"))
        assert len(pipe.engine.sessions) == 0 and pipe.engine.kv.usage().in_use == 0
