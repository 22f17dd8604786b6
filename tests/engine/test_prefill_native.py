"""Native prefill attention through the whole engine: the same tokens and logprobs as the torch reference
(LLMSERVE_ATTENTION=torch), over fresh prompts, chunked prefills and prefix-cache hits, windows included."""

from __future__ import annotations

import pytest

from llmserve import EngineConfig, GenerationConfig, pipeline
from llmserve.kernels import native

pytestmark = pytest.mark.skipif(not native.prefill_attention_usable(),
                                reason="native prefill attention needs the extension and a CPU with AVX-512")

SHARED = [5, 17, 33, 2, 9, 41, 77, 12, 3, 8, 100, 4, 61, 7, 7, 19, 23, 29, 31, 37, 43, 47, 53, 59]
PROMPTS = [SHARED + [60, 70, 80], list(range(3, 70)), SHARED + list(range(90, 130)), [11, 12]]
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True, logprobs=3)


def _run(model_dir: str, monkeypatch: pytest.MonkeyPatch, attention: str | None, dtype: str) -> tuple[list, list]:
    if attention:
        monkeypatch.setenv("LLMSERVE_ATTENTION", attention)
    else:
        monkeypatch.delenv("LLMSERVE_ATTENTION", raising=False)
    # 16-token step budget: prompts are prefilled in chunks that read earlier chunks from the cache; prompt 3
    # finds prompt 1's 24 shared tokens (6 blocks of 4) in the prefix cache
    config = EngineConfig(dtype=dtype, num_blocks=128, block_size=4, max_prefill_token_num=16,
                          enable_prefix_caching=True)
    with pipeline(model_dir, backend_config=config) as pipe:
        first = pipe([{"input_ids": PROMPTS[0]}], gen_config=GREEDY, do_preprocess=False)
        rest = pipe([{"input_ids": p} for p in PROMPTS[1:]], gen_config=GREEDY, do_preprocess=False)
    out = first + rest
    return [o.token_ids for o in out], [o.logprobs for o in out]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])  # windows 4 and 5; head_dim 16 and 32
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_prefill_matches_reference(tiny_model_dir, monkeypatch, arch: str, dtype: str) -> None:
    path = tiny_model_dir(arch)
    ids, lps = _run(path, monkeypatch, None, dtype)
    ref_ids, ref_lps = _run(path, monkeypatch, "torch", dtype)
    if dtype == "float32":
        assert ids == ref_ids
    tol = 1e-4 if dtype == "float32" else 0.1  # bf16: outputs rounded to bf16 differ by an ulp here and there
    for seq, ref_seq, a, b in zip(ids, ref_ids, lps, ref_lps):
        for tok, ref_tok, step_a, step_b in zip(seq, ref_seq, a, b):
            for token in set(step_a) & set(step_b):
                assert step_a[token] == pytest.approx(step_b[token], abs=tol)
            if tok != ref_tok:  # bf16 only: a near tie, then the sequences part (a random tiny model's flat logits)
                assert step_a[tok] == pytest.approx(step_a[ref_tok], abs=tol)
                break
