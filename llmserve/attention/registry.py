"""Which kernel runs decode and prefill attention. The torch backend is the reference and the fallback.

`LLMSERVE_ATTENTION=torch` forces the reference (decode and prefill attention and the int8 / int4 KV writers);
otherwise CPU steps use the native kernels once they have built (the first step pays the compile, or its
cached link), and CUDA steps the Triton kernels: decode (attention/triton_decode.py) and prefill over caches of the
model's dtype (attention/triton_prefill.py).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

from llmserve.attention.metadata import AttentionMetadata
from llmserve.kernels import native

logger = logging.getLogger(__name__)

_NATIVE_DTYPES = {torch.float32, torch.bfloat16, torch.float16}  # any mix of q and cache dtypes

# (q [nd, heads, head_dim], kv_cache, kv_scales (int8 and int4 caches) or None, meta, scale, sliding_window)
#   -> [nd, heads, head_dim]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", AttentionMetadata, float, "int | None"],
                    torch.Tensor]


def _native_decode(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, meta: AttentionMetadata,
                   scale: float, sliding_window: int | None) -> torch.Tensor:
    assert meta.decode_tables is not None and meta.decode_lens is not None
    return native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, scale, sliding_window, kv_scales,
                               dot=meta.decode_dot)


def native_enabled(x: torch.Tensor) -> bool:
    """Whether native kernels may run on x: a CPU tensor, the extension built, the reference not forced."""
    return x.device.type == "cpu" and os.environ.get("LLMSERVE_ATTENTION") != "torch" and native.load() is not None


def native_prefill(q: torch.Tensor, k: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether prefill attention runs in the native kernel for these tensors (AVX-512, or AVX2 over a float cache;
    head_dim % 16 == 0)."""
    return (q.dtype in _NATIVE_DTYPES and k.dtype == q.dtype and q.shape[-1] % 16 == 0 and kv_cache.is_contiguous()
            and (kv_cache.dtype in _NATIVE_DTYPES  # uint8: int4
                 or (kv_cache.dtype in (torch.int8, torch.uint8) and native.prefill_quantized_usable()))
            and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1] and k.stride(-1) == 1 and k.stride(-2) == k.shape[-1]
            and native_enabled(q) and native.prefill_attention_usable())


def native_decode(q: torch.Tensor, kv_cache: torch.Tensor) -> DecodeFn | None:
    """The native decode kernel for these tensors, or None where the torch reference should run."""
    if not kv_cache.is_contiguous() or q.dtype not in _NATIVE_DTYPES or not native_enabled(q):
        return None
    if kv_cache.dtype in (torch.int8, torch.uint8):  # uint8: packed int4
        return _native_decode if q.shape[-1] % 16 == 0 and native.int8_kv_decode_usable() else None
    return _native_decode if kv_cache.dtype in _NATIVE_DTYPES else None


@functools.cache
def _triton_decode_fn() -> DecodeFn | None:
    try:
        from llmserve.attention import triton_decode
    except ImportError:  # no triton (CPU-only torch): the torch reference runs
        logger.warning("triton is not installed: CUDA decode attention runs the torch reference, every step eagerly")
        return None
    return triton_decode.decode


def triton_decode_covers(device: torch.device, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the Triton paged decode kernel runs decode attention on this device for these dtypes and heads (CUDA
    only: kernels/cpu's are the CPU's); it must, for CUDA graphs to capture the decode steps."""
    return (device.type == "cuda" and os.environ.get("LLMSERVE_ATTENTION") != "torch" and head_dim <= 256
            and dtype in _NATIVE_DTYPES and (cache_dtype in _NATIVE_DTYPES or cache_dtype in (torch.int8, torch.uint8))
            and _triton_decode_fn() is not None)  # (uint8: int4, head_dim even as the cache's spec requires)


@functools.cache
def _triton_prefill_fn() -> Callable | None:
    try:
        from llmserve.attention import triton_prefill
    except ImportError:
        return None
    return triton_prefill.prefill


def triton_prefill(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> Callable | None:
    """The Triton paged prefill kernel for these tensors (CUDA, a cache of q's dtype), or None: the torch reference,
    one SDPA call per chunk, then."""
    if (q.device.type != "cuda" or os.environ.get("LLMSERVE_ATTENTION") == "torch" or kv_scales is not None
            or kv_cache.dtype != q.dtype or kv_cache.stride(-1) != 1 or q.stride(-1) != 1 or q.shape[-1] > 256
            or q.dtype not in _NATIVE_DTYPES):
        return None
    return _triton_prefill_fn()


def triton_decode(q: torch.Tensor, kv_cache: torch.Tensor) -> DecodeFn | None:
    """The Triton paged decode kernel for these tensors, or None: the torch reference then."""
    if kv_cache.stride(-1) != 1 or not triton_decode_covers(q.device, q.shape[-1], q.dtype, kv_cache.dtype):
        return None
    return _triton_decode_fn()
