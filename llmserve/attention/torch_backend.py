"""Reference attention over the paged KV cache, in plain torch (CPU and CUDA; the test oracle).

Decodes run as one batched SDPA call over keys gathered by slot (padded to the longest context);
each prefill chunk runs its own SDPA call, causal over its context. On CPU the registry's native
kernels take both where they can (kernels/cpu/paged_decode.cpp, kernels/cpu/prefill_attention.cpp).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from llmserve.attention import registry
from llmserve.attention.metadata import AttentionMetadata
from llmserve.kernels import native
from llmserve.kernels.triton import fused_for


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scales: torch.Tensor | None = None) -> None:
    """kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim]. The cache
    may be narrower than the model (kv_cache_dtype): K/V are rounded to it here, or quantized to int8 with one scale
    per token and head into kv_scales [2, num_blocks, block_size, kv_heads] (fp32), or to int4 (a uint8 cache of
    head_dim / 2 bytes per row: quantize_int4) with a scale and a zero point per token and head into kv_scales
    [2, num_blocks, block_size, kv_heads, 2] (fp16)."""
    int4 = kv_cache.dtype == torch.uint8
    if registry.native_enabled(k):  # one call for K and V, the same bytes as below
        if kv_scales is not None:
            (native.write_kv_int4 if int4 else native.write_kv_int8)(kv_cache, kv_scales, k, v, slot_mapping)
            return
        if k.stride(1) == k.shape[2]:  # heads contiguous (views of the fused QKV output are)
            native.write_kv(kv_cache, k, v, slot_mapping)
            return
    if kv_scales is None and (fused := fused_for(k)) is not None and kv_cache.is_contiguous() and all(
            x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (k, v)):
        fused.write_kv(kv_cache, k, v, slot_mapping)  # CUDA: K and V in one kernel
        return
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if kv_scales is None:
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))
        return
    flat_scales = kv_scales.view(2, -1, *kv_scales.shape[3:])
    for i, x in enumerate((k, v)):
        q, s = quantize_int4(x) if int4 else quantize_int8(x)
        flat[i].index_copy_(0, slot_mapping, q)
        flat_scales[i].index_copy_(0, slot_mapping, s)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (int8 [..., D], fp32 scales [...]): symmetric per row, scale = max|x| / 127, rounded half
    to even (an all-zero row: scale 0, zeros). kernels/cpu/kv_int8.cpp does exactly this."""
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8), scale


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D even) -> (packed uint8 [..., D / 2], fp16 (scale, zero) [..., 2]): asymmetric per row, zero =
    min x and scale = (max x - min x) / 15, each rounded to fp16, then q = round_half_even((x - zero) / scale) in
    [0, 15] (a constant row: scale 0, q 0), packed by pack_int4; x ~ q * scale + zero. Why asymmetric: SmolLM2-135M's
    perplexity over int4 K/V was 9.61 symmetric (max|x| / 7, 15 levels about 0) against 7.50 with a zero point (bf16
    6.70): a row's 16 levels span its own range. fp16 parameters keep a row of 64 at 36 bytes (int8's: 68).
    kernels/cpu/kv_int8.cpp's write_kv_int4 does exactly this."""
    xf = x.float()
    lo, hi = xf.aminmax(dim=-1)
    params = torch.stack(((hi - lo) / 15, lo), dim=-1).half()
    scale, zero = params.float().unbind(-1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((xf - zero.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    return pack_int4(torch.where(scale.unsqueeze(-1) > 0, q, 0).to(torch.uint8)), params


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D] in [0, 15] -> uint8 [..., D / 2]: byte i holds element 2i in its low nibble and element 2i + 1
    in its high one (the decode kernel unpacks by a mask and a shift)."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(x: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: uint8 [..., D / 2] -> uint8 [..., D]."""
    return torch.stack((x & 15, x >> 4), dim=-1).flatten(-2)


def dequantize(x: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows x [..., D] in dtype: widened; int8 times scales [...]; or int4 (packed uint8 [..., D / 2]) times
    scales[..., 0] plus scales[..., 1] (quantize_int4). In fp32, then rounded to dtype."""
    if scales is None:
        return x.to(dtype)
    if x.dtype == torch.uint8:
        params = scales.float()
        return (unpack_int4(x).float() * params[..., :1] + params[..., 1:]).to(dtype)
    return (x.float() * scales.unsqueeze(-1)).to(dtype)


def paged_attention(
    q: torch.Tensor,  # [T, heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim] (this step's keys, already written to the cache)
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    kv_scales: torch.Tensor | None = None,  # int8 / int4 caches: [2, num_blocks, block_size, kv_heads(, 2)] (write_kv)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) (Gemma 2); not in the native kernels
) -> torch.Tensor:  # [T, heads, head_dim]
    nd = meta.num_decodes
    decoded = None
    if nd:
        native_decode = registry.native_decode(q, kv_cache) if softcap is None else None
        if native_decode is not None:
            decoded = native_decode(q[:nd], kv_cache, kv_scales, meta, scale, sliding_window)
        else:
            decode = registry.triton_decode(q, kv_cache) or decode_attention
            decoded = decode(q[:nd], kv_cache, kv_scales, meta, scale, sliding_window, softcap=softcap)
        if not meta.prefills:
            return decoded  # a decode-only step: nothing else to fill in, no copy into a new output
    out = torch.empty_like(q)
    if decoded is not None:
        out[:nd] = decoded
    if meta.prefills:
        if softcap is None and registry.native_prefill(q, k, kv_cache):
            spans, slots = meta.prefill_arrays()
            native.prefill_attention(q, k, v, kv_cache, kv_scales, spans, slots, scale, sliding_window, out,
                                     meta.prefill_kernel)
        elif (triton_prefill := registry.triton_prefill(q, kv_cache, kv_scales)) is not None:
            triton_prefill(q, kv_cache, meta, scale, sliding_window, out, softcap)
        else:
            prefill_attention(q, k, v, kv_cache, kv_scales, meta, scale, sliding_window, out, softcap)
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      kv_scales: torch.Tensor | None, meta: AttentionMetadata, scale: float,
                      sliding_window: int | None, out: torch.Tensor, softcap: float | None = None) -> None:
    """Reference prefill: each span's rows of out, one SDPA call per span, causal over its context."""
    kv_heads, row = kv_cache.shape[3:]  # row: head_dim, or head_dim / 2 bytes of an int4 cache
    flat = kv_cache.view(2, -1, kv_heads, row)
    flat_scales = None if kv_scales is None else kv_scales.view(2, -1, *kv_scales.shape[3:])
    gqa = q.shape[1] != k.shape[1]
    # bf16 prefill attention runs in fp32 on every CPU, as the native kernels compute it: on CPUs with AMX torch's bf16
    # SDPA is faster, but rounds otherwise, so a prompt's first token would depend on which path ran (an int4 cache's
    # prefill comes here, a bf16 cache's to the native kernel: their first tokens' logprobs differed on a Xeon with AMX)
    wide = torch.float32 if q.dtype == torch.bfloat16 and q.is_cpu else q.dtype
    # CUDA: K/V heads expanded to the query heads here, because SDPA's memory-efficient kernel (the one that takes a
    # mask, and fp32) refuses enable_gqa, and its math fallback materialises [heads, q_len, context] scores
    # (4 GiB for a 4,096-token chunk over 8k of context at 32 heads)
    expand = q.shape[1] // k.shape[1] if gqa and q.device.type == "cuda" else 1
    gqa = gqa and expand == 1
    with _sdpa_backends(q):
        for span in meta.prefills:
            qs = q[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0).to(wide)  # [1, heads, q_len, head_dim]
            if span.num_cached == 0 and (sliding_window is None or span.q_len <= sliding_window):
                # Fresh prompt: its keys are exactly this step's keys (unrounded, as a narrow or int8 cache's
                # later readers see them rounded); plain causal attention.
                ks = _expand_heads(k[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0).to(wide), expand)
                vs = _expand_heads(v[span.q_start:span.q_end].transpose(0, 1).unsqueeze(0).to(wide), expand)
                o = _sdpa(qs, ks, vs, None, scale, gqa, softcap)
            else:
                # [1, kv_heads, ctx, head_dim], widened to the compute dtype when the cache is narrower
                ks, vs = (_expand_heads(dequantize(
                    flat[i].index_select(0, span.slots),
                    None if flat_scales is None else flat_scales[i].index_select(0, span.slots),
                    wide).transpose(0, 1).unsqueeze(0), expand) for i in (0, 1))
                o = _sdpa(qs, ks, vs, span.mask(sliding_window), scale, gqa, softcap)
            out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, gqa: bool,
          softcap: float | None) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, KVH, Lk, D]; mask: bool [Lq, Lk] (True: attend), additive [B, 1, 1, Lk], or None for
    causal with Lq == Lk. SDPA, which has no soft-capping; capped scores in plain ops as HF's eager attention: scores in
    q's dtype, capped, masked, softmax in fp32 rounded to q's dtype, times V."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=gqa)
    if q.shape[1] != k.shape[1]:
        k, v = _expand_heads(k, q.shape[1] // k.shape[1]), _expand_heads(v, q.shape[1] // v.shape[1])
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, Lq, Lk]
    s = torch.tanh(s / softcap) * softcap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril_()
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sdpa_backends(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """On CUDA, SDPA without cuDNN's kernel, which plans anew for every new shape (every prompt length is one):
    flash, then memory-efficient attention, the math fallback last."""
    if q.device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _expand_heads(x: torch.Tensor, n: int) -> torch.Tensor:
    """[1, kv_heads, L, D] -> [1, kv_heads * n, L, D], each KV head repeated for its n query heads (GQA's order)."""
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                     meta: AttentionMetadata, scale: float, sliding_window: int | None,
                     softcap: float | None = None) -> torch.Tensor:
    """Reference decode: q [nd, heads, head_dim], one query token per request -> [nd, heads, head_dim]."""
    block_size = kv_cache.shape[2]
    keys, values = _gather_blocks(kv_cache, meta)  # [nd, kv_heads, max_blocks * block_size, head_dim]
    if kv_scales is None:
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # no-op unless the cache is narrower
    else:
        int4 = kv_cache.dtype == torch.uint8  # its scales: [..., 2] (scale, zero); int8's one a row
        k_scales, v_scales = _gather_blocks(kv_scales if int4 else kv_scales.unsqueeze(-1), meta, "_scale")
        keys = dequantize(keys, k_scales if int4 else k_scales.squeeze(-1), q.dtype)
        values = dequantize(values, v_scales if int4 else v_scales.squeeze(-1), q.dtype)
    mask = meta.decode_mask(sliding_window, block_size, q.dtype)
    with _sdpa_backends(q):
        o = _sdpa(q.unsqueeze(2), keys, values, mask, scale, q.shape[1] != keys.shape[1], softcap)
    return o.squeeze(2)


def _gather_blocks(kv_cache: torch.Tensor, meta: AttentionMetadata,
                   suffix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Copy the decode requests' blocks (whole blocks: long contiguous rows copy fastest) into
    workspace buffers shared by all layers of the step (named by suffix: the int8 scales have their own)."""
    assert meta.decode_tables is not None
    nd, max_blocks = meta.decode_tables.shape
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    idx = meta.decode_tables.reshape(-1)
    shape = (nd * max_blocks, block_size, kv_heads, head_dim)
    out = []
    for i, name in enumerate(("decode_k" + suffix, "decode_v" + suffix)):
        buf = meta.workspace.get(name, shape, kv_cache.dtype, kv_cache.device)
        torch.index_select(kv_cache[i], 0, idx, out=buf)
        out.append(buf.view(nd, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2))
    return out[0], out[1]
