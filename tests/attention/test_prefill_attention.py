"""The native prefill attention kernel (kernels/cpu/prefill_attention.cpp) against the torch reference (one SDPA call per
span): fresh prompts (this step's K/V), later chunks and prefix hits (the cache), windows, GQA, every cache dtype."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention import registry
from llmserve.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata
from llmserve.attention.torch_backend import prefill_attention, quantize_int4, quantize_int8, write_kv
from llmserve.kernels import native

pytestmark = pytest.mark.skipif(not native.prefill_attention_usable(),
                                reason="native prefill attention needs the extension and a CPU with AVX-512 or AVX2")
# an int8 or int4 cache's prefill (as its decode) runs on AVX-512 only; AVX2 CPUs refuse it (tested below)
needs_quantized = pytest.mark.skipif(not native.prefill_quantized_usable(),
                                     reason="an int8 or int4 cache's prefill needs AVX-512")


def _skip_quantized_without_avx512(cache_dtype: torch.dtype | str) -> None:
    if cache_dtype in ("int8", "int4") and not native.prefill_quantized_usable():
        pytest.skip("an int8 or int4 cache's prefill needs AVX-512")


def _case(spans: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
          dtype: torch.dtype, cache_dtype: torch.dtype | str, seed: int = 0, decodes: int = 0,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, AttentionMetadata]:
    """spans: (num_cached, q_len) per prefill, after `decodes` single-token requests. q/k/v are views of one fused
    [T, (heads + 2 kv_heads) * D] output (strided rows, as in the model); the cache holds random earlier context and
    this step's K/V written as the engine writes them; blocks in random order, spare blocks full of garbage."""
    g = torch.Generator().manual_seed(seed)
    seqs_shape = [(9, 1)] * decodes + spans
    need = [-(-(c + n) // block_size) for c, n in seqs_shape]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, used = [], 0
    for (c, n), b in zip(seqs_shape, need):
        seqs.append(SeqSpec(num_cached=c, num_new=n, block_table=perm[used:used + b]))
        used += b
    meta = build_attention_metadata(seqs, block_size, torch.device("cpu"))
    T = sum(n for _, n in seqs_shape)
    qkv = (torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(T, -1, head_dim) for x in (q, k, v))
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    if cache_dtype == "int8":
        kv_cache, kv_scales = quantize_int8(torch.randn(shape, generator=g))
    elif cache_dtype == "int4":  # packed, two codes a byte, with a (scale, zero) pair a row
        kv_cache, kv_scales = quantize_int4(torch.randn(shape, generator=g) * 2 + 0.5)
    else:
        kv_cache, kv_scales = (torch.randn(shape, generator=g) * 2).to(cache_dtype), None
    write_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)
    return q, k, v, kv_cache, kv_scales, meta


def _both(q, k, v, kv_cache, kv_scales, meta, scale, window, kernel: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    nd = meta.num_decodes
    want = torch.zeros_like(q)
    prefill_attention(q, k, v, kv_cache, kv_scales, meta, scale, window, want)
    got = torch.zeros_like(q)
    spans, slots = meta.prefill_arrays()
    native.prefill_attention(q, k, v, kv_cache, kv_scales, spans, slots, scale, window, got, kernel)
    assert torch.equal(got[:nd], torch.zeros_like(got[:nd]))  # decode rows are not the prefill's to write
    return got[nd:].float(), want[nd:].float()


# a fresh prompt of every tile shape (1, 15, 16, 17, 64, 65, 200 tokens: 16-token query tiles, 64-key blocks), a
# chunk after cached context, a prefix hit of one token, and a long cached context
SPANS = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 64), (0, 65), (0, 200), (37, 20), (100, 1 + 1), (1, 70), (300, 45)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2), (14, 2)])  # GQA 1, 3, 4, 7 (7: 3 + 3 + 1 vectors)
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("window", [None, 1, 17, 100])
def test_matches_reference_fp32(heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
    case = _case(SPANS, heads, kv_heads, head_dim, 16, torch.float32, torch.float32, seed=heads + head_dim, decodes=2)
    got, want = _both(*case, scale=head_dim ** -0.5, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.float32, "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 64])
def test_matches_reference_across_dtypes(dtype: torch.dtype, cache_dtype, block_size: int) -> None:
    _skip_quantized_without_avx512(cache_dtype)
    # bf16 rows: the reference widens to fp32 too (on every CPU) and both round the output once to bf16;
    # only the summation order differs, so a few outputs may land one bf16 ulp apart
    case = _case(SPANS, 9, 3, 64, block_size, dtype, cache_dtype, seed=block_size)
    got, want = _both(*case, scale=0.125, window=None)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
        assert (got != want).float().mean() < 0.01


@needs_quantized
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 4)])
@pytest.mark.parametrize("head_dim", [32, 80, 128])
@pytest.mark.parametrize("window", [None, 17])
def test_int4_cache_matches_the_reference(heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
    """An int4 cache's rows (two codes a byte, at head h's D / 2 bytes of a slot) dequantized as the reference does:
    code * scale, rounded, + zero; every head dim's offsets, GQA, windows, chunks and prefix hits over the cache."""
    case = _case(SPANS, heads, kv_heads, head_dim, 16, torch.float32, "int4", seed=heads + head_dim, decodes=2)
    got, want = _both(*case, scale=head_dim ** -0.5, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


needs_dot = pytest.mark.skipif(not native.bf16_dot_usable(), reason="the dot path needs a CPU with AVX512-BF16")


@needs_dot
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("window", [None, 17])
def test_dot_path_matches_the_reference(heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
    """The scores by vdpbf16ps: exact products, fp32 sums in another order, P kept in fp32 for the PV product (rounding
    it to bf16 made a prompt's last position differ from the decode kernel's after a prefix-cache hit), the output
    rounded once to bf16. Every tile shape, chunks over the cache, windows, GQA 3-7."""
    case = _case(SPANS, heads, kv_heads, head_dim, 16, torch.bfloat16, torch.bfloat16, seed=heads + head_dim, decodes=2)
    got, want = _both(*case, scale=head_dim ** -0.5, window=window, kernel="dot")
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean() < 0.01  # only the sums' order differs: rarely a bf16 ulp apart


@needs_dot
@pytest.mark.parametrize("cache_dtype", [torch.float32, "int8", "int4"])
def test_dot_path_takes_only_bf16_keys(cache_dtype) -> None:
    """Spans read from an fp32, int8 or int4 cache keep fp32 FMAs under dot=1 (bit for bit the dot=0 result); a fresh
    prompt (this step's bf16 rows) takes the dot path."""
    case = _case([(0, 40), (37, 20)], 9, 3, 64, 16, torch.bfloat16, cache_dtype)
    meta = case[-1]
    dot, want = _both(*case, scale=0.125, window=None, kernel="dot")
    fma, _ = _both(*case, scale=0.125, window=None, kernel="fp32")
    cached = slice(40, 60)
    assert torch.equal(dot[cached], fma[cached])
    torch.testing.assert_close(dot, want, atol=1e-2, rtol=1e-2)
    assert meta.prefills[0].num_cached == 0 and meta.prefills[1].num_cached == 37


def test_dot_refuses_where_the_cpu_lacks_it() -> None:
    if native.bf16_dot_usable():
        pytest.skip("this CPU has AVX512-BF16")
    q, k, v, kv_cache, kv_scales, meta = _case([(0, 10)], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16)
    spans, slots = meta.prefill_arrays()
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        native.prefill_attention(q, k, v, kv_cache, None, spans, slots, 0.125, None, torch.empty_like(q), "dot")


def test_a_quantized_cache_is_refused_without_avx512() -> None:
    """Without AVX-512 the kernel runs fp32 FMAs over float caches only; an int8 or int4 cache is refused, and the
    attention layer keeps the torch reference for it (registry.native_prefill)."""
    if native.prefill_quantized_usable():
        pytest.skip("this CPU has AVX-512")
    for cache_dtype in ("int8", "int4"):
        q, k, v, kv_cache, kv_scales, meta = _case([(5, 10)], 9, 3, 64, 16, torch.float32, cache_dtype)
        spans, slots = meta.prefill_arrays()
        with pytest.raises(RuntimeError, match="int8 or int4 cache needs a CPU with AVX-512"):
            native.prefill_attention(q, k, v, kv_cache, kv_scales, spans, slots, 0.125, None, torch.empty_like(q))
        assert not registry.native_prefill(q, k, kv_cache)
    q, k, _, kv_cache, _, _ = _case([(5, 10)], 9, 3, 64, 16, torch.float32, torch.float32)
    assert registry.native_prefill(q, k, kv_cache)


@needs_quantized
def test_fresh_prompt_reads_this_steps_rows_not_the_cache() -> None:
    # An int8 cache rounds K/V; a fresh prompt attends over the unrounded rows (the reference's rule), a later
    # chunk over the cache. Garbage in the cache slots of a fresh prompt must not matter.
    q, k, v, kv_cache, kv_scales, meta = _case([(0, 40)], 9, 3, 64, 16, torch.float32, "int8")
    kv_cache.random_(-127, 127)
    got, want = _both(q, k, v, kv_cache, kv_scales, meta, 0.125, None)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # the same prompt with a window shorter than it is read from the cache, as the reference does
    got, want = _both(q, k, v, kv_cache, kv_scales, meta, 0.125, 10)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_bad_input_is_refused() -> None:
    q, k, v, kv_cache, kv_scales, meta = _case([(5, 10)], 9, 3, 64, 16, torch.float32, torch.float32)
    spans, slots = meta.prefill_arrays()
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="out of range"):
        native.prefill_attention(q, k, v, kv_cache, None, spans, slots[:-1], 0.125, None, out)
    bad = slots.clone()
    bad[3] = kv_cache.shape[1] * kv_cache.shape[2]
    with pytest.raises(RuntimeError, match="slot out of range"):
        native.prefill_attention(q, k, v, kv_cache, None, spans, bad, 0.125, None, out)
    with pytest.raises(RuntimeError, match="exactly when the cache is int8"):
        native.prefill_attention(q, k, v, kv_cache, kv_cache[:, :, :, :, 0].float(), spans, slots, 0.125, None, out)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        native.prefill_attention(q[..., :40], k[..., :40], v[..., :40], kv_cache[..., :40].contiguous(), None, spans,
                                 slots, 0.125, None, out[..., :40])


needs_amx = pytest.mark.skipif(not native.prefill_amx_usable(), reason="the amx path needs a CPU with AMX-BF16")


@needs_amx
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (14, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 128])
@pytest.mark.parametrize("window", [None, 17])
def test_amx_path_matches_the_reference(heads: int, kv_heads: int, head_dim: int, window: int | None) -> None:
    """Both products on AMX tiles: exact products, fp32 sums in another order, P as two bf16 terms (~17 bits),
    the output rounded once to bf16. Every tile shape, chunks over the cache, windows, GQA 3-7; head_dim 80 (not a
    multiple of 32) runs the dot path."""
    case = _case(SPANS, heads, kv_heads, head_dim, 16, torch.bfloat16, torch.bfloat16, seed=heads + head_dim, decodes=2)
    got, want = _both(*case, scale=head_dim ** -0.5, window=window, kernel="amx")
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean() < 0.01  # only the sums' order differs: rarely a bf16 ulp apart
    fma, _ = _both(*case, scale=head_dim ** -0.5, window=window, kernel="fp32")
    assert (got != fma).float().mean() < 0.01  # P kept to fp32's bits: the FMA path's outputs, up to a rare ulp


@needs_amx
@pytest.mark.parametrize("growth", [0.02, 0.2, 2.0])
def test_amx_path_where_the_max_keeps_rising(growth: float) -> None:
    """The amx path moves a row's reference max only where the row's max passes it by more than 2^8 (P up to 256
    between), rescaling l and O^T then. Keys whose scores rise along the prompt (each key larger than the last) move
    it often: slowly (P grows toward 256 before each move), fast (a move every block) and in jumps."""
    q, k, v, kv_cache, kv_scales, meta = _case([(0, 300), (0, 90)], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16,
                                               seed=11)
    q.copy_(q.abs())
    pos = torch.cat([torch.arange(300), torch.arange(90)]).float()
    k.copy_((k.float().abs() * (1 + growth * pos)[:, None, None] / 8).bfloat16())
    got, want = _both(q, k, v, kv_cache, kv_scales, meta, 0.125, None, kernel="amx")
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got != want).float().mean() < 0.01
    fma, _ = _both(q, k, v, kv_cache, kv_scales, meta, 0.125, None, kernel="fp32")
    assert (got != fma).float().mean() < 0.01


@needs_amx
@pytest.mark.parametrize("cache_dtype", [torch.float32, "int8", "int4"])
def test_amx_path_takes_only_bf16_keys(cache_dtype) -> None:
    """Spans read from an fp32, int8 or int4 cache keep fp32 FMAs under the amx path (bit for bit); a fresh prompt (this
    step's bf16 rows) takes the tiles."""
    case = _case([(0, 40), (37, 20)], 9, 3, 64, 16, torch.bfloat16, cache_dtype, seed=3)
    amx, want = _both(*case, scale=0.125, window=None, kernel="amx")
    fma, _ = _both(*case, scale=0.125, window=None, kernel="fp32")
    assert torch.equal(amx[40:60], fma[40:60])
    torch.testing.assert_close(amx, want, atol=1e-2, rtol=1e-2)


def test_amx_refuses_where_the_cpu_lacks_it() -> None:
    if native.prefill_amx_usable():
        pytest.skip("this CPU has AMX-BF16")
    q, k, v, kv_cache, kv_scales, meta = _case([(0, 10)], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16)
    spans, slots = meta.prefill_arrays()
    with pytest.raises(RuntimeError, match="AMX"):
        native.prefill_attention(q, k, v, kv_cache, None, spans, slots, 0.125, None, torch.empty_like(q), "amx")


@needs_amx
def test_a_verify_sized_span_over_the_cache_runs_fp32() -> None:
    """A span of at most one 16-token tile over a cached context (speculative decoding's verify span: a token and its
    drafts) runs the fp32 path whatever the call's, bit for bit: the nearer to the decode kernel, which computes the
    same rows when no drafts are verified. A fresh prompt of 16 and a cached span of 17 keep the amx path. (The dot
    path keeps its spans: its P is fp32, and its outputs match the FMAs' nearly always.)"""
    case = _case([(300, 16), (37, 2), (0, 16), (200, 17)], 9, 3, 64, 16, torch.bfloat16, torch.bfloat16, seed=5)
    got, want = _both(*case, scale=0.125, window=None, kernel="amx")
    fma, _ = _both(*case, scale=0.125, window=None, kernel="fp32")
    assert torch.equal(got[:18], fma[:18])
    assert not torch.equal(got[18:34], fma[18:34]) and not torch.equal(got[34:], fma[34:])
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
