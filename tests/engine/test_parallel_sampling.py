"""n > 1 shares the prompt: the siblings take the first sequence's full prompt blocks by reference and
compute only the tail, with or without the prefix cache; outputs equal n separate seeded requests."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.engine.kv_cache import KVCacheManager
from llmserve.engine.request import Request, RequestStatus
from llmserve.engine.scheduler import Scheduler
from llmserve.sampling.params import SamplingParams
from tests.engine.test_scheduler import plan, run_step


def siblings(n: int, n_prompt: int, max_new: int = 4) -> list[Request]:
    out: list[Request] = []
    for i in range(n):
        out.append(Request(f"p#{i}", list(range(1, n_prompt + 1)), n_prompt, SamplingParams(), max_new, 10_000,
                           parent_id="p", index=i, prompt_source=out[0] if out else None))
    return out


def queued_pair(n_prompt: int, budget: int = 64, batch: int = 8,
                caching: bool = False) -> tuple[KVCacheManager, Scheduler, Request, Request]:
    """An 8-block pool of 4-token blocks with two siblings of an n = 2 request queued."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
    s = Scheduler(kv, max_num_batched_tokens=budget, max_batch_size=batch)
    a, b = siblings(2, n_prompt)
    s.add_request(a)
    s.add_request(b)
    return kv, s, a, b


@pytest.mark.parametrize("caching", [False, True])
def test_siblings_wait_then_share_full_prompt_blocks_and_compute_the_tail(caching):
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
    s = Scheduler(kv, max_num_batched_tokens=64, max_batch_size=8)
    a, b, c = siblings(3, 10)
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    assert plan(out) == [("p#0", 10)]  # b and c wait for a's prompt instead of prefilling it too
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("p#0", 1), ("p#1", 2), ("p#2", 2)]  # 2 = 10 mod 4: only the partial block
    assert (b.num_computed_tokens, c.num_computed_tokens) == (8, 8)
    assert kv.block_table("p#0") == [0, 1, 2]
    assert kv.block_table("p#1") == [0, 1, 3]
    assert kv.block_table("p#2") == [0, 1, 4]
    assert [kv.blocks[i].ref_count for i in range(5)] == [3, 3, 1, 1, 1]
    assert b.prompt_source is None and c.prompt_source is None
    assert kv.prefix_stats.hit_tokens == 0  # a fork is not a prefix-cache hit
    kv.check_invariants()
    run_step(s, out)
    assert s.num_prefill_tokens == 10 + 2 + 2
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert [kv.blocks[i].ref_count for i in range(5)] == [2, 2, 0, 1, 1]
    kv.check_invariants()
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    s.finish(c, RequestStatus.FINISHED_LENGTH)
    kv.check_invariants()
    assert kv.usage().in_use == 0


def test_prompt_filling_its_blocks_recomputes_one_whole_block():
    kv, s, a, b = queued_pair(8)
    run_step(s, s.schedule())
    out = s.schedule()
    assert plan(out) == [("p#0", 1), ("p#1", 4)]  # the last prompt token must be computed for logits
    assert kv.block_table("p#1") == [0, 3]


def test_prompt_under_one_block_is_not_held_back():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_batch_size=8)
    for r in siblings(2, 3):
        s.add_request(r)
    assert plan(s.schedule()) == [("p#0", 3), ("p#1", 3)]  # nothing to share: no reason to wait


def test_siblings_wait_through_a_chunked_prompt():
    kv, s, a, b = queued_pair(10, budget=6)
    out = s.schedule()
    assert plan(out) == [("p#0", 6)]
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("p#0", 4)]  # a has 6 of the 8 shared tokens: b still waits
    run_step(s, out)
    assert plan(s.schedule()) == [("p#0", 1), ("p#1", 2)]
    kv.check_invariants()


@pytest.mark.parametrize("caching, b_table, b_computed", [(False, [3, 4, 5], 0), (True, [0, 1, 3], 8)])
def test_source_finished_before_the_sibling_starts_falls_back_to_a_normal_prefill(caching, b_table, b_computed):
    kv, s, a, b = queued_pair(10, batch=1, caching=caching)
    out = s.schedule()
    assert plan(out) == [("p#0", 10)]
    run_step(s, out)
    assert s.schedule().scheduled[0].request is a  # the batch is full: b cannot start
    s.finish(a, RequestStatus.FINISHED_LENGTH)
    out = s.schedule()
    assert plan(out) == [("p#1", 10 - b_computed)]  # a prefix-cache hit when caching is on
    assert kv.block_table("p#1") == b_table and b.num_computed_tokens == b_computed
    kv.check_invariants()


def test_sibling_waits_for_a_preempted_source_and_forks_after_its_recompute():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_batched_tokens=64, max_batch_size=8)
    x = Request("x", [9, 9, 9, 9], 4, SamplingParams(), 4, 10_000)
    a, b = siblings(2, 10)
    for r in (x, a, b):
        s.add_request(r)
    out = s.schedule()
    assert plan(out) == [("x", 4), ("p#0", 10)]  # all 4 blocks in use
    run_step(s, out)
    out = s.schedule()  # x needs a second block: a, the newest, is preempted before b started
    assert plan(out) == [("x", 1)] and out.preempted == [a]
    assert list(s.waiting) == [a, b] and b.prompt_source is a
    run_step(s, out)
    s.finish(x, RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert plan(out) == [("p#0", 11)]  # a recomputes its prompt and its token; b waits again
    run_step(s, out)
    out = s.schedule()
    assert plan(out) == [("p#0", 1), ("p#1", 2)]
    # Free queue after x finished: 2, 1 (a's, freed tail first, 3 went to x), then x's 3, 0.
    assert kv.block_table("p#0") == [2, 1, 3] and kv.block_table("p#1") == [2, 1, 0]
    kv.check_invariants()


# --- through the engine, on the tiny llama ---------------------------------------------------------

SAMPLED = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=10, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def engine_for(tiny_model_dir, caching: bool, num_blocks: int):
    return pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        dtype="float32", block_size=4, num_blocks=num_blocks, enable_prefix_caching=caching)).engine


def generate(engine, requests: dict[str, tuple[list[int], GenerationConfig]]) -> dict[tuple[str, int], list[int]]:
    out: dict[tuple[str, int], list[int]] = {}
    for rid, (ids, gen) in requests.items():
        engine.add_request(rid, ids, gen)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        engine.kv.check_invariants()
    assert engine.kv.usage().in_use == 0
    return out


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("n_prompt, tail", [(10, 2), (12, 4)])
def test_n4_computes_the_prompt_once_plus_three_tails(tiny_model_dir, caching, n_prompt, tail):
    engine = engine_for(tiny_model_dir, caching, num_blocks=64)
    generate(engine, {"r": (prompt(n_prompt), SAMPLED.replace(n=4, random_seed=3))})
    assert engine.scheduler.num_prefill_tokens == n_prompt + 3 * tail


@pytest.mark.parametrize("caching", [False, True])
def test_n4_equals_four_separate_seeded_requests_even_under_preemption(tiny_model_dir, caching):
    ids = prompt(10)
    alone = engine_for(tiny_model_dir, caching=False, num_blocks=64)
    expected = [generate(alone, {"s": (ids, SAMPLED.replace(random_seed=5 + i))})[("s", 0)] for i in range(4)]
    assert len({tuple(e) for e in expected}) == 4
    # 8 blocks: the 4 sequences need 2 shared + 4 x 3 own blocks at the end, so some are preempted.
    engine = engine_for(tiny_model_dir, caching, num_blocks=8)
    out = generate(engine, {"r": (ids, SAMPLED.replace(n=4, random_seed=5))})
    assert [out[("r", i)] for i in range(4)] == expected
    assert engine.scheduler.num_preemptions > 0
