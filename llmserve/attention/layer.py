"""The attention layer models use: writes this step's K/V into its cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention.metadata import AttentionMetadata
from llmserve.attention.torch_backend import paged_attention, write_kv


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # Gemma 2: scores become softcap * tanh(scores / softcap) before the mask and softmax. The native CPU kernels
        # do not cap; capped layers run the torch reference on CPU and the Triton kernel on CUDA (torch_backend).
        self.softcap = softcap
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the model runner.
        self.kv_cache: torch.Tensor | None = None
        # int8 caches only: one fp32 scale per token and KV head, [2, num_blocks, block_size, num_kv_heads]; int4: an
        # fp16 scale and zero point each, [..., 2].
        self.kv_scales: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, heads * head_dim], k/v: [T, kv_heads * head_dim] -> [T, heads * head_dim]."""
        assert self.kv_cache is not None, "KV cache not bound: the model runner binds it before the first step"
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        write_kv(self.kv_cache, k, v, meta.slot_mapping, self.kv_scales)
        o = paged_attention(q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, self.kv_scales,
                            self.softcap)
        return o.reshape(t, self.num_heads * self.head_dim)
