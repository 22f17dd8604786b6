"""Sessions through the whole engine on the tiny llama: turn 2 prefills exactly its new tokens and
answers token for token as an engine without sessions does, also after the session was evicted (by
memory pressure, before any preemption; by count; by TTL) or ended."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.api import Pipeline
from llmserve.engine.llm_engine import LLMEngine

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


P1 = tokens(13, 0)
NEW = tokens(5, 1)


def make_pipe(tiny_model_dir, num_blocks: int, caching: bool = False, **kw) -> Pipeline:
    return pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        dtype="float32", block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching, **kw))


def generate(engine: LLMEngine, rid: str, ids: list[int], session: str | None = None,
             gen: GenerationConfig = GREEDY) -> tuple[list[int], int]:
    """The greedy output and how many prompt tokens the engine computed for it."""
    before = engine.scheduler.num_prefill_tokens
    engine.add_request(rid, ids, gen, session_id=session)
    out: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out, engine.scheduler.num_prefill_tokens - before


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> tuple[list[int], list[int]]:
    """Turn 1's answer, and turn 2's (prompt: turn 1's prompt and answer, then 5 new tokens), from an
    engine without sessions."""
    with make_pipe(tiny_model_dir, num_blocks=16, max_sessions=0) as pipe:
        o1, computed1 = generate(pipe.engine, "1", P1)
        o2, computed2 = generate(pipe.engine, "2", P1 + o1 + NEW)
        assert (computed1, computed2) == (13, 24)
        assert pipe.engine.kv.usage().in_use == 0
    return o1, o2


@pytest.mark.parametrize("caching", [False, True])
def test_turn2_prefills_only_its_new_tokens_and_answers_the_same(tiny_model_dir, reference, caching):
    o1_ref, o2_ref = reference
    with make_pipe(tiny_model_dir, num_blocks=16, caching=caching) as pipe:
        e = pipe.engine
        o1, _ = generate(e, "1", P1, session="s")
        assert o1 == o1_ref
        # 19 tokens, the last sampled one never computed: 18 computed, in blocks 0-3 and half of 4.
        assert e.sessions.token_ids("s") == P1 + o1[:-1] and e.kv.held_table("s") == [0, 1, 2, 3, 4]
        o2, computed = generate(e, "2", P1 + o1 + NEW, session="s")
        assert o2 == o2_ref
        assert computed == 24 - 18  # the last answer token and the 5 new ones
        assert e.sessions.hit_tokens == 18 and e.kv.prefix_stats.hit_tokens == 0
        # 24 + 6 = 30 tokens, 29 computed: blocks 0-4 written further in place, then 5-7.
        assert e.kv.held_table("s") == [0, 1, 2, 3, 4, 5, 6, 7]
        e.kv.check_invariants()
        assert e.end_session("s") and not e.end_session("s")
        assert e.kv.usage().in_use == 0
        e.kv.check_invariants()


def test_memory_pressure_evicts_the_idle_session_before_preempting_and_output_is_unchanged(tiny_model_dir,
                                                                                         reference):
    o1_ref, o2_ref = reference
    with make_pipe(tiny_model_dir, num_blocks=8) as pipe:
        e = pipe.engine
        o1, _ = generate(e, "1", P1, session="s")
        assert e.kv.held_table("s") == [0, 1, 2, 3, 4] and e.kv.num_free_blocks == 3
        other, computed = generate(e, "other", tokens(20, 2), gen=GREEDY.replace(max_new_tokens=4))
        assert computed == 20 and "s" not in e.sessions and e.sessions.num_evicted == 1
        assert e.scheduler.num_preemptions == 0
        o2, computed = generate(e, "2", P1 + o1 + NEW, session="s")
        assert (o1, o2) == (o1_ref, o2_ref) and computed == 24  # recomputed, same answer
        assert e.scheduler.num_preemptions == 0
        e.end_session("s")
        assert e.kv.usage().in_use == 0


def test_count_and_ttl_evictions_recompute_with_the_same_output(tiny_model_dir, reference):
    o1_ref, o2_ref = reference
    with make_pipe(tiny_model_dir, num_blocks=16, max_sessions=1, session_ttl=30.0) as pipe:
        e = pipe.engine
        now = [0.0]
        e.sessions.clock = lambda: now[0]
        generate(e, "1", P1, session="s")
        generate(e, "x", tokens(3, 3), session="x")  # a second session: "s" is the older, evicted
        assert "s" not in e.sessions and "x" in e.sessions
        o2, computed = generate(e, "2", P1 + o1_ref + NEW, session="s")
        assert o2 == o2_ref and computed == 24
        assert "x" not in e.sessions and "s" in e.sessions  # storing "s" evicted "x" in turn
        now[0] = 31.0  # idle past the TTL: the next step expires it
        o3, computed = generate(e, "3", P1 + o1_ref + NEW, session="s")
        assert o3 == o2_ref and computed == 24
        assert e.sessions.num_evicted == 3
        now[0] = 40.0  # within the TTL of its last use
        o4, computed = generate(e, "4", P1 + o1_ref + NEW, session="s")
        assert o4 == o2_ref and computed == 1  # the same prompt again: only its last token
        e.end_session("s")
        assert e.kv.usage().in_use == 0


def test_session_refused_with_several_sequences(tiny_model_dir):
    from llmserve.errors import InvalidRequestError

    with make_pipe(tiny_model_dir, num_blocks=16) as pipe:
        with pytest.raises(InvalidRequestError, match="session_id: a session continues one sequence"):
            pipe.engine.add_request("r", P1, GREEDY.replace(n=2), session_id="s")
        with pytest.raises(InvalidRequestError, match="session_id: expected a non-empty string"):
            pipe.engine.add_request("r", P1, GREEDY, session_id=5)  # type: ignore[arg-type]
        assert not pipe.engine.has_unfinished_requests()
