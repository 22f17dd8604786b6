"""Gemma 2 (and the decoder Gemma 3's text model shares, models/gemma3.py) over flat, unpadded tokens.

What differs from Llama (models/llama.py): the embedding is scaled by sqrt(E) (rounded to the model dtype, as HF
does); every RMSNorm scales by (1 + weight) in fp32; each layer norms its attention and MLP outputs too before adding
them to the residual stream (four norms a layer); the MLP is GELU(tanh)-gated; attention scales by
query_pre_attn_scalar^-0.5 and caps its scores (softcap * tanh(scores / softcap)); sliding and full layers alternate
(config.layer_types); the logits are capped too; the LM head is tied. Shapes as in llama.py.

The soft-capped scores are not in the native CPU kernels: attention runs the torch reference on CPU and the Triton
kernel on CUDA (attention/torch_backend.py), and the native decoder stack never runs these layers (it computes
Llama's, decoder_stack.computes).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.attention import Attention, AttentionMetadata
from llmserve.errors import ModelLoadError
from llmserve.layers.activation import GeluAndMul
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.norm import GemmaRMSNorm
from llmserve.layers.rotary import RotaryEmbedding, rope_config, rotate_
from llmserve.models.llama import (
    DecoderSpec,
    LlamaForCausalLM,
    gated_mlp_projections,
    head_dim_of,
    init_attention_projections,
    layer_sliding_windows,
)

_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF's ACT2FN names -> F.gelu's approximate


class GemmaAttention(nn.Module):
    caps_scores = True  # Gemma 2 caps attention scores by attn_logit_softcapping; Gemma 3 does not (gemma3.py)

    def __init__(self, cfg: Any, spec: DecoderSpec, layer: int) -> None:
        super().__init__()
        init_attention_projections(self, cfg, spec)
        d = self.head_dim
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps) if spec.qk_norm else None
        softcap = getattr(cfg, "attn_logit_softcapping", None) if self.caps_scores else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, float(cfg.query_pre_attn_scalar) ** -0.5,
                              spec.sliding_windows[layer], softcap)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))  # [T, H*D], [T, KVH*D] x2
        q, k = q.view(t, h, d), k.view(t, kvh, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head, before rotary
        q, k = rotate_(q, cos, sin), rotate_(k, cos, sin)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or cfg.hidden_act
        if act not in _GELU:
            raise ModelLoadError(f"config.json hidden_activation={act!r} is not supported (only {', '.join(_GELU)})")
        self.gate_up_proj, self.down_proj = gated_mlp_projections(cfg.hidden_size, cfg.intermediate_size, False)
        self.act = GeluAndMul(_GELU[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))  # [T, E] -> [T, 2I] -> [T, I] -> [T, E]


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, spec: DecoderSpec, layer: int, attention: type[GemmaAttention]) -> None:
        super().__init__()
        self.self_attn = attention(cfg, spec, layer)
        self.mlp = GemmaMLP(cfg)
        e, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = GemmaRMSNorm(e, eps), GemmaRMSNorm(e, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = GemmaRMSNorm(e, eps), GemmaRMSNorm(e, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        """[T, E] residual stream in and out."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    attention: type[GemmaAttention] = GemmaAttention

    def __init__(self, cfg: Any, spec: DecoderSpec) -> None:
        super().__init__()
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ModelLoadError("config.json use_bidirectional_attention=true (an encoder) is not supported")
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, spec, i, self.attention)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # One rotary table per layer type where the config has rope parameters per type (Gemma 3), else one for all.
        params = getattr(cfg, "rope_parameters", None) or {}
        per_type = bool(params) and all(isinstance(p, dict) for p in params.values())
        types = list(cfg.layer_types)
        self.rope_keys = types if per_type else ["all"] * len(types)
        self.rotary_emb = nn.ModuleDict({key: RotaryEmbedding(head_dim_of(cfg), rope_config(cfg, key))
                                         for key in dict.fromkeys(self.rope_keys)})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, E]
        x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)  # HF rounds the scale to the dtype first
        if embeds is not None:  # (rows, values): inputs other than token embeddings at these rows, unscaled
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        tables = {key: rotary(positions, x.dtype) for key, rotary in self.rotary_emb.items()}  # (cos, sin) each
        for layer, key in zip(self.layers, self.rope_keys):
            x = layer(x, *tables[key], meta)
        return self.norm(x)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_class = GemmaModel
    qk_norm = False  # Gemma 3: per-head q/k norms

    @classmethod
    def decoder_spec(cls, cfg: Any) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=cls.qk_norm,
                           sliding_windows=layer_sliding_windows(cfg))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, E] -> [N, vocab] float32, capped: cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def init_dummy_weights(self, std: float, seed: int = 0) -> None:
        super().init_dummy_weights(std, seed)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.zero_()  # (1 + w): w = 0 is the identity scale
