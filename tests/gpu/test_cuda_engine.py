"""The engine on CUDA, against transformers on the same GPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from tests.engine.test_engine_vs_transformers import ARCHS, NEW_TOKENS, prompts
from tests.tiny_models import TINY_CONFIGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_greedy_matches_transformers_on_cuda(arch, dtype, tiny_model_dir):
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    from transformers import __version__ as hf_version

    model_type = TINY_CONFIGS[arch][0]
    if model_type not in CONFIG_MAPPING:  # InternLM3's config: in the pinned 5.24, not in the lent GPUs' 5.17
        pytest.skip(f"transformers {hf_version} has no {model_type} config to build the reference")
    torch_dtype = getattr(torch, dtype)
    # transformers' SDPA path drops Gemma 2's attention softcap (5.24 refuses SDPA for it; 5.17, on the lent GPUs, ran
    # it, up to 1.1 off on the first logprob): eager there. Elsewhere SDPA, whose fp32 accumulation is the engine's
    # (eager's bf16 softmax output put Gemma 3's bf16 logprob 0.06 from the engine's, where fp32 agrees to 1e-3)
    softcap = getattr(AutoConfig.from_pretrained(tiny_model_dir(arch)), "attn_logit_softcapping", None)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(arch), dtype=torch_dtype,
                                              attn_implementation="eager" if softcap else "sdpa").cuda().eval()
    config = EngineConfig(dtype=dtype, device="cuda", block_size=4, num_blocks=64, max_prefill_token_num=16)
    with pipeline(tiny_model_dir(arch), backend_config=config) as pipe:
        out = pipe([{"input_ids": p} for p in prompts()],
                   gen_config=GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                               logprobs=1))
        for p, r in zip(prompts(), out):
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, -1].float(), -1)
            first = r.token_ids[0]
            tol = 1e-3 if dtype == "float32" else 5e-2
            assert r.logprobs[0][first] == pytest.approx(ref[first].item(), abs=tol)
            if dtype == "float32":  # bf16 rounding may flip near-ties; fp32 must agree exactly
                assert first == int(ref.argmax())
        pipe.engine.kv.check_invariants()
        assert pipe.engine.kv.usage().in_use == 0


# the CPU engine needs the native extension, which a fresh GPU machine compiles first (146 s on an H100's 16 cores):
# on an H200 the llama case failed at a 60 s limit a test and the qwen2 case after it passed (2026-11-28)
@pytest.mark.timeout(420)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_int8_kv_cache_agrees_with_the_cpu_engine(arch, tiny_model_dir, monkeypatch):
    """An int8 cache on CUDA runs the torch reference (quantize on write, dequantize on read); the CPU engine's
    reference path reads the same bytes: same tokens, near-equal logprobs."""
    monkeypatch.setenv("LLMSERVE_ATTENTION", "torch")
    gen = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    runs = {}
    for device in ("cuda", "cpu"):
        config = EngineConfig(dtype="float32", device=device, kv_cache_dtype="int8", block_size=4, num_blocks=64,
                              max_prefill_token_num=16)
        with pipeline(tiny_model_dir(arch), backend_config=config) as pipe:
            assert {layer.kv_cache.dtype for layer in pipe.engine.runner.model.attention_layers()} == {torch.int8}
            runs[device] = pipe([{"input_ids": p} for p in prompts()], gen_config=gen)
            assert pipe.engine.kv.usage().in_use == 0
    # fp32 on two devices rounds differently, and a K/V element on a rounding edge lands one int8 step apart (seen:
    # 1.1e-3 on one logprob of 12): logprobs agree within a few such steps, and the tokens agree until a near-tie
    # (on this random model, at the 12th token of 2 of 16 runs), where both devices' top two are within that bound
    for a, b in zip(runs["cuda"], runs["cpu"]):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        for i in range(same):
            assert a.logprobs[i][a.token_ids[i]] == pytest.approx(b.logprobs[i][b.token_ids[i]], abs=5e-3)
        if same < len(a.token_ids):
            tie = b.logprobs[same]
            assert a.token_ids[same] in tie and abs(tie[a.token_ids[same]] - tie[b.token_ids[same]]) < 5e-3
