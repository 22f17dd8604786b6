"""Block-quantized weights kept at their bit width: GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K, AWQ and GPTQ, run
natively.

Every format here is one form: unsigned codes q of 4, 5, 6 or 8 bits, and per row and group of `group` columns (16,
or a multiple of 32) a scale d and a min m,

    w[n, k] = d[n, k // group] * q[n, k] + m[n, k // group]

with m = -zero * d when the format has one integer zero point (Q4_0: 8, Q8_0: 128, Q6_K: 32), so no mins are
stored. Each format's reader (models/gguf_blocks.py, models/awq_gptq.py) turns its tensors into a `BlockTensor` (one
code per byte, the loader's transient form; shards of a fused layer are concatenated in it), and `BlockWeight` packs
that for kernels/cpu/qblock_gemm.cpp (bits / 8 bytes a code: a nibble plane and 5- and 6-bit codes' high bits beside
it; tiles of 16 rows), the only copy kept.
In fp32 the values d * q + m equal the formats' published dequantization exactly (the products are exact; one
rounding in the sum, as theirs), which `dequantize` gives back and the tests check against gguf.quants.
GPTQ act-order weights keep their columns sorted by group (`perm`, see models/awq_gptq.py): each group is a run of
columns as everywhere else, and a linear gathers x's columns by perm before the kernel. Only linears: `rows` (an
embedding lookup) reads the stored order.

What a linear runs: where the native kernel runs (a CPU with AVX-512, int8 activations per block of 32 with VNNI;
or AVX2 and FMA, the same int8 arithmetic on vpmaddubsw), that; on CUDA, kernels/triton/qblock.py's GEMM, which reads the same packed tensors and dequantizes tiles in
registers (4 and 8 bits, groups of multiples of 32; LLMSERVE_QBLOCK_TRITON=0 pins the reference, for A/B runs);
elsewhere (other CPUs, CUDA without triton) the reference path dequantizes the whole weight at each call and
multiplies in torch: correct, not fast. Nothing in fp32 or bf16 is held between calls on any of them.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels import native

log = logging.getLogger(__name__)

TILE = 16  # output rows per tile of the packed layout
BLOCK = 32  # columns per block of the packed layout (and per activation scale in the kernel)


@dataclass
class BlockTensor:
    """A block-quantized [n, k] weight as a loader reads it: codes uint8 [n, k] (one per byte), scales and mins
    [n, k // group] (fp16 or fp32; mins None: m = -zero * d). With `perm` (int64 [k], GPTQ act-order) the columns are
    stored in another order: stored column j is the weight's column perm[j], and the groups are runs of the stored
    columns; a product needs x's columns gathered alike (x[..., perm])."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    zero: int = 0
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def with_mins(self, dtype: torch.dtype) -> BlockTensor:
        """The same values with explicit mins of `dtype` (exact: zero * d has at most 19 significant bits)."""
        mins = self.mins if self.mins is not None else self.scales.float() * -float(self.zero)
        return replace(self, scales=self.scales.to(dtype), mins=mins.to(dtype), zero=0)

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k]: d * q + m, the formats' own values, in the weight's column order."""
        d = self.scales.float().repeat_interleave(self.group, dim=1)
        m = (self.scales.float() * -float(self.zero) if self.mins is None else self.mins.float())
        w = d * self.codes.float() + m.repeat_interleave(self.group, dim=1)
        return w if self.perm is None else w[:, self.perm.argsort()]

    def in_order(self, perm: torch.Tensor | None) -> BlockTensor:
        """The same weight with its columns stored in the order `perm` (None: the weight's own). ValueError where a
        run of `group` stored columns would not lie in one of this weight's groups."""
        k = self.shape[1]
        mine = torch.arange(k) if self.perm is None else self.perm.cpu()
        theirs = torch.arange(k) if perm is None else perm.cpu()
        if torch.equal(mine, theirs):
            return self
        src = mine.argsort()[theirs]  # new stored column j is my stored column src[j]
        runs = (src // self.group).view(-1, self.group)
        if not (runs == runs[:, :1]).all():
            raise ValueError("act-order shards whose g_idx put different columns in one group cannot share one "
                             "column order (GPTQ gives the layers of one input one g_idx: quantize them together)")
        groups = runs[:, 0]
        return replace(self, codes=self.codes[:, src], scales=self.scales[:, groups],
                       mins=None if self.mins is None else self.mins[:, groups], perm=perm)


def common_kind(kinds: set[tuple[int, int]]) -> tuple[int, int] | None:
    """The (bits, group) that shards of these kinds are stacked in: the widest codes and the smallest group, where
    every group is a multiple of it (else None). Each shard's values stay exactly its own: a code of fewer bits is a
    valid wider one, and a group's scale and min repeat over the smaller groups it splits into."""
    bits = max(b for b, _ in kinds)
    group = min(g for _, g in kinds)
    return (bits, group) if all(g % group == 0 for _, g in kinds) else None


def widen(t: BlockTensor, bits: int, group: int) -> BlockTensor:
    """t's values with `bits`-bit codes (>= t.bits) in groups of `group` (dividing t.group): exact."""
    if (t.bits, t.group) == (bits, group):
        return t
    r = t.group // group
    mins = None if t.mins is None else t.mins.repeat_interleave(r, dim=1)
    return BlockTensor(t.codes, t.scales.repeat_interleave(r, dim=1), mins, bits, group, t.zero, t.perm)


def concat(parts: list[BlockTensor]) -> BlockTensor:
    """Shards of a fused layer (q, k, v) stacked along the rows. Shards of different bit widths or groups (a
    Q4_K_M GGUF's Q4_K q and k beside a Q6_K v) are widened to their common kind (common_kind: exact, the narrower
    shards' codes then take the wider form's memory); differing zero points or scale dtypes become explicit fp32
    mins (exact); act-order shards take the first one's column order (GPTQ gives shards of one input the same
    g_idx). ValueError if they cannot be stacked (different widths, groups that do not nest)."""
    first = parts[0]
    if any(p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("shards of different columns: " + ", ".join(str(p.shape[1]) for p in parts))
    kind = common_kind({(p.bits, p.group) for p in parts})
    if kind is None:
        raise ValueError("shards whose groups do not nest: " + ", ".join(f"{p.bits}-bit/{p.group}" for p in parts))
    if len(parts) == 1:
        return first
    perm = next((p.perm for p in parts if p.perm is not None), None)
    parts = [widen(p.in_order(perm), *kind) for p in parts]
    if any((p.mins is None, p.zero, p.scales.dtype) != (parts[0].mins is None, parts[0].zero, parts[0].scales.dtype)
           for p in parts):
        parts = [p.with_mins(torch.float32) for p in parts]
    mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
    return BlockTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins,
                       *kind, parts[0].zero, perm)


def fits(cols: int, group: int) -> bool:
    """Whether the kernel's layout takes `cols` columns in groups of `group`: blocks of 32, groups of 16 (two a
    block) or whole blocks."""
    return cols > 0 and cols % BLOCK == 0 and (group == 16 or (group > 0 and group % BLOCK == 0)) and cols % group == 0


class BlockWeight:
    """A weight in kernels/cpu/qblock_gemm.cpp's layout (see there): codes [NT, k / 32, bits * 64] uint8 (NT tiles of
    16 rows, zero-padded past n), scales and mins [NT, k / group, 16] (group 16: fp32, as the kernel takes them; fp16
    widens exactly). On CUDA the same tensors feed the Triton kernel (4 and 8 bits, groups of 32 or more) or else the
    torch reference, as on a CPU without the native kernel."""

    def __init__(self, t: BlockTensor, device: torch.device | str = "cpu") -> None:
        n, k = t.shape
        if not fits(k, t.group):
            raise ValueError(f"{k} columns in groups of {t.group}: the columns must be a multiple of {BLOCK}, the "
                             f"group 16 or a multiple of {BLOCK} dividing them")
        if t.group == 16:
            t = replace(t, scales=t.scales.float(), mins=None if t.mins is None else t.mins.float())
        self.n, self.k, self.bits, self.group, self.zero = n, k, t.bits, t.group, t.zero
        # packed where they will live: on a GPU by torch's ops there, never by the CPU extension (which a GPU machine
        # would compile first, minutes on its first load: the first Triton qblock test on an H100 ran past 60 s)
        self.codes = pack_codes(t.codes.to(device), t.bits)
        self.scales = _tiles(t.scales).to(device)
        self.mins = None if t.mins is None else _tiles(t.mins).to(device)
        # act-order: the codes' columns are in this order (int64 [k]); x's columns are gathered alike per call
        self.perm = None if t.perm is None else t.perm.to(device)
        self.native = None
        if self.codes.device.type == "cpu" and native.qblock_usable():
            self.native = native.qblock_weight(self.codes, self.scales, self.mins, n, k, t.bits, t.group, t.zero)
        # kernels/triton/qblock.py's linear on CUDA (its bit widths and groups), else None
        self.triton = _triton_linear(self.codes.device) if t.bits in (4, 8) and t.group % BLOCK == 0 else None
        # bf16 x on AMX tiles over the tiles dequantized as read (native.qblock_linear_amx), where the measured choice
        # says so (kernels/calibrate.py's blocks_amx); else the int8-activation kernel
        self.amx = False
        # with amx: batches of at most this many rows run qblock_linear_amx_dot (the same bits; calibrate's few_rows)
        self.few_rows = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.codes, self.scales, self.mins, self.perm) if t is not None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., k] -> [..., n] in x's dtype."""
        if self.native is not None and self.amx and x.dtype == torch.bfloat16:
            x2 = self.gather(x).reshape(-1, self.k)
            few = x2.shape[0] <= self.few_rows
            y = (native.qblock_linear_amx_dot if few else native.qblock_linear_amx)(x2, self.native, bias)
            return y.reshape(*x.shape[:-1], self.n)
        if self.native is not None and x.dtype in (torch.float32, torch.bfloat16):
            y = native.qblock_linear(self.gather(x).reshape(-1, self.k), self.native, bias)
            return y.reshape(*x.shape[:-1], self.n)
        if self.triton is not None and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return self.triton(self.gather(x), self, bias)
        return reference_linear(x, self, bias)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] with its columns in the codes' order (act-order); x itself otherwise."""
        return x if self.perm is None else x.index_select(-1, self.perm)

    def dequantize(self) -> torch.Tensor:
        """fp32 [n, k], exactly the format's values."""
        return self.to_tensor().dequantize()

    def dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        """fp32 rows [start, end) of the weight, exactly the format's values, in the weight's column order."""
        w = self.rows(torch.arange(start, end, device=self.codes.device))
        return w if self.perm is None else w[:, self.perm.argsort()]

    def to_tensor(self, rows: torch.Tensor | None = None) -> BlockTensor:
        """Back to one code per byte ([n, k], or the given rows [R] int64 of it)."""
        codes = unpack_codes(self.codes, self.bits)
        scales = self.scales.transpose(1, 2).reshape(-1, self.scales.shape[1])
        mins = None if self.mins is None else self.mins.transpose(1, 2).reshape(-1, self.mins.shape[1])
        if rows is None:
            rows = torch.arange(self.n, device=self.codes.device)
        return BlockTensor(codes[rows], scales[rows], None if mins is None else mins[rows], self.bits, self.group,
                           self.zero, self.perm)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [R, k] of the weight (an embedding lookup): only those rows are unpacked (natively where the
        blocks kernel runs: the same values in one call, where these torch ops took 0.2 ms for 64 ids, 6.4 for 2,048)."""
        if self.native is not None and ids.device.type == "cpu":
            return native.qblock_rows(self.native, ids.reshape(-1).long())
        tiles, lanes = ids // TILE, ids % TILE
        codes = self.codes[tiles]  # [R, KB, bits * 64]: vector v's lane r is bytes 64v + 4r .. 64v + 4r + 3
        lane_vectors = codes.view(len(ids), -1, self.bits, TILE, 4)[torch.arange(len(ids)), :, :, lanes]
        q = _codes(lane_vectors, self.bits).reshape(len(ids), self.k)
        d = self.scales[tiles, :, lanes].float()
        m = d * -float(self.zero) if self.mins is None else self.mins[tiles, :, lanes].float()
        return d.repeat_interleave(self.group, dim=1) * q.float() + m.repeat_interleave(self.group, dim=1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [n, k] codes -> [ceil(n / 16), k / 32, bits * 64]: per tile and block of 32 columns, `bits` 64-byte
    vectors whose lane r (4 bytes) serves row r. 8 bits: vector v holds columns 4v .. 4v + 3. Fewer: the codes' low
    nibbles first (vector h: low nibbles columns 8h .. 8h + 3, high nibbles 8h + 4 .. 8h + 7), then the high bits
    (bits - 4 a code) of columns 4u .. 4u + 3, u = 8 / (bits - 4) * j + p, at bit (bits - 4) * p of vector 4 + j."""
    if codes.device.type == "cpu" and native.load() is not None:
        return native.qblock_pack(codes, bits)  # the same bytes in one pass
    n, k = codes.shape
    nt = -(-n // TILE)
    q = torch.zeros(nt * TILE, k, dtype=torch.uint8, device=codes.device)
    q[:n] = codes
    vectors = _vectors(q.view(nt, TILE, k // BLOCK, BLOCK), bits)  # [NT, r, KB, bits, i]
    return vectors.permute(0, 2, 3, 1, 4).reshape(nt, k // BLOCK, bits * 64).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """pack_codes' inverse: uint8 [NT * 16, k] (the padding rows included)."""
    nt, kb, _ = packed.shape
    lane_vectors = packed.view(nt, kb, bits, TILE, 4).permute(0, 3, 1, 2, 4)  # [NT, r, KB, bits, i]
    return _codes(lane_vectors, bits).reshape(nt * TILE, kb * BLOCK)


def _vectors(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [..., 32] of one lane and block -> that lane's 4 bytes of each of the block's vectors [..., bits, 4]."""
    if bits == 8:
        return q.unflatten(-1, (8, 4))
    nib = (q & 15).unflatten(-1, (4, 2, 4))  # [..., h, low / high nibble, i]
    planes = [nib[..., 0, :] | (nib[..., 1, :] << 4)]
    if bits > 4:
        hb = bits - 4
        hi = (q >> 4).unflatten(-1, (hb, 8 // hb, 4))  # [..., j, p, i]
        plane = torch.zeros_like(hi[..., 0, :])
        for p in range(8 // hb):
            plane |= hi[..., p, :] << (hb * p)
        planes.append(plane)
    return torch.cat(planes, dim=-2)


def _codes(vectors: torch.Tensor, bits: int) -> torch.Tensor:
    """_vectors' inverse: [..., bits, 4] -> codes [..., 32]."""
    if bits == 8:
        return vectors.flatten(-2)
    nib = vectors[..., :4, :]
    q = torch.stack([nib & 15, nib >> 4], dim=-2).flatten(-3)
    if bits > 4:
        hb = bits - 4
        shifts = torch.arange(0, 8, hb, dtype=torch.uint8, device=vectors.device)[:, None]  # [p, 1]
        hi = (vectors[..., 4:, None, :] >> shifts) & ((1 << hb) - 1)  # [..., j, p, i]
        q = q | (hi.flatten(-3) << 4)
    return q


def _tiles(s: torch.Tensor) -> torch.Tensor:
    """[n, groups] -> [ceil(n / 16), groups, 16] (zero past n)."""
    n, g = s.shape
    nt = -(-n // TILE)
    out = torch.zeros(nt * TILE, g, dtype=s.dtype, device=s.device)
    out[:n] = s
    return out.view(nt, TILE, g).transpose(1, 2).contiguous()


def _triton_linear(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The Triton GEMM for weights on CUDA; None elsewhere, without triton, or with LLMSERVE_QBLOCK_TRITON=0 (which
    pins the reference path, for A/B comparisons)."""
    if device.type != "cuda" or os.environ.get("LLMSERVE_QBLOCK_TRITON", "1") == "0":
        return None
    return _import_triton_linear()


@functools.cache
def _import_triton_linear() -> Callable[..., torch.Tensor] | None:
    try:
        from llmserve.kernels.triton.qblock import qblock_linear
    except ImportError:  # CPU-only torch builds bring no triton
        log.warning("triton is not installed: block-quantized linears on CUDA dequantize their weight at every call")
        return None
    return qblock_linear


def reference_linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The torch path: the weight dequantized (fp32, the format's values, in its own column order: no gather) for this
    call, then one matmul in x's dtype (fp32 on CPU for 16-bit x: bf16 products are exact in fp32, as in a bf16
    GEMM)."""
    weight = w.dequantize()[:w.n]
    if x.device.type == "cpu" and x.dtype != torch.float32:
        return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
    # the bias in x's dtype too: F.linear refuses an fp32 bias beside fp16 operands (the CUDA tests' reference raised)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


# Loading: a Linear whose weight arrives as BlockTensor shards holds a placeholder on the meta device (no memory)
# until every shard is there, then the packed BlockWeight replaces it (finish).

def expect_blocks(layer: nn.Module) -> None:
    """Make `layer` (a Linear, MergedLinear or VocabEmbedding) take its weight as BlockTensor shards in load_weights; the plain
    weight is never allocated for real."""
    old = layer.weight
    placeholder = nn.Parameter(torch.empty(old.shape, device="meta"), requires_grad=False)
    placeholder.shards = old.shards
    placeholder.parts = {}
    placeholder.weight_loader = functools.partial(_load_block_shard, old.shape[1])
    layer.weight = placeholder


def _load_block_shard(cols: int, param: nn.Parameter, loaded: object, shard: str | None = None) -> None:
    from llmserve.layers.linear import ShapeMismatch

    if not isinstance(loaded, BlockTensor):
        raise ShapeMismatch("expected a block-quantized tensor (this layer's other shards are quantized), got a "
                            "plain one")
    start, end = param.shards[shard]
    if loaded.shape != (end - start, cols):
        raise ShapeMismatch(f"expected shape {(end - start, cols)}, got {loaded.shape}")
    param.parts[shard] = loaded


def finish_blocks(layer: nn.Module, device: torch.device | str) -> None:
    """After load_weights: the shards, in row order, packed into layer.qblocks; the placeholder goes."""
    param = layer.weight
    order = sorted(param.parts, key=lambda s: param.shards[s][0])
    layer.qblocks = BlockWeight(concat([param.parts[s] for s in order]), device)
    layer.weight = None
