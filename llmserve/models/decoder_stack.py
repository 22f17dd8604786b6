"""Steps through the native decoder stack (kernels/cpu/decoder_stack.cpp) where its kernels cover the model.

A step runs every decoder layer and the final norm in one native call, without the interpreter between the kernels
and without the GIL: the same kernels on the same tensors in the same order as the Python layers, so the hidden
states are bit for bit the Python path's (tested). Why: between the kernels a single-request decode step spent
~4.5-5 ms in Python (SmolLM2-135M, 2-core AVX512-BF16 Xeon, alternated runs; BENCHMARKS.md): with the stack,
single-request decode went from 88-90 to 143-155 tokens/s in w8a8 and from 61-63 to 85-87 in bf16, and the first
token of a 36-token prompt from 24-26 to 19 ms in w8a8, 47-49 to 43 in bf16.

It covers the Llama family (Llama, Mistral, Qwen2, Qwen3's per-head q/k norm, InternLM3, Phi-3 with rotary over whole
heads; not Gemma: `computes`) with: linears in kernels/cpu/packed_gemm.cpp's, kernels/cpu/w8a8_linear.cpp's or
kernels/cpu/qblock_gemm.cpp's (block-quantized: GGUF, AWQ, GPTQ) layout (bf16 models on AVX-512 CPUs whose measured
choice is a packed kernel, fp32 models on AVX2 CPUs whose measured choice is fp32_gemm, --quantization w8a8,
--quantization int8 on AVX-512 or AVX2 CPUs, and block-quantized checkpoints on AVX-512 or AVX2 CPUs), a cache
paged_decode reads, for steps with prefill chunks native prefill attention (AVX-512, head_dim % 16 ==
0), and the native kernels enabled (not LLMSERVE_ATTENTION=torch, not LLMSERVE_FUSED_OPS=0).
`LLMSERVE_DECODER_STACK=0` turns it off. Anything else keeps the Python layers, which stay the reference.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from llmserve.attention import registry
from llmserve.attention.metadata import AttentionMetadata
from llmserve.distributed.state import tp_state
from llmserve.kernels import native
from llmserve.layers.linear import Linear

if TYPE_CHECKING:
    from llmserve.models.llama import LlamaModel


def enabled() -> bool:
    return os.environ.get("LLMSERVE_DECODER_STACK", "1") != "0" and native.fused_ops_enabled()


def _linear_args(linear: Linear) -> list[Any] | None:
    """(packed weight, outputs, scale, wsum, bias, path, few-row blocks, few rows[, amx rows]) of a linear the stack
    runs, or None. A bf16 linear runs in the stack where its measured kernel is a packed one (fma, dot or amx:
    bf16_gemm's path argument; kernels/choice.py), an fp32 one where it is fma (fp32_gemm; path 0). On the amx path,
    batches of at most `few rows` rows run on the blocks (the layer's own where the few-row blocks are None;
    OpChoice.few_rows). A w8a8 linear's `amx rows`: from how many rows its batches run on AMX-INT8 tiles
    (Linear.amx8_rows)."""
    if linear.qblocks is not None:  # block-quantized (layers/quant_blocks.py), where the native kernel runs
        qb = linear.qblocks
        if qb.native is None or qb.perm is not None:  # (act-order: the stack would not gather x)
            return None
        return [qb.native, linear.out_features, None, None, linear.bias, 2 if qb.amx else 0, None,
                qb.few_rows if qb.amx else 0]
    if linear.int8_packed is not None and linear.wsum is not None:  # w8a8
        return [linear.int8_packed, linear.out_features, linear.scale, linear.wsum, linear.bias, 0, None, 0,
                linear.amx8_rows]
    if linear.int8_packed is not None:  # weight-only int8
        return [linear.int8_packed, linear.out_features, linear.scale, None, linear.bias, 0]
    if linear.matmul is not None and linear.matmul.packed:
        few, few_rows = linear.matmul.few or (None, 0)
        return [linear.matmul.weight, linear.out_features, None, None, linear.bias,
                native.BF16_PATHS[linear.matmul.kernel], few, few_rows]
    return None


def computes(model: LlamaModel) -> bool:
    """Whether the stack's kernels compute these layers exactly as the Python ones: Llama's layer with its plain
    RMSNorms (an optional per-head q/k norm), a SiLU-gated MLP, rotary over whole heads and uncapped attention. Gemma's
    (1 + w) norms, post-norms and GELU, soft-capping and Phi's partial rotary are not in the kernels."""
    from llmserve.layers.activation import SiluAndMul
    from llmserve.layers.norm import RMSNorm
    from llmserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    def plain(layer: Any) -> bool:
        a, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm) + ((a.q_norm, a.k_norm) if a.q_norm else ())
        return (type(layer) is LlamaDecoderLayer and type(a) is LlamaAttention and type(mlp) is LlamaMLP
                and type(mlp.act) is SiluAndMul and all(type(n) is RMSNorm for n in norms)
                and a.attn.softcap is None and a.rotary_dim == a.head_dim)

    return all(plain(layer) for layer in model.layers)


def build(model: LlamaModel) -> Any | None:
    """The native stack over the model's layers and bound caches, or None where it does not cover them."""
    if native.load() is None or not computes(model):
        return None
    first = model.layers[0]
    attn = first.self_attn
    stack = native._module.DecoderStack(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                        first.mlp.down_proj.in_features, first.input_layernorm.eps, attn.attn.scale)
    for layer in model.layers:
        a, mlp = layer.self_attn, layer.mlp
        cache, scales = a.attn.kv_cache, a.attn.kv_scales
        linears = [_linear_args(m) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(lin is None for lin in linears) or cache is None or not cache.is_contiguous():
            return None
        if cache.dtype in (torch.int8, torch.uint8) and not (a.head_dim % 16 == 0 and native.int8_kv_decode_usable()):
            return None  # (uint8: int4, two codes a byte)
        if cache.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8):
            return None
        norms = (layer.input_layernorm, layer.post_attention_layernorm) + ((a.q_norm, a.k_norm) if a.q_norm else ())
        if any(n.eps != first.input_layernorm.eps for n in norms) or a.attn.scale != attn.attn.scale:
            return None
        window = a.attn.sliding_window
        qk_norms = (a.q_norm.weight, a.k_norm.weight) if a.q_norm else (None, None)
        k_scales, v_scales = (None, None) if scales is None else (scales[0], scales[1])
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *linears, *qk_norms,
                        cache[0], cache[1], k_scales, v_scales, -1 if window is None else window)
    return stack


def covers(x: torch.Tensor) -> bool:
    """Whether a step over x [T, E] may run in a stack: native kernels on x's device, the stack enabled."""
    # (tensor parallelism: the layers' all-reduces sit between the stack's ops)
    return x.shape[0] > 0 and registry.native_enabled(x) and enabled() and tp_state().size == 1


def runs_prefills(model: LlamaModel) -> bool:
    """Whether the stack may run steps with prefill chunks: prefill attention native for this model's heads."""
    return model.layers[0].self_attn.head_dim % 16 == 0 and native.prefill_attention_usable()


def forward(stack: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            final_norm: torch.Tensor) -> torch.Tensor:
    spans, slots = meta.prefill_arrays() if meta.prefills else (None, None)
    return stack.forward(x, cos.squeeze(1), sin.squeeze(1), meta.slot_mapping, meta.num_decodes, meta.decode_tables,
                         meta.decode_lens, spans, slots, final_norm, native.ATTENTION_PATHS[meta.prefill_kernel],
                         int(meta.decode_dot))
