"""Our models vs transformers on the same token ids: a batched prefill, decode steps through the
paged KV cache, and a chunked prefill mixed with decodes. fp32 on both sides; atol 1e-4 on logits
whose standard deviation is ~0.8 (observed differences are ~2e-6)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmserve.config import EngineConfig
from llmserve.models import load_model
from tests.tiny_models import TINY_CONFIGS, TRAINING_TEXT, PagedRunner, hf_logits, make_hf_model

ATOL = 1e-4
CLASSES = {"llama": "LlamaForCausalLM", "llama-tied": "LlamaForCausalLM", "llama3-rope": "LlamaForCausalLM",
           "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
           "phi3": "Phi3ForCausalLM", "internlm3": "InternLM3ForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen2-moe": "Qwen2MoeForCausalLM", "qwen3-moe": "Qwen3MoeForCausalLM"}


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def _load(path: str) -> tuple:
    lm = load_model(path, EngineConfig(dtype="float32", device="cpu"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return lm, hf


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
def test_prefill_then_decode_matches_transformers(arch: str, tiny_model_dir) -> None:
    lm, hf = _load(tiny_model_dir(arch))
    assert type(lm.model).__name__ == CLASSES[arch]
    prompts = [lm.tokenizer(t).input_ids for t in TRAINING_TEXT[:3]]
    assert min(len(p) for p in prompts) > 5  # longer than the sliding windows (4 and 5)
    runner = PagedRunner(lm.model, block_size=4)
    out = runner.step(list(enumerate(prompts)))  # one flat batch of three prompts
    for i, p in enumerate(prompts):
        _close(out[i], hf_logits(hf, p))
    seqs = [list(p) for p in prompts]
    for _ in range(4):  # greedy decode, all three sequences in one step each time
        for i in range(3):
            seqs[i].append(int(out[i][-1].argmax()))
        out = runner.step([(i, [seqs[i][-1]]) for i in range(3)])
        for i in range(3):
            _close(out[i][-1], hf_logits(hf, seqs[i])[-1])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2-moe"])
def test_chunked_prefill_mixed_with_decodes(arch: str, tiny_model_dir) -> None:
    lm, hf = _load(tiny_model_dir(arch))
    a, b = (lm.tokenizer(t).input_ids for t in TRAINING_TEXT[:2])
    runner = PagedRunner(lm.model, block_size=4)
    runner.step([(0, a)])
    a.append(5)
    # seq 1 arrives in chunks of 3 and 7 tokens while seq 0 decodes
    c1, c2 = b[:3], b[3:10]
    out = runner.step([(1, c1), (0, [5])])
    _close(out[0][-1], hf_logits(hf, a)[-1])
    _close(out[1], hf_logits(hf, c1))
    a.append(7)
    out = runner.step([(0, [7]), (1, c2)])
    _close(out[0][-1], hf_logits(hf, a)[-1])
    _close(out[1], hf_logits(hf, b[:10])[3:])


def test_tied_embeddings_share_one_weight(tiny_model_dir) -> None:
    lm, hf = _load(tiny_model_dir("llama-tied"))
    assert lm.model.lm_head is None
    assert "lm_head.weight" not in dict(lm.model.named_parameters())
    torch.testing.assert_close(lm.model.model.embed_tokens.weight, hf.lm_head.weight, atol=0, rtol=0)


def test_sliding_windows_per_layer(tiny_model_dir) -> None:
    windows = {arch: [a.sliding_window for a in load_model(tiny_model_dir(arch), EngineConfig()).model
                      .attention_layers()] for arch in ("mistral", "qwen2", "qwen3", "llama")}
    # qwen2: max_window_layers=1 -> layers >= 1 slide (transformers' reading)
    assert windows == {"mistral": [5, 5], "qwen2": [None, 4, 4], "qwen3": [None, None], "llama": [None, None]}


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sliding_window_changes_the_reference(arch: str, tiny_model_dir) -> None:
    # Guards the comparison above: with these prompts the window must change the logits.
    _, hf = _load(tiny_model_dir(arch))
    no_window = make_hf_model(arch, sliding_window=None, use_sliding_window=False)
    no_window.load_state_dict(hf.state_dict())
    ids = list(range(3, 15))
    assert (hf_logits(hf, ids) - hf_logits(no_window, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
], ids=lambda r: r["rope_type"])
def test_rope_scaling_logits_match_transformers(rope: dict) -> None:
    hf = make_hf_model("llama", rope_parameters={"rope_theta": 10000.0, **rope})
    from llmserve.models.llama import LlamaForCausalLM

    ours = LlamaForCausalLM(hf.config, torch.float32, "cpu")
    ours.load_weights(hf.state_dict().items())
    ids = [list(range(3, 40)), list(range(50, 70))]
    out = PagedRunner(ours).step(list(enumerate(ids)))
    for i, p in enumerate(ids):
        _close(out[i], hf_logits(hf, p))
