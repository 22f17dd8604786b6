"""Linear layers whose parameters carry their own `weight_loader`.

A checkpoint names q/k/v (and gate/up) separately; we fuse them into one matmul. Each fused
parameter knows its shards (`param.shards`: name -> row range), so the model's `load_weights` only
maps a checkpoint name to (parameter, shard) and the layer places the rows. Tensor-parallel slicing,
when it comes, belongs in these loaders too.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.cpu_features import fp32_compute_for_bf16
from llmserve.distributed.state import all_reduce_, shard, tp_state
from llmserve.kernels import native
from llmserve.kernels.choice import OpChoice

log = logging.getLogger(__name__)


class ShapeMismatch(ValueError):
    """A checkpoint tensor whose shape does not fit its parameter (or shard); the model names it."""


def tp_slice(param: nn.Parameter, loaded: torch.Tensor, shard: str | None) -> torch.Tensor:
    """A tensor-parallel rank's part of a checkpoint tensor (llmserve/distributed): the rows of its heads or
    features (`tp_rows`: shard -> (start, the checkpoint's row count)), the columns of a row-parallel layer's input
    (`tp_cols`: (start, count, the checkpoint's column count)), or zeros for the bias every rank but 0 adds (the
    all-reduce would add it size times). The whole tensor where the parameter has none of these (tp = 1)."""
    rows = getattr(param, "tp_rows", None)
    if rows is not None and shard in rows:
        start, full = rows[shard]  # start: the first row, or a list of the rows (gathered)
        if loaded.shape[0] != full:
            raise ShapeMismatch(f"expected {full} rows{'' if shard is None else f' for shard {shard}'}, got "
                                f"{tuple(loaded.shape)}")
        lo, hi = param.shards[shard]
        if isinstance(start, list):
            loaded = loaded[torch.tensor(start)]
        else:
            loaded = loaded.narrow(0, start, hi - lo)
    loaded = tp_columns(param, loaded)
    if getattr(param, "tp_zero", False):
        loaded = torch.zeros_like(loaded)
    return loaded


def tp_columns(param: nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
    """A row-parallel rank's columns of a checkpoint tensor (`tp_cols`: (start, count, the checkpoint's count))."""
    cols = getattr(param, "tp_cols", None)
    if cols is None:
        return loaded
    start, count, full = cols
    if loaded.shape[-1] != full:
        raise ShapeMismatch(f"expected {full} columns, got {tuple(loaded.shape)}")
    return loaded.narrow(-1, start, count)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    loaded = tp_slice(param, loaded, shard)
    if tuple(loaded.shape) != tuple(param.shape):
        raise ShapeMismatch(f"expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    # copy_ converts dtype and moves across devices in one pass: the only copy of the weight.
    param.data.copy_(loaded)


def sharded_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
    if shard not in param.shards:
        raise ShapeMismatch(f"unknown shard {shard!r}; expected one of {sorted(param.shards)}")
    start, end = param.shards[shard]
    loaded = tp_slice(param, loaded, shard)
    target = param.data[start:end]
    if tuple(loaded.shape) != tuple(target.shape):
        raise ShapeMismatch(f"expected shape {tuple(target.shape)} for shard {shard}, got {tuple(loaded.shape)}")
    target.copy_(loaded)


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised on purpose: every parameter is overwritten by load_weights, which checks it.
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    p.shards = {None: (0, shape[0])}
    return p


class Linear(nn.Module):
    """y = x @ W.T (+ b); W: [out_features, in_features].

    Under tensor parallelism (llmserve/distributed, tp > 1) `tp` shards it Megatron's way: "column" keeps this rank's
    share of the output features (out_features is then the share), "row" its share of the input features and sums
    the ranks' partial products with one all-reduce (in_features is the share; the bias is added once)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: str | None = None,
                 tp_share: tuple[int, int] | None = None) -> None:
        """tp_share: (start, count) of this rank's features where they are not an even split (a rank's heads)."""
        super().__init__()
        state = tp_state()
        self.reduce = False  # a row-parallel layer's output is summed over the group
        col_share = row_share = None
        if tp is not None and state.size > 1:
            if tp == "column":
                col_share = (*(tp_share or shard(out_features, "output features")), out_features)
                out_features = col_share[1]
            elif tp == "row":
                row_share = (*(tp_share or shard(in_features, "input features")), in_features)
                in_features = row_share[1]
                self.reduce = True
            else:
                raise ValueError(f"tp must be 'column' or 'row', got {tp!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        if col_share is not None:
            for p in (self.weight, self.bias):
                if p is not None:
                    p.tp_rows = {None: (col_share[0], col_share[2])}
        if row_share is not None:
            self.weight.tp_cols = row_share
            if self.bias is not None and state.rank != 0:
                self.bias.tp_zero = True

        # oneDNN-blocked copy of an fp32 weight (CPU), see pack_for_cpu; the plain weight is then freed
        self.packed: torch.Tensor | None = None
        self.qweight: torch.Tensor | None = None  # int8 [out, in] replacing the weight, see quantize_int8
        self.scale: torch.Tensor | None = None  # fp32 [out]: weight ~= qweight * scale[:, None]
        self.matmul: MeasuredMatmul | None = None  # a bf16 or fp32 weight on CPU in the form its measured kernel reads
        # The int8 weight in w8a8_pack's block layout (no qweight then): w8a8 (quantize_w8a8, with wsum), or weight-only
        # int8 where kernels/cpu/packed_gemm.cpp runs (quantize_int8)
        self.int8_packed: torch.Tensor | None = None
        self.wsum: torch.Tensor | None = None  # int32 [out]: row sums of the int8 weight, for int8 activations (w8a8)
        # int8 weights (w8a8, or weight-only on the packed kernel): from how many rows a batch runs on AMX-INT8 tiles (the
        # same bits as VNNI; 0: never; -1: the kernel's default), as measured on this machine (kernels/calibrate.py,
        # w8a8_linear and int8w_linear)
        self.amx8_rows = -1
        # LoRA adapters on this layer (llmserve/lora): adds each adapter's x @ A.T @ B.T to its requests' rows
        self.lora: Any = None
        # A block-quantized weight (GGUF, AWQ, GPTQ) kept at its bit width, replacing the weight: layers/quant_blocks.py
        self.qblocks: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        if self.lora is not None:
            y = self.lora(x, y)
        if self.reduce:
            all_reduce_(y)
        return y

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's own product, without adapters."""
        if self.qblocks is not None:
            return self.qblocks.linear(x, self.bias)
        if self.int8_packed is not None or self.matmul is not None:
            x2 = x.reshape(-1, self.in_features)  # the packed-weight kernels take [M, K]
            if self.wsum is not None:
                y = native.w8a8_linear(x2, self.int8_packed, self.scale, self.wsum, self.bias, self.amx8_rows)
            elif self.int8_packed is not None:
                y = native.int8w_gemm(x2, self.int8_packed, self.scale, self.bias, amx_rows=self.amx8_rows)
            else:
                y = self.matmul(x2, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.qweight is not None:
            return int8_linear(x, self.qweight, self.scale, self.bias)
        if self.packed is not None:
            return onednn_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, choice: OpChoice | None = None) -> None:
        """Put the weight in the form of the CPU's fastest matmul; the plain one is freed. A bf16 or fp32 weight with
        its measured choice (kernels/calibrate.py): a MeasuredMatmul. Otherwise a oneDNN-blocked copy. Int8 layers stay
        as they are."""
        if self.weight is None:
            return
        if choice is not None and self.weight.dtype in (torch.bfloat16, torch.float32):
            self.matmul = MeasuredMatmul(self.weight, choice)
        else:
            self.packed = pack_weight(self.weight)
        self.weight = None

    def quantize_int8(self) -> None:
        """Replace the weight by int8 with one symmetric fp32 scale per output row (the plain one is freed): packed for
        kernels/cpu/packed_gemm.cpp where it runs (int8_packed_ok), else kept row-major for int8_linear's torch paths."""
        qweight, self.scale = quantize_rows(self.weight)
        if int8_packed_ok(self.weight):
            self.int8_packed = native.w8a8_pack(qweight)
        else:
            self.qweight = qweight
        self.weight = None

    def quantize_w8a8(self) -> None:
        """int8 weights as quantize_int8, and int8 activations: every call quantizes its input per row and
        multiplies in int8 (kernels/cpu/w8a8_linear.cpp; needs native.w8a8_usable()). The weight is kept only in the
        kernel's block layout (int8_packed; qweight is freed)."""
        qweight, self.scale = quantize_rows(self.weight)
        self.weight = None
        self.wsum = qweight.sum(dim=1, dtype=torch.int32)
        self.int8_packed = native.w8a8_pack(qweight)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Why: on CPU, torch's F.linear goes to MKL sgemm, which on this AMD EPYC (AVX2) reaches 10 GB/s
    at M=1 and gets slower still at M=4..16. oneDNN on a pre-blocked weight measured 1.46x faster at
    M=1, 1.42x at M=8, 1.26x at M=64 and even at M=512, streaming a whole decoder's weights."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)  # 64: batch hint; any M works


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class MeasuredMatmul:
    """A bf16 or fp32 weight [N, K] on CPU in the form its chosen kernel reads (kernels/choice.py measured it on this
    machine, one kernel for every batch size). bf16: fma, dot and amx read kernels/cpu/packed_gemm.cpp's layout
    (bf16_pack), onednn its blocked copy, fp32 the plain weight (widened per call). fp32: fma reads fp32_pack's layout
    (AVX2 FMAs), onednn its blocked copy."""

    def __init__(self, weight: torch.Tensor, choice: OpChoice, rows: int | None = None) -> None:
        """weight: the plain [N, K] weight; or, with rows = N, one already in bf16_pack's layout for a packed kernel
        (fma, dot, amx): a dequantized block-quantized weight as the native dequantizer writes it (calibrate.unblock)."""
        self.n = weight.shape[0] if rows is None else rows
        self.kernel = choice.kernel
        self.fp32 = weight.dtype == torch.float32  # fp32 weights: fma is fp32_gemm
        # whether the weight is in packed_gemm.cpp's layout, which the native decoder stack runs (read on every call)
        self.packed = self.kernel in native.BF16_PATHS
        # a dequantized block-quantized weight on amx: (its blocks' native handle, rows): batches of at most that many
        # rows run qblock_linear_amx_dot on the blocks, the tiles' bits from a third of the bytes (models/llama.py)
        self.few: tuple[object, int] | None = None
        if rows is not None:
            assert self.packed, f"a pre-packed weight needs a packed kernel, not {self.kernel}"
            self.weight = weight
        elif self.packed:
            self.weight = native.fp32_pack(weight) if self.fp32 else native.bf16_pack(weight)
        elif self.kernel == "onednn":
            self.weight = pack_weight(weight)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] in the weight's dtype -> [M, N] in it."""
        if self.few is not None and x.shape[0] <= self.few[1]:
            return native.qblock_linear_amx_dot(x, self.few[0], bias)
        if self.packed:
            if self.fp32:
                return native.fp32_gemm(x, self.weight, self.n, bias)
            return native.bf16_gemm(x, self.weight, self.n, bias, self.kernel)
        if self.kernel == "onednn":
            return onednn_linear(x, self.weight, bias)
        return fp32_linear(x, self.weight, bias)


def int8_packed_ok(weight: torch.Tensor) -> bool:
    """Whether weight-only int8 of this weight runs in kernels/cpu/packed_gemm.cpp (int8w_gemm): a CPU with AVX-512 or
    AVX2, the extension built, a bf16 or fp32 model. There it beats the former int8 matrix-vector kernel at every batch
    size and torch's int8 matmul 1.8-1.9x (SmolLM2-135M's 30 decoders, 2-core AVX512-BF16 Xeon, best of 3, ms: M = 1:
    5.0 vs 5.2 vs 9.6; 16: 19.7 vs 20.3 vs 38.9; 64: 68 vs 73 vs 124), and beyond 64 rows nothing is dequantized per
    call; on an AVX2-only Zen 3 it is what lets the native decoder stack run at all (BENCHMARKS.md, 2026-12-07)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and native.int8w_usable())


# Weight-only int8 where the packed kernel does not run (int8_linear's torch paths, CPUs without AVX2): a bf16 matmul
# of at least this many rows runs in fp32 on CPUs without AMX (fp32_compute_for_bf16); widening the weight costs about
# one read of it. Measured over a SmolLM2-135M decoder's linears, 2 cores, AVX512-BF16 Xeon: bf16 (blocked) vs fp32
# widened, ms per forward: M = 64: 91 vs 88-107 (a wash); M = 96: 177 vs 127; M = 128: 172-177 vs 125-139.
FP32_COMPUTE_MIN_ROWS = 96


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) with both widened to fp32, the result in x's dtype. Products of bf16 values
    are exact in fp32 and the sums accumulate in fp32, as in a bf16 GEMM: only the summation order differs."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, cols] -> (int8 [rows, cols], fp32 [rows]): symmetric, each row's max |w| -> 127. On CPU one native pass
    (native.quantize_rows_int8: the same bytes) where the extension is built."""
    if weight.device.type == "cpu" and weight.dim() == 2 and native.load() is not None:
        return native.quantize_rows_int8(weight.detach())
    return quantize_rows_torch(weight)


def quantize_rows_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in torch ops (CUDA; the reference of the native pass)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


# Which int8 path runs where the packed kernel does not (int8_packed_ok false: CUDA, CPUs without AVX2). On CUDA,
# kernels/triton/int8.py's GEMM (one byte a weight read, nothing dequantized to memory). On CPUs, by rows: for bf16
# activations torch's int8 matmul up to 64 rows (at 16-36 rows 2-5x faster than dequantizing); beyond, and for
# fp32/fp16, the weight dequantized into a matmul, in fp32 for bf16 activations where that is faster (see
# FP32_COMPUTE_MIN_ROWS). The last is also CUDA's path without triton or with LLMSERVE_INT8_TRITON=0 (for A/B runs).
INT8PACK_MAX_ROWS = 64
# On CUDA, batches of this many rows and more (prefill chunks) dequantize the weight into the dense GEMM instead of
# the Triton kernel: they are compute-bound, where cuBLAS's tuned GEMM beats the untuned Triton one by more than the
# transient weight costs (vLLM's AWQ takes the same turn at 256 rows). On an H200, 64 requests of Llama-3-8B's shape:
# 4,436 output tok/s with the kernel at every size, against 7,520 for bf16 (BENCHMARKS.md, 2026-11-28).
INT8_TRITON_MAX_ROWS = int(os.environ.get("LLMSERVE_INT8_TRITON_MAX_ROWS", "256"))


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """(x @ qweight.T) * scale (+ bias), x: [..., in] -> [..., out] in x's dtype."""
    triton_linear = _triton_int8_linear(x.device)
    if (triton_linear is not None and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and x.numel() < INT8_TRITON_MAX_ROWS * x.shape[-1]):
        return triton_linear(x, qweight, scale, bias)
    rows = x.shape[0] if x.dim() == 2 else None
    if x.device.type == "cpu" and rows is not None:
        # torch's int8 matmul reads K in steps of 16: other widths crash it (segfault, torch 2.13)
        if (x.dtype == torch.bfloat16 and rows <= INT8PACK_MAX_ROWS and qweight.shape[1] % 16 == 0
                and hasattr(torch, "_weight_int8pack_mm")):
            y = torch._weight_int8pack_mm(x.contiguous(), qweight, scale.to(x.dtype))
            return y if bias is None else y + bias
        if x.dtype == torch.bfloat16 and rows >= FP32_COMPUTE_MIN_ROWS and fp32_compute_for_bf16():
            return fp32_linear(x, qweight.float() * scale[:, None], bias)
    return F.linear(x, qweight.to(x.dtype) * scale.to(x.dtype)[:, None], bias)


def int8_triton_runs() -> bool:
    """Whether int8 linears on CUDA run kernels/triton/int8.py's GEMM here (triton importable, not pinned off)."""
    return _triton_int8_linear(torch.device("cuda")) is not None


def _triton_int8_linear(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """kernels/triton/int8.py's GEMM for x on CUDA; None elsewhere, without triton or with LLMSERVE_INT8_TRITON=0
    (torch's path, for A/B runs)."""
    if device.type != "cuda" or os.environ.get("LLMSERVE_INT8_TRITON", "1") == "0":
        return None
    return _import_triton_int8()


@functools.cache
def _import_triton_int8() -> Callable[..., torch.Tensor] | None:
    try:
        from llmserve.kernels.triton.int8 import int8_linear as triton_int8_linear
    except ImportError:  # CPU-only torch builds bring no triton
        log.warning("triton is not installed: int8 linears on CUDA dequantize their weight at every call")
        return None
    return triton_int8_linear


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output rows, in `shard_sizes` order.

    QKV: {"q": H*D, "k": KVH*D, "v": KVH*D}; gate/up: {"gate": I, "up": I}.
    """

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 tp_rows: dict[str, tuple[int, int]] | None = None) -> None:
        """tp_rows (tensor parallelism): shard -> (the first checkpoint row of this rank's share, the checkpoint's
        row count); shard_sizes are then the shares' sizes."""
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        offsets: dict[str | None, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            offsets[name] = (start, start + size)
            start += size
        self.shard_sizes = dict(shard_sizes)
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = sharded_weight_loader
                p.shards = offsets
                if tp_rows is not None:
                    p.tp_rows = dict(tp_rows)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, out_features] -> one view per shard, in order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)
