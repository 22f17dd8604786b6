"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import native
from llmserve.kernels.triton import fused_for

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class SiluAndMul(nn.Module):
    """[..., 2 * I] (gate then up) -> silu(gate) * up: [..., I]. On CPU one native pass (kernels/cpu/fused_ops.cpp) where
    the extension builds, as the decoder stack, so the two paths give the same bits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES and x.is_contiguous() and x.shape[-1] % 2 == 0
                and native.fused_ops_enabled() and native.load() is not None):
            return native.silu_mul(x.view(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
        fused = fused_for(x)
        if fused is not None and x.is_contiguous() and x.shape[-1] % 2 == 0:
            return fused.silu_mul(x.view(-1, x.shape[-1])).view(*x.shape[:-1], x.shape[-1] // 2)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """[..., 2 * I] (gate then up) -> gelu(gate) * up: [..., I]; approximate "tanh" (Gemma's gelu_pytorch_tanh) or
    "none" (exact)."""

    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
