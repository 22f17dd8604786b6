"""Decode steps replayed from CUDA graphs give what eager steps give. Skipped without CUDA.

Requests of different lengths and output budgets, so the batch shrinks step by step through the captured sizes
and most steps pad their batch (padding rows must touch no request's cache)."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _requests(n: int) -> dict[str, tuple[list[int], GenerationConfig]]:
    g = torch.Generator().manual_seed(5)
    out = {}
    for i in range(n):
        ids = torch.randint(3, 300, (int(torch.randint(1, 60, (1,), generator=g)),), generator=g).tolist()
        out[f"r{i}"] = (ids, GenerationConfig(temperature=0.0, max_new_tokens=4 + i % 17, ignore_eos=True, logprobs=1))
    return out


def _run(model_dir: str, config: EngineConfig, requests) -> tuple[dict, dict]:
    tokens = {rid: [] for rid in requests}
    logprobs = {rid: [] for rid in requests}
    with pipeline(model_dir, backend_config=config) as pipe:
        engine = pipe.engine
        assert (engine.runner.graphs is not None) == (not config.enforce_eager)
        for rid, (ids, gen) in requests.items():
            engine.add_request(rid, ids, gen)
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
                logprobs[o.request_id] += [lp.logprob for lp in o.new_logprobs]
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0
    return tokens, logprobs


@pytest.mark.parametrize("arch,kv_dtype,quantization", [("llama", "auto", None), ("mistral", "auto", None),
                                                        ("qwen3", "auto", None), ("llama", "int8", None),
                                                        ("llama", "auto", "int8"), ("qwen3", "int8", "int8")])
def test_graphs_match_eager(arch, kv_dtype, quantization, tiny_model_dir):
    """Int8 weights (kernels/triton/int8.py's GEMM) are captured as unquantized ones are."""
    requests = _requests(37)
    base = dict(dtype="float32", device="cuda", kv_cache_dtype=kv_dtype, block_size=4, num_blocks=600,
                max_batch_size=40, max_prefill_token_num=64, quantization=quantization)
    eager = _run(tiny_model_dir(arch), EngineConfig(**base, enforce_eager=True), requests)
    graphs = _run(tiny_model_dir(arch), EngineConfig(**base), requests)
    assert graphs[0] == eager[0]
    for rid, (_, gen) in requests.items():
        assert len(graphs[1][rid]) == gen.max_new_tokens
        assert graphs[1][rid] == pytest.approx(eager[1][rid], abs=1e-4)


def test_graphs_under_preemption(tiny_model_dir):
    """A pool too small for the batch: requests are preempted and recomputed between graph steps."""
    requests = _requests(24)
    base = dict(dtype="float32", device="cuda", block_size=4, num_blocks=40, max_batch_size=24,
                max_prefill_token_num=32)
    eager = _run(tiny_model_dir("llama"), EngineConfig(**base, enforce_eager=True), requests)
    graphs = _run(tiny_model_dir("llama"), EngineConfig(**base), requests)
    assert graphs[0] == eager[0]
