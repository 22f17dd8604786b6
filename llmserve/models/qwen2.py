"""Qwen2: Llama with q/k/v biases (o_proj has none) and optional per-layer sliding windows."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import DecoderSpec, LlamaForCausalLM, layer_sliding_windows


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False,
                           sliding_windows=layer_sliding_windows(cfg))
