"""Token embedding; the same layout ([vocab, hidden]) serves as the LM head, tied or not.

Under tensor parallelism (tp > 1) the vocabulary is split: each rank holds a contiguous share of the rows (the
vocabulary padded with zero rows to a multiple of tp). A lookup takes the ids in this rank's share, zeroes the rest
and sums over the group; the LM head's logits are this rank's columns, gathered in rank order."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.distributed.state import all_gather_last, all_reduce_, tp_state
from llmserve.kernels import native
from llmserve.kernels.choice import OpChoice
from llmserve.layers.linear import (
    MeasuredMatmul,
    ShapeMismatch,
    default_weight_loader,
    int8_linear,
    int8_packed_ok,
    onednn_linear,
    pack_weight,
    quantize_rows,
)


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = tp_state()
        self.tp = state.size > 1
        self.full_vocab_size = vocab_size
        self.vocab_start = 0
        if self.tp:  # this rank's rows [vocab_start, vocab_start + vocab_size) of the padded vocabulary
            local = -(-vocab_size // state.size)
            self.vocab_start, vocab_size = state.rank * local, local
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self._load_rows if self.tp else default_weight_loader
        self.weight.shards = {None: (0, vocab_size)}
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.packed: torch.Tensor | None = None  # oneDNN-blocked copy for logits(), see pack_for_cpu
        self.matmul: MeasuredMatmul | None = None  # a bf16 or fp32 LM head's measured kernel, see pack_for_cpu
        self.qweight: torch.Tensor | None = None  # int8 [vocab, hidden] replacing the weight, see quantize_int8
        self.scale: torch.Tensor | None = None  # fp32 [vocab]
        self.dtype: torch.dtype | None = None  # set by quantize_int8: lookups of the int8 table come back in it
        # int8 rows in w8a8_pack's layout for logits() (kernels/cpu/packed_gemm.cpp), with `scale`: quantize_head_int8 (the
        # lookup keeps the plain table), or quantize_int8 where the packed kernel runs (lookups read it too)
        self.head_int8_packed: torch.Tensor | None = None
        # from how many rows the int8 head runs on AMX-INT8 tiles (the same bits as VNNI; -1: the kernel's default), as
        # measured (kernels/calibrate.py, int8w_linear)
        self.amx8_rows = -1
        # A block-quantized table (GGUF) replacing the weight, for lookups and logits alike: layers/quant_blocks.py
        self.qblocks: Any = None

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        """This rank's rows of the checkpoint's [vocab, hidden] table; padding rows past the vocabulary are zero."""
        if tuple(loaded.shape) != (self.full_vocab_size, self.hidden_size):
            raise ShapeMismatch(f"expected shape {(self.full_vocab_size, self.hidden_size)}, got {tuple(loaded.shape)}")
        rows = loaded[self.vocab_start:self.vocab_start + self.vocab_size]
        param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]."""
        if not self.tp:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_size)
        rows = self._lookup(local.clamp(0, self.vocab_size - 1))
        rows = rows * mine[:, None].to(rows.dtype)
        return all_reduce_(rows)

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(input_ids, self.weight)
        if self.qblocks is not None:
            return self.qblocks.rows(input_ids).to(self.dtype)
        if self.qweight is not None:
            rows = self.qweight[input_ids]
        else:  # row n of the packed table: block n // 16, lane n % 16 of every group of 4 columns
            rows = self.head_int8_packed[input_ids // 16, :, input_ids % 16].flatten(1)[:, :self.hidden_size]
        return (rows.float() * self.scale[input_ids, None]).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (the matmul runs in the model dtype, as HF's lm_head does)."""
        if self.tp:
            return all_gather_last(self._logits(hidden))[:, :self.full_vocab_size]
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.qblocks is not None:
            return self.qblocks.linear(hidden, None).float()
        if self.qweight is not None:
            return int8_linear(hidden, self.qweight, self.scale, None).float()
        if self.head_int8_packed is not None:
            return native.int8w_gemm(hidden, self.head_int8_packed, self.scale, None, amx_rows=self.amx8_rows).float()
        if self.matmul is not None:
            return self.matmul(hidden, None).float()
        if self.packed is not None:
            return onednn_linear(hidden, self.packed, None).float()
        return F.linear(hidden, self.weight).float()

    def pack_for_cpu(self, keep_plain: bool, choice: OpChoice | None = None) -> None:
        """A packed copy for the LM-head matmul (a bf16 or fp32 weight with its measured choice: a MeasuredMatmul; else
        oneDNN-blocked); the plain weight stays if the lookup needs it (tied embeddings): then the vocab matrix is
        held twice. An int8 table stays as it is, and so does an int8 LM head (only the plain weight is dropped where
        the lookup does not need it)."""
        if self.qweight is not None or self.qblocks is not None:
            return
        if self.head_int8_packed is not None:
            if not keep_plain:
                self.weight = None
            return
        if choice is not None and self.weight.dtype in (torch.bfloat16, torch.float32):
            self.matmul = MeasuredMatmul(self.weight, choice)
        else:
            self.packed = pack_weight(self.weight)
        if not keep_plain:
            self.weight = None

    def quantize_head_int8(self) -> None:
        """int8 rows with one fp32 scale each for the LM-head matmul only (weight-only: the hidden states stay in the
        model dtype, or int16 per row on VNNI CPUs), multiplied in kernels/cpu/packed_gemm.cpp; the lookup keeps the plain
        table. Needs native.int8w_usable() (AVX-512, or AVX2 and FMA)."""
        qweight, self.scale = quantize_rows(self.weight)
        self.head_int8_packed = native.w8a8_pack(qweight)

    def quantize_int8(self) -> None:
        """int8 rows with one fp32 scale each, for the lookup and the LM head alike (the plain one is freed): packed for
        kernels/cpu/packed_gemm.cpp where it runs (int8_packed_ok), else row-major for int8_linear's torch paths."""
        self.dtype = self.weight.dtype
        qweight, self.scale = quantize_rows(self.weight)
        if int8_packed_ok(self.weight):
            self.head_int8_packed = native.w8a8_pack(qweight)
        else:
            self.qweight = qweight
        self.weight = None
