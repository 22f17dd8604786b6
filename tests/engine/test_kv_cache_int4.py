"""kv_cache_dtype="int4" (LMDeploy's quant_policy=4): K/V packed two values a byte with an fp16 scale and zero point
per token and KV head, through the whole engine: the native decode kernel against the torch reference (plain, chunked
and preempted runs), batch invariance (plain and prefix-cached), closeness to the unquantized cache, the block budget
and the config."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from llmserve.models import load_model
from llmserve.worker.model_runner import CacheSpec, cache_spec, num_blocks_for

# the batch, sampling, config and runner of the int8 tests; their native-vs-torch test covers int4 too
from tests.engine.test_kv_cache_int8 import GREEDY, PROMPTS, _config, _run, needs_native  # noqa: E402,F401


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_cache_stays_close_to_the_unquantized_run(tiny_model_dir, monkeypatch, arch: str, dtype: str) -> None:
    path = tiny_model_dir(arch)
    _, ids, lps = _run(path, monkeypatch, None, dtype=dtype)
    _, q_ids, q_lps = _run(path, monkeypatch, None, dtype=dtype, quant_policy=4)
    # The first token's logits saw the prompt's K/V fresh from the prefill (never through the cache): equal.
    # Not under qwen2's sliding window, whose prefill of a prompt longer than the window reads the cache.
    if arch == "llama":
        assert [i[0] for i in q_ids] == [i[0] for i in ids]
        assert [lp[0] for lp in q_lps] == pytest.approx([lp[0] for lp in lps], abs=1e-5 if dtype == "float32" else 0)
    # Later tokens read int4 K/V: the chosen tokens' logprobs stay within 0.5 nats while the sequences agree (the
    # tiny random models' logits are flat, so their greedy sequences part within a few tokens; int8 keeps 0.05)
    agreed = 0
    for a, b, ta, tb in zip(q_lps, lps, q_ids, ids):
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        agreed += same
        assert a[:same] == pytest.approx(b[:same], abs=0.5)
    assert agreed >= 3


def _greedy_ids(pipe, prompts: list[list[int]], together: bool) -> list[list[int]]:
    gen = GenerationConfig(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    if together:
        return [o.token_ids for o in pipe([{"input_ids": p} for p in prompts], gen_config=gen, do_preprocess=False)]
    return [pipe({"input_ids": p}, gen_config=gen, do_preprocess=False).token_ids for p in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["plain", "prefix_cached"])
def test_batched_equals_one_at_a_time(tiny_model_dir, dtype: str, mode: str) -> None:
    """Decodes read the cache per request and head, and the write quantizes per token: a request's tokens do not
    depend on what else runs in its step. Across modes they may differ, as with int8: a fresh prompt attends over its
    own unrounded K/V, a later chunk or a prefix hit over the cache's int4 ones. So chunked prefills and preemption
    are not here: a shared token budget cuts a request's first chunk differently in a batch than alone, and a
    preempted request's recompute attends over its generated tokens unrounded (checked: the tokens differ);
    test_kv_cache_int8.py::test_native_and_torch_paths_agree[int4] and test_preemption_on_both_paths cover them."""
    engine = {"dtype": dtype, "kv_cache_dtype": "int4", "enable_prefix_caching": mode == "prefix_cached"}
    with pipeline(tiny_model_dir("llama"), backend_config=_config(**engine)) as pipe:
        if mode == "prefix_cached":
            _greedy_ids(pipe, PROMPTS, together=False)  # fills the cache: both runs below hit it
        together = _greedy_ids(pipe, PROMPTS, together=True)
        alone = _greedy_ids(pipe, PROMPTS, together=False)
        if mode == "prefix_cached":
            assert pipe.engine.kv.prefix_stats.hit_tokens >= 3 * (len(PROMPTS[0]) // 4 * 4)
        pipe.engine.kv.check_invariants()
        assert pipe.engine.kv.usage().in_use == 0
    assert together == alone


@needs_native
def test_preemption_on_both_paths(tiny_model_dir, monkeypatch) -> None:
    """A pool too small for the batch: requests are preempted and recomputed, every block comes back, and the native
    kernels make the reference's tokens over the same schedule."""
    prompts = [list(range(3 + i, 30 + i)) for i in range(4)]
    ids = []
    for attention in (None, "torch"):
        if attention:
            monkeypatch.setenv("LLMSERVE_ATTENTION", attention)
        with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype="int4", num_blocks=16)) as pipe:
            ids.append(_greedy_ids(pipe, prompts, together=True))
            assert pipe.engine.scheduler.num_preemptions > 0
            pipe.engine.kv.check_invariants()
            assert pipe.engine.kv.usage().in_use == 0
    assert ids[0] == ids[1] and all(len(t) == 12 for t in ids[0])


def test_int4_budget_holds_nearly_twice_the_tokens_of_int8(tiny_model_dir) -> None:
    loaded = load_model(tiny_model_dir("llama"), EngineConfig(device="cpu", dtype="float32"))
    spec = cache_spec(loaded, "int4")
    assert spec.dtype == torch.uint8 and spec.quantized and spec.row == spec.head_dim // 2
    assert spec.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim // 2 + 4)
    blocks = num_blocks_for(loaded, 4, 1 << 20, 0.8, kv_cache_dtype="int4")
    assert blocks == (1 << 20) // (4 * spec.bytes_per_token)
    assert blocks > num_blocks_for(loaded, 4, 1 << 20, 0.8, kv_cache_dtype="int8")
    # at head_dim 64 (SmolLM2's), 36 bytes a row against int8's 68: 1.89x the tokens
    int4, int8 = (CacheSpec(30, 3, 64, d).bytes_per_token for d in (torch.uint8, torch.int8))
    assert int8 / int4 == pytest.approx(68 / 36)
    with pipeline(tiny_model_dir("llama"), backend_config=_config(kv_cache_dtype="int4")) as pipe:
        layer = pipe.engine.runner.model.attention_layers()[0]
        assert layer.kv_cache.shape[-1] == layer.head_dim // 2
        assert layer.kv_scales.shape == (*layer.kv_cache.shape[:-1], 2) and layer.kv_scales.dtype == torch.float16


def test_quant_policy_4_names_the_int4_cache() -> None:
    assert EngineConfig(quant_policy=4).kv_cache_dtype == "int4"
    assert EngineConfig(quant_policy=4, kv_cache_dtype="int4").kv_cache_dtype == "int4"
    assert EngineConfig(kv_cache_dtype="int4").quant_policy == 0
    with pytest.raises(InvalidRequestError, match="quant_policy: 4 means an int4 KV cache, which contradicts "
                                                  "kv_cache_dtype='int8'"):
        EngineConfig(quant_policy=4, kv_cache_dtype="int8")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype: must be auto, float32, bfloat16, float16, int8 or "
                                                  "int4, got 'int2'"):
        EngineConfig(kv_cache_dtype="int2")


def test_odd_head_dim_is_refused_for_int4() -> None:
    from types import SimpleNamespace

    layer = SimpleNamespace(num_kv_heads=2, head_dim=15)
    loaded = SimpleNamespace(model=SimpleNamespace(attention_layers=lambda: [layer]), dtype=torch.float32)
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype: int4 packs head_dim in pairs; this model's is 15"):
        cache_spec(loaded, "int4")  # type: ignore[arg-type]
    assert cache_spec(loaded, "int8").head_dim == 15  # type: ignore[arg-type]
