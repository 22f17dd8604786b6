"""Mixtral: Mistral's attention (one optional sliding window on every layer) and a sparse MoE block on every layer:
top-k of num_local_experts, the top-k weights renormalised, kept fp32 until they scale the expert outputs (as
transformers does). models/moe.py has the block and both checkpoint layouts."""

from __future__ import annotations

from typing import Any

from llmserve.models.moe import MoeDecoderSpec, MoeForCausalLM, MoeSpec


class MixtralForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> MoeDecoderSpec:
        n = cfg.num_hidden_layers
        moe = MoeSpec(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                      expert_size=cfg.intermediate_size, renormalize=True, model_dtype_weights=False,
                      shared_expert_size=0, sparse_layers=frozenset(range(n)))
        return MoeDecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                              sliding_windows=(getattr(cfg, "sliding_window", None),) * n, moe=moe)
