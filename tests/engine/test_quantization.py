"""quantization="int8" (weight-only int8) and "w8a8" (int8 weights and per-token int8 activations in the
decoder's linear layers), through the whole engine."""

from __future__ import annotations

import pytest
import torch

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from llmserve.kernels import native
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear
from llmserve.models.loader import check_w8a8

needs_w8a8 = pytest.mark.skipif(not native.w8a8_usable(), reason="w8a8 needs a CPU with AVX-512 and VNNI")

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 3, 8, 100, 4, 61], [7, 7, 19], list(range(3, 40))]
FIRST = GenerationConfig(temperature=0.0, max_new_tokens=1, ignore_eos=True, logprobs=20)


def _first_logprobs(model_dir: str, **engine) -> list[dict[int, float]]:
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", num_blocks=64, block_size=4,
                                                         **engine)) as pipe:
        modules = list(pipe.engine.runner.model.modules())
        method = engine.get("quantization")
        # int8: packed for kernels/cpu/packed_gemm.cpp where it runs, else row-major int8
        assert {(m.qweight is not None or m.int8_packed is not None) and m.wsum is None
                for m in modules if isinstance(m, Linear)} == {method == "int8"}
        assert {m.int8_packed is not None and m.wsum is not None
                for m in modules if isinstance(m, Linear)} == {method == "w8a8"}
        model = pipe.engine.runner.model
        embed, head = model.model.embed_tokens, model.lm_head or model.model.embed_tokens
        assert (embed.weight is None) == (method == "int8")  # int8 quantizes the lookup table too, w8a8 keeps it
        assert isinstance(head, VocabEmbedding)
        assert (head.qweight is not None or head.head_int8_packed is not None) == (method is not None)  # LM head
        out = pipe([{"input_ids": p} for p in PROMPTS], gen_config=FIRST, do_preprocess=False)
    return [o.logprobs[0] for o in out]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q/k/v
def test_int8_first_token_distribution_stays_close(tiny_model_dir, arch: str) -> None:
    path = tiny_model_dir(arch)
    plain, int8 = _first_logprobs(path), _first_logprobs(path, quantization="int8")
    for a, b in zip(plain, int8):
        common = set(a) & set(b)
        assert len(common) >= 15  # mostly the same top 20
        assert max(abs(a[t] - b[t]) for t in common) < 0.1  # per-channel int8 on random weights


@needs_w8a8
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_w8a8_first_token_distribution_stays_close(tiny_model_dir, arch: str) -> None:
    path = tiny_model_dir(arch)
    plain, w8a8 = _first_logprobs(path), _first_logprobs(path, quantization="w8a8")
    for a, b in zip(plain, w8a8):
        common = set(a) & set(b)
        assert len(common) >= 14
        assert max(abs(a[t] - b[t]) for t in common) < 0.25  # int8 activations too: looser than int8


@pytest.mark.parametrize("quantization", ["int8", pytest.param("w8a8", marks=needs_w8a8)])
def test_quantized_batched_equals_one_at_a_time(tiny_model_dir, quantization: str) -> None:
    """int8: prefill chunks take the dequantized path and decodes the native kernel; w8a8: every row of x has
    its own scale. Either way a request's tokens do not depend on what else is in the batch."""
    config = EngineConfig(dtype="float32", quantization=quantization, num_blocks=64, block_size=4)
    gen = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
        together = [o.token_ids for o in pipe([{"input_ids": p} for p in PROMPTS], gen_config=gen,
                                               do_preprocess=False)]
        alone = [pipe({"input_ids": p}, gen_config=gen, do_preprocess=False).token_ids for p in PROMPTS]
    assert together == alone


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", pytest.param("w8a8", marks=needs_w8a8)])
def test_quantized_smollm2_still_answers_paris(quantization: str) -> None:
    # "Answer in one sentence": the bare question's first token is a near tie ("The" vs "L'", 0.25 nats apart
    # in bf16, an exact tie of the bf16 logits under w8a8), which any 1-ulp change in a norm can flip; with
    # it, "The" leads by 1.5 nats in bf16, int8 and w8a8 alike.
    with pipeline(backend_config=EngineConfig(dtype="bfloat16", quantization=quantization)) as pipe:
        out = pipe("What is the capital of France? Answer in one sentence.",
                   gen_config=GenerationConfig(max_new_tokens=12, temperature=0))
    assert out.text == "The capital of France is Paris."


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="quantization: must be int8, w8a8, awq, gptq or unset, got 'int4'"):
        EngineConfig(quantization="int4")


def test_w8a8_refuses_what_it_cannot_run() -> None:
    with pytest.raises(InvalidRequestError, match="w8a8 runs on the CPU only .*cuda.*use int8"):
        check_w8a8(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(InvalidRequestError, match="w8a8 needs dtype float32 or bfloat16, got torch.float16"):
        check_w8a8(torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("missing,message", [("cpu", "w8a8 needs a CPU with AVX-512 and VNNI, which this one lacks"),
                                             ("build", "native CPU kernels, which did not build here")])
def test_w8a8_without_vnni_or_kernels_says_which(tiny_model_dir, monkeypatch: pytest.MonkeyPatch, missing: str,
                                                 message: str) -> None:
    monkeypatch.setattr(native, "w8a8_usable", lambda: False)
    if missing == "build":
        monkeypatch.setattr(native, "load", lambda: None)
    with pytest.raises(InvalidRequestError, match=message):
        with pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(dtype="float32", quantization="w8a8")):
            pass


def test_int8_without_the_packed_kernel_says_so(tiny_model_dir, caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="llmserve.models.loader"):
        config = EngineConfig(dtype="float16", quantization="int8", num_blocks=16)  # the packed GEMM: fp32/bf16 only
        with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
            out = pipe([{"input_ids": [5, 6, 7]}], max_new_tokens=2, ignore_eos=True, do_preprocess=False)
    assert "no packed int8 kernel for torch.float16" in caplog.text and len(out[0].token_ids) == 2
