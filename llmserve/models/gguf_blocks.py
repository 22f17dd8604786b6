"""GGUF quantized tensors as layers/quant_blocks.py's BlockTensor (codes, per-group scale and min), read from the raw
block bytes the conversion cache keeps (models/gguf_loader.py), without dequantizing.

Block formats (ggml's, per row of k columns; fp16 little-endian):
  Q4_0  18 bytes / 32:  d, 16 bytes of nibbles (byte j: column j low, column j + 16 high);  w = d * (q - 8)
  Q4_1  20 bytes / 32:  d, m, nibbles as Q4_0;                                            w = d * q + m
  Q8_0  34 bytes / 32:  d, 32 int8;                                                        w = d * q
  Q4_K  144 bytes / 256: d, dmin, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128 bytes of nibbles
        (per 64 columns: 32 bytes, low nibbles the first 32 columns, high the next);      w = d * sc * q - dmin * mn
Q4_K's per-32 scale and min are stored as fp32 products (d * sc, -(dmin * mn)), which is how gguf.quants computes
them, so the values are its own; the codes stay 4-bit (6 bits a weight in all against Q4_K's 4.5). Other types
(Q5_K, Q6_K, ...) are not run natively: the loader dequantizes them (NATIVE_TYPES says which are).
"""

from __future__ import annotations

import torch

from llmserve.kernels import native
from llmserve.layers.quant_blocks import BlockTensor

NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K")
BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}


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
    if qtype == "Q4_K":
        return _q4_k(b, rows, cols)
    raise ValueError(f"GGUF type {qtype} is not run natively")


def _q4_k(b: torch.Tensor, rows: int, cols: int) -> BlockTensor:
    d, dmin = _fp16(b[..., 0:2]).float(), _fp16(b[..., 2:4]).float()  # [rows, SB]
    sc, mn = k_scale_min(b[..., 4:16])  # [rows, SB, 8]
    qs = b[..., 16:].reshape(rows, -1, 4, 32)  # per 64 columns: 32 bytes
    codes = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, cols)
    scales = (d[..., None] * sc.float()).reshape(rows, -1)
    mins = -(dmin[..., None] * mn.float()).reshape(rows, -1)
    return BlockTensor(codes, scales, mins, 4, 32)


def k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> 6-bit (scale, min) of the 8 sub-blocks, [..., 8] each. Sub-blocks 0-3: the
    low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: low / high nibbles of bytes 8-11, with their top 2 bits
    from the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)."""
    s = s.to(torch.int32)
    lo_sc, lo_mn = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    hi_mn = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], dim=-1), torch.cat([lo_mn, hi_mn], dim=-1)
