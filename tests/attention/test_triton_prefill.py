"""The Triton paged prefill kernel (CUDA's prefill attention) against the torch reference (one SDPA call per chunk).

On CUDA it runs compiled; without CUDA under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported), which checks the same indexing, causal and window masks and work list on the CPU. Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from llmserve.attention import registry, triton_prefill  # noqa: E402
from llmserve.attention.metadata import SeqSpec, build_attention_metadata  # noqa: E402
from llmserve.attention.torch_backend import prefill_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _case(chunks: list[tuple[int, int]], heads: int, kv_heads: int, block_size: int, head_dim: int,
          dtype: torch.dtype, decodes: int = 0, seed: int = 0):
    """A step of `decodes` decode rows, then one prefill chunk per (cached, new) pair, over distinct blocks in random
    order; every slot outside the contexts holds NaN (a read of one poisons a row). Returns q, k, v (this step's
    rows), the cache with this step's K/V written, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    lens = [(n - 1, 1) for n in [5] * decodes] + chunks
    need = [-(-(c + n) // block_size) for c, n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, used = [], 0
    for (c, n), b in zip(lens, need):
        seqs.append(SeqSpec(num_cached=c, num_new=n, block_table=perm[used:used + b]))
        used += b
    meta = build_attention_metadata(seqs, block_size, DEVICE)
    kv = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    flat = kv.view(2, -1, kv_heads, head_dim)
    for s, (c, n) in zip(seqs, lens):
        slots = (torch.tensor(s.block_table)[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:c + n]
        flat[:, slots] = torch.randn(2, c + n, kv_heads, head_dim, generator=g).to(dtype)
    t = meta.slot_mapping.numel()
    k, v = (flat[i, meta.slot_mapping.cpu()].clone() for i in (0, 1))  # this step's rows, as written
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kv.to(DEVICE), meta


def _check(case, window=None, softcap=None) -> None:
    q, k, v, kv, meta = case
    nd = meta.num_decodes
    sentinel = torch.full_like(q, 7.0)
    got = sentinel.clone()
    triton_prefill.prefill(q, kv, meta, 0.125, window, got, softcap)
    want = sentinel.clone()
    prefill_attention(q, k, v, kv, None, meta, 0.125, window, want, softcap)
    assert torch.equal(got[:nd], sentinel[:nd])  # decode rows untouched
    got, want = got[nd:].float(), want[nd:].float()
    assert torch.isfinite(got).all()
    err = ((got - want).norm() / want.norm()).item()
    assert err < TOL[q.dtype], err


CHUNKS = [(0, 1 + 1), (0, 37), (16, 20), (5, 50), (100, 3), (0, 70)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 2)])
def test_fp32_chunks_and_groups(heads: int, kv_heads: int) -> None:
    _check(_case(CHUNKS, heads, kv_heads, 16, 64, torch.float32, decodes=3))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype: torch.dtype) -> None:
    _check(_case(CHUNKS, 8, 2, 16, 64, dtype, decodes=2, seed=1))


@pytest.mark.parametrize("window", [1, 7, 20, 64])
def test_sliding_window(window: int) -> None:
    _check(_case(CHUNKS, 4, 2, 16, 64, torch.float32, seed=2), window=window)


def test_softcap() -> None:
    _check(_case(CHUNKS, 4, 2, 16, 64, torch.float32, seed=3), softcap=5.0)


@pytest.mark.parametrize("head_dim,block_size", [(40, 8), (128, 32), (256, 16)])
def test_head_dims_and_block_sizes(head_dim: int, block_size: int) -> None:
    _check(_case([(0, 19), (9, 30)], 4, 2, block_size, head_dim, torch.float32, seed=4))


def test_work_list_covers_every_row_once() -> None:
    """One program per block_m rows of each chunk, in chunk order; the device copy is one tensor split three ways."""
    meta = _case(CHUNKS, 4, 4, 16, 64, torch.float32, decodes=2)[4]
    tables, spans, work = meta.prefill_work(16)
    spans, work = spans.cpu().tolist(), work.cpu().tolist()
    assert spans == [[p.q_start, p.q_len, p.num_cached] for p in meta.prefills]
    assert work == [[i, m] for i, (_, n) in enumerate(CHUNKS) for m in range(0, n, 16)]
    assert tables.dtype == torch.int32 and tables.shape[0] == len(CHUNKS)
    assert meta.prefill_work(16)[0] is tables  # made once per step
    # one compiled variant for every step: rows a multiple of 16 wide, each part 16-byte aligned (Triton specializes
    # on both)
    assert tables.shape[1] % 16 == 0 and tables.stride(0) == tables.shape[1]
    for x in meta.prefill_work(16):
        assert x.data_ptr() % 16 == 0


def test_registry_routes_only_cuda_caches_of_the_query_dtype() -> None:
    q = torch.zeros(2, 4, 64)
    assert registry.triton_prefill(q, torch.zeros(2, 1, 16, 4, 64), None) is None  # a CPU tensor: native / reference
    if torch.cuda.is_available():
        qc = q.cuda()
        assert registry.triton_prefill(qc, torch.zeros(2, 1, 16, 4, 64, device="cuda"), None) is not None
        cache8 = torch.zeros(2, 1, 16, 4, 64, dtype=torch.int8, device="cuda")
        assert registry.triton_prefill(qc, cache8, torch.zeros(2, 1, 16, 4, device="cuda")) is None
        assert registry.triton_prefill(qc.bfloat16(), torch.zeros(2, 1, 16, 4, 64, device="cuda"), None) is None


@pytest.mark.parametrize("window,softcap", [(4, 2.0), (None, 2.0), (4, None)])
def test_gemma2_shapes(window, softcap) -> None:
    """Gemma 2's tiny test model: head_dim 16, blocks of 4, a window of 4 with capped scores, chunks of 16."""
    chunks = [(0, 16), (16, 5), (0, 3), (32, 16)]
    for dtype in (torch.float32, torch.bfloat16):
        _check(_case(chunks, 4, 2, 4, 16, dtype, decodes=1, seed=5), window=window, softcap=softcap)
