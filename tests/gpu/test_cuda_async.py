"""Async scheduling on CUDA, where it is on by default: steps replayed from CUDA graphs with the previous step's
tokens still on the device give what synchronous graph steps give. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from tests.engine.test_async_scheduling import Ahead, ids, run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = GenerationConfig(temperature=0.0, ignore_eos=True)


def _both(model_dir: str, requests, num_blocks: int, **kw) -> tuple[dict, dict, int, int, int]:
    results, ahead, graphs, started = [], 0, 0, 0
    for flag in (False, True):
        config = EngineConfig(dtype="float32", device="cuda", block_size=4, num_blocks=num_blocks, max_batch_size=24,
                              max_prefill_token_num=64, async_scheduling=None if flag else False)
        with pipeline(model_dir, backend_config=config) as pipe:
            engine = pipe.engine
            assert engine.async_scheduling == flag and engine.runner.graphs is not None
            counter = Ahead(engine)
            used: list[bool] = []

            def counted(*a, replays=engine.runner.graphs.run, used=used, **k):
                used.append(k.get("prev") is not None)
                return replays(*a, **k)

            engine.runner.graphs.run = counted
            results.append(run(engine, requests, **kw))
            if flag:
                ahead, graphs, started = counter.count, sum(used), counter.started
    return results[0], results[1], ahead, graphs, started


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_async_graph_steps_match_synchronous_ones(arch, tiny_model_dir):
    requests = {f"r{i}": (ids(1 + (7 * i) % 50, i), GREEDY.replace(max_new_tokens=3 + i % 13)) for i in range(30)}
    for i in (4, 9, 17):  # stop tokens at steps the engine cannot know ahead: their next step is computed, dropped
        requests[f"r{i}"] = (requests[f"r{i}"][0], requests[f"r{i}"][1].replace(stop_token_ids=[5, 77, 123, 250]))
    for i in (2, 11, 25):  # logprobs: computed on the device and copied back with the tokens
        requests[f"r{i}"] = (requests[f"r{i}"][0], requests[f"r{i}"][1].replace(logprobs=i % 4))
    from tests.structured.test_engine_structured import FORMATS

    for i, fmt in zip((8, 14, 27), FORMATS.values()):  # grammars: the next step's mask follows the token in flight
        requests[f"r{i}"] = (requests[f"r{i}"][0], requests[f"r{i}"][1].replace(response_format=fmt))
    for i in (6, 21):  # penalties: the next step waits for the token in flight, which they count
        requests[f"r{i}"] = (requests[f"r{i}"][0], requests[f"r{i}"][1].replace(repetition_penalty=1.4,
                                                                               frequency_penalty=0.5))
    want, got, ahead, graphs, started = _both(tiny_model_dir(arch), requests, 600,
                                     arrivals={0: [f"r{i}" for i in range(20)], 12: [f"r{i}" for i in range(20, 30)]},
                                     aborts={9: ["r1"], 14: ["r20"]})
    for rid in ("r1", "r20"):  # aborted: a prefix of the same greedy tokens, however many steps had run
        (a, _), (b, _) = want.pop(rid), got.pop(rid)
        shorter, longer = sorted((a, b), key=len)
        assert longer[:len(shorter)] == shorter
    assert got == want
    assert ahead >= 10 and graphs >= 10  # steps launched ahead, replayed from the graphs with device-side ids
    assert started >= 1  # late arrivals started in eager steps launched ahead (their prompts beside the decodes)


def test_async_graph_steps_under_preemption(tiny_model_dir):
    requests = {f"p{i}": (ids(10 + i, 40 + i), GREEDY.replace(max_new_tokens=12 + i % 5)) for i in range(16)}
    want, got, ahead, _, _ = _both(tiny_model_dir("llama"), requests, 40)
    assert got == want and ahead >= 3
