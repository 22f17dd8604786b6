"""Reference attention over the paged KV cache, in plain torch (CPU and CUDA; the test oracle).

Decodes run as one batched SDPA call over keys gathered by slot (padded to the longest context),
unless the registry offers a native kernel (CPU); each prefill chunk runs its own SDPA call, causal
over its context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.attention import registry
from llmserve.attention.metadata import AttentionMetadata
from llmserve.cpu_features import fp32_compute_for_bf16


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]. The cache
    may be narrower than the model (kv_cache_dtype): K/V are rounded to it here."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim] (this step's keys, already written to the cache)
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [T, heads, head_dim]
    out = torch.empty_like(q)
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    flat = kv_cache.view(2, -1, kv_heads, head_dim)
    gqa = q.shape[1] != k.shape[1]
    nd = meta.num_decodes
    if nd:
        decode = registry.native_decode(q, kv_cache) or decode_attention
        out[:nd] = decode(q[:nd], kv_cache, meta, scale, sliding_window)
    # bf16 prefill attention runs in fp32 on CPUs where that is faster (torch's bf16 SDPA: half the speed)
    wide = torch.float32 if q.dtype == torch.bfloat16 and q.is_cpu and fp32_compute_for_bf16() else q.dtype
    for span in meta.prefills:
        qs = q[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0).to(wide)  # [1, heads, q_len, head_dim]
        if span.num_cached == 0 and (sliding_window is None or span.q_len <= sliding_window):
            # Fresh prompt: its keys are exactly this step's keys; plain causal attention.
            ks = k[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0).to(wide)
            vs = v[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0).to(wide)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # [1, kv_heads, ctx, head_dim], widened to the compute dtype when the cache is narrower
            ks = flat[0].index_select(0, span.slots).to(wide).transpose(0, 1).unsqueeze(0)
            vs = flat[1].index_select(0, span.slots).to(wide).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask(sliding_window),
                                               scale=scale, enable_gqa=gqa)
        out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None) -> torch.Tensor:
    """Reference decode: q [nd, heads, head_dim], one query token per request -> [nd, heads, head_dim]."""
    block_size = kv_cache.shape[2]
    keys, values = _gather_blocks(kv_cache, meta)  # [nd, kv_heads, max_blocks * block_size, head_dim]
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # no-op unless the cache is narrower
    mask = meta.decode_mask(sliding_window, block_size, q.dtype)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != keys.shape[1])
    return o.squeeze(2)


def _gather_blocks(kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the decode requests' blocks (whole blocks: long contiguous rows copy fastest) into
    workspace buffers shared by all layers of the step."""
    assert meta.decode_tables is not None
    nd, max_blocks = meta.decode_tables.shape
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    idx = meta.decode_tables.reshape(-1)
    shape = (nd * max_blocks, block_size, kv_heads, head_dim)
    out = []
    for i, name in enumerate(("decode_k", "decode_v")):
        buf = meta.workspace.get(name, shape, kv_cache.dtype, kv_cache.device)
        torch.index_select(kv_cache[i], 0, idx, out=buf)
        out.append(buf.view(nd, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2))
    return out[0], out[1]
