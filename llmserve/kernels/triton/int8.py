"""y = x @ (q * s)^T (+ bias) on CUDA for a weight-only int8 weight (`--quantization int8`: Linear.qweight int8 [n, k]
row-major, one fp32 scale per output row, layers/linear.py's quantize_rows), read as stored.

Each program owns a [BLOCK_M, BLOCK_N] tile of y and walks k in steps of BLOCK_K: it loads the [BLOCK_K, BLOCK_N]
int8 codes, widens them to x's dtype in registers (exact: |q| <= 127 fits bf16's and fp16's significands) and adds
tl.dot(x, q) to an fp32 accumulator, which the row scales multiply once at the end. So a decode step reads one byte a
weight, half of bf16's, and no dequantized weight ever reaches memory (torch's path, int8_linear's fallback, writes
and reads the whole weight in x's dtype at every call). The products are those of x and the exact int8 codes; torch's
path rounds q * s to x's dtype first, so the two differ by that rounding (this one is the closer to x @ (q * s)).

Tiles and split-K follow kernels/triton/qblock.py's plan (16-row tiles for decode, split-K where the tiles alone would
leave the GPU under two waves, fp32 partial sums added by torch: deterministic). Launch shapes depend only on M, N
and K, so CUDA graphs capture it. k needs no particular multiple (the last step is masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.triton.qblock import Plan, destination, finish
from llmserve.kernels.triton.qblock import plan as qblock_plan

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # x's dtypes the kernel takes


@triton.jit
def _int8_kernel(X, Q, Scale, Bias, Out, M, N, K, stride_xm, stride_qn, stride_om, stride_os, steps_per_split,
                 HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    kk = tl.arange(0, BLOCK_K)
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    q_cols = Q + rn.to(tl.int64)[None, :] * stride_qn  # [1, BLOCK_N]: row n of the weight is column n of the tile
    dtype = X.dtype.element_ty

    # tl.full, not tl.zeros (see kernels/triton/qblock.py: the interpreter and a triton imported before it was set)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    steps = tl.cdiv(K, BLOCK_K)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
    for step in range(first, last):
        k = step * BLOCK_K + kk
        if EVEN_K:
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
            q = tl.load(q_cols + k[:, None], mask=n_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N] int8
        else:
            k_mask = k < K
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            q = tl.load(q_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        if WIDEN_DOTS:  # the interpreter's fp16/bf16 dot is wrong (and its int8 -> bf16 cast gives NaN): the same
            # operands, multiplied in fp32
            acc += tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, q.to(dtype), input_precision=PRECISION)

    acc = acc * tl.load(Scale + rn, mask=n_mask, other=0.0)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    rows = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if PARTIAL:  # fp32 partial sums [splits, M, N]; the caller adds them and the bias
        tl.store(Out + split * stride_os + rows, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rows, acc.to(Out.dtype.element_ty), mask=out_mask)


def plan(m: int, n: int, k: int, device: torch.device, splits: int | None = None) -> Plan:
    """qblock.py's plan for the same bytes a weight (16-row tiles for decode, up to 128 x 128 for prefill, split-K
    under two waves of the GPU), k rounded up to whole 128-column steps (the last one masked here). Not tuned on a
    GPU."""
    return qblock_plan(m, n, triton.cdiv(k, 128) * 128, 128, device, splits)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                splits: int | None = None) -> torch.Tensor:
    """x [..., k] (fp16, bf16 or fp32), qweight int8 [n, k], scale fp32 [n], bias [n] or None -> [..., n] in x's
    dtype. `splits` overrides the split-K choice (tests)."""
    n, k = qweight.shape
    assert x.dtype in DTYPES and qweight.dtype == torch.int8 and x.shape[-1] == k, (x.dtype, qweight.dtype, x.shape)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    s = scale if scale.dtype == torch.float32 else scale.float()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    p = plan(m, n, k, x.device, splits)
    dest = destination(out, p)
    grid = (triton.cdiv(n, p.block_n), triton.cdiv(m, p.block_m), p.splits)
    steps = triton.cdiv(k, p.block_k)
    _int8_kernel[grid](
        x2, q, s, out if bias is None else bias, dest, m, n, k, x2.stride(0), q.stride(0), dest.stride(-2),
        dest.stride(0), triton.cdiv(steps, p.splits),
        HAS_BIAS=bias is not None, PARTIAL=p.splits > 1, EVEN_K=k % p.block_k == 0, BLOCK_M=p.block_m,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        WIDEN_DOTS=x.device.type != "cuda", num_warps=p.num_warps, num_stages=p.num_stages)
    finish(out, dest, bias)
    return out.reshape(*x.shape[:-1], n)
