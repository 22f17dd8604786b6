"""kv_cache_dtype: a 16-bit KV cache under a float32 model (the cache holds rounded K/V; compute is fp32)."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from llmserve.models import load_model
from llmserve.worker.model_runner import cache_spec, num_blocks_for

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 3, 8, 100, 4, 61], [7, 7, 19], list(range(3, 40))]
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=1)


def _run(model_dir: str, monkeypatch: pytest.MonkeyPatch, attention: str | None, **engine) -> list:
    if attention:
        monkeypatch.setenv("LLMSERVE_ATTENTION", attention)
    else:
        monkeypatch.delenv("LLMSERVE_ATTENTION", raising=False)
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", num_blocks=32, block_size=4,
                                                         **engine)) as pipe:
        caches = {layer.kv_cache.dtype for layer in pipe.engine.runner.model.attention_layers()}
        out = pipe([{"input_ids": p} for p in PROMPTS], gen_config=GREEDY, do_preprocess=False)
    return [caches, [o.token_ids for o in out], [o.logprobs for o in out]]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_narrow_cache_native_and_torch_paths_agree(tiny_model_dir, monkeypatch, kv_dtype: str) -> None:
    """Both decode paths read the same rounded K/V and accumulate in fp32: same tokens, near-equal logprobs."""
    path = tiny_model_dir("qwen2")  # mixed sliding-window and full layers
    native_caches, native_ids, native_lp = _run(path, monkeypatch, None, kv_cache_dtype=kv_dtype)
    torch_caches, torch_ids, torch_lp = _run(path, monkeypatch, "torch", kv_cache_dtype=kv_dtype)
    assert native_caches == torch_caches == {getattr(torch, kv_dtype)}
    assert native_ids == torch_ids
    for a, b in zip(native_lp, torch_lp):
        got = [next(iter(step.values())) for step in a]
        want = [next(iter(step.values())) for step in b]
        assert got == pytest.approx(want, abs=1e-4)


def test_narrow_cache_stays_close_to_fp32(tiny_model_dir, monkeypatch) -> None:
    path = tiny_model_dir("llama")
    caches, ids, lps = _run(path, monkeypatch, None)
    assert caches == {torch.float32}
    _, bf_ids, bf_lps = _run(path, monkeypatch, None, kv_cache_dtype="bfloat16")
    # First generated token of each prompt: its logits saw the prompt's K/V only from the fresh prefill
    # (not from the cache) in both runs, so it is identical; later ones read rounded K/V and stay close.
    assert [i[0] for i in bf_ids] == [i[0] for i in ids]
    for a, b in zip(bf_lps, lps):
        for step_a, step_b in zip(a, b):
            for token in set(step_a) & set(step_b):
                assert step_a[token] == pytest.approx(step_b[token], abs=5e-2)


def test_narrow_cache_doubles_the_blocks_of_a_byte_budget(tiny_model_dir) -> None:
    loaded = load_model(tiny_model_dir("llama"), EngineConfig(device="cpu", dtype="float32"))
    assert cache_spec(loaded).dtype == torch.float32
    assert cache_spec(loaded, "bfloat16").bytes_per_token * 2 == cache_spec(loaded).bytes_per_token
    wide = num_blocks_for(loaded, 4, 1 << 20, 0.8)
    assert num_blocks_for(loaded, 4, 1 << 20, 0.8, kv_cache_dtype="bfloat16") == 2 * wide


def test_bad_kv_cache_dtype_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype: must be auto, float32, bfloat16, float16, int8 or int4, got .int3."):
        EngineConfig(kv_cache_dtype="int3")
