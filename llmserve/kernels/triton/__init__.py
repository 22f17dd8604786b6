"""CUDA kernels in Triton that are not attention (attention/triton_decode.py is with its backend): qblock.py, the
GEMM over block-quantized weights, and fused.py, the elementwise ops of a decoder layer. On a CPU they run only under
TRITON_INTERPRET=1 (tests)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def fused_for(x: torch.Tensor) -> ModuleType | None:
    """The fused elementwise kernels (fused.py) where they run for x (a CUDA tensor of a float dtype, triton importable,
    LLMSERVE_FUSED_OPS not 0), else None: the torch ops then. Imports triton only for CUDA tensors."""
    if not x.is_cuda:
        return None
    fused = _fused()
    return fused if fused is not None and fused.usable(x) else None


@functools.cache
def _fused() -> ModuleType | None:
    try:
        from llmserve.kernels.triton import fused
    except ImportError:
        return None
    return fused
