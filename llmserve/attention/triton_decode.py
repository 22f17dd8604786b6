"""Decode attention on CUDA: one Triton kernel reads K/V straight from the paged cache through the block tables.

The torch reference (torch_backend.decode_attention) copies every request's blocks into a padded buffer each layer
and runs SDPA under a mask; this kernel reads each context token once, where it lies. One program per (request,
KV head, split): the GQA group's query heads share each K/V tile (a [group, D] x [D, BLOCK_N] dot), online softmax
in fp32, exp2. Long contexts at small batches are split over the context (flash-decoding) so the GPU has enough
programs; a second kernel merges the splits by their log-sum-exp. Shapes depend only on the batch, never on the
context lengths (read on the device), so CUDA graphs can capture it.

Rounding follows the reference: int8 K/V (times their scale) and int4 K/V (a uint8 cache of two codes a byte, times
their scale plus their zero point: torch_backend.quantize_int4) are dequantized in fp32 and rounded to the query
dtype, K and V are read in
the query dtype, P is rounded to it for the PV product, accumulation is fp32 (IEEE for fp32 models, no TF32).
On a CPU the kernel runs only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmserve.attention.metadata import AttentionMetadata


@triton.jit
def _decode_kernel(Q, K, V, KS, VS, Tables, Lens, MidO, MidL, Out,
                   stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_sh,
                   stride_tab, stride_ot, stride_oh, sm_scale, window, softcap,
                   GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, NUM_HEADS: tl.constexpr,
                   QUANT: tl.constexpr, INT4: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                   WIDEN_DOTS: tl.constexpr, SOFTCAP: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lens + seq).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(length - window, 0)
    chunk = tl.cdiv(tl.cdiv(length - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, length)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    dtype = Q.dtype.element_ty
    q = tl.load(Q + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if WIDEN_DOTS:
        q = q.to(tl.float32)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    # tl.full, not tl.zeros (a jit'd library function): the interpreter cannot call it where triton was imported before
    # TRITON_INTERPRET was set, as in a test session that imported it elsewhere first (kernels/triton/qblock.py too)
    l_sum = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, D_PAD], 0.0, tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        block = tl.load(Tables + seq * stride_tab + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = block * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        if INT4:
            # a row's D / 2 bytes: dim 2i in byte i's low nibble, 2i + 1 in its high one (pack_int4), joined back into
            # [BLOCK_N, D_PAD] in order (tl.join, tl.reshape: builtins, unlike the jit'd tl.interleave; see tl.full)
            half = tl.arange(0, D_PAD // 2)
            byte_mask = nmask[:, None] & (half < HEAD_DIM // 2)[None, :]
            srow = block * stride_sb + (n % BLOCK_SIZE) * stride_ss + kvh * stride_sh  # (scale, zero) pairs
            kb = tl.load(K + row[:, None] + half[None, :], mask=byte_mask, other=0)
            vb = tl.load(V + row[:, None] + half[None, :], mask=byte_mask, other=0)
            k = tl.reshape(tl.join(kb & 15, kb >> 4), (BLOCK_N, D_PAD)).to(tl.float32)
            v = tl.reshape(tl.join(vb & 15, vb >> 4), (BLOCK_N, D_PAD)).to(tl.float32)
            k = k * tl.load(KS + srow, mask=nmask, other=0.0).to(tl.float32)[:, None] + \
                tl.load(KS + srow + 1, mask=nmask, other=0.0).to(tl.float32)[:, None]
            v = v * tl.load(VS + srow, mask=nmask, other=0.0).to(tl.float32)[:, None] + \
                tl.load(VS + srow + 1, mask=nmask, other=0.0).to(tl.float32)[:, None]
        else:
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(K + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if QUANT and not INT4:
            srow = block * stride_sb + (n % BLOCK_SIZE) * stride_ss + kvh * stride_sh
            k = k.to(tl.float32) * tl.load(KS + srow, mask=nmask, other=0.0)[:, None]
            v = v.to(tl.float32) * tl.load(VS + srow, mask=nmask, other=0.0)[:, None]
        k = k.to(dtype)
        v = v.to(dtype)
        if WIDEN_DOTS:  # the interpreter's bf16/fp16 dot is wrong: the same rounded operands, multiplied in fp32
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1); then to log2 units
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (sm_scale / softcap)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * 1.4426950408889634
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype).to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out_mask = gmask[:, None] & dmask[None, :]
    if SPLITS == 1:
        o = acc / l_sum[:, None]
        tl.store(Out + seq * stride_ot + heads[:, None] * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
                 mask=out_mask)
    else:
        # an empty split (a short context) leaves l_sum 0: weight 0 in the merge
        safe = tl.where(l_sum > 0, l_sum, 1.0)
        lse = tl.where(l_sum > 0, m + tl.log2(safe), float("-inf"))
        base = (seq * NUM_HEADS + heads) * SPLITS + split  # MidO [nd, H, SPLITS, D_PAD], MidL [nd, H, SPLITS]
        tl.store(MidO + base[:, None] * D_PAD + d[None, :], acc / safe[:, None], mask=gmask[:, None])
        tl.store(MidL + base, lse, mask=gmask)


@triton.jit
def _merge_kernel(MidO, MidL, Out, stride_ot, stride_oh,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                  NUM_HEADS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < SPLITS
    base = (seq * NUM_HEADS + head) * SPLITS + s
    lse = tl.load(MidL + base, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # -inf (empty or padding) -> 0
    o = tl.load(MidO + base[:, None] * D_PAD + d[None, :], mask=smask[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + seq * stride_ot + head * stride_oh + d, merged.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def num_splits(num_decodes: int, num_kv_heads: int, device: torch.device) -> int:
    """Context splits per (request, KV head): enough programs for two waves over the GPU, at most 16, a power of
    two (each value is a compiled variant: the captured graphs compile the values their batch sizes use at start,
    and eager steps of those batch sizes reuse them instead of compiling one per batch size mid-run)."""
    return min(16, triton.next_power_of_2(triton.cdiv(2 * _num_sms(device), max(1, num_decodes * num_kv_heads))))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None, kv_scales: torch.Tensor | None = None,
                 splits: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [nd, H, D]; kv_cache [2, num_blocks, block_size, KVH, D] (float or int8 with kv_scales
    [2, num_blocks, block_size, KVH] fp32, or int4: uint8 [.., D / 2] with kv_scales [2, num_blocks, block_size, KVH,
    2] fp16, quantize_int4's); tables [nd, W] block ids; lens [nd] context lengths (the new token included, >= 1) ->
    [nd, H, D] in q's dtype."""
    nd, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    int4 = kv_cache.dtype == torch.uint8
    assert cache_dim == (head_dim // 2 if int4 else head_dim) and num_heads % num_kv_heads == 0
    assert kv_cache.stride(-1) == 1 and (not int4 or (head_dim % 2 == 0 and kv_scales is not None
                                                      and kv_scales.stride(-1) == 1))
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty((nd, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if nd == 0:
        return out
    group = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    splits = splits or num_splits(nd, num_kv_heads, q.device)
    block_n = 64 if d_pad <= 128 else 32
    quant = kv_scales is not None
    scales = kv_scales if quant else kv_cache  # without QUANT the kernel never reads KS/VS: any pointer will do
    mid_o = mid_l = out  # unused when splits == 1
    if splits > 1:
        mid_o = torch.empty((nd, num_heads, splits, d_pad), dtype=torch.float32, device=q.device)
        mid_l = torch.empty((nd, num_heads, splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(nd, num_kv_heads, splits)](
        q, kv_cache[0], kv_cache[1], scales[0], scales[1], tables, lens, mid_o, mid_l, out,
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        scales.stride(1), scales.stride(2), scales.stride(3), tables.stride(0), out.stride(0), out.stride(1),
        scale, sliding_window or 0, softcap or 1.0,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLITS=splits, NUM_HEADS=num_heads, QUANT=quant, INT4=int4,
        HAS_WINDOW=sliding_window is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WIDEN_DOTS=q.device.type != "cuda" and q.dtype != torch.float32, SOFTCAP=softcap is not None, num_warps=4)
    if splits > 1:
        _merge_kernel[(nd, num_heads)](mid_o, mid_l, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
                                       D_PAD=d_pad, SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits),
                                       NUM_HEADS=num_heads)
    return out


def decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, meta: AttentionMetadata,
           scale: float, sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
    """The registry's DecodeFn: decode attention of a step's decode requests."""
    assert meta.decode_tables is not None and meta.decode_lens is not None
    return paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, scale, sliding_window, kv_scales,
                        splits=meta.decode_splits, softcap=softcap)
