from __future__ import annotations

import pytest

from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.errors import PromptTooLongError
from llmserve.sampling.params import SamplingParams


def req(rid: str, n_prompt: int, max_new: int = 4) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), n_prompt, SamplingParams(), max_new, 10_000)


def run_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> None:
    """What the engine does after the model ran: advance, then append a token to samplers."""
    samplers = [x.request for x in out.scheduled if x.samples]
    s.update_after_step(out)
    for r in samplers:
        r.append_token(token)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def test_decodes_first_then_chunked_prefill_under_token_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=8, max_batch_size=8)
    a, b = req("a", 3), req("b", 13)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("a", 3), ("b", 5)]  # b gets the remaining budget as a first chunk
    assert [x.samples for x in out.scheduled] == [True, False]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 7)]  # a decodes first; b continues its prefill
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]  # b's last prompt token: it samples now
    assert [x.samples for x in out.scheduled] == [True, True]
    run_step(s, out)
    assert b.num_computed_tokens == 13 and b.num_tokens == 14


def test_max_batch_size_caps_running_requests():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=100, max_batch_size=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 2))
    out = s.schedule()
    assert plan(out) == [("r0", 2), ("r1", 2)]
    run_step(s, out)
    s.finish(out.scheduled[0].request, RequestStatus.FINISHED_STOPPED)
    assert plan(s.schedule()) == [("r1", 1), ("r2", 2)]


def test_preemption_frees_newest_and_recomputes_it_later():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=16, max_batch_size=8)
    a, b = req("a", 4, max_new=4), req("b", 4, max_new=4)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("a", 4), ("b", 4)]
    assert kv.block_table("a") == [0, 1] and kv.block_table("b") == [2, 3]
    run_step(s, out)  # both now hold 5 tokens: each needs a third block, the pool has none
    out = s.schedule()
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.token_ids == [1, 2, 3, 4, 7]  # its generated token is kept
    assert kv.block_table("a") == [0, 1, 3]
    kv.check_invariants()
    run_step(s, out)
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    out = s.schedule()
    assert plan(out) == [("b", 5)]  # recompute prompt + generated token, then sample the next
    assert out.scheduled[0].samples
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    kv.check_invariants()
    assert kv.usage().in_use == 0


def test_preempting_itself_when_alone_cannot_happen_because_admission_refuses():
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=16, max_batch_size=8)
    with pytest.raises(PromptTooLongError, match="needs 3 KV blocks but the pool has 2"):
        s.add_request(req("big", 4, max_new=2))
    assert not s.has_unfinished()


def test_waiting_queue_is_first_come_first_served():
    kv = KVCacheManager(num_blocks=3, block_size=2, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=16, max_batch_size=8)
    big, small = req("big", 4, max_new=2), req("small", 1, max_new=1)
    s.add_request(req("first", 3, max_new=1))
    s.add_request(big)
    s.add_request(small)
    out = s.schedule()
    # "big" needs 2 blocks, 1 is free: it waits, and "small" does not jump the queue.
    assert plan(out) == [("first", 3)]


def test_prefix_cache_hit_starts_with_computed_tokens():
    kv = KVCacheManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    s = Scheduler(kv, max_num_batched_tokens=64, max_batch_size=8)
    a = req("a", 7)
    s.add_request(a)
    out = s.schedule()
    run_step(s, out)
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    b = req("b", 7)  # same prompt
    s.add_request(b)
    out = s.schedule()
    assert plan(out) == [("b", 1)]  # 3 full blocks (6 tokens) hit; the last token is computed
    assert b.num_computed_tokens == 6
    assert kv.block_table("b")[:3] == kv.block_table("b")[:3] == [0, 1, 2]
    assert kv.prefix_stats.hit_tokens == 6 and kv.prefix_stats.queried_tokens == 14
