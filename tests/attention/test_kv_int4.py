"""The int4 KV cache's kernels (kv_cache_dtype="int4", quant_policy=4): quantize/pack round trips, the native writer
against torch's bytes, and the native decode kernel reading packed int4 in place against the torch reference over the
same bytes."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention import registry
from llmserve.attention.metadata import AttentionMetadata, SeqSpec, build_attention_metadata
from llmserve.attention.torch_backend import (
    decode_attention,
    dequantize,
    pack_int4,
    quantize_int4,
    unpack_int4,
    write_kv,
)
from llmserve.kernels import native

needs_native = pytest.mark.skipif(not native.int8_kv_decode_usable(),
                                  reason="the native int4 KV path needs the extension and AVX-512")


def test_pack_is_two_values_a_byte_low_nibble_first() -> None:
    q = torch.tensor([[0, 15, 8, 7, 11, 1]], dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0 | (15 << 4), 8 | (7 << 4), 11 | (1 << 4)]]
    assert torch.equal(unpack_int4(packed), q)
    every = torch.arange(16, dtype=torch.uint8).repeat_interleave(16)
    pairs = torch.stack((every, every.view(16, 16).t().reshape(-1)), -1).flatten()  # every (lo, hi) pair
    assert torch.equal(unpack_int4(pack_int4(pairs)), pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_within_half_a_step(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(50, 3, 64, generator=g) * torch.rand(50, 3, 1, generator=g) * 8 + 3).to(dtype)
    x[4, 2] = 0
    x[5, 1] = -2.5  # constant rows: scale 0, zero the value, codes 0
    packed, params = quantize_int4(x)
    assert packed.shape == (50, 3, 32) and params.shape == (50, 3, 2) and params.dtype == torch.float16
    scale, zero = params.float().unbind(-1)
    q = unpack_int4(packed)
    live = scale > 0
    assert (q.amin(-1)[live] == 0).all() and (q.amax(-1)[live] == 15).all()  # each row's min and max: the ends
    assert (scale[4, 2], zero[4, 2], scale[5, 1], zero[5, 1]) == (0, 0, 0, -2.5) and not q[4, 2].any()
    back = dequantize(packed, params, torch.float32)
    assert torch.equal(back[5, 1], x[5, 1].float())
    err = (back - x.float()).abs()
    # round to nearest: half a step at most, plus the fp16 rounding of the zero point (the step's is inside 15 levels)
    assert (err <= scale.unsqueeze(-1) / 2 + zero.abs().unsqueeze(-1) * 2 ** -10 + 1e-6).all()
    assert torch.equal(back, q.float() * scale.unsqueeze(-1) + zero.unsqueeze(-1))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 16, 100])
def test_native_writer_stores_the_reference_bytes(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                                  head_dim: int) -> None:
    g = torch.Generator().manual_seed(1)
    qkv = (torch.randn(37, 5, head_dim, generator=g) * torch.rand(37, 5, 1, generator=g) * 8).to(dtype)
    k, v = qkv[:, 1:3], qkv[:, 3:5]  # strided token rows, as the views of a fused QKV output are
    k[3, 1] = 0
    slots = torch.randperm(48, generator=g)[:37]
    caches = []
    for attention in (None, "torch"):
        if attention:
            monkeypatch.setenv("LLMSERVE_ATTENTION", attention)
        kv_cache = torch.full((2, 12, 4, 2, head_dim // 2), 99, dtype=torch.uint8)
        kv_scales = torch.full((2, 12, 4, 2, 2), -1.0, dtype=torch.float16)
        write_kv(kv_cache, k, v, slots, kv_scales)
        caches.append((kv_cache, kv_scales))
    (nat, nat_s), (ref, ref_s) = caches
    assert torch.equal(nat, ref) and torch.equal(nat_s, ref_s)
    flat = nat.view(2, 48, 2, head_dim // 2)
    assert torch.equal(flat[0, slots], quantize_int4(k)[0]) and torch.equal(flat[1, slots], quantize_int4(v)[0])
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[:, untouched] == 99).all()
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.write_kv_int4(nat, nat_s, k[:1], v[:1], torch.tensor([48]))
    with pytest.raises(RuntimeError, match="uint8"):
        native.write_kv_int4(nat.view(torch.int8), nat_s, k, v, slots)


def _case(lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int = 16,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(q, float cache, its int4 cache, scales, meta): blocks in random order, rows of very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    seqs, used = [], 0
    for n, b in zip(lens, need):
        seqs.append(SeqSpec(num_cached=n - 1, num_new=1, block_table=perm[used:used + b]))
        used += b
    meta = build_attention_metadata(seqs, block_size, torch.device("cpu"))
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    kv = kv * (0.01 + 4 * torch.rand(kv.shape[:-1], generator=g)).unsqueeze(-1)
    kv[0, 0, 0, 0] = 0
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    return (q, kv, *quantize_int4(kv), meta)


LENS = [1, 5, 63, 64, 65, 128, 300, 517]


@needs_native
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 32), (4, 4, 128), (8, 2, 80), (4, 2, 16)])
@pytest.mark.parametrize("window", [None, 40])
def test_native_int4_decode_matches_torch_dequantized(q_dtype: torch.dtype, heads: int, kv_heads: int,
                                                      head_dim: int, window: int | None) -> None:
    """The kernel unpacks int4 in registers; the result is fp32 attention over q4 * scale, as the torch reference
    computes it from the same bytes, and stays near attention over the unquantized cache."""
    q, kv, cache4, scales, meta = _case(LENS, heads, kv_heads, head_dim, seed=4)
    q = q.to(q_dtype)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    assert registry.native_decode(q, cache4) is not None
    want = decode_attention(q.float(), cache4, scales, meta, 0.125, window)
    got = native.paged_decode(q, cache4, meta.decode_tables, meta.decode_lens, 0.125, window, scales)
    assert got.dtype == q_dtype
    tol = {"rtol": 1e-4, "atol": 1e-4} if q_dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    # 16 levels a row: each element within 1/30 of its row's range (an rms error ~5% of a Gaussian row's spread);
    # peaked softmaxes and one-key contexts pass that through, so the bound is on the whole output: measured 7-17%
    # here (symmetric int4, max|x| / 7: 16-19%; int8: under 2%)
    exact = decode_attention(q.float(), kv, None, meta, 0.125, window)
    assert (want - exact).norm() < 0.25 * exact.norm()


@needs_native
@pytest.mark.parametrize("splits", [1, 3, 7])
@pytest.mark.parametrize("window", [None, 1, 700])
def test_split_int4_contexts_merge_to_the_same_attention(splits: int, window: int | None) -> None:
    q, _, cache4, scales, meta = _case([1, 40, 130, 1000], 9, 3, 64, seed=5)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    want = decode_attention(q, cache4, scales, meta, 0.125, window)
    got = native.paged_decode(q, cache4, meta.decode_tables, meta.decode_lens, 0.125, window, scales, splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_native
def test_native_int4_decode_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    q, _, cache4, scales, meta = _case([10], 9, 3, 64)
    assert meta.decode_tables is not None and meta.decode_lens is not None
    with pytest.raises(RuntimeError, match="exactly when the cache is int8 or int4"):
        native.paged_decode(q, cache4, meta.decode_tables, meta.decode_lens, 0.125, None)
    with pytest.raises(RuntimeError, match="head_dim mismatch"):
        native.paged_decode(q[..., :32], cache4, meta.decode_tables, meta.decode_lens, 0.125, None, scales)
    monkeypatch.setenv("LLMSERVE_DECODE_AVX512", "0")  # the AVX2 path cannot read it: the engine runs torch's
    assert registry.native_decode(q, cache4) is None
    with pytest.raises(RuntimeError, match="an int4 KV cache needs the AVX-512 decode path"):
        native.paged_decode(q, cache4, meta.decode_tables, meta.decode_lens, 0.125, None, scales)
