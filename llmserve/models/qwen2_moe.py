"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases per `qkv_bias`, per-layer windows from
`layer_types`) and, on the layers `mlp_only_layers` / `decoder_sparse_step` make sparse, a MoE block: top-k of
num_experts (renormalised where `norm_topk_prob`) of moe_intermediate_size each, plus a shared expert of
shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x)). Dense layers keep intermediate_size.
models/moe.py has the block and both checkpoint layouts."""

from __future__ import annotations

from typing import Any

from llmserve.models.llama import layer_sliding_windows
from llmserve.models.moe import MoeDecoderSpec, MoeForCausalLM, MoeSpec, qwen_sparse_layers


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg: Any) -> MoeDecoderSpec:
        moe = MoeSpec(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                      expert_size=cfg.moe_intermediate_size, renormalize=bool(cfg.norm_topk_prob),
                      model_dtype_weights=True, shared_expert_size=cfg.shared_expert_intermediate_size,
                      sparse_layers=qwen_sparse_layers(cfg))
        return MoeDecoderSpec(qkv_bias=bool(getattr(cfg, "qkv_bias", True)), o_bias=False, mlp_bias=False,
                              qk_norm=False, sliding_windows=layer_sliding_windows(cfg), moe=moe)
