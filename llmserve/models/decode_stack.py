"""Decode steps through the native decoder stack (csrc/decoder_stack.cpp) where its kernels cover the model.

A step whose tokens are all decodes (one per request) runs every decoder layer and the final norm in one native
call, without the interpreter between the kernels and without the GIL: the same kernels on the same tensors in the
same order as the Python layers, so the hidden states are bit for bit the Python path's (tested). Why: between the
kernels a single-request decode step spent ~4.5-5 ms in Python; with the stack, single-request decode went from
85-88 to 127-132 tokens/s in w8a8 and from 59-62 to 79-85 in bf16 (SmolLM2-135M, 2-core AVX512-BF16 Xeon,
alternated runs; BENCHMARKS.md).

It covers: linears in csrc/bf16_gemm.cpp's or csrc/w8a8_linear.cpp's layout (bf16 models on AVX-512 CPUs without
AMX, and --quantization w8a8), no per-head q/k norm (Qwen3 keeps the Python path), caches paged_decode reads, and
the native kernels enabled (not LLMSERVE_ATTENTION=torch, not LLMSERVE_FUSED_OPS=0). `LLMSERVE_DECODE_STACK=0`
turns it off. Anything else keeps the Python layers, which stay the reference.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from llmserve.attention import native, registry
from llmserve.attention.metadata import AttentionMetadata
from llmserve.layers.linear import Linear

if TYPE_CHECKING:
    from llmserve.models.llama import LlamaModel


def enabled() -> bool:
    return os.environ.get("LLMSERVE_DECODE_STACK", "1") != "0" and native.fused_ops_enabled()


def _linear_args(linear: Linear) -> list[Any] | None:
    """(packed weight, outputs, scale, wsum, bias) of a linear the stack runs, or None."""
    if linear.wsum is not None:
        return [linear.w8a8_packed, linear.out_features, linear.scale, linear.wsum, linear.bias]
    if linear.bf16_packed is not None:
        return [linear.bf16_packed, linear.out_features, None, None, linear.bias]
    return None


def build(model: LlamaModel) -> Any | None:
    """The native stack over the model's layers and bound caches, or None where it does not cover them."""
    if native.load() is None or not hasattr(native._module, "DecoderStack"):
        return None
    first = model.layers[0]
    attn = first.self_attn
    stack = native._module.DecoderStack(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        first.mlp.down_proj.in_features, first.input_layernorm.eps, attn.attn.scale)
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        cache, scales = a.attn.kv_cache, a.attn.kv_scales
        linears = [_linear_args(m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(lin is None for lin in linears) or a.q_norm is not None or cache is None or not cache.is_contiguous():
            return None
        if cache.dtype == torch.int8 and not (a.head_dim % 16 == 0 and native.int8_kv_decode_usable()):
            return None
        if cache.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int8):
            return None
        if layer.input_layernorm.eps != first.input_layernorm.eps or a.attn.scale != attn.attn.scale:
            return None
        window = a.attn.sliding_window
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *linears,
                        cache[0], cache[1], None if scales is None else scales[0], None if scales is None else scales[1],
                        -1 if window is None else window)
    return stack


def covers(meta: AttentionMetadata, x: torch.Tensor) -> bool:
    """Whether this step may run in the stack: decodes only, native kernels on x's device, the stack enabled."""
    return not meta.prefills and meta.num_decodes == x.shape[0] > 0 and registry.native_enabled(x) and enabled()
