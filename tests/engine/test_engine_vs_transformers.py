"""Every architecture, through the whole engine, token for token against transformers (fp32, greedy):
plainly batched, with every prompt chunked, and with preemption forced by a tiny block pool."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.kernels import native
from llmserve.layers.linear import Linear

ARCHS = ["llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "internlm3",
         "mixtral", "qwen2-moe", "qwen3-moe"]
PROMPT_LENS = [3, 5, 9, 14, 17, 23, 31, 40]
NEW_TOKENS = 12


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]


# transformers 5.23's generate() disagrees with its own cache-free forward on Qwen2 with mixed full and
# sliding-window layers (its sliding cache layer drops context the full forward attends to); we follow
# the forward, the model's definition: a greedy loop that recomputes the whole sequence each token.
CACHE_FREE_REFERENCE = {"qwen2"}
# Phi-3's generate() drops its cache once a sequence passes original_max_position_embeddings and recomputes every
# position with the long longrope factors; a KV cache keeps each position's rotation (layers/rotary.py), as
# transformers' own model does when run token by token over its cache: that loop is the reference here.
CACHED_LOOP_REFERENCE = {"phi3"}


def hf_greedy(model_dir: str, prompt: list[int], cache_free: bool = False, cached_loop: bool = False) -> list[int]:
    model = _hf_model(model_dir)
    if cached_loop:
        from transformers import DynamicCache

        seq, cache = list(prompt), DynamicCache(config=model.config)
        with torch.no_grad():
            logits = model(torch.tensor([seq]), past_key_values=cache, use_cache=True).logits
            for _ in range(NEW_TOKENS):
                seq.append(int(logits[0, -1].argmax()))
                logits = model(torch.tensor([seq[-1:]]), past_key_values=cache, use_cache=True,
                               position_ids=torch.tensor([[len(seq) - 1]])).logits
        return seq[len(prompt):]
    if cache_free:
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(prompt):]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


_HF_CACHE: dict[str, object] = {}


def _hf_model(model_dir: str):  # one load per directory for the module
    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
    return _HF_CACHE[model_dir]


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> dict[str, list[list[int]]]:
    return {arch: [hf_greedy(tiny_model_dir(arch), p, arch in CACHE_FREE_REFERENCE, arch in CACHED_LOOP_REFERENCE)
                   for p in prompts()] for arch in ARCHS}


GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
MODES = {
    "plain": dict(),
    "chunked": dict(max_prefill_token_num=7),  # every prompt longer than 7 tokens is prefilled in chunks
    "preempted": dict(num_blocks=16, block_size=4),  # 8 prompts need up to 13 blocks each
    "prefix-cached": dict(enable_prefix_caching=True, block_size=4),  # the batch runs twice: 2nd run hits
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(arch, mode, tiny_model_dir, expected):
    config = EngineConfig(dtype="float32", **{"block_size": 8, **MODES[mode]})
    with pipeline(tiny_model_dir(arch), backend_config=config) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()], gen_config=GREEDY)
        engine = pipe.engine
        assert [r.token_ids for r in out] == expected[arch]
        assert all(r.finish_reason == "length" and r.generate_token_len == NEW_TOKENS for r in out)
        if mode == "preempted":
            assert engine.scheduler.num_preemptions > 0
        if mode == "prefix-cached":
            again = pipe([{"input_ids": p} for p in prompts()], gen_config=GREEDY)
            assert [r.token_ids for r in again] == expected[arch]
            # Every full block of each prompt is a hit, except one holding the prompt's last token.
            assert engine.kv.prefix_stats.hit_tokens == sum((n - 1) // 4 * 4 for n in PROMPT_LENS) == 124
        engine.kv.check_invariants()
        assert engine.kv.usage().in_use == 0


# An fp32 model's linears run the kernel measured fastest on the machine (kernels/calibrate.py, fp32_linear): each
# pinned here, so both are checked whatever this machine would measure
FP32_KERNELS = [pytest.param("fma", marks=pytest.mark.skipif(not native.fp32_gemm_usable(),
                                                            reason="fp32_gemm needs AVX2 and FMA")),
                pytest.param("onednn", marks=pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                                               reason="needs oneDNN"))]


@pytest.mark.parametrize("kernel", FP32_KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_each_fp32_kernel_matches_transformers(arch, kernel, tiny_model_dir, expected):
    """Batched, every prompt chunked, preempted (a pool of 16 blocks of 4 tokens), on one fp32 linear kernel."""
    config = EngineConfig(dtype="float32", kernel_choice=f"fp32_linear={kernel}", max_prefill_token_num=7,
                          num_blocks=16, block_size=4)
    with pipeline(tiny_model_dir(arch), backend_config=config) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()], gen_config=GREEDY)
        engine = pipe.engine
        assert [r.token_ids for r in out] == expected[arch]
        assert engine.scheduler.num_preemptions > 0
        linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear) and m.matmul is not None]
        assert linears and {m.matmul.kernel for m in linears} == {kernel}


@pytest.mark.parametrize("arch", ARCHS)
def test_first_step_logprobs_match_transformers(arch, tiny_model_dir):
    model = _hf_model(tiny_model_dir(arch))
    with pipeline(tiny_model_dir(arch), backend_config=EngineConfig(dtype="float32")) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()], temperature=0.0, max_new_tokens=1, logprobs=5,
                   ignore_eos=True)
    for p, r in zip(prompts(), out):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([p])).logits[0, -1].float(), -1)
        top = torch.topk(ref, 5)
        got = r.logprobs[0]
        assert set(got) >= set(top.indices.tolist())
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert got[tid] == pytest.approx(lp, abs=1e-4)  # fp32 logits within 1e-4
