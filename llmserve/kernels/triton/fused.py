"""The elementwise ops of a decoder layer on CUDA, one Triton kernel each where torch launches several.

Why: in a CUDA-graph decode step of an 8B model at batch 64 on an H100 (BENCHMARKS.md), the elementwise ops took
~1.5 of 8.65 ms of GPU work: torch launches ~20 small kernels a layer for them (the residual add, the RMSNorm's
widen / normalise / round / scale, rotary's four products, two sums and a concatenation, SiLU and the product, two
index copies for K/V), each a few microseconds over a few hundred kB. Here a layer's are five: add + RMSNorm (in
place, as the CPU's native op), rotary of q and k together (in place, in the fused QKV output), the K/V write, and
SiLU · up; plus one RMSNorm at the first layer. Eager steps (prefill) launch fewer kernels too.

Rounding follows the torch layers they replace (layers/norm.py, layers/rotary.py, layers/activation.py): the sum
rounded to the model dtype, the norm in fp32 rounded before the weight's product; rotary's products and sums each
rounded to the dtype, as bf16 tensor ops round; silu(gate) rounded before the product with up. Not bit for bit: the
norm's sum runs in another order, the GPU may contract a product and a sum into one FMA (fp32 rotary), and Triton's
exp and division are the fast approximate ones, so a value can land one unit in the last place from torch's. `LLMSERVE_FUSED_OPS=0` keeps the torch ops (A/B, reference), as on
the CPU. On a CPU the kernels run only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rms_norm_kernel(X, R, W, Out, stride_x, stride_r, stride_o, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < n
    dtype = X.dtype.element_ty
    x = tl.load(X + row * stride_x + c, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + c, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    y = (xf * inv).to(dtype)
    w = tl.load(W + c, mask=mask, other=0.0)
    # in place: every thread's loads before any store. Where a row has fewer elements than the program has
    # threads, Triton gives several threads the same elements, and one that loaded late would read another's result
    # (seen on an H100 with the tiny test models: hidden 64)
    tl.debug_barrier()
    if HAS_RESIDUAL:
        tl.store(R + row * stride_r + c, x, mask=mask)
    tl.store(Out + row * stride_o + c, (y.to(tl.float32) * w.to(tl.float32)).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """x [T, E] -> weight * norm(x), a new tensor; with residual [T, E]: in place, residual <- x + residual and
    x <- weight * norm(x + residual), returning x."""
    t, n = x.shape
    out = x if residual is not None else torch.empty_like(x)
    if t:
        r = residual if residual is not None else x
        _rms_norm_kernel[(t,)](x, r, weight, out, x.stride(0), r.stride(0), out.stride(0), n, eps,
                               HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
                               num_warps=_warps(n))
    return out


@triton.jit
def _rotary_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_ct, heads, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   HEADS_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (h < heads)[:, None] & (j < HALF)[None, :]
    dtype = X.dtype.element_ty
    p = X + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(p, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(Cos + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + t * stride_ct + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    # each product and sum rounded to the dtype, as apply_rotary's tensor ops
    o1 = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype)
    tl.debug_barrier()  # in place: all loads before any store (threads may share elements: _rms_norm_kernel)
    tl.store(p, o1, mask=mask)
    tl.store(p + HALF, o2, mask=mask)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (a strided view: heads may be rows of the fused QKV output), cos / sin [T, 1, D / 2] of x's
    dtype: rotates each head's halves in place, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin). Returns x."""
    t, heads, d = x.shape
    cos, sin = cos.reshape(t, d // 2), sin.reshape(t, d // 2)
    assert cos.stride() == sin.stride() and cos.stride(1) == 1 and x.stride(2) == 1
    if t:
        _rotary_kernel[(t,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, HALF=d // 2,
                             HALF_PAD=triton.next_power_of_2(d // 2), HEADS_PAD=triton.next_power_of_2(heads),
                             num_warps=4)
    return x


@triton.jit
def _silu_mul_kernel(X, Out, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < n
    dtype = X.dtype.element_ty
    g = tl.load(X + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n + c, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu, rounded to the dtype before the product
    tl.store(Out + row * stride_o + c, (act.to(tl.float32) * u).to(dtype), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate, then up) -> silu(gate) * up [T, I]."""
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)
    return out


@triton.jit
def _write_kv_kernel(K, V, Cache, Slots, stride_kt, stride_vt, stride_cache, width, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < width
    slot = tl.load(Slots + t).to(tl.int64)
    dtype = Cache.dtype.element_ty
    k = tl.load(K + t * stride_kt + c, mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + c, mask=mask, other=0.0)
    tl.store(Cache + slot * width + c, k.to(dtype), mask=mask)
    tl.store(Cache + stride_cache + slot * width + c, v.to(dtype), mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, KVH, D] (contiguous, a float dtype); k / v [T, KVH, D] with heads
    contiguous in a row (views of the fused QKV output are): row t of each to slot slot_mapping[t], rounded to the
    cache's dtype."""
    t = k.shape[0]
    width = k.shape[1] * k.shape[2]
    if t:
        _write_kv_kernel[(t,)](k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0), width,
                               BLOCK=triton.next_power_of_2(width), num_warps=4)


def _warps(n: int) -> int:
    return 8 if n >= 4096 else 4 if n >= 1024 else 2


def usable(x: torch.Tensor) -> bool:
    """Whether these kernels run for x: a CUDA tensor of a float dtype, LLMSERVE_FUSED_OPS not 0."""
    from llmserve.kernels import native

    return x.is_cuda and x.dtype in DTYPES and native.fused_ops_enabled()
