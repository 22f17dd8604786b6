"""Sessions keep a finished turn's KV for the next request with the same id: exact block tables, exact
prefill counts, eviction by count, TTL and memory pressure (before any preemption), close and abort.
Pure bookkeeping over tiny pools; the engine-level tests (same greedy output) are in
test_sessions_engine.py."""

from __future__ import annotations

import pytest

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sessions import SessionStore
from llmserve.sampling.params import SamplingParams
from tests.engine.test_scheduler import plan, run_step

PROMPT = list(range(1, 11))  # 10 tokens: blocks of 4 -> 2 full + 2 in the third
TURN2 = PROMPT + [7, 7, 20]  # turn 1's prompt, its answer token 7, then the new user tokens


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(num_blocks: int = 8, caching: bool = False, max_sessions: int = 4, ttl: float = 100.0,
          budget: int = 64) -> tuple[KVCacheManager, Scheduler, SessionStore, Clock]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=caching)
    clock = Clock()
    store = SessionStore(kv, max_sessions, ttl, clock)
    return kv, Scheduler(kv, max_num_batched_tokens=budget, max_batch_size=8, sessions=store), store, clock


def sreq(rid: str, tokens: list[int], session: str | None = "s", max_new: int = 2) -> Request:
    return Request(rid, list(tokens), len(tokens), SamplingParams(), max_new, 10_000, session_id=session)


def run_to_end(s: Scheduler, r: Request, token: int = 7) -> None:
    """Schedule and step until r has max_new_tokens outputs, then finish it by length."""
    while r.num_output_tokens < r.max_new_tokens:
        run_step(s, s.schedule(), token)
    s.finish(r, RequestStatus.FINISHED_LENGTH)


def turn1(s: Scheduler, session: str = "s", tokens: list[int] = PROMPT) -> Request:
    a = sreq(f"{session}-1", tokens, session)
    s.add_request(a)
    run_to_end(s, a)
    return a


def test_finished_turn_keeps_exactly_its_computed_tokens_and_blocks():
    kv, s, store, _ = setup()
    a = turn1(s)
    # 10 prompt tokens + 2 sampled (7, 7): the last sampled one was never computed.
    assert a.token_ids == PROMPT + [7, 7] and a.num_computed_tokens == 11
    assert store.token_ids("s") == PROMPT + [7]
    assert kv.held_table("s") == [0, 1, 2] and kv.block_table("s-1") == []
    assert [kv.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert store.stats().num_sessions == 1 and store.stats().num_blocks == 3
    kv.check_invariants()


def test_next_turn_takes_the_blocks_and_prefills_only_new_tokens_mid_block():
    kv, s, store, _ = setup()
    turn1(s)
    before, queried = s.num_prefill_tokens, kv.prefix_stats.queried_tokens
    b = sreq("s-2", PROMPT + [7, 7, 20, 21, 22])  # 15 tokens; the session computed the first 11
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("s-2", 4)]  # starts at token 11, inside block 2, which it writes in place
    assert b.num_computed_tokens == 11
    assert kv.block_table("s-2") == [0, 1, 2, 3] and kv.held_table("s") == []
    assert [kv.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 1]  # moved, not shared
    kv.check_invariants()
    run_step(s, out)
    assert s.num_prefill_tokens - before == 4 and store.hit_tokens == 11
    assert kv.prefix_stats.queried_tokens == queried  # a session start is not a prefix-cache lookup
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert store.token_ids("s") == PROMPT + [7, 7, 20, 21, 22]  # 15 computed; the sampled 16th is not
    assert kv.held_table("s") == [0, 1, 2, 3]
    assert store.close("s") and kv.usage().in_use == 0 and len(store) == 0
    kv.check_invariants()


@pytest.mark.parametrize("caching, kept, computed", [(False, [0, 1], 6), (True, [0], 4)])
def test_diverging_turn_keeps_the_common_prefix_and_releases_the_rest(caching, kept, computed):
    kv, s, store, _ = setup(caching=caching)
    turn1(s)
    b = sreq("s-2", PROMPT[:6] + [99, 98, 97])  # differs at token 6, inside block 1
    s.add_request(b)
    out = s.schedule()
    # Without the prefix cache block 1 is private and unhashed: written in place from token 6. With
    # it, block 1 is published as (5, 6, 7, 8) and must keep that content: the prefix is cut to block 0.
    assert b.num_computed_tokens == computed and plan(out) == [("s-2", 9 - computed)]
    assert kv.block_table("s-2")[:len(kept)] == kept
    if caching:
        # Blocks 1 and 2 were released: 1 stays in the prefix cache, 2 (never full) is merely free.
        assert kv.block_table("s-2") == [0, 3, 4] and kv.usage().cached == 1
    else:
        assert kv.block_table("s-2") == [0, 1, 3]  # block 2 was released to the back of the free queue
    kv.check_invariants()
    run_step(s, out)
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    store.close("s")
    assert kv.usage().in_use == 0
    kv.check_invariants()


def test_the_last_prompt_token_is_always_computed():
    kv, s, store, _ = setup()
    turn1(s)
    b = sreq("s-2", PROMPT + [7])  # exactly the session's computed tokens
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("s-2", 1)] and b.num_computed_tokens == 10 and out.scheduled[0].samples
    assert kv.block_table("s-2") == [0, 1, 2]
    kv.check_invariants()


def test_session_works_alongside_the_prefix_cache():
    kv, s, store, _ = setup(caching=True)
    turn1(s)
    assert [kv.blocks[i].block_hash is not None for i in range(3)] == [True, True, False]
    other = sreq("other", PROMPT + [7, 50], session=None)  # hits blocks 0, 1 the session holds
    s.add_request(other)
    out = s.schedule()
    assert other.num_computed_tokens == 8 and kv.block_table("other")[:2] == [0, 1]
    assert [kv.blocks[i].ref_count for i in range(3)] == [2, 2, 1]
    run_step(s, out)
    b = sreq("s-2", TURN2)
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("other", 1), ("s-2", 2)]  # block 2 (unhashed, the session's alone) written in place
    assert kv.block_table("s-2")[:3] == [0, 1, 2] and [kv.blocks[i].ref_count for i in range(3)] == [2, 2, 1]
    kv.check_invariants()


def test_max_sessions_evicts_the_least_recently_used_idle_one():
    kv, s, store, _ = setup(num_blocks=16, max_sessions=2)
    turn1(s, "x")
    turn1(s, "y")
    assert kv.held_table("x") == [0, 1, 2] and kv.held_table("y") == [3, 4, 5]
    turn1(s, "z")
    assert "x" not in store and "y" in store and "z" in store and store.num_evicted == 1
    assert kv.held_table("x") == [] and kv.held_table("z") == [6, 7, 8]
    assert kv.usage().in_use == 6
    kv.check_invariants()


def test_idle_sessions_expire_after_the_ttl():
    kv, s, store, clock = setup(num_blocks=16, ttl=10.0)
    turn1(s, "x")
    clock.now = 5.0
    turn1(s, "y")
    clock.now = 10.0
    store.expire()
    assert "x" in store  # exactly the TTL idle: not yet
    clock.now = 10.5
    store.expire()
    assert "x" not in store and "y" in store and kv.usage().in_use == 3
    clock.now = 15.5
    store.expire()
    assert len(store) == 0 and kv.usage().in_use == 0
    kv.check_invariants()


def test_expiry_walks_past_a_running_turns_session():
    kv, s, store, clock = setup(num_blocks=32, ttl=10.0)
    turn1(s, "y")
    clock.now = 1.0
    turn1(s, "x")
    clock.now = 2.0
    running = sreq("x-2", TURN2, session="x")
    s.add_request(running)
    run_step(s, s.schedule())  # x's next turn holds it (last used at 2)
    clock.now = 3.0
    turn1(s, "w")  # idle, and behind x in last-used order
    clock.now = 12.5
    turn1(s, "z")
    clock.now = 13.5  # y, x and w are past the TTL, z is not
    store.expire()
    assert "x" in store and "z" in store  # a held session never expires under its turn
    assert "y" not in store and "w" not in store  # and the walk goes on past it
    kv.check_invariants()


def test_admission_evicts_idle_sessions_before_refusing():
    kv, s, store, _ = setup(num_blocks=4)
    turn1(s, "x", tokens=PROMPT[:6])  # 7 computed: blocks 0, 1
    other = sreq("other", list(range(30, 39)), session=None, max_new=1)  # 9 tokens: 3 blocks, 2 free
    s.add_request(other)
    out = s.schedule()
    assert plan(out) == [("other", 9)] and "x" not in store and store.num_evicted == 1
    assert s.num_preemptions == 0
    kv.check_invariants()


def test_running_requests_evict_idle_sessions_before_anyone_is_preempted():
    kv, s, store, _ = setup(num_blocks=6)
    a = sreq("a", list(range(30, 38)), session=None, max_new=10)  # 8 tokens: blocks 0, 1
    x = sreq("x-1", PROMPT[:7], session="x")
    s.add_request(a)
    run_step(s, s.schedule())
    s.add_request(x)
    run_step(s, s.schedule())
    run_step(s, s.schedule())
    s.finish(x, RequestStatus.FINISHED_LENGTH)  # 8 computed tokens: blocks 3, 4 (a took 2 for its 9th)
    assert kv.block_table("a") == [0, 1, 2] and kv.held_table("x") == [3, 4] and kv.num_free_blocks == 1
    b = sreq("b", [40, 41, 42], session=None, max_new=4)
    s.add_request(b)
    run_step(s, s.schedule())  # b takes block 5, the last free one
    run_step(s, s.schedule())
    assert kv.num_free_blocks == 0 and "x" in store and a.num_tokens == 13 and b.num_tokens == 5
    out = s.schedule()  # a and b both need a new block: the idle session goes, nobody is preempted
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted == [] and s.num_preemptions == 0
    assert "x" not in store and store.num_evicted == 1
    assert kv.block_table("a") == [0, 1, 2, 4] and kv.block_table("b") == [5, 3]  # the tail is freed first
    kv.check_invariants()


def test_a_session_in_use_is_not_evictable_and_a_second_request_runs_without_it():
    kv, s, store, _ = setup(num_blocks=16)
    turn1(s)
    b = sreq("s-2", TURN2)
    c = sreq("s-3", PROMPT + [7, 7, 30])  # the same session, concurrently
    s.add_request(b)
    s.add_request(c)
    out = s.schedule()
    assert plan(out) == [("s-2", 2), ("s-3", 13)]  # c prefills all of its prompt
    assert kv.block_table("s-2") == [0, 1, 2, 3] and kv.block_table("s-3") == [4, 5, 6, 7]
    assert not store.evict_lru() and "s" in store
    run_step(s, out)
    s.finish(c, RequestStatus.FINISHED_LENGTH)  # finishes while b holds the session: not kept
    assert kv.usage().in_use == 4 and store.token_ids("s") == []
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert store.token_ids("s") == TURN2 and kv.held_table("s") == [0, 1, 2, 3]
    kv.check_invariants()


def two_concurrent_turns(s: Scheduler, max_new_second: int) -> tuple[Request, Request]:
    """Turn 1, then two turns on the same session admitted in one step: the first takes the session."""
    turn1(s)
    b = sreq("s-2", TURN2, max_new=1)
    c = sreq("s-3", PROMPT + [7, 7, 30], max_new=max_new_second)
    s.add_request(b)
    s.add_request(c)
    run_step(s, s.schedule())
    return b, c


def test_last_finished_turn_wins():
    kv, s, store, _ = setup(num_blocks=16)
    b, c = two_concurrent_turns(s, max_new_second=2)
    s.finish(b, RequestStatus.FINISHED_LENGTH)  # the holder ends first: its KV is the session's
    assert kv.held_table("s") == [0, 1, 2, 3]
    run_step(s, s.schedule())
    s.finish(c, RequestStatus.FINISHED_LENGTH)  # then c, which ran without it, replaces it
    assert store.token_ids("s") == PROMPT + [7, 7, 30, 7] and kv.held_table("s") == [4, 5, 6, 7]
    assert kv.usage().in_use == 4
    kv.check_invariants()


def running_turn2(s: Scheduler) -> Request:
    """Turn 1 finished, then turn 2 admitted and run one step: it holds the session."""
    turn1(s)
    b = sreq("s-2", TURN2)
    s.add_request(b)
    run_step(s, s.schedule())
    return b


def test_abort_frees_the_turn_and_the_session_it_took():
    kv, s, store, _ = setup()
    b = running_turn2(s)
    assert kv.usage().in_use == 4
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert "s" not in store and kv.usage().in_use == 0
    kv.check_invariants()


def test_abort_of_a_queued_turn_leaves_the_session_as_it_was():
    kv, s, store, _ = setup()
    turn1(s)
    b = sreq("s-2", TURN2)
    s.add_request(b)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert kv.held_table("s") == [0, 1, 2] and store.token_ids("s") == PROMPT + [7]
    kv.check_invariants()


def test_close_while_a_turn_runs_frees_that_turn_when_it_ends():
    kv, s, store, _ = setup()
    b = running_turn2(s)
    assert store.close("s") and not store.close("s")
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert "s" not in store and kv.usage().in_use == 0
    kv.check_invariants()


def test_zero_max_sessions_keeps_nothing():
    kv, s, store, _ = setup(max_sessions=0)
    turn1(s)
    assert len(store) == 0 and kv.usage().in_use == 0


def test_a_turn_running_without_its_session_may_evict_it_rather_than_be_preempted():
    kv, s, store, _ = setup(num_blocks=8)
    b, c = two_concurrent_turns(s, max_new_second=8)
    s.finish(b, RequestStatus.FINISHED_LENGTH)  # b took the session; now it keeps b's 13 computed tokens
    assert kv.held_table("s") == [0, 1, 2, 3] and kv.block_table("s-3") == [4, 5, 6, 7]
    for _ in range(3):
        run_step(s, s.schedule())
    assert c.num_computed_tokens == 16 and kv.num_free_blocks == 0
    out = s.schedule()  # c's 17th token needs a fifth block: its own session's idle blocks go first
    assert plan(out) == [("s-3", 1)] and s.num_preemptions == 0 and "s" not in store
    assert kv.block_table("s-3") == [4, 5, 6, 7, 3]
    kv.check_invariants()
