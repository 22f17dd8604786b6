"""quantization="int8": weight-only int8 linear layers, through the whole engine."""

from __future__ import annotations

import pytest

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.errors import InvalidRequestError
from llmserve.layers.linear import Linear

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 3, 8, 100, 4, 61], [7, 7, 19], list(range(3, 40))]
FIRST = GenerationConfig(temperature=0.0, max_new_tokens=1, ignore_eos=True, logprobs=20)


def _first_logprobs(model_dir: str, **engine) -> list[dict[int, float]]:
    with pipeline(model_dir, backend_config=EngineConfig(dtype="float32", num_blocks=64, block_size=4,
                                                         **engine)) as pipe:
        linears = [m for m in pipe.engine.runner.model.modules() if isinstance(m, Linear)]
        quantized = {m.qweight is not None for m in linears}
        assert quantized == {engine.get("quantization") == "int8"}
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


def test_int8_batched_equals_one_at_a_time(tiny_model_dir) -> None:
    """Prefill chunks take the dequantized path and decodes the native kernel; a request's tokens do not
    depend on what else is in the batch."""
    config = EngineConfig(dtype="float32", quantization="int8", num_blocks=64, block_size=4)
    gen = GenerationConfig(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with pipeline(tiny_model_dir("llama"), backend_config=config) as pipe:
        together = [o.token_ids for o in pipe([{"input_ids": p} for p in PROMPTS], gen_config=gen,
                                               do_preprocess=False)]
        alone = [pipe({"input_ids": p}, gen_config=gen, do_preprocess=False).token_ids for p in PROMPTS]
    assert together == alone


@pytest.mark.slow
def test_int8_smollm2_still_answers_paris() -> None:
    with pipeline(backend_config=EngineConfig(dtype="bfloat16", quantization="int8")) as pipe:
        out = pipe("What is the capital of France?", gen_config=GenerationConfig(max_new_tokens=12, temperature=0))
    assert out.text == "The capital of France is Paris."


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="quantization: must be int8 or unset, got 'int4'"):
        EngineConfig(quantization="int4")
