"""Which kernel runs decode attention. The torch backend is the reference and the fallback.

`LLMSERVE_ATTENTION=torch` forces the reference; otherwise CPU decodes use the native kernel
once it has built (the first decode step pays the compile, or its cached link).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from llmserve.attention import native
from llmserve.attention.metadata import AttentionMetadata

_NATIVE_DTYPES = {torch.float32, torch.bfloat16, torch.float16}  # any mix of q and cache dtypes

# (q [nd, heads, head_dim], kv_cache, meta, scale, sliding_window) -> [nd, heads, head_dim]
DecodeFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor]


def _native_decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                   sliding_window: int | None) -> torch.Tensor:
    assert meta.decode_tables is not None and meta.decode_lens is not None
    return native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, scale, sliding_window)


def native_decode(q: torch.Tensor, kv_cache: torch.Tensor) -> DecodeFn | None:
    """The native decode kernel for these tensors, or None where the torch reference should run."""
    if (q.device.type != "cpu" or not {q.dtype, kv_cache.dtype} <= _NATIVE_DTYPES or not kv_cache.is_contiguous()
            or os.environ.get("LLMSERVE_ATTENTION") == "torch"):
        return None
    return _native_decode if native.load() is not None else None
