"""Prefill attention on CUDA: one Triton kernel for all of a step's prefill chunks, over the paged cache.

The torch reference (torch_backend.prefill_attention) runs each chunk on its own: a chunk that follows cached context
(a prefix-cache hit, a later chunk of a long prompt) gathers its context's K/V, expands the KV heads, builds a mask
and calls SDPA: ~10 kernel launches a chunk and layer. A step that admits 64 chat prompts behind a cached system
prompt made ~20,000 launches in its layers' attention alone. Here one launch a layer covers every chunk: a program
takes BLOCK_M query rows of one chunk and one query head (the work list, built once a step, maps programs to
chunks), and reads the chunk's keys and values where they lie in the cache, through its block table. This step's
K/V are already there (Attention.forward writes them first), so fresh prompts and continued ones are the same case.

Causal over absolute positions: query i of a chunk with `num_cached` tokens before it sits at num_cached + i and
attends keys 0..num_cached + i (within the window, with a sliding window). Online softmax in fp32 with exp2, P
rounded to the query dtype for the PV product (as flash attention does), accumulation fp32 (IEEE for fp32 models).
Only caches of the query dtype come here: an int8 / int4 cache's fresh prompts attend their unrounded keys in the
reference, which a kernel reading the cache cannot match, so those keep it.
On a CPU the kernel runs only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.attention.metadata import AttentionMetadata


@triton.jit
def _prefill_kernel(Q, K, V, Out, Tables, Spans, Work,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tab, stride_ot, stride_oh,
                    sm_scale, window, softcap,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr, SOFTCAP: tl.constexpr):
    item = tl.program_id(0)
    head = tl.program_id(1)
    span = tl.load(Work + 2 * item)
    m0 = tl.load(Work + 2 * item + 1)  # the program's first query row, within its chunk
    q_start = tl.load(Spans + 3 * span)
    q_len = tl.load(Spans + 3 * span + 1)
    cached = tl.load(Spans + 3 * span + 2)
    kvh = head // GROUP

    i = m0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    imask = i < q_len
    dmask = d < HEAD_DIM
    pos = cached + i  # absolute positions of the rows (padding rows past the chunk are computed, never stored)
    rows = (q_start + i).to(tl.int64)
    dtype = Q.dtype.element_ty
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=imask[:, None] & dmask[None, :], other=0.0)
    if WIDEN_DOTS:
        q = q.to(tl.float32)
    # keys [lo, hi): the rows' contexts; hi is one past the last real row's position
    hi = cached + tl.minimum(m0 + BLOCK_M, q_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(cached + m0 - window + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nmask = n < hi
        block = tl.load(Tables + span * stride_tab + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = block * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(K + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if WIDEN_DOTS:  # the interpreter's bf16/fp16 dot is wrong: the same rounded operands, multiplied in fp32
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if SOFTCAP:  # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1); then to log2 units
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (sm_scale / softcap)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0)) * 1.4426950408889634
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = (n[None, :] <= pos[:, None]) & nmask[None, :]
        if HAS_WINDOW:
            visible = visible & (n[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row with nothing visible yet (a window's later rows in an early block) keeps m = -inf: exp2 of -inf, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype).to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(Out.dtype.element_ty),
             mask=imask[:, None] & dmask[None, :])


def block_m(head_dim: int, device: torch.device) -> int:
    """Query rows per program: 16 under the interpreter (a test's short chunks still span several programs)."""
    if device.type != "cuda":
        return 16
    return 128 if head_dim <= 128 else 64


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, spans: torch.Tensor,
                  work: torch.Tensor, scale: float, out: torch.Tensor, sliding_window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D]; kv_cache [2, num_blocks, block_size, KVH, D] of q's dtype, this step's K/V written; tables
    [S, W] int32 block ids of the S chunks' contexts; spans [S, 3] int32 (first row in q, rows, tokens cached before);
    work [P, 2] int32 (chunk, first row) per program, rows in steps of block_m(D). Writes the chunks' rows of
    out [T, H, D] (other rows untouched) and returns it."""
    num_heads, head_dim = q.shape[1:]
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    assert cache_dim == head_dim and num_heads % num_kv_heads == 0 and kv_cache.stride(-1) == 1
    assert kv_cache.dtype == q.dtype and q.stride(-1) == 1 and out.stride(-1) == 1
    if work.shape[0] == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_dim))
    bm = block_m(head_dim, q.device)
    cuda = q.device.type == "cuda"
    _prefill_kernel[(work.shape[0], num_heads)](
        q, kv_cache[0], kv_cache[1], out, tables, spans, work,
        q.stride(0), q.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), tables.stride(0),
        out.stride(0), out.stride(1), scale, sliding_window or 0, softcap or 1.0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=bm,
        BLOCK_N=64 if d_pad <= 128 else 32, HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDEN_DOTS=not cuda and q.dtype != torch.float32,
        SOFTCAP=softcap is not None, num_warps=8 if cuda and bm >= 128 else 4, num_stages=2 if cuda else 1)
    return out


def prefill(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            sliding_window: int | None, out: torch.Tensor, softcap: float | None = None) -> None:
    """The registry's prefill: the rows of every prefill chunk of the step, into out."""
    tables, spans, work = meta.prefill_work(block_m(q.shape[-1], q.device))
    paged_prefill(q, kv_cache, tables, spans, work, scale, out, sliding_window, softcap)
