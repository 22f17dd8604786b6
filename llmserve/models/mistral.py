"""Mistral: Llama with one sliding window (config.sliding_window) on every layer."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import DecoderSpec, LlamaForCausalLM


def one_window_spec(cfg: Any) -> DecoderSpec:
    """No biases, no q/k norms, config.sliding_window (or none) on every layer: Mistral's and Phi-3's decoder."""
    window = getattr(cfg, "sliding_window", None)
    return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                       sliding_windows=(window,) * cfg.num_hidden_layers)


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        return one_window_spec(cfg)
