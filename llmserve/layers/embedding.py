"""Token embedding; the same layout ([vocab, hidden]) serves as the LM head, tied or not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.layers.linear import default_weight_loader, onednn_linear, pack_weight


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shards = {None: (0, vocab_size)}
        self.packed: torch.Tensor | None = None  # oneDNN-blocked copy for logits(), see pack_for_cpu

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]."""
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (the matmul runs in the model dtype, as HF's lm_head does)."""
        if self.packed is not None:
            return onednn_linear(hidden, self.packed, None).float()
        return F.linear(hidden, self.weight).float()

    def pack_for_cpu(self, keep_plain: bool) -> None:
        """A oneDNN-blocked copy for the LM-head matmul; the plain weight stays if the lookup needs it
        (tied embeddings): then the vocab matrix is held twice."""
        self.packed = pack_weight(self.weight)
        if not keep_plain:
            self.weight = None
