"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import native
from llmserve.kernels.triton import fused_for
from llmserve.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shards = {None: (0, hidden_size)}

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale in the model dtype, as HF's LlamaRMSNorm does, so bf16/fp16
        # results round the same way as the reference.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * y

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`: returns (norm(x + residual), x + residual)."""
        fused = fused_for(x) if x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype else None
        if residual is None:
            return self._norm(x) if fused is None else fused.rms_norm(x, self.weight, self.eps)
        if fused is not None and residual.stride(-1) == 1 and residual.dtype == x.dtype:
            return fused.rms_norm(x, self.weight, self.eps, residual), residual  # in place, as the CPU's below
        if _fused_ok(x, residual):
            # In place: x and residual are this step's own activations (a projection's output and the
            # running residual stream), never read again under their old values.
            native.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        x = x + residual
        return self._norm(x), x


def _fused_ok(x: torch.Tensor, residual: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.is_contiguous() and residual.is_contiguous() and x.dim() == 2
            and native.fused_ops_enabled() and native.load() is not None)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by (1 + weight), all in fp32, then rounds to x's dtype (HF's Gemma2RMSNorm); the
    checkpoint stores weight - 1. Never fused with the residual add: Gemma's layers add after their post-norms."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        assert residual is None, "GemmaRMSNorm takes no residual"
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)
