"""Qwen3: Llama with per-head RMSNorm on q and k, `attention_bias` on q/k/v/o, optional sliding windows."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import DecoderSpec, LlamaForCausalLM, layer_sliding_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                           sliding_windows=layer_sliding_windows(cfg))
