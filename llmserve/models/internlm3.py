"""InternLM3 (InternLM3ForCausalLM): transformers 5 has no modeling class of its own for it; its `internlm3` config
(InternLM3Config, no remote code) runs in LlamaForCausalLM, with `qkv_bias` for the q/k/v/o biases and `bias` for the
MLP's (attention_bias / mlp_bias; the config refuses them unequal). So here it is Llama's decoder as configured."""

from __future__ import annotations

from llmserve.models.llama import LlamaForCausalLM


class InternLM3ForCausalLM(LlamaForCausalLM):
    pass
