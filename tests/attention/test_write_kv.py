"""The native K/V writer for 16- and 32-bit caches (kernels/cpu/kv_int8.cpp, write_kv): exactly what index_copy_ of the
rows converted with .to() writes, and nothing else."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native

pytestmark = pytest.mark.skipif(native.load() is None, reason="the native extension did not build here")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_same_bytes_as_index_copy(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    T, KVH, D = 300, 3, 64  # more tokens than one thread's share
    qkv = torch.randn(T, (9 + 2 * KVH) * D, generator=g).to(dtype)  # k, v: strided views of a fused output
    k = qkv[:, 9 * D:(9 + KVH) * D].view(T, KVH, D)
    v = qkv[:, (9 + KVH) * D:].view(T, KVH, D)
    cache = torch.randn(2, 20, 16, KVH, D, generator=g).to(cache_dtype)
    slots = torch.randperm(320, generator=g)[:T]
    want = cache.clone()
    flat = want.view(2, -1, KVH, D)
    flat[0].index_copy_(0, slots, k.to(cache_dtype))
    flat[1].index_copy_(0, slots, v.to(cache_dtype))
    native.write_kv(cache, k, v, slots)
    assert torch.equal(cache, want)  # written slots converted alike, the other 20 slots untouched


def test_bad_slots_and_layouts_are_refused() -> None:
    cache = torch.zeros(2, 2, 4, 3, 16)
    k = torch.zeros(2, 3, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.write_kv(cache, k, k, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="one int64 slot per token"):
        native.write_kv(cache, k, k, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="contiguous"):
        native.write_kv(cache, k.transpose(0, 1).contiguous().transpose(0, 1), k, torch.tensor([0, 1]))
