"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) for tiny test models: the installed gguf package dequantizes them but cannot
quantize them. Plain round-to-nearest per sub-block (no search for the best scales as llama.cpp does): the tests need
valid blocks of about the weights' values, which gguf.quants.dequantize then reads as the format's own."""

from __future__ import annotations

import numpy as np

QK = 256  # columns per super-block


def quantize(a: np.ndarray, qtype: str) -> np.ndarray:
    """fp32 [rows, cols] (cols % 256 == 0) -> uint8 [rows, bytes per row] of `qtype` blocks."""
    rows, cols = a.shape
    if cols % QK:
        raise ValueError(f"{qtype} rows are whole super-blocks of {QK} columns, got {cols}")
    blocks = a.astype(np.float32).reshape(-1, QK)
    out = _q6_k(blocks) if qtype == "Q6_K" else _q45_k(blocks, five=qtype == "Q5_K")
    return out.reshape(rows, -1)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q45_k(w: np.ndarray, five: bool) -> np.ndarray:
    """Q4_K / Q5_K: per sub-block of 32, w ~ d * sc * q - dmin * mn with 6-bit sc, mn and q < 16 (32)."""
    top = 31 if five else 15
    sub = w.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    d = (_fp16_round((sub.max(axis=2) - lo).max(axis=1) / top / 63))[:, None]
    dmin = (_fp16_round(-lo.min(axis=1) / 63))[:, None]
    sc = np.clip(np.round(np.divide((sub.max(axis=2) - lo) / top, d, out=np.zeros_like(lo), where=d > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-lo, dmin, out=np.zeros_like(lo), where=dmin > 0)), 0, 63)
    step = (d * sc)[..., None]
    q = np.divide(sub + (dmin * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.round(q), 0, top).astype(np.uint8)  # [B, sub-block, 32]
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    pairs = q.reshape(-1, 4, 2, 32)  # per 64 columns: low nibbles the first 32, high the next
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(-1, 128)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), scales]
    if five:  # bit s of qh byte i: the fifth bit of sub-block s's column i
        parts.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1))
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: per 16 columns w ~ d * sc * (q - 32) with int8 sc and q < 64."""
    sub = w.reshape(-1, 16, 16)
    step = np.abs(sub).max(axis=2) / 31
    d = _fp16_round(step.max(axis=1) / 127)[:, None]
    sc = np.clip(np.round(np.divide(step, d, out=np.zeros_like(step), where=d > 0)), -128, 127)
    eff = (d * sc)[..., None]
    q = np.divide(sub, eff, out=np.zeros_like(sub), where=eff > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [B, half, s, i]
    low = q.reshape(-1, 2, 2, 64)  # ql byte 64h + j: column 128h + j low, 128h + 64 + j high
    ql = ((low[:, :, 0] & 15) | ((low[:, :, 1] & 15) << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None], axis=2)
    return np.concatenate([ql, qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _fp16_bytes(d)], axis=1)


def _fp16_round(x: np.ndarray) -> np.ndarray:
    """x as fp16 holds it, back in fp32 (the scale the blocks will carry)."""
    return x.astype(np.float16).astype(np.float32)
