"""The kernel choices of one model on this machine (kernels/choice.py has the selection logic and the cache).

Ops with equivalent paths, and their candidates where each can run at all (the CPU-flag gates):

- `bf16_linear:NxK` (a bf16 weight [N, K]: every decoder projection and the LM head):
  fma     kernels/cpu/packed_gemm.cpp, fp32 FMAs on weights widened in registers (AVX-512, the extension built);
  dot     the same packed weights, vdpbf16ps on bf16 x (AVX512-BF16);
  onednn  oneDNN's bf16 matmul on its blocked weights (AMX where the CPU has it);
  fp32    both widened to fp32 per call, oneDNN's fp32 matmul.
  amx     the same packed weights on AMX tiles (AMX-BF16; K a multiple of 32): kernels/cpu/amx_gemm.cpp;
  fma, dot and amx share one copy of the weight; onednn and fp32 add their own where they win. Each path must give a
  row the same result whatever the batch (the engine's tokens never depend on it): ours do by construction; onednn and
  fp32 are candidates for a shape only where a check at calibration finds them so (oneDNN's AMX matmul is not:
  batch_invariant).
- `fp32_linear:NxK` (an fp32 weight [N, K]: an fp32 model's projections and LM head), where both run:
  fma     kernels/cpu/packed_gemm.cpp's fp32_gemm on fp32_pack's layout, AVX2 FMAs (CPUs with AVX2 and FMA);
  onednn  oneDNN's fp32 matmul on its blocked weights (what every fp32 linear ran before; a candidate where
          batch_invariant finds it so).
  On a 2-core AMD EPYC Zen 3 (AVX2 only) fma won at 1-128 rows by 1.1-4x and lost by 3-10% at 256-2,048 rows of the
  MLP's gate/up: fma for every op (BENCHMARKS.md, 2026-12-07).
- `qblock_linear:NxK:B-bit/G` (a block-quantized weight, GGUF's or AWQ/GPTQ's, of B-bit codes in groups of G columns,
  where the native block kernel runs). An fp32 model's (a GGUF's blocks where the compute dtype is fp32: CPUs
  without AVX512-BF16), where both of the kernel's numerics run (VNNI or AVX2 beside the FMAs), chooses between
  blocks  kernels/cpu/qblock_gemm.cpp on the blocks as loaded, activations rounded to int8 per block, and
  blocks_fma  the same blocks with x unrounded, fp32 FMAs on the widened codes (QBlockWeight.fma); one of the two for
          every batch size, so a row's result never depends on its batch. On a 2-core Zen 3 (AVX2 only) the Q8_0 LM
          head took 1.2 against 1.6 ms at 1 row and 53 against 40 ms at 64 (two vpmaddubsw a product for 8-bit codes):
          blocks_fma for the head, blocks for the Q4_1 decoder layers (BENCHMARKS.md, 2026-12-08).
  A bf16 model's (its compute dtype bf16):
  blocks  kernels/cpu/qblock_gemm.cpp on the blocks as loaded (activations rounded to int8 per block);
  blocks_amx  the blocks kept, each tile dequantized to bf16 as it is read, on AMX tiles (qblock_linear_amx): bit for
          bit amx over the dequantized weight, reading the blocks' bytes. A candidate only where the dequantized
          weights do not fit (below): where they do, amx gives the same bits and timed faster (2-core Xeon with AMX,
          SmolLM2's shapes, weights in cache: 0.70 against 0.77 ms at 512 rows, 0.023 against 0.092 at 1; over 30
          layers streamed from memory the two were within 10%);
  fma, dot, amx, onednn, fp32  the bf16_linear paths over the dequantized weight (exactly the format's values, rounded
          to bf16), which then replaces the blocks. Offered only where every block layer's dequantized weights fit in
          a quarter of the memory available (dequantize_fits): blocks are a quarter to a half of bf16's bytes.
  Timed first on one layer's weight in cache, then, up to COLD_MAX_ROWS rows (decode batches), again with the weights
  read from memory in passes through the model's layers (add_cold_times): the blocks are a third of bf16's bytes, and
  a step reads every weight from memory. The op's choice is made from both.
  Where the winner is amx or blocks_amx, qblock_linear_amx_dot (blocks_dot: the blocks' dot products in the tiles'
  order, their bits exactly) may run the batches of a few rows, reading the blocks rather than a bf16 weight: up to
  how many rows is measured after the choice, by passes through the model's block layers (add_few_rows), and kept
  with the op (OpChoice.few_rows; where it is above 0 the blocks stay beside the dequantized weight). Where the
  blocks won, the same is measured for the amx path, and the blocks' AMX-INT8 threshold (add_amx8_rows) where amx
  won; the op is then chosen again between the two as their plans run (choice.as_run).
- `w8a8_linear:NxK` (a w8a8 layer: int8 weights and int8 activations, kernels/cpu/w8a8_linear.cpp), where the CPU has
  AMX-INT8: both give the same bits (exact int32 sums), so the choice is a threshold, not one kernel for every batch:
  vnni    VNNI register tiles at every row count;
  amx8    from OpChoice.amx8_rows rows on, AMX-INT8 tiles (each layer's amx8_rows). Timed on the op's first
          layer at AMX8_BUCKETS rows (measure_w8a8); pins: vnni (never the tiles), amx8 (the tiles from one row).
- `int8w_linear:NxK` (weight-only int8 on the packed kernel: --quantization int8's layers and LM head, w8a8's LM head;
  x rounded to int16 per row), where the CPU has AMX-INT8: the same threshold between vnni (vpdpwssd) and amx8 (the
  16-bit activations as two int8 tile products, the same bits), measured by measure_int8w; each layer's
  amx8_rows, as the head's.
- `prefill_attention:H/KVHxD` (native prefill attention of a bf16 model, by the step's prefill tokens):
  fp32    kernels/cpu/prefill_attention.cpp with fp32 FMAs (AVX-512);
  dot     the same with the scores by vdpbf16ps on the keys as stored (AVX512-BF16); P stays fp32;
  amx     both products on AMX tiles (AMX-BF16, head_dim % 32 == 0), P as two bf16 terms (~17 bits).
- `decode_attention:H/KVHxD` (native decode attention of a bf16 model over its bf16 cache, by the step's decodes):
  fp32    kernels/cpu/paged_decode.cpp, scores by FMAs over widened keys (AVX-512);
  dot     both products by vdpbf16ps on the cache as stored (AVX512-BF16, head_dim % 32 == 0; other head dims run
          fp32), P as two bf16 terms (~17 bits) for P @ V.

Each op is timed on random weights of its shape (a qblock_linear on the first such layer's own blocks), so calibration
runs before the weights are packed, at the batch sizes the engine will give it (RowLimits): a decoder linear at the
powers of two up to the step's token budget (max_prefill_token_num: 1-2,048 rows by default), the LM head up to the
rows it samples (max_batch_size, times 1 + the drafts with speculation: 1-128). The embedded SmolLM2-135M takes
5.3-5.8 s on a 2-core Zen 5; later starts read the cache.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llmserve.errors import InvalidRequestError
from llmserve.kernels import native
from llmserve.kernels.choice import (
    AMX8,
    AMX8_BUCKETS,
    AMX_PATHS,
    FEW_BUCKETS,
    FEW_ROWS_KERNEL,
    NARROW,
    PRUNE,
    VNNI,
    WIDE,
    Candidate,
    ChoiceTable,
    OpChoice,
    Timer,
    amend,
    as_run,
    choose,
    few_rows,
    from_rows,
    load_or_measure,
    lone_loss,
    parse_pins,
    pinned,
    wall_clock,
    with_cold_times,
)

if TYPE_CHECKING:
    from torch import nn

    from llmserve.config import EngineConfig
    from llmserve.layers.quant_blocks import BlockWeight

log = logging.getLogger(__name__)

BF16_LINEAR = "bf16_linear"
QBLOCK_LINEAR = "qblock_linear"
PREFILL_ATTENTION = "prefill_attention"
DECODE_ATTENTION = "decode_attention"
W8A8_LINEAR = "w8a8_linear"
INT8W_LINEAR = "int8w_linear"
BF16_KERNELS = ("fma", "dot", "amx", "onednn", "fp32")
FP32_LINEAR = "fp32_linear"
FP32_KERNELS = ("fma", "onednn")
KINDS: dict[str, tuple[str, ...]] = {BF16_LINEAR: BF16_KERNELS, FP32_LINEAR: FP32_KERNELS,
                                     QBLOCK_LINEAR: ("blocks", "blocks_amx", "blocks_fma") + BF16_KERNELS,
                                     PREFILL_ATTENTION: ("fp32", "dot", "amx"), DECODE_ATTENTION: ("fp32", "dot"),
                                     W8A8_LINEAR: (VNNI, AMX8), INT8W_LINEAR: (VNNI, AMX8)}
# dequantize_fits: the share of the memory available that a model's dequantized block layers may take
DEQUANTIZE_SHARE = 0.25
# prefill tokens in a step: a chunk's attention grows with its square, so its buckets are wider than a linear's
ATTENTION_BUCKETS = (16, 64, 256, 1024, 4096)

DECODE_BUCKETS = (1, 4, 16, 64, 256)  # decodes in a step
DECODE_CONTEXT = 256  # tokens of context each timed decode reads (64-token blocks, in random block order)
# Each timed decode call reads a new "layer" of the cache until this many bytes were read, as an engine's step reads
# every layer's: a single hot cache (12 MB at 64 decodes) fit the caches and ranked the paths otherwise than the
# engine's DRAM-bound steps did (dot 1.25x faster timed hot, 2-5% slower in the 64-request workload).
DECODE_COLD_BYTES = 96 << 20
# Values a timed cache is filled with: a run of this many normal values in bf16, repeated (an odd length, so no two
# blocks of a cache hold the same values). Drawing every value took 0.8-1.1 s of a 2-core Xeon's calibration (the
# buckets' caches are 12-100 MB): the kernels' time does not depend on which values they read, only on where.
RANDOM_RUN = 1_000_003
ENV = "LLMSERVE_KERNEL_CHOICE"


@dataclasses.dataclass(frozen=True)
class RowLimits:
    """The most rows the engine gives a matmul in one step, so that calibration times the batch sizes it will run and
    none it will not: a decoder linear takes a step's tokens (max_prefill_token_num: prefill chunks plus decodes), the
    LM head only the rows it samples (one a request, max_batch_size; with speculation, each request's drafts too)."""

    linear: int = 2048
    head: int = 128


# the largest bucket a linear is timed at, whatever the limit (a 4,096-row call of a large model's gate/up is long
# enough; more rows only repeat it)
MAX_BUCKET_ROWS = 4096


def row_buckets(limit: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first at or above limit (at most MAX_BUCKET_ROWS): the row counts a matmul of
    at most `limit` rows is timed at."""
    top = min(max(1, limit), MAX_BUCKET_ROWS)
    out = [1]
    while out[-1] < top:
        out.append(out[-1] * 2)
    return tuple(out)


def row_limits(config: EngineConfig) -> RowLimits:
    """An EngineConfig's RowLimits."""
    spec = config.speculative_method is not None or config.speculative_model is not None
    per_request = 1 + (config.num_speculative_tokens if spec else 0)
    return RowLimits(linear=config.max_prefill_token_num, head=config.max_batch_size * per_request)


def op_name(weight: torch.Tensor) -> str:
    """The op of a bf16 or fp32 weight's matmul: bf16_linear:NxK or fp32_linear:NxK."""
    kind = FP32_LINEAR if weight.dtype == torch.float32 else BF16_LINEAR
    return f"{kind}:{weight.shape[0]}x{weight.shape[1]}"


def qblock_op(layer: nn.Module) -> str | None:
    """The op name of a linear / embedding that runs on block-quantized weights in the native kernel, else None."""
    qb = getattr(layer, "qblocks", None)
    if qb is None or getattr(qb, "native", None) is None:
        return None
    return f"{QBLOCK_LINEAR}:{qb.n}x{qb.k}:{qb.bits}-bit/{qb.group}"


def qblock_layers(model: nn.Module) -> Iterator[nn.Module]:
    """The model's linears and LM head (the table its logits_head() computes logits with) on native block-quantized
    weights; an embedding only looked up is not a matmul."""
    from llmserve.layers.linear import Linear

    heads = [m.logits_head() for m in model.modules() if hasattr(m, "logits_head")]
    for m in model.modules():
        if (isinstance(m, Linear) or any(m is h for h in heads)) and qblock_op(m) is not None:
            yield m


def dequantize_fits(layers: list[nn.Module], available_bytes: int | None = None) -> bool:
    """Whether the layers' weights dequantized to bf16 would take at most DEQUANTIZE_SHARE of the memory available
    (/proc/meminfo's MemAvailable, or available_bytes), counting what their blocks free."""
    extra = sum(2 * m.qblocks.n * m.qblocks.k - m.qblocks.nbytes for m in layers)
    if available_bytes is None:
        available_bytes = _mem_available()
    return available_bytes is not None and extra <= DEQUANTIZE_SHARE * available_bytes


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def unblock(layer: nn.Module, packed: bool = False) -> torch.Tensor | None:
    """Replace a layer's blocks by its dequantized weight in bf16 (a qblock_linear choice other than blocks).
    packed (for fma, dot or amx, and a layer whose plain weight nothing else reads): return that weight in bf16_pack's
    layout, straight from the native dequantizer where it runs (it writes that layout), and leave layer.weight None.
    Making the plain [n, k] weight and packing it again cost 0.5 s of the embedded model's 2 s load (2-core Xeon with
    AMX). Else, or where the native dequantizer does not run, layer.weight is the plain weight and this returns None."""
    qb, layer.qblocks = layer.qblocks, None
    if packed and native.bf16_dot_usable():
        return native.qblock_dequantize_bf16(qb.native)
    layer.weight = torch.nn.Parameter(dequantized_bf16(qb), requires_grad=False)
    return None


def dequantized_bf16(qb: BlockWeight, rows: int = 4096) -> torch.Tensor:
    """[n, k] bf16: exactly the format's values rounded to bf16. In the native kernel where it runs (the embedded
    model's 121 block layers: 2.0 s in torch, `rows` rows at a time so that a whole LM head in fp32 does not add its
    size to the peak memory), else in torch."""
    if native.bf16_dot_usable():
        packed = native.qblock_dequantize_bf16(qb.native)  # [tiles, k / 2, 16, 2]
        return packed.permute(0, 2, 1, 3).reshape(-1, qb.k)[:qb.n].contiguous()
    w = torch.empty(qb.n, qb.k, dtype=torch.bfloat16)
    for r in range(0, qb.n, rows):
        w[r:r + rows] = qb.dequantize_rows(r, min(qb.n, r + rows))
    return w


def matmul_weights(model: nn.Module) -> Iterator[torch.Tensor]:
    """The bf16 and fp32 CPU weights of the model's linears and LM head (the matmuls a bf16_linear or fp32_linear
    choice applies to: op_name). Not an embedding that is only looked up: an untied model's input table, or one whose
    LM head is int8 (w8a8's head) (timing its 49152x576 shape took SmolLM2-135M's w8a8 calibration from 2.7 to 7.4 s on
    a 2-core Xeon, for a choice nothing used)."""
    from llmserve.layers.embedding import VocabEmbedding
    from llmserve.layers.linear import Linear

    heads = {id(m.logits_head()) for m in model.modules() if hasattr(m, "logits_head")}
    for m in model.modules():
        int8_head = isinstance(m, VocabEmbedding) and getattr(m, "head_int8_packed", None) is not None
        matmul = isinstance(m, Linear) or (isinstance(m, VocabEmbedding) and id(m) in heads and not int8_head)
        w = getattr(m, "weight", None) if matmul else None
        if w is not None and w.dtype in (torch.bfloat16, torch.float32) and w.device.type == "cpu" and w.dim() == 2:
            yield w


def attention_op(model: nn.Module, kind: str, dtype: torch.dtype) -> str | None:
    """The op name of the model's native prefill or decode attention where a choice exists: a bf16 model (dtype: its
    compute dtype, whatever its linears hold: a GGUF's may all be quantized blocks) whose heads the kernels take
    (head_dim % 16 == 0), on a CPU where they run; else None. (A decode choice applies to a bf16 cache: the runner's
    default for a bf16 model; another cache dtype keeps FMAs.)"""
    layers = model.attention_layers() if hasattr(model, "attention_layers") else []
    bf16 = dtype == torch.bfloat16
    if not layers or not bf16 or not native.prefill_attention_usable():
        return None
    a = layers[0]
    return f"{kind}:{a.num_heads}/{a.num_kv_heads}x{a.head_dim}" if a.head_dim % 16 == 0 else None


def available(kind: str) -> tuple[str, ...]:
    """The candidates of an op kind that can run on this machine (flags only gate; they never choose)."""
    if kind == W8A8_LINEAR:
        return ((VNNI, AMX8) if native.w8a8_amx_usable() else (VNNI,)) if native.w8a8_usable() else ()
    if kind == INT8W_LINEAR:  # 16-bit activations (VNNI), on the tiles where AMX-INT8 is
        return ((VNNI, AMX8) if native.w8a8_amx_usable() else (VNNI,)) if native.int8w_a16_usable() else ()
    if kind == FP32_LINEAR:
        fma = ("fma",) if native.fp32_gemm_usable() else ()
        return fma + (("onednn",) if torch.backends.mkldnn.is_available() else ())
    if kind in (PREFILL_ATTENTION, DECODE_ATTENTION):
        names = ("fp32", "dot") if native.bf16_dot_usable() else ("fp32",)
        return names + ("amx",) if kind == PREFILL_ATTENTION and native.prefill_amx_usable() else names
    names = []
    if kind == QBLOCK_LINEAR:
        names = ["blocks"] + (["blocks_amx"] if native.qblock_amx_usable() else [])
        if native.qblock_int8_usable() and native.qblock_fma_usable():  # two numerics for the blocks: measured
            names.append("blocks_fma")
    if native.packed_gemm_usable():
        names.append("fma")
        if native.bf16_dot_usable():
            names.append("dot")
        if native.amx_usable():
            names.append("amx")
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        names.append("onednn")
    names.append("fp32")
    return tuple(names)


def runs_shape(name: str, k: int) -> bool:
    """Whether candidate `name` takes k columns: a linear's weight, or attention's head_dim (amx: whole tiles of 32)."""
    return name != "amx" or k % 32 == 0


def bf16_linear_candidates(n: int, k: int, names: tuple[str, ...], w: torch.Tensor | None = None,
                           invariant_only: bool = True, invariant_rows: int = 512) -> list[Candidate]:
    """Each named path over a bf16 [n, k] weight (w, else random), as MeasuredMatmul runs it, where it takes the shape
    (runs_shape) and, for oneDNN's and fp32's, gives rows the same results in any batch up to invariant_rows rows (the
    largest timed; batch_invariant; unless not invariant_only: what the machine can do, bench's peak); inputs made once
    per row count."""
    from llmserve.layers.linear import fp32_linear, onednn_linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    if w is None:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()

    @functools.lru_cache(maxsize=1)  # choose() times one row count at a time: only its inputs are kept
    def x(rows: int) -> torch.Tensor:
        return torch.randn(rows, k, generator=gen).bfloat16()

    out = []
    names = tuple(name for name in names if runs_shape(name, k))
    packed = native.bf16_pack(w) if {"fma", "dot", "amx"} & set(names) else None
    for name in names:
        if name in native.BF16_PATHS:
            out.append(Candidate(name, lambda r, p=name: native.bf16_gemm(x(r), packed, n, None, p)))
            continue
        if name == "onednn":
            blocked = pack_weight(w)
            run = functools.partial(lambda b, xs: onednn_linear(xs, b, None), blocked)
        else:
            run = functools.partial(fp32_linear, weight=w, bias=None)
        if not invariant_only or batch_invariant(run, k, gen, invariant_rows):
            out.append(Candidate(name, lambda r, f=run: f(x(r))))
        else:
            log.info("%s: %s's results for a row change with the batch here: not a candidate", op_name(w), name)
    return out


def fp32_linear_candidates(n: int, k: int, names: tuple[str, ...], invariant_rows: int = 512,
                           invariant_only: bool = True) -> list[Candidate]:
    """Each named path over an fp32 [n, k] weight (random), as MeasuredMatmul runs it: fma (fp32_gemm on fp32_pack's
    layout) and onednn (its blocked copy), the latter where it gives rows the same results in any batch up to
    invariant_rows rows (batch_invariant; unless not invariant_only: what the machine can do, bench's peak); inputs
    made once per row count."""
    from llmserve.layers.linear import onednn_linear, pack_weight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.05

    @functools.lru_cache(maxsize=1)
    def x(rows: int) -> torch.Tensor:
        return torch.randn(rows, k, generator=gen)

    out = []
    if "fma" in names:
        packed = native.fp32_pack(w)
        out.append(Candidate("fma", lambda r: native.fp32_gemm(x(r), packed, n, None)))
    if "onednn" in names:
        run = functools.partial(lambda b, xs: onednn_linear(xs, b, None), pack_weight(w))
        if not invariant_only or batch_invariant(run, k, gen, invariant_rows, torch.float32):
            out.append(Candidate("onednn", lambda r: run(x(r))))
        else:
            log.info("%s:%dx%d: onednn's results for a row change with the batch here: not a candidate", FP32_LINEAR,
                     n, k)
    return out


# batch_invariant's pieces of a batch of the most rows an op is timed and run at (each cut at that many): each piece's
# results must equal the batch's
INVARIANCE_PIECES = ((0, 1), (1, 17), (17, 81), (81, 337), (337, 849))


def batch_invariant(run: Callable[[torch.Tensor], torch.Tensor], k: int, gen: torch.Generator,
                    rows: int = 512, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether run (x [M, k] of dtype -> [M, n]) gives each row the same result in batches of 1, 16, 64, 256 and 512 rows
    (each cut at `rows`, the most the op runs at) as in one batch of `rows`: a sample, not a proof (our own kernels are
    invariant by construction; a library's blocking may follow M: oneDNN's AMX matmul on a Xeon 6 207 changed rows'
    results between 64- and 512-row batches). Batches larger than the op's are not checked: the LM head (128 rows at
    most by default) was checked at 512, 0.64 s of a 2-core Xeon's calibration for oneDNN's and fp32's 49152 x 576."""
    rows = max(rows, 1)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    whole = run(x)
    return all(torch.equal(run(x[a:min(b, rows)]), whole[a:min(b, rows)]) for a, b in INVARIANCE_PIECES if a < rows)


def qblock_linear_candidates(layer: nn.Module, names: tuple[str, ...], invariant_rows: int = 512,
                             dtype: torch.dtype = torch.bfloat16) -> list[Candidate]:
    """blocks: the layer's own blocks in the native kernel (int8 activations where they run; blocks_fma: fp32 FMAs on
    the codes); the other names: the bf16_linear paths over its dequantized weight. dtype: x's (the model's)."""
    qb = layer.qblocks
    gen = torch.Generator().manual_seed(0)

    @functools.lru_cache(maxsize=1)
    def x(rows: int) -> torch.Tensor:
        return torch.randn(rows, qb.k, generator=gen).to(dtype)

    out = []  # blocks: what the kernel runs by default (int8 where it can), whatever qb.native.fma says
    for name, vnni in (("blocks", 1 if native.qblock_int8_usable() else 0), ("blocks_fma", 0)):
        if name in names:
            out.append(Candidate(name, functools.partial(lambda r, v: native.qblock_linear(x(r), qb.native, None, v),
                                                         v=vnni)))
    if "blocks_amx" in names:
        out.append(Candidate("blocks_amx", lambda r: native.qblock_linear_amx(x(r), qb.native, None)))
    others = tuple(name for name in names if name not in ("blocks", "blocks_amx", "blocks_fma"))
    if others:
        out += bf16_linear_candidates(qb.n, qb.k, others, dequantized_bf16(qb), invariant_rows=invariant_rows)
    return out


def w8a8_op(layer: nn.Module) -> str | None:
    """The op name of a w8a8 linear (int8 weights in w8a8_pack's layout with their row sums), else None."""
    if getattr(layer, "wsum", None) is None or getattr(layer, "int8_packed", None) is None:
        return None
    return f"{W8A8_LINEAR}:{layer.out_features}x{layer.in_features}"


def int8w_op(layer: nn.Module) -> str | None:
    """The op name of a weight-only int8 matmul on the packed kernel (a Linear's int8 weights without w8a8's row sums,
    or an int8 LM head: --quantization int8, and w8a8's head) whose columns the tiles take (a multiple of 64), else
    None."""
    from llmserve.layers.embedding import VocabEmbedding

    if isinstance(layer, VocabEmbedding):
        packed = getattr(layer, "head_int8_packed", None)
    elif getattr(layer, "wsum", None) is None:
        packed = getattr(layer, "int8_packed", None)
    else:
        packed = None
    if packed is None or packed.shape[1] % 16:
        return None
    return f"{INT8W_LINEAR}:{layer.scale.numel()}x{packed.shape[1] * 4}"


def measure_int8w(layer: nn.Module, dtype: torch.dtype, timer: Timer = wall_clock, reps: int = 3) -> OpChoice:
    """From how many rows a weight-only int8 op's batches run on AMX-INT8 tiles (int8w_gemm's 16-bit activations as
    two int8 products: the same bits as VNNI), timed as measure_w8a8 times w8a8's. On a 2-core Xeon with AMX (model
    207), w8a8's LM head (49152 x 576), best of 15: VNNI / tiles 0.67 / 0.89 ms at 1 row, 1.6 / 1.0 at 8, 9.8 / 3.7 at
    64."""
    packed = layer.head_int8_packed if hasattr(layer, "head_int8_packed") else layer.int8_packed
    return _amx8_threshold(packed.shape[1] * 4, dtype, timer, reps, lambda x, name: functools.partial(
        native.int8w_gemm, x, packed, layer.scale, None, None, 0 if name == VNNI else 1))


def int8_amx_rows(c: OpChoice) -> int:
    """An int8 op's choice (w8a8_linear, int8w_linear) as its kernel's amx_rows: pinned vnni 0 (never), pinned amx8 1
    (every batch), measured: its amx8_rows (0: the tiles never ran faster)."""
    if c.pinned or c.amx8_rows is None:
        return 1 if c.kernel == AMX8 else 0
    return c.amx8_rows


def measure_w8a8(layer: nn.Module, dtype: torch.dtype, timer: Timer = wall_clock, reps: int = 3) -> OpChoice:
    """From how many rows a w8a8 op's batches run on AMX-INT8 tiles: its first layer timed at AMX8_BUCKETS rows on VNNI
    alone and on the tiles (a warm-up and `reps` interleaved calls each, the fastest kept); the tiles run from the
    smallest bucket from which they were at least as fast at every larger one (choice.from_rows). The same bits either
    way, so this only chooses speed. On a 2-core Xeon with AMX (model 207), SmolLM2-135M's four decoder shapes over 30
    layers: VNNI faster at 1-4 rows, the tiles 1.06x at 8 and 1.4-1.7x from 16 (BENCHMARKS.md)."""
    return _amx8_threshold(layer.in_features, dtype, timer, reps, lambda x, name: functools.partial(
        native.w8a8_linear, x, layer.int8_packed, layer.scale, layer.wsum, None, 0 if name == VNNI else 1))


def _amx8_threshold(k: int, dtype: torch.dtype, timer: Timer, reps: int,
                    call: Callable[[torch.Tensor, str], Callable[[], object]]) -> OpChoice:
    """An int8 op's choice: VNNI, with the AMX-INT8 tiles from the smallest bucket from which they never lost
    (_time_same_bits on x of the model's dtype, bf16 for others)."""
    x_dtype = dtype if dtype in (torch.float32, torch.bfloat16) else torch.bfloat16
    timed = _time_same_bits(k, x_dtype, timer, reps, call)
    return OpChoice(VNNI, amx8_rows=from_rows(AMX8_BUCKETS, timed[VNNI], timed[AMX8]), amx8_timed=timed)


def add_few_rows(model: nn.Module, table: ChoiceTable, timer: Timer = wall_clock) -> ChoiceTable:
    """The table with OpChoice.few_rows for each qblock op whose kernel is an amx path (amx over the dequantized
    weight, blocks_amx over the blocks), or is blocks with an amx path among its candidates (for choice.as_run), and
    which qblock_linear_amx_dot can stand in for: measured over passes through
    all the model's block layers in order, as a decode step reads them (each op's time its layers' sum), every layer on
    its op's kernel, then every layer on the blocks' dot products. Why the whole model: timed hot, the two were even at
    one row (SmolLM2's shapes, 7.6 ms against 7.7 for its 30 layers, 2-core Xeon with AMX); copies of one op's weight
    (96 MB) ranked them otherwise than a step does; read from memory as a step reads them, 13-14 ms against 8.3-8.5."""
    if not native.qblock_amx_dot_usable():
        return table
    runs: list[tuple[str, int, Callable[[torch.Tensor], object], Callable[[torch.Tensor], object]]] = []
    with torch.inference_mode():
        for layer in qblock_layers(model):
            op = qblock_op(layer)
            c = table.ops.get(op)
            qb = layer.qblocks
            if c is None or c.pinned or qb.perm is not None:
                continue
            amx = c.kernel if c.kernel in AMX_PATHS else next((n for n in AMX_PATHS if n in c.seconds), None)
            if amx is None or c.kernel not in (amx, "blocks"):  # (blocks: amx as it would run, for as_run)
                continue
            if amx == "amx":  # the dequantized weight, as unblock will make it (freed after the timing)
                w = native.qblock_dequantize_bf16(qb.native)
                reference = functools.partial(lambda x, w, n: native.bf16_gemm(x, w, n, None, "amx"), w=w, n=qb.n)
            else:
                reference = functools.partial(lambda x, b: native.qblock_linear_amx(x, b, None), b=qb.native)
            runs.append((op, qb.k, reference,
                         functools.partial(lambda x, b: native.qblock_linear_amx_dot(x, b, None), b=qb.native)))
        if not runs:
            return table
        gen = torch.Generator().manual_seed(0)
        xs: dict[tuple[int, int], torch.Tensor] = {}

        def timed_pass(kernel: str, rows: int) -> dict[str, float]:
            seconds: dict[str, float] = {}
            for op, k, reference, fma in runs:
                x = xs.get((rows, k))
                if x is None:
                    x = xs[rows, k] = torch.randn(rows, k, generator=gen).bfloat16()
                f = fma if kernel == FEW_ROWS_KERNEL else reference
                seconds[op] = seconds.get(op, 0.0) + timer(kernel, rows, functools.partial(f, x))
            return seconds

        found = few_rows(list(dict.fromkeys(op for op, *_ in runs)), timed_pass)
    ops = dict(table.ops)
    for op, (rows, timed) in found.items():
        ops[op] = dataclasses.replace(ops[op], few_rows=rows, few_timed=timed)
    return dataclasses.replace(table, ops=ops)


# Rows up to which a block-quantized op's candidates are timed again with their weights read from memory (decode
# batches: compute is small there, and the bytes a kernel reads decide its time), and the candidates timed so: the
# blocks, and the packed kernels over the dequantized weight (one copy of the model's layers for all three)
COLD_MAX_ROWS = 64
COLD_KERNELS = ("blocks", "blocks_amx") + tuple(native.BF16_PATHS)


def add_cold_times(model: nn.Module, table: ChoiceTable, timer: Timer = wall_clock, reps: int = 2) -> ChoiceTable:
    """The table with each measured qblock op's times at the buckets up to COLD_MAX_ROWS taken again with the weights
    read from memory, and its kernel chosen again from them (choice.with_cold_times): passes through all the model's
    block layers in order, the LM head last, as a decode step reads them, each layer on one candidate (the blocks, or a
    packed kernel over the layer's dequantized weight) and each op's time the mean over its layers; a warm-up pass and
    `reps` interleaved ones per candidate, the fastest kept. Candidates are those within PRUNE of the bucket's fastest
    as timed hot, and the blocks always; the others (oneDNN's and fp32's layouts, not built for every layer) are
    scaled from a timed one that reads the same bytes. Not where only the blocks were candidates (they read the
    same bytes either way).
    Why: each op was timed on one layer's weight, in cache, where a bf16 kernel over the dequantized weight can beat
    the blocks; a step reads the weights from memory, and the blocks are a third of bf16's bytes. On a 2-core Zen 5,
    SmolLM2's 576x576 at one row: dot 0.005 against the blocks' 0.008 ms hot, 0.019 against 0.012 read cold; its two
    smaller shapes went to dot, and single-request decode ran 160-174 tokens/s against 186-226 on the blocks."""
    heads = {id(m.logits_head()) for m in model.modules() if hasattr(m, "logits_head")}
    layers = []
    for layer in qblock_layers(model):
        c = table.ops.get(qblock_op(layer))
        if c is not None and not c.pinned and "blocks" in c.seconds and \
                set(c.seconds) - {"blocks", "blocks_amx", "blocks_fma"}:
            layers.append(layer)
    if not layers:
        return table
    layers.sort(key=lambda m: id(m) in heads)  # decoder layers in the model's order, then the head
    start = time.perf_counter()
    ops = {id(m): qblock_op(m) for m in layers}
    count = collections.Counter(ops.values())  # layers per op
    # per op and cold bucket (index into its rows): the candidates timed cold
    names: dict[str, dict[int, list[str]]] = {}
    for op in count:
        c = table.ops[op]
        names[op] = {}
        for i, rows in enumerate(c.rows):
            if rows <= COLD_MAX_ROWS:
                fastest = min(c.seconds[n][i] for n in c.seconds)
                names[op][i] = [n for n in c.seconds if n in COLD_KERNELS
                                and (n == "blocks" or c.seconds[n][i] <= PRUNE * fastest)]
    packed: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    cold: dict[str, dict[str, dict[int, float]]] = {op: {} for op in count}
    with torch.inference_mode():
        if any(n in native.BF16_PATHS for per in names.values() for ns in per.values() for n in ns):
            for m in layers:  # the dequantized weight as unblock(packed=True) makes it
                qb = m.qblocks
                packed[id(m)] = (native.qblock_dequantize_bf16(qb.native) if native.bf16_dot_usable()
                                 else native.bf16_pack(dequantized_bf16(qb)))

        def call(name: str, m: nn.Module, x: torch.Tensor) -> Callable[[], object]:
            qb = m.qblocks
            if name == "blocks":
                return functools.partial(native.qblock_linear, x, qb.native, None)
            if name == "blocks_amx":
                return functools.partial(native.qblock_linear_amx, x, qb.native, None)
            return functools.partial(native.bf16_gemm, x, packed[id(m)], qb.n, None, name)

        buckets = sorted({(i, table.ops[op].rows[i]) for op in count for i in names[op]})
        for i, rows in buckets:
            xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {m.qblocks.k for m in layers}}
            active = [n for n in COLD_KERNELS if any(n in names[op].get(i, ()) for op in count)]
            best: dict[tuple[str, str], float] = {}
            for rep in range(reps + 1):
                for name in active:
                    sums: dict[str, float] = {}
                    for m in layers:
                        op = ops[id(m)]
                        if name in names[op].get(i, ()):
                            sums[op] = sums.get(op, 0.0) + timer(name, rows, call(name, m, xs[m.qblocks.k]))
                    if rep:  # the first pass warms up
                        for op, t in sums.items():
                            best[op, name] = min(best.get((op, name), float("inf")), t)
            for (op, name), t in best.items():
                cold[op].setdefault(name, {})[i] = t / count[op]
    packed.clear()
    ops_out = dict(table.ops)
    for op, times in cold.items():
        ops_out[op] = with_cold_times(table.ops[op], times, lambda n: "blocks" if n.startswith("blocks") else "bf16")
    return dataclasses.replace(table, ops=ops_out, seconds=table.seconds + time.perf_counter() - start)


AMX8_NEVER = 2 ** 62  # QBlockWeight.amx8_rows where the tiles never ran faster


def timed_tiles_from(model: nn.Module) -> int:
    """From how many rows the blocks' candidate ran on AMX-INT8 tiles while choose and add_cold_times timed it (0:
    never): the weights' threshold as the kernel left it (QBlockWeight::amx8_rows' default; the measured one is
    applied only after calibration). choice.as_run scales the blocks' times only where the plan differs from that."""
    if not native.qblock_amx8_usable():
        return 0
    first = next(iter(qblock_layers(model)), None)
    return 0 if first is None else int(first.qblocks.native.amx8_rows)


def add_amx8_rows(model: nn.Module, table: ChoiceTable, timer: Timer = wall_clock, reps: int = 3) -> ChoiceTable:
    """The table with OpChoice.amx8_rows for each qblock op whose kernel is blocks (not pinned), or an amx path with
    the blocks among its candidates (for choice.as_run), where AMX-INT8 runs: its
    first layer timed at AMX8_BUCKETS rows with VNNI alone and with the tiles from every row count (a warm-up and
    `reps` interleaved calls each, the fastest kept); the tiles run from the smallest bucket from which they were at
    least as fast at every larger one (choice.from_rows). Both give the same bits, so this only chooses speed. Measured
    where the kernel used to take a fixed 16 from one machine (a 2-core Xeon 6 207: about even at 16 rows, 1.1-1.3x
    from 64)."""
    if not native.qblock_amx8_usable():
        return table
    ops = dict(table.ops)
    with torch.inference_mode():
        for layer in qblock_layers(model):
            op = qblock_op(layer)
            c = ops.get(op)
            qb = layer.qblocks
            # (group 16 formats, two scales a block, stay on VNNI: no AMX-INT8 path)
            contends = c is not None and c.kernel in AMX_PATHS and "blocks" in c.seconds  # (for as_run)
            if c is None or c.pinned or not (c.kernel == "blocks" or contends) or c.amx8_rows is not None \
                    or qb.group == 16:
                continue
            kept = qb.native.amx8_rows
            qb.native.amx8_rows = 1  # vnni=1: the tiles at every row count; vnni=2: VNNI alone
            try:
                timed = _time_same_bits(qb.k, torch.bfloat16, timer, reps, lambda x, name, b=qb.native: functools.partial(
                    native.qblock_linear, x, b, None, 2 if name == VNNI else 1))
            finally:
                qb.native.amx8_rows = kept
            ops[op] = dataclasses.replace(c, amx8_rows=from_rows(AMX8_BUCKETS, timed[VNNI], timed[AMX8]),
                                          amx8_timed=timed)
    return dataclasses.replace(table, ops=ops)


WIDE_NEVER = 2 ** 62  # QBlockWeight.wide_rows where the widened codes never ran faster (the kernel's default)


def add_wide_rows(model: nn.Module, table: ChoiceTable, timer: Timer = wall_clock, reps: int = 3) -> ChoiceTable:
    """The table with OpChoice.wide_rows for each qblock op whose kernel is blocks (not pinned, codes under 8 bits)
    where the VNNI kernel runs: its first layer timed at the op's buckets below its amx8_rows (from there the AMX-INT8
    tiles run instead) with each register tile unpacking its codes, and with each work unit's codes widened once (a
    warm-up and `reps` interleaved calls each, the fastest kept); the widened codes run from the smallest bucket from
    which they were at least as fast at every larger one (choice.from_rows). The same bits either way.
    Why measured: on a 2-core Xeon without AMX (model 207) they ran 0.66x the unpacking kernel's speed at one row,
    0.86x at 16, 1.05x at 64, 1.16x at 2,048; where they start to win differs by rows and shape."""
    if not native.qblock_vnni_usable():
        return table
    ops = dict(table.ops)
    with torch.inference_mode():
        for layer in qblock_layers(model):
            op = qblock_op(layer)
            c = ops.get(op)
            qb = layer.qblocks
            if c is None or c.pinned or c.kernel != "blocks" or c.wide_rows is not None or qb.bits >= 8:
                continue
            # from here the AMX-INT8 tiles take the batch: as measured (0: never), else the kernel's default
            if native.qblock_amx8_usable() and qb.group != 16:
                tiles_from = qb.native.amx8_rows if c.amx8_rows is None else (c.amx8_rows or AMX8_NEVER)
            else:
                tiles_from = WIDE_NEVER
            buckets = tuple(r for r in c.rows if r < tiles_from)
            if not buckets:
                continue

            def call(x: torch.Tensor, name: str, b: object = qb.native) -> Callable[[], object]:
                def run() -> object:
                    b.wide_rows = 1 if name == WIDE else WIDE_NEVER
                    return native.qblock_linear(x, b, None)
                return run

            kept = qb.native.wide_rows
            try:
                timed = _time_same_bits(qb.k, torch.bfloat16, timer, reps, call, (NARROW, WIDE), buckets)
            finally:
                qb.native.wide_rows = kept
            ops[op] = dataclasses.replace(c, wide_rows=from_rows(buckets, timed[NARROW], timed[WIDE]), wide_timed=timed)
    return dataclasses.replace(table, ops=ops)


def _time_same_bits(k: int, dtype: torch.dtype, timer: Timer, reps: int,
                     call: Callable[[torch.Tensor, str], Callable[[], object]], names: tuple[str, str] = (VNNI, AMX8),
                     buckets: tuple[int, ...] = AMX8_BUCKETS) -> dict[str, tuple[float, ...]]:
    """Two paths with the same bits (VNNI alone against the AMX-INT8 tiles by default; names: the path kept below the
    threshold, then the one from it) at `buckets` rows of random x [rows, k] in dtype: call(x, name) is the op on path
    `name`; a warm-up and `reps` interleaved calls each, the fastest kept. Then the bucket that alone would set the
    threshold (choice.lone_loss: the second path slower there, faster at the bucket below) is timed again in the same
    way, both paths, each keeping its fastest; and the next such bucket, if that one turned. A slow bucket that is
    real stays slow. {name: times}, times[i] at buckets[i] rows."""
    gen = torch.Generator().manual_seed(0)
    best = {name: [float("inf")] * len(buckets) for name in names}

    def time_bucket(i: int) -> None:
        x = torch.randn(buckets[i], k, generator=gen).to(dtype)
        for rep in range(reps + 1):
            for name in names:
                seconds = timer(name, buckets[i], call(x, name))
                if rep:  # the first call warms up
                    best[name][i] = min(best[name][i], seconds)

    with torch.inference_mode():
        for i in range(len(buckets)):
            time_bucket(i)
        looked: set[int] = set()
        while (i := lone_loss(best[names[0]], best[names[1]])) is not None and i not in looked:
            looked.add(i)
            time_bucket(i)
    return {name: tuple(v) for name, v in best.items()}


def prefill_attention_candidates(heads: int, kv_heads: int, head_dim: int, names: tuple[str, ...]) -> list[Candidate]:
    """Each path over one fresh bf16 prompt of `rows` tokens (random q, k, v; causal over itself)."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 1, 1, kv_heads, head_dim, dtype=torch.bfloat16)  # a fresh prompt reads this step's K/V

    @functools.lru_cache(maxsize=1)  # choose() times one row count at a time: only its inputs are kept
    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        q = torch.randn(rows, heads, head_dim, generator=gen).bfloat16()
        k, v = (torch.randn(rows, kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
        spans = torch.tensor([[0, rows, 0, 0]], dtype=torch.int64)
        return q, k, v, spans, torch.zeros(rows, dtype=torch.int64), torch.empty_like(q)

    def run(rows: int, kernel: str) -> None:
        q, k, v, spans, slots, out = inputs(rows)
        native.prefill_attention(q, k, v, cache, None, spans, slots, head_dim ** -0.5, None, out, kernel)

    # amx needs head_dim a multiple of 32 (else the kernel runs dot: not a candidate of its own)
    return [Candidate(name, functools.partial(run, kernel=name)) for name in names if runs_shape(name, head_dim)]


def random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A bf16 tensor of `shape` holding RANDOM_RUN standard normal values over and over (fewer if it is smaller)."""
    n = math.prod(shape)
    run = torch.randn(min(n, RANDOM_RUN), generator=gen).bfloat16()
    return run.repeat(-(-n // run.numel()))[:n].view(shape)


def decode_attention_candidates(heads: int, kv_heads: int, head_dim: int, names: tuple[str, ...]) -> list[Candidate]:
    """Each path over `rows` decodes of DECODE_CONTEXT tokens each, in a bf16 cache of 64-token blocks in random order."""
    gen = torch.Generator().manual_seed(0)
    per = DECODE_CONTEXT // 64

    @functools.lru_cache(maxsize=1)  # choose() times one row count at a time: only its inputs are kept
    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        layer_bytes = 2 * rows * DECODE_CONTEXT * kv_heads * head_dim * 2
        layers = max(1, min(64, -(-DECODE_COLD_BYTES // layer_bytes)))
        caches = random_bf16((layers, 2, rows * per, 64, kv_heads, head_dim), gen)
        tables = torch.randperm(rows * per, generator=gen).view(rows, per)
        lens = torch.full((rows,), DECODE_CONTEXT, dtype=torch.int64)
        return torch.randn(rows, heads, head_dim, generator=gen).bfloat16(), caches, tables, lens

    def run(rows: int, dot: bool) -> None:  # one call: every layer once, as a step reads them
        q, caches, tables, lens = inputs(rows)
        for cache in caches:
            native.paged_decode(q, cache, tables, lens, head_dim ** -0.5, None, dot=dot)

    return [Candidate(name, functools.partial(run, dot=name == "dot")) for name in names]


def cpu_model() -> str:
    """The CPU's model name with its family / model / stepping (a VM may show only "AMD EPYC")."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
            if not line.strip():
                break
    except OSError:
        return platform.processor() or platform.machine()
    return " ".join(fields.get(f, "?") for f in ("model name", "cpu family", "model", "stepping"))


@functools.cache
def kernels_hash() -> str:
    """Of the native kernels' sources: a rebuilt kernel is measured again."""
    h = hashlib.sha256()
    for path in sorted(p for p in (Path(__file__).parent / "cpu").iterdir() if p.is_file()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def key(ops: list[str], threads: int, blocks_only: bool = False, rows: RowLimits = RowLimits()) -> dict[str, object]:
    """The cache key. blocks_only: block-quantized ops were timed without the dequantized candidates (they would not
    fit), so a table measured with them must not be reused, nor the other way round. rows: the batch sizes timed."""
    k: dict[str, object] = {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
                            "kernels": kernels_hash(), "ops": sorted(ops),
                            "rows": {"linear": list(row_buckets(rows.linear)), "head": list(row_buckets(rows.head))},
                            # what can run here: a table measured while the native kernels failed to build (only
                            # torch's paths) must not be reused once they run, nor the other way round
                            "candidates": {kind: list(available(kind)) for kind in KINDS}}
    if blocks_only:
        k["blocks_only"] = True
    return k


def head_ops(model: nn.Module) -> set[str]:
    """The bf16, fp32 and block-quantized ops only the LM head runs (whose rows are the sampled ones:
    RowLimits.head)."""
    from llmserve.layers.linear import Linear

    heads = [m.logits_head() for m in model.modules() if hasattr(m, "logits_head")]
    head_weights = {id(getattr(h, "weight", None)) for h in heads}
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, Linear) and m.weight is not None}
    of_head, of_others = set(), set()
    for w in matmul_weights(model):  # (an embedding table only looked up is neither: it is not a matmul)
        if id(w) in head_weights:
            of_head.add(op_name(w))
        elif id(w) in linear_weights:
            of_others.add(op_name(w))
    for layer in qblock_layers(model):
        (of_head if any(layer is h for h in heads) else of_others).add(qblock_op(layer))
    return of_head - of_others


def plan(model: nn.Module, threads: int, kernel_choice: str | None = None, *, dtype: torch.dtype,
         timer: Timer = wall_clock, remeasure: bool = False, rows: RowLimits = RowLimits()) -> ChoiceTable | None:
    """The choice table for the model's bf16 and fp32 matmuls (fp32: where both of its paths run), its w8a8 linears
    (where AMX-INT8 can run them) and, where its attention runs natively, its prefill and decode attention on this
    machine (None where there is nothing to choose): pinned by kernel_choice (else LLMSERVE_KERNEL_CHOICE, else "auto"), read from the cache, or measured now. dtype:
    the model's compute dtype (attention_op). rows: the most rows the engine gives a linear and the LM head in a step;
    each matmul is timed at the powers of two up to its limit (row_buckets)."""
    shapes = {op_name(w): (w.shape[0], w.shape[1]) for w in matmul_weights(model)}
    heads = head_ops(model)

    def buckets(op: str) -> tuple[int, ...]:
        return row_buckets(rows.head if op in heads else rows.linear)

    spec = kernel_choice if kernel_choice not in (None, "auto") else os.environ.get(ENV, kernel_choice)
    pins = parse_pins(spec, KINDS)
    for kind, name in pins.items():
        if name not in available(kind):
            raise InvalidRequestError(f"kernel_choice: {kind}={name} cannot run on this machine; it runs "
                                      f"{', '.join(available(kind))}", param="kernel_choice")
    if len(available(FP32_LINEAR)) < 2 and FP32_LINEAR not in pins:  # one fp32 path: nothing to choose
        shapes = {op: nk for op, nk in shapes.items() if not op.startswith(FP32_LINEAR + ":")}
    for op, (_, k) in shapes.items():
        if op.startswith(BF16_LINEAR + ":") and not runs_shape(pins.get(BF16_LINEAR, ""), k):
            raise InvalidRequestError(f"kernel_choice: {BF16_LINEAR}={pins[BF16_LINEAR]} cannot run {op} (its columns "
                                      "are not a multiple of 32): pin another kernel, or leave it auto",
                                      param="kernel_choice")
    names, fp32_names = available(BF16_LINEAR), available(FP32_LINEAR)
    measure = {op: functools.partial(_measure, op, fp32_linear_candidates, (n, k, fp32_names, buckets(op)[-1]), timer,
                                     buckets(op))
               if op.startswith(FP32_LINEAR + ":") else
               functools.partial(_measure, op, bf16_linear_candidates, (n, k, names, None, True, buckets(op)[-1]),
                                 timer, buckets(op))
               for op, (n, k) in shapes.items()}
    blocked = list(qblock_layers(model)) if dtype == torch.bfloat16 else []
    blocks_only = bool(blocked) and not dequantize_fits(blocked)
    if dtype == torch.float32 and "blocks_fma" in available(QBLOCK_LINEAR):
        # an fp32 model's blocks: int8 activations or fp32 FMAs on the codes (never a bf16 copy of its weights)
        if pins.get(QBLOCK_LINEAR, "blocks") not in ("blocks", "blocks_fma"):
            raise InvalidRequestError(f"kernel_choice: {QBLOCK_LINEAR}={pins[QBLOCK_LINEAR]} is a bf16 path; an fp32 "
                                      "model's blocks run blocks or blocks_fma: pin one of those, or leave it auto",
                                      param="kernel_choice")
        for layer in qblock_layers(model):  # the first layer of each op stands for it
            op = qblock_op(layer)
            measure.setdefault(op, functools.partial(_measure, op, qblock_linear_candidates,
                                                     (layer, ("blocks", "blocks_fma"), buckets(op)[-1], dtype),
                                                     timer, buckets(op)))
    if blocked:
        qnames = tuple(name for name in available(QBLOCK_LINEAR) if name != "blocks_fma")  # (measured for fp32)
        if not blocks_only:  # blocks_amx computes amx's bits, and is not faster timed hot: amx stands for both
            qnames = tuple(name for name in qnames if name != "blocks_amx")
        else:  # the candidates that keep the blocks
            qnames = tuple(name for name in qnames if name.startswith("blocks"))
        for layer in blocked:  # the first layer of each op stands for it
            op = qblock_op(layer)
            measure.setdefault(op, functools.partial(_measure, op, qblock_linear_candidates,
                                                     (layer, qnames, buckets(op)[-1]), timer, buckets(op)))
    for kind, op_of, measure_op in ((W8A8_LINEAR, w8a8_op, measure_w8a8), (INT8W_LINEAR, int8w_op, measure_int8w)):
        if AMX8 in available(kind):  # (VNNI alone: nothing to choose)
            for layer in model.modules():
                op = op_of(layer)
                if op is not None:  # the first layer of each op stands for it
                    measure.setdefault(op, functools.partial(measure_op, layer, dtype, timer))
    for kind, make, buckets in ((PREFILL_ATTENTION, prefill_attention_candidates, ATTENTION_BUCKETS),
                                (DECODE_ATTENTION, decode_attention_candidates, DECODE_BUCKETS)):
        op = attention_op(model, kind, dtype)
        if op is not None:
            a = model.attention_layers()[0]
            if not runs_shape(pins.get(kind, ""), a.head_dim):
                raise InvalidRequestError(f"kernel_choice: {kind}={pins[kind]} cannot run {op} (head_dim "
                                          f"{a.head_dim} is not a multiple of 32): pin another kernel, or leave it "
                                          "auto", param="kernel_choice")
            measure[op] = functools.partial(_measure, op, make,
                                            (a.num_heads, a.num_kv_heads, a.head_dim, available(kind)), timer, buckets)
    if not measure:
        return None
    pinned_ops = {op: pinned(pins[op.partition(":")[0]]) for op in measure if op.partition(":")[0] in pins}
    table = load_or_measure(key(list(measure), threads, blocks_only, rows), measure, pinned_ops, remeasure)
    if table.reused:
        return table
    tiles_from = timed_tiles_from(model)  # the threshold choose and add_cold_times ran the blocks with
    table = add_amx8_rows(model, add_few_rows(model, add_cold_times(model, table, timer), timer), timer)
    table = dataclasses.replace(table, ops={op: as_run(c, tiles_from) for op, c in table.ops.items()})
    return amend(add_wide_rows(model, table, timer))


def _measure(op: str, make: Callable[..., list[Candidate]], args: tuple, timer: Timer,
             buckets: tuple[int, ...]) -> OpChoice | None:
    """The op's choice; None where no candidate may run it (the native kernels did not build, and oneDNN's and
    fp32's results for a row change with the batch here): the op keeps its default path, and the start goes on."""
    with torch.inference_mode():
        candidates = make(*args)
        if not candidates:
            why = ("the native kernels did not build: see the warning above" if native.load() is None
                   else "no candidate passed its checks")
            linear = op.partition(":")[0] in (BF16_LINEAR, FP32_LINEAR, QBLOCK_LINEAR)
            log.warning("%s: no measured kernel may run it here (%s): it keeps its default path%s", op, why,
                        " (oneDNN's matmul, whose results for a row may change with the batch)" if linear else "")
            return None
        return choose(candidates, timer, buckets)


def report(table: ChoiceTable) -> str:
    """The table of what was measured: per op and row bucket, each candidate's time and the winner."""
    lines = []
    for op, c in sorted(table.ops.items()):
        lines.append(f"{op}: {c.describe()}")
        names = list(c.seconds)
        if names:
            lines.append("  rows  " + "".join(f"{n:>11}" for n in names) + "  fastest")
        for i, rows in enumerate(c.rows if names else ()):
            cells = "".join(f"{c.seconds[n][i] * 1e3:>9.3f}ms" for n in names)
            cold = "*" if rows <= c.cold_rows else " "
            lines.append(f"  {rows:>4}{cold} {cells}  {min(names, key=lambda n: c.seconds[n][i])}")
        if c.cold_rows and names:
            lines.append(f"  * up to {c.cold_rows} rows: weights read from memory (passes through the model's layers)")
        lines += _same_bits_table("weights read cold, the same bits", c.few_timed, FEW_BUCKETS)
        lines += _same_bits_table("int8 activations, the same bits", c.amx8_timed, AMX8_BUCKETS)
        lines += _same_bits_table("codes widened once, the same bits", c.wide_timed, c.rows)
    return "\n".join(lines)


def _same_bits_table(title: str, timed: dict[str, tuple[float, ...]], buckets: tuple[int, ...]) -> list[str]:
    """report's lines for one op's paths with the same bits (timed[name][i] at buckets[i]); none where none was timed."""
    if not timed:
        return []
    names = list(timed)
    lines = [f"  {title}: " + "".join(f"{n:>11}" for n in names)]
    for i, rows in enumerate(buckets[:len(timed[names[0]])]):
        lines.append(f"  {rows:>4}  " + "".join(f"{timed[n][i] * 1e3:>9.3f}ms" for n in names))
    return lines
