"""Token embedding; the same layout ([vocab, hidden]) serves as the LM head, tied or not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention import native
from llmserve.cpu_features import fp32_compute_for_bf16
from llmserve.layers.linear import (
    bf16_gemv_ok,
    default_weight_loader,
    int8_linear,
    onednn_linear,
    pack_weight,
    quantize_rows,
)

# A bf16 LM head on a CPU without AMX (fp32_compute_for_bf16) also keeps an fp32 blocked copy when that is
# at most LM_HEAD_FP32_MAX_BYTES (SmolLM2-135M: 113 MB), used from LM_HEAD_FP32_MIN_ROWS rows. Measured on a
# 2-core AVX512-BF16 Xeon, [M, 576] x [576, 49152], ms: M = 1: bf16 2.0 vs fp32 5.0 (memory-bound: bf16
# reads half the bytes); M = 32: 13.8 vs 12.3; M = 48: 23.3 vs 14.3; M = 64: 24.6 vs 15.4-18.0;
# M = 128: 45.4 vs 27.1.
LM_HEAD_FP32_MIN_ROWS = 48
LM_HEAD_FP32_MAX_BYTES = 256 << 20


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.weight.shards = {None: (0, vocab_size)}
        self.packed: torch.Tensor | None = None  # oneDNN-blocked copy for logits(), see pack_for_cpu
        self.packed32: torch.Tensor | None = None  # fp32 blocked copy of a bf16 table, for many rows
        self.qweight: torch.Tensor | None = None  # int8 [vocab, hidden] replacing the weight, see quantize_int8
        self.scale: torch.Tensor | None = None  # fp32 [vocab]
        self.dtype: torch.dtype | None = None  # set by quantize_int8: lookups of the int8 table come back in it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]."""
        if self.qweight is not None:
            return (self.qweight[input_ids].float() * self.scale[input_ids, None]).to(self.dtype)
        return F.embedding(input_ids, self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (the matmul runs in the model dtype, as HF's lm_head does)."""
        if self.qweight is not None:
            return int8_linear(hidden, self.qweight, self.scale, None).float()
        if self.packed32 is not None and hidden.shape[0] >= LM_HEAD_FP32_MIN_ROWS:
            # fp32 products of bf16 values are exact and the sums fp32 as in the bf16 GEMM; rounding once to
            # bf16 keeps the logits the bf16 path would give (but for summation order) at any batch size.
            return onednn_linear(hidden.float(), self.packed32, None).to(hidden.dtype).float()
        if self.weight is not None and self.packed is not None and bf16_gemv_ok(hidden, self.weight):
            return native.bf16_linear(hidden, self.weight, None).float()  # a tied table keeps its plain weight
        if self.packed is not None:
            return onednn_linear(hidden, self.packed, None).float()
        return F.linear(hidden, self.weight).float()

    def pack_for_cpu(self, keep_plain: bool) -> None:
        """A oneDNN-blocked copy for the LM-head matmul; the plain weight stays if the lookup needs it
        (tied embeddings): then the vocab matrix is held twice. A small bf16 table on a CPU without AMX adds
        an fp32 blocked copy for batches (LM_HEAD_FP32_MIN_ROWS). An int8 table stays as it is."""
        if self.qweight is not None:
            return
        self.packed = pack_weight(self.weight)
        nbytes = self.weight.numel() * 4
        if self.weight.dtype == torch.bfloat16 and fp32_compute_for_bf16() and nbytes <= LM_HEAD_FP32_MAX_BYTES:
            self.packed32 = pack_weight(self.weight.float())
        if not keep_plain:
            self.weight = None

    def quantize_int8(self) -> None:
        """int8 rows with one fp32 scale each, for the lookup and the LM head alike (the plain one is freed)."""
        self.dtype = self.weight.dtype
        self.qweight, self.scale = quantize_rows(self.weight)
        self.weight = None
