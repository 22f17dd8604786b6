from __future__ import annotations

from llmserve.engine.kv_cache import KVCacheManager, KVCacheUsage
from llmserve.engine.request import Request
from llmserve.sampling.params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), len(tokens), SamplingParams(), max_new_tokens=8, max_total_tokens=1000)


def test_allocate_takes_blocks_in_order_and_free_returns_them():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = req("a", list(range(6))), req("b", list(range(9)))
    assert kv.allocate(a, 6)
    assert kv.allocate(b, 9)
    assert kv.block_table("a") == [0, 1]
    assert kv.block_table("b") == [2, 3, 4]
    a.num_computed_tokens = 6
    assert kv.allocate(a, 2)  # 8 tokens: still two blocks
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate(a, 3)  # 9 tokens: a third block
    assert kv.block_table("a") == [0, 1, 5]
    kv.check_invariants()
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    assert kv.usage() == KVCacheUsage(total=8, free=8, cached=0, in_use=0)


def test_allocate_refuses_without_side_effects_when_pool_is_short():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = req("a", list(range(12))), req("b", list(range(8)))
    assert kv.allocate(a, 12)
    assert not kv.allocate(b, 8)
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 1
    kv.check_invariants()


def test_prefix_hit_reuses_blocks_and_always_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(10)))
    assert kv.allocate(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)  # blocks 0 and 1 are full: cached; block 2 holds 2 tokens: not
    kv.free(a)
    assert kv.usage() == KVCacheUsage(total=8, free=6, cached=2, in_use=0)
    b = req("b", list(range(8)) + [99, 98])
    assert kv.find_cached_prefix(b) == [0, 1]
    exact = req("c", list(range(8)))  # whole prompt cached: the last block must be recomputed
    assert kv.find_cached_prefix(exact) == [0]
    other = req("d", [5] + list(range(1, 8)) + [1])
    assert kv.find_cached_prefix(other) == []
    assert kv.allocate(b, 2, [0, 1])
    assert kv.block_table("b") == [0, 1, 3]  # never-used blocks are at the front of the free queue
    kv.check_invariants()


def test_prefix_blocks_shared_by_two_running_requests_are_ref_counted():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    b = req("b", [1, 2, 3, 4, 7])
    prefix = kv.find_cached_prefix(b)
    assert prefix == [0, 1]
    assert kv.allocate(b, 1, prefix)
    assert kv.blocks[0].ref_count == 2 and kv.blocks[1].ref_count == 2
    kv.free(a)
    assert kv.blocks[0].ref_count == 1
    assert kv.usage().in_use == 3  # 0, 1 shared and b's own tail block
    kv.free(b)
    kv.check_invariants()
    assert kv.usage() == KVCacheUsage(total=6, free=4, cached=2, in_use=0)


def test_eviction_is_least_recently_used_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a, b = req("a", [1, 2, 3]), req("b", [7, 8, 9])
    for r in (a, b):
        assert kv.allocate(r, 3)
        r.num_computed_tokens = 3
        kv.cache_full_blocks(r)
    assert kv.block_table("a") == [0, 1] and kv.block_table("b") == [2, 3]
    kv.free(a)  # queue: 1, 0 (tail released first)
    kv.free(b)  # queue: 1, 0, 3, 2
    # Touch a's prefix again so it becomes the most recently used.
    c = req("c", [1, 2, 5])
    assert kv.allocate(c, 1, kv.find_cached_prefix(c))  # takes cached 0, then evicts 1 (uncached tail)
    assert kv.block_table("c") == [0, 1]
    kv.free(c)  # queue: 3, 2, 1, 0
    d = req("d", [4, 4, 4, 4, 4])
    assert kv.allocate(d, 5)  # needs 3 blocks: takes 3, 2 (b's cached prefix evicted), then 1
    assert kv.block_table("d") == [3, 2, 1]
    assert kv.find_cached_prefix(req("e", [7, 8, 0])) == []  # b's prefix is gone
    assert kv.find_cached_prefix(req("f", [1, 2, 0])) == [0]  # a's survived
    kv.check_invariants()


def test_hash_chain_depends_on_the_whole_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 0])
    assert kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free(a)
    # Same second block, different first block: no hit on the second either.
    assert kv.find_cached_prefix(req("b", [9, 9, 3, 4, 0])) == []
    assert kv.find_cached_prefix(req("c", [1, 2, 3, 4, 0])) == [0, 1]


def test_blocks_published_step_by_step_are_those_published_at_once():
    """cache_full_blocks looks only at the blocks filled since its last call: a request decoding token by token
    publishes exactly what one call at the end publishes, and a later request hits all of it; after a free (as
    on preemption) the recomputed request publishes again from its first block."""
    tokens = list(range(3, 40))
    step_by_step = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    a = req("a", tokens[:5])
    assert step_by_step.allocate(a, 5)
    a.num_computed_tokens = 5
    step_by_step.cache_full_blocks(a)
    for t in tokens[5:]:
        a.token_ids.append(t)
        assert step_by_step.allocate(a, 1)
        a.num_computed_tokens += 1
        step_by_step.cache_full_blocks(a)
    at_once = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    b = req("a", tokens)
    assert at_once.allocate(b, len(tokens))
    b.num_computed_tokens = len(tokens)
    at_once.cache_full_blocks(b)
    assert set(step_by_step._cached) == set(at_once._cached) and len(at_once._cached) == len(tokens) // 4
    later = req("c", tokens + [1])
    assert len(step_by_step.find_cached_prefix(later)) == len(tokens) // 4
    step_by_step.free(a)
    step_by_step.reset_prefix_cache()  # forget the published blocks: only a new publication brings them back
    a.num_computed_tokens = 0
    assert step_by_step.allocate(a, len(a.token_ids))
    a.num_computed_tokens = len(a.token_ids)
    step_by_step.cache_full_blocks(a)
    assert len(step_by_step.find_cached_prefix(later)) == len(tokens) // 4
    step_by_step.check_invariants()
