"""The native paged decode kernel against the torch reference (gather + SDPA)."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata
from llmserve.attention.torch_backend import decode_attention, quantize_int8
from llmserve.kernels import native


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    if native.load() is None:
        pytest.skip("native paged decode extension did not build on this machine (see the warning log)")


@pytest.fixture(params=["avx512", "avx2"], autouse=True)
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on both of the kernel's paths: the AVX-512 one (where the CPU has it) and AVX2."""
    if request.param == "avx512":
        if not torch.cpu._is_avx512_supported():
            pytest.skip("this CPU has no AVX-512")
        monkeypatch.delenv("LLMSERVE_DECODE_AVX512", raising=False)
    else:
        monkeypatch.setenv("LLMSERVE_DECODE_AVX512", "0")
    return request.param


def _case(lens: list[int], heads: int, kv_heads: int, block_size: int, dtype: torch.dtype = torch.float32,
          seed: int = 0, head_dim: int = 64) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q and cache; each request gets distinct blocks drawn in random (non-contiguous) order."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5  # spare blocks hold garbage the kernel must never read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, used = [], 0
    for n, b in zip(lens, need):
        seqs.append(SeqSpec(num_cached=n - 1, num_new=1, block_table=perm[used:used + b]))
        used += b
    meta = build_attention_metadata(seqs, block_size, torch.device("cpu"))
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, kv_cache, meta


LENS = [1, 5, 63, 64, 65, 128, 300, 517]  # single token, partial and exactly-full last blocks


# GQA groups of 1, 3, 4 and 5 query heads (5: a pass of 4 heads then 1); block size 8: a block
# shorter than the AVX-512 path's 16 keys of scores
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (10, 2)])
@pytest.mark.parametrize("block_size", [8, 16, 64])
@pytest.mark.parametrize("window", [None, 1, 40, 200])
def test_native_matches_torch_fp32(heads: int, kv_heads: int, block_size: int, window: int | None) -> None:
    q, kv_cache, meta = _case(LENS, heads, kv_heads, block_size)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    got = native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.125, window)
    want = decode_attention(q, kv_cache, None, meta, 0.125, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_half_caches_accumulate_in_fp32(dtype: torch.dtype) -> None:
    q, kv_cache, meta = _case(LENS, 9, 3, 16, dtype=dtype, seed=1)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    got = native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.125, None)
    # Reference in fp32 on the same (rounded) inputs; the only extra error is the output rounding.
    want = decode_attention(q.float(), kv_cache.float(), None, meta, 0.125, None)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-3)


needs_dot = pytest.mark.skipif(not native.bf16_dot_usable(), reason="the dot path needs a CPU with AVX512-BF16")


@needs_dot
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 32), (4, 4, 128), (8, 2, 80)])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("splits", [1, 3])
def test_dot_scores_match_the_reference(kernel_path: str, heads: int, kv_heads: int, head_dim: int, block_size: int,
                                        window: int | None, splits: int) -> None:
    """dot=1 on a bf16 query and cache: both products by vdpbf16ps on the cache as stored (the scores exact products
    in fp32 sums, scaled after; P as two bf16 terms for P @ V, whose accumulators hold each 32 dims permuted until the
    end), every block shape, partial last blocks (keys past a block's end never read) and odd token counts (the last
    token's pair is zeros), windows, split contexts. Head dims that are not a multiple of 32 run the FMA path, and so
    does everything on the AVX2 path: the flag changes nothing there."""
    q, kv_cache, meta = _case(LENS, heads, kv_heads, block_size, dtype=torch.bfloat16, seed=heads + head_dim,
                              head_dim=head_dim)
    scale = head_dim ** -0.5
    args = (q, kv_cache, meta.decode_tables, meta.decode_lens, scale, window, None, splits)
    dot, fma = native.paged_decode(*args, dot=True), native.paged_decode(*args, dot=False)
    want = decode_attention(q.float(), kv_cache.float(), None, meta, scale, window)
    torch.testing.assert_close(dot.float(), want, rtol=1e-2, atol=2e-3)
    if kernel_path == "avx2" or head_dim % 32:
        assert torch.equal(dot, fma)
    else:
        torch.testing.assert_close(dot.float(), fma.float(), rtol=1e-2, atol=2e-3)
        # P to ~17 bits: the output is the FMA path's (and prefill attention's, whose P is fp32: a prompt's last
        # position gives one token whether prefill or, after a prefix-cache hit, this kernel computes it) but for a
        # rare bf16 unit; one bf16 P (2^-9) changed 30% of the elements here
        assert (dot != fma).float().mean().item() < 0.01


@needs_dot
@pytest.mark.parametrize("cache", ["fp32", "int8"])
def test_dot_leaves_other_caches_and_queries_on_fmas(kernel_path: str, cache: str) -> None:
    if cache == "int8" and kernel_path == "avx2":
        pytest.skip("int8 caches are read by the AVX-512 path only")
    q, kv_cache, meta = _case(LENS, 9, 3, 16, seed=3)
    scales = None
    if cache == "int8":
        _, kv_cache, scales = _quantized(kv_cache)
    for query in (q, q.bfloat16()):
        args = (query, kv_cache, meta.decode_tables, meta.decode_lens, 0.125, None, scales)
        assert torch.equal(native.paged_decode(*args, dot=True), native.paged_decode(*args, dot=False))
    bf16 = kv_cache.bfloat16() if cache == "fp32" else None
    if bf16 is not None:  # an fp32 query over a bf16 cache: no rounding of the query, so FMAs too
        args = (q, bf16, meta.decode_tables, meta.decode_lens, 0.125, None)
        assert torch.equal(native.paged_decode(*args, dot=True), native.paged_decode(*args, dot=False))


def test_paged_attention_uses_native_unless_forced_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from llmserve.attention import registry

    q, kv_cache, _ = _case([10], 9, 3, 16)
    assert registry.native_decode(q, kv_cache) is not None
    monkeypatch.setenv("LLMSERVE_ATTENTION", "torch")
    assert registry.native_decode(q, kv_cache) is None


# 32, 48: multiples of 16, not 64 (the AVX-512 path's one-vector passes); 40: not a multiple of 16
# (the AVX2 path even when AVX-512 is there); 128: two 64-wide passes
@pytest.mark.parametrize("head_dim", [32, 40, 48, 128])
def test_native_other_head_dims(head_dim: int) -> None:
    q, kv_cache, meta = _case(LENS, 9, 3, 16, seed=2, head_dim=head_dim)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    got = native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.1, 100)
    want = decode_attention(q, kv_cache, None, meta, 0.1, 100)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_native_fp32_query_over_a_narrower_cache(cache_dtype: torch.dtype, head_dim: int) -> None:
    """kv_cache_dtype under a float32 model: the kernel widens the cache in registers; the result is the
    fp32 attention over the same (rounded) K/V, to fp32 accuracy, in q's dtype."""
    q, kv_cache, meta = _case(LENS, 9, 3, 16, seed=3, head_dim=head_dim)
    narrow = kv_cache.to(cache_dtype)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    got = native.paged_decode(q, narrow, meta.decode_tables, meta.decode_lens, 0.125, 40)
    want = decode_attention(q, narrow.float(), None, meta, 0.125, 40)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the torch reference accepts the narrow cache itself too (it widens what it gathers)
    torch.testing.assert_close(decode_attention(q, narrow, None, meta, 0.125, 40), want, rtol=1e-5, atol=1e-6)


def test_native_refuses_other_dtypes() -> None:
    q, kv_cache, meta = _case([10], 9, 3, 16)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        native.paged_decode(q.double(), kv_cache, meta.decode_tables, meta.decode_lens, 0.125, None)


def _quantized(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float cache, its int8 cache, scales [2, NB, BS, KVH]): rows of very different magnitudes (and one all
    zero) so that per-row scales matter."""
    g = torch.Generator().manual_seed(7)
    kv_cache = kv_cache.float() * (0.01 + 4 * torch.rand(kv_cache.shape[:-1], generator=g)).unsqueeze(-1)
    kv_cache[0, 0, 0, 0] = 0
    return (kv_cache, *quantize_int8(kv_cache))


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 32), (4, 4, 128), (8, 2, 80)])
@pytest.mark.parametrize("window", [None, 40])
def test_native_int8_cache_matches_torch_dequantized(kernel_path: str, q_dtype: torch.dtype, heads: int,
                                                      kv_heads: int, head_dim: int, window: int | None) -> None:
    """An int8 cache (kv_cache_dtype=int8): the kernel dequantizes in registers; the result is fp32 attention over
    q8 * scale, as the torch reference computes it from the same bytes."""
    q, kv_cache, meta = _case(LENS, heads, kv_heads, 16, seed=4, head_dim=head_dim)
    q = q.to(q_dtype)
    kv_cache, cache8, scales = _quantized(kv_cache)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    want = decode_attention(q.float(), cache8, scales, meta, 0.125, window)
    from llmserve.attention import registry

    if kernel_path == "avx2":  # the int8 cache is read by the AVX-512 path only; the engine falls back to torch
        assert registry.native_decode(q, cache8) is None
        with pytest.raises(RuntimeError, match="int8 KV cache needs the AVX-512 decode path"):
            native.paged_decode(q, cache8, meta.decode_tables, meta.decode_lens, 0.125, window, scales)
        return
    assert registry.native_decode(q, cache8) is not None
    got = native.paged_decode(q, cache8, meta.decode_tables, meta.decode_lens, 0.125, window, scales)
    assert got.dtype == q_dtype
    tol = {"rtol": 1e-4, "atol": 1e-4} if q_dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    # and it stays near attention over the unquantized cache (each row keeps its max to 1/254 relative; peaked
    # softmaxes amplify that in a few elements, so the bound is on the whole output)
    exact = decode_attention(q.float(), kv_cache, None, meta, 0.125, window)
    assert (want - exact).norm() < 0.02 * exact.norm()


def test_native_int8_cache_needs_its_scales() -> None:
    q, kv_cache, meta = _case([10], 9, 3, 16)
    _, cache8, scales = _quantized(kv_cache)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    with pytest.raises(RuntimeError, match="exactly when the cache is int8"):
        native.paged_decode(q, cache8, meta.decode_tables, meta.decode_lens, 0.125, None)
    with pytest.raises(RuntimeError, match="exactly when the cache is int8"):
        native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.125, None, scales)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        native.paged_decode(q, cache8, meta.decode_tables, meta.decode_lens, 0.125, None, scales.double())


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
@pytest.mark.parametrize("window", [None, 1, 100, 700])
@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8"])
def test_split_contexts_merge_to_the_same_attention(kernel_path: str, splits: int, window: int | None,
                                                    cache: str) -> None:
    """Flash-decoding: a context split into parts across threads (any count, parts empty or not, under a
    sliding window), merged by their softmax max and sum, equals the unsplit attention."""
    lens = [1, 40, 130, 1000]  # 1 and 40: more parts than blocks (empty parts)
    q, kv_cache, meta = _case(lens, 9, 3, 16, seed=5)
    scales = None
    if cache == "bf16":
        kv_cache = kv_cache.bfloat16()
    if cache == "int8":
        _, kv_cache, scales = _quantized(kv_cache)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    if cache == "int8" and kernel_path == "avx2":  # int8 caches are read by the AVX-512 path only
        with pytest.raises(RuntimeError, match="int8 KV cache needs the AVX-512 decode path"):
            native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.125, window, scales, splits)
        return
    want = decode_attention(q, kv_cache.float() if scales is None else kv_cache, scales, meta, 0.125, window)
    got = native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.125, window, scales, splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_splits_fill_every_thread_evenly() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert native._module.decode_splits(3, 2000) == 2  # one request, 3 KV heads: 6 parts, 3 per thread
        assert native._module.decode_splits(1, 2000) == 4  # one KV head: 4 parts
        assert native._module.decode_splits(3, 300) == 1  # a part would hold fewer than 256 keys
        assert native._module.decode_splits(4, 5000) == 1  # already two items per thread
        assert native._module.decode_splits(192, 5000) == 1
    finally:
        torch.set_num_threads(threads)


def test_one_long_request_is_split_by_default() -> None:
    """One request of 3 KV heads on 2 threads: the kernel splits on its own (bit for bit the 2-part result,
    which the merge makes differ from the whole context's in the last bits) and stays close to no split."""
    q, kv_cache, meta = _case([2000], 9, 3, 64, seed=6)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        run = lambda splits: native.paged_decode(q, kv_cache, meta.decode_tables, meta.decode_lens, 0.125,  # noqa: E731
                                                 None, None, splits)
        auto, two, whole = run(-1), run(2), run(1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(auto, two) and not torch.equal(auto, whole)
    torch.testing.assert_close(auto, whole, rtol=1e-5, atol=1e-6)
