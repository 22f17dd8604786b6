"""GGUF quantized tensors as layers/quant_blocks.py's BlockTensor (codes, per-group scale and min), read from the raw
block bytes the conversion cache keeps (models/gguf_loader.py), without dequantizing.

Block formats (ggml's, per row of k columns; fp16 little-endian):
  Q4_0  18 bytes / 32:  d, 16 bytes of nibbles (byte j: column j low, column j + 16 high);  w = d * (q - 8)
  Q4_1  20 bytes / 32:  d, m, nibbles as Q4_0;                                            w = d * q + m
  Q8_0  34 bytes / 32:  d, 32 int8;                                                        w = d * q
  Q4_K  144 bytes / 256: d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes of nibbles
        (per 64 columns: 32 bytes, low nibbles the first 32 columns, high the next);      w = d * sc * q - dmin * mn
  Q5_K  176 bytes / 256: d, dmin, 12 bytes of (scale, min) as Q4_K, 32 bytes qh (bit s of byte i: the fifth bit of
        column 32s + i), 128 bytes of nibbles as Q4_K;                                    w = d * sc * q - dmin * mn
  Q6_K  210 bytes / 256: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 columns), d. Per 128 columns h:
        ql bytes 64h + j hold column 128h + j (low nibble) and 128h + 64 + j (high); bits 2s, 2s + 1 of qh byte
        32h + i are the top 2 bits of column 128h + 32s + i;                              w = d * sc * (q - 32)
The K-quants' per-group scale and min are stored as fp32 products (d * sc, -(dmin * mn)), which is how gguf.quants
computes them, so the values are its own (Q6_K: zero point 32, the products d * sc * (q - 32) exact as fp32); the
codes stay at their width. Bits a weight kept, against the format's own: Q4_K 6 (4.5), Q5_K 7 (5.5), Q6_K 8 (6.56).
Other types are not run natively: the loader dequantizes them (KINDS says which are).
"""

from __future__ import annotations

import torch

from llmserve.kernels import native
from llmserve.layers.quant_blocks import BlockTensor

# the types run natively -> (code bits, group) of their BlockTensor
KINDS = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}
BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
               "Q6_K": (256, 210)}


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [...] fp16 (little-endian)."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(raw: torch.Tensor, b: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """Q4_0 / Q4_1 codes [rows, cols] from the 16 nibble bytes at `offset` of each block (natively where it is built:
    the same values, 20x faster than these torch ops)."""
    if native.load() is not None:
        return native.gguf_nibbles(raw, offset, size)
    return _nibbles32(b[..., offset:]).reshape(raw.shape[0], -1)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: byte j holds column j (low) and j + 16 (high)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def block_tensor(raw: torch.Tensor, qtype: str, cols: int) -> BlockTensor:
    """raw: uint8 [rows, bytes per row] of a `qtype` tensor with `cols` columns -> its BlockTensor."""
    per, size = BLOCK_BYTES[qtype]
    rows = raw.shape[0]
    if cols % per or raw.shape[1] != cols // per * size:
        raise ValueError(f"{qtype} rows of {cols} columns are {cols // per * size} bytes, got {raw.shape[1]}")
    b = raw.reshape(rows, cols // per, size)
    if qtype == "Q4_0":
        return BlockTensor(_nibbles(raw, b, 2, size), _fp16(b[..., 0:2]), None, 4, 32, zero=8)
    if qtype == "Q4_1":
        return BlockTensor(_nibbles(raw, b, 4, size), _fp16(b[..., 0:2]), _fp16(b[..., 2:4]), 4, 32)
    if qtype == "Q8_0":  # int8 q as unsigned q + 128, zero point 128
        codes = (b[..., 2:].reshape(rows, cols).view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return BlockTensor(codes, _fp16(b[..., 0:2]), None, 8, 32, zero=128)
    if qtype in ("Q4_K", "Q5_K"):
        return _q45_k(b, rows, cols, qtype == "Q5_K")
    if qtype == "Q6_K":
        return _q6_k(b, rows, cols)
    raise ValueError(f"GGUF type {qtype} is not run natively")


def _q45_k(b: torch.Tensor, rows: int, cols: int, five: bool) -> BlockTensor:
    d, dmin = _fp16(b[..., 0:2]).float(), _fp16(b[..., 2:4]).float()  # [rows, SB]
    sc, mn = k_scale_min(b[..., 4:16])  # [rows, SB, 8]
    qs = b[..., 48 if five else 16:].reshape(rows, -1, 4, 32)  # per 64 columns: 32 bytes
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, -1, 8, 32)  # [rows, SB, sub-block, i]
    if five:
        codes |= _bit_fields(b[..., 16:48], 1) << 4
    scales = (d[..., None] * sc.float()).reshape(rows, -1)
    mins = -(dmin[..., None] * mn.float()).reshape(rows, -1)
    return BlockTensor(codes.reshape(rows, cols), scales, mins, 5 if five else 4, 32)


def _q6_k(b: torch.Tensor, rows: int, cols: int) -> BlockTensor:
    ql = b[..., :128].reshape(rows, -1, 2, 1, 64)  # [rows, SB, h, 1, j]
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(rows, -1, 2, 4, 32)  # [rows, SB, h, s, i]
    high = _bit_fields(b[..., 128:192].reshape(rows, -1, 2, 32), 2)  # [rows, SB, h, s, i]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [rows, SB, 16]
    scales = (_fp16(b[..., 208:210]).float()[..., None] * sc).reshape(rows, -1)
    return BlockTensor((low | (high << 4)).reshape(rows, cols), scales, None, 6, 16, zero=32)


def _bit_fields(qh: torch.Tensor, width: int) -> torch.Tensor:
    """[..., 32] bytes -> [..., 8 / width, 32]: field s of byte i is its bits width * s .. width * s + width - 1."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)[:, None]
    return (qh[..., None, :] >> shifts) & ((1 << width) - 1)


def k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> 6-bit (scale, min) of the 8 sub-blocks, [..., 8] each. Sub-blocks 0-3: the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: low / high nibbles of bytes 8-11, with their top 2 bits
    from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = s.to(torch.int32)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], dim=-1), torch.cat([lo_mn, hi_mn], dim=-1)
