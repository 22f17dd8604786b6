"""The Triton paged decode kernel (CUDA's decode attention) against the torch reference (gather + SDPA).

On CUDA it runs compiled; without CUDA under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported), which checks the same indexing, masking, splits and merge on the CPU. Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from llmserve.attention import triton_decode  # noqa: E402
from llmserve.attention.metadata import SeqSpec, build_attention_metadata  # noqa: E402
from llmserve.attention.torch_backend import decode_attention, quantize_int4, quantize_int8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(lens: list[int], heads: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype,
          cache_dtype: torch.dtype, seed: int = 0) -> tuple:
    """Random q and cache; each request's blocks are distinct and in random order. Returns (q, cache, scales, meta)
    twice over: the kernel's copy has NaN in every slot outside the contexts (a read of one poisons the output),
    the reference's (which reads padding under a -inf mask) has the same finite values there."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, used = [], 0
    for n, b in zip(lens, need):
        seqs.append(SeqSpec(num_cached=n - 1, num_new=1, block_table=perm[used:used + b]))
        used += b
    meta = build_attention_metadata(seqs, block_size, DEVICE)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    scales = None
    if cache_dtype == torch.int8:
        kv, scales = quantize_int8(kv)
    elif cache_dtype == torch.uint8:  # int4: two codes a byte, a (scale, zero) pair a row
        kv, scales = quantize_int4(kv * 2 + 0.5)
    else:
        kv = kv.to(cache_dtype)
    poisoned = (scales if scales is not None else kv).clone()
    poisoned[:, perm[used:]] = float("nan")
    for i, n in enumerate(lens):  # the unused tail of each last block: NaN too
        last, tail = seqs[i].block_table[-1], n - (len(seqs[i].block_table) - 1) * block_size
        poisoned[:, last, tail:] = float("nan")
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype).to(DEVICE)
    kv = kv.to(DEVICE)
    if scales is None:
        return (q, poisoned.to(DEVICE), None, meta), (q, kv, None, meta)
    return (q, kv, poisoned.to(DEVICE), meta), (q, kv, scales.to(DEVICE), meta)


LENS = [1, 5, 63, 64, 65, 130, 300]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _check(case, window, splits, dtype, softcap=None) -> None:
    (q, kv, scales, meta), reference = case
    got = triton_decode.paged_decode(q, kv, meta.decode_tables, meta.decode_lens, 0.125, window, scales, splits,
                                     softcap=softcap)
    want = decode_attention(*reference[:3], meta, 0.125, window, softcap=softcap)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert torch.isfinite(got).all()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 2), (32, 8)])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_fp32_every_group_and_split(heads: int, kv_heads: int, splits: int) -> None:
    case = _case(LENS, heads, kv_heads, 16, 64, torch.float32, torch.float32)
    _check(case, None, splits, torch.float32)


@pytest.mark.parametrize("window", [1, 7, 64, 200])
@pytest.mark.parametrize("splits", [1, 4])
def test_sliding_window(window: int, splits: int) -> None:
    case = _case(LENS, 8, 2, 16, 64, torch.float32, torch.float32, seed=1)
    _check(case, window, splits, torch.float32)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("splits", [1, 4])
def test_softcap(window: int | None, splits: int) -> None:
    """Gemma 2's capped scores (a cap of 0.5 on scores of O(1) changes the softmax a lot), before the window's mask."""
    case = _case(LENS, 8, 2, 16, 64, torch.float32, torch.float32, seed=4)
    _check(case, window, splits, torch.float32, softcap=0.5)
    (q, kv, scales, meta), _ = case
    args = (q, kv, meta.decode_tables, meta.decode_lens, 0.125, window, scales, splits)
    uncapped, capped = triton_decode.paged_decode(*args), triton_decode.paged_decode(*args, softcap=0.5)
    assert not torch.allclose(uncapped, capped, atol=1e-3)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.float32, torch.int8),
                                               (torch.bfloat16, torch.int8), (torch.float32, torch.uint8),
                                               (torch.bfloat16, torch.uint8), (torch.float16, torch.uint8)])
@pytest.mark.parametrize("splits", [1, 5])
def test_cache_dtypes(dtype: torch.dtype, cache_dtype: torch.dtype, splits: int) -> None:
    case = _case(LENS, 8, 2, 32, 64, dtype, cache_dtype, seed=2)
    _check(case, None, splits, dtype)


@pytest.mark.parametrize("head_dim", [16, 48, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.uint8])
def test_head_dims(head_dim: int, cache_dtype: torch.dtype) -> None:
    """16 (tl.dot's smallest), 48 (not a power of two: padded lanes; an int4 cache's padded bytes dequantize to its
    zero point, which the zero query lanes and the masked stores keep out) and 128."""
    case = _case([3, 70, 129], 4, 2, 8, head_dim, torch.float32, cache_dtype, seed=3)
    _check(case, None, 2, torch.float32)


@pytest.mark.parametrize("window", [None, 40])
def test_int4_window_and_groups(window: int | None) -> None:
    case = _case(LENS, 32, 8, 16, 64, torch.float32, torch.uint8, seed=5)
    _check(case, window, 4, torch.float32)


def test_default_splits_and_int32_tables() -> None:
    """The splits the kernel picks itself, and int32 block tables (what a captured CUDA graph passes)."""
    case = _case(LENS, 8, 2, 16, 64, torch.float32, torch.float32, seed=4)
    meta = case[0][3]
    meta.decode_tables = meta.decode_tables.to(torch.int32)
    _check(case, None, None, torch.float32)


def test_num_splits_bounds() -> None:
    assert triton_decode.num_splits(1, 8, torch.device("cpu")) == 1  # one "SM" on a CPU: two waves of 1
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert triton_decode.num_splits(1, 8, DEVICE) == min(16, triton.next_power_of_2(-(-2 * sms // 8)))
        assert triton_decode.num_splits(512, 8, DEVICE) == 1
