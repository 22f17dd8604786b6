"""y = x @ W^T (+ bias) on CUDA for a block-quantized weight (layers/quant_blocks.py's BlockWeight), read as packed.

The kernel reads BlockWeight's tensors as they are (codes [NT, k / 32, bits * 64] uint8 in tiles of 16 rows, scales
and mins [NT, k / group, 16]; see pack_codes for the byte order), so the CPU and CUDA keep one layout. Each program
owns a [BLOCK_M, BLOCK_N] tile of y and walks k in steps of BLOCK_K columns, a divisor of the group, so one step
needs one scale and one min per output row. Per step it dequantizes the [BLOCK_K, BLOCK_N] codes in registers
(w = d * q + m in fp32, rounded to x's dtype: the operands the torch reference's F.linear(x, w.to(x.dtype)) sees)
and adds tl.dot(x, w) to an fp32 accumulator; no dequantized weight ever reaches memory.

Small M (decode) has few tiles: the k steps are then split over programs (split-K, enough for two waves over the
GPU's SMs), each writing fp32 partial sums that torch adds up (deterministic, unlike atomics). Launch shapes
depend only on M, N, K, so CUDA graphs can capture it. The caller gathers x's columns for act-order weights
(BlockWeight.gather). The tile sizes are reasonable defaults, not tuned on a GPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from llmserve.layers.quant_blocks import BlockWeight

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # x's dtypes the kernel takes


@triton.jit
def _qblock_kernel(X, Codes, Scales, Mins, Bias, Out, M, N, stride_xm, stride_om, stride_os, stride_ct, stride_st,
                   neg_zero, steps_per_split, steps,
                   BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr, WIDEN_DOTS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    # output row n: tile n // 16, lane n % 16; a lane is 4 bytes of each 64-byte vector, one scale of each group's 16
    tile = (rn // 16).to(tl.int64)
    lane = rn % 16
    code_rows = tile * stride_ct + lane * 4  # [BLOCK_N]
    scale_rows = tile * stride_st + lane
    # column c of a block of 32: 8 bits in vector c // 4, byte c % 4 of the lane; 4 bits in vector c // 8, byte c % 4,
    # the low nibble for c % 8 < 4 and the high one above
    kk = tl.arange(0, BLOCK_K)
    c = kk % 32
    if BITS == 8:
        col_bytes = (kk // 32) * 512 + (c // 4) * 64 + c % 4
    else:
        col_bytes = (kk // 32) * 256 + (c // 8) * 64 + c % 4
        shifts = ((c // 4) % 2) * 4
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    dtype = X.dtype.element_ty

    # tl.full, not tl.zeros: tl.zeros is a jit'd library function, which the interpreter cannot call where triton
    # was imported before TRITON_INTERPRET was set (a test session that imported it elsewhere first)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, steps)
    for step in range(first, last):
        k0 = step * BLOCK_K
        x = tl.load(x_rows + k0 + kk[None, :], mask=m_mask[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        q = tl.load(Codes + (k0 // 32) * (BITS * 64) + col_bytes[:, None] + code_rows[None, :],
                    mask=n_mask[None, :], other=0)  # [BLOCK_K, BLOCK_N]
        if BITS == 4:
            q = (q >> shifts[:, None]) & 15
        g = k0 // GROUP  # BLOCK_K divides GROUP: the whole step is in one group
        d = tl.load(Scales + scale_rows + g * 16, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_MINS:
            mn = tl.load(Mins + scale_rows + g * 16, mask=n_mask, other=0.0).to(tl.float32)
        else:
            mn = d * neg_zero
        w = (q.to(tl.float32) * d[None, :] + mn[None, :]).to(dtype)
        if WIDEN_DOTS:  # the interpreter's fp16/bf16 dot is wrong: the same rounded operands, multiplied in fp32
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(x, w, input_precision=PRECISION)

    out_mask = m_mask[:, None] & n_mask[None, :]
    rows = rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if PARTIAL:  # fp32 partial sums [splits, M, N]; the caller adds them and the bias
        tl.store(Out + split * stride_os + rows, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rows, acc.to(Out.dtype.element_ty), mask=out_mask)


class Plan(NamedTuple):
    """One launch's shape: tile sizes, the k steps' split and the launch options."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int
    num_stages: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def plan(m: int, n: int, k: int, group: int, device: torch.device, splits: int | None = None) -> Plan:
    """Tiles for M rows of x: 16-row tiles (tl.dot's smallest) for decode, up to 128 x 128 for prefill; BLOCK_K the
    largest of 128 / 64 / 32 dividing the group (64 at most for big tiles, to keep the dequantized tile in
    registers); split-K where the tiles alone would leave the GPU under two waves."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 64 if m <= 64 else 128
    block_k = next(b for b in ((64, 32) if block_m == 128 else (128, 64, 32)) if group % b == 0)
    steps = k // block_k
    if splits is None:
        tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
        splits = min(16, steps, max(1, triton.cdiv(2 * _num_sms(device), tiles)))
    splits = triton.cdiv(steps, triton.cdiv(steps, max(1, min(splits, steps))))  # no empty split
    return Plan(block_m, block_n, block_k, splits, 8 if block_m == 128 else 4, 3 if block_m >= 64 else 4)


def destination(out: torch.Tensor, p: Plan) -> torch.Tensor:
    """Where a launch of plan p writes: out itself, or with split-K fp32 partial sums [splits, M, N] (see finish)."""
    return out if p.splits == 1 else torch.empty((p.splits, *out.shape), dtype=torch.float32, device=out.device)


def finish(out: torch.Tensor, dest: torch.Tensor, bias: torch.Tensor | None) -> None:
    """After a split-K launch: out = the partial sums in dest added (in torch: deterministic), plus the bias."""
    if dest is out:
        return
    y = dest.sum(0)
    if bias is not None:
        y += bias.float()
    out.copy_(y)


def qblock_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None,
                  splits: int | None = None) -> torch.Tensor:
    """x [..., k] (fp16, bf16 or fp32; columns already in the codes' order) -> [..., n] in x's dtype. `splits`
    overrides the split-K choice (tests)."""
    assert x.dtype in DTYPES and w.bits in (4, 8) and w.group % 32 == 0, (x.dtype, w.bits, w.group)
    x2 = x.reshape(-1, w.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, w.n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], w.n)
    p = plan(m, w.n, w.k, w.group, x.device, splits)
    dest = destination(out, p)
    grid = (triton.cdiv(w.n, p.block_n), triton.cdiv(m, p.block_m), p.splits)
    steps = w.k // p.block_k
    _qblock_kernel[grid](
        x2, w.codes, w.scales, w.scales if w.mins is None else w.mins, out if bias is None else bias, dest,
        m, w.n, x2.stride(0), dest.stride(-2), dest.stride(0), w.codes.stride(0), w.scales.stride(0),
        -float(w.zero), triton.cdiv(steps, p.splits), steps,
        BITS=w.bits, GROUP=w.group, HAS_MINS=w.mins is not None, HAS_BIAS=bias is not None,
        PARTIAL=p.splits > 1, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", WIDEN_DOTS=x.device.type != "cuda",
        num_warps=p.num_warps, num_stages=p.num_stages)
    finish(out, dest, bias)
    return out.reshape(*x.shape[:-1], w.n)
