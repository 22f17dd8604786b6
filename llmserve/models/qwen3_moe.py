"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head RMSNorm on q and k, `attention_bias` on
q/k/v/o; its window, where `use_sliding_window`, on every layer as transformers' Qwen3-MoE applies it) and, on the
layers `mlp_only_layers` / `decoder_sparse_step` make sparse, a MoE block: top-k of num_experts of
moe_intermediate_size each, renormalised where `norm_topk_prob`; no shared expert. models/moe.py has the block and both
checkpoint layouts."""

from __future__ import annotations

from typing import Any

from llmserve.models.moe import MoeDecoderSpec, MoeForCausalLM, MoeSpec, qwen_sparse_layers


class Qwen3MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> MoeDecoderSpec:
        moe = MoeSpec(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                      expert_size=cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob),
                      model_dtype_weights=True, shared_expert_size=0, sparse_layers=qwen_sparse_layers(cfg))
        bias = bool(getattr(cfg, "attention_bias", False))
        window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", False) else None
        return MoeDecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                              sliding_windows=(window,) * cfg.num_hidden_layers, moe=moe)
