"""Gemma 3's text model (model_type gemma3_text): Gemma 2's decoder (models/gemma2.py) with a per-head (1 + w) RMSNorm
on q and k before rotary, no soft-capping of attention scores (transformers' Gemma3Attention ignores
attn_logit_softcapping; final_logit_softcapping still applies where set), and rope per layer type: sliding layers
rotate with the local base frequency, full layers with the global one and its scaling (config.rope_parameters keyed
by layer type; the layer types come from config.layer_types)."""

from __future__ import annotations

from llmserve.models.gemma2 import Gemma2ForCausalLM, GemmaAttention, GemmaModel


class Gemma3Attention(GemmaAttention):
    caps_scores = False


class Gemma3Model(GemmaModel):
    attention = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model
    qk_norm = True
