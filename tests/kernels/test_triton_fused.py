"""CUDA's fused elementwise kernels (kernels/triton/fused.py) against the torch ops they replace.

On CUDA they run compiled; without CUDA under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported). The torch ops are the layers' own fallbacks: RMSNorm's normalise-in-fp32, apply_rotary, F.silu * up and
index_copy_ into the cache. Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from llmserve.kernels.triton import fused, fused_for  # noqa: E402
from llmserve.layers.rotary import apply_rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


# Triton's interpreter converts fp32 to bf16 by truncation (a GPU rounds to nearest even): there, bf16 results may be
# a unit in the last place off at each rounding, and exact comparisons hold for fp32 and fp16 only
INTERPRETED_BF16 = not torch.cuda.is_available()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a unit or two in the last place, on few elements (fused.py: a sum's order, FMA contraction, Triton's
    approximate exp and division move some values across a rounding boundary); a race or an indexing error is off
    by far more, or everywhere."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    diff = (got.float() - want.float()).abs()
    if got.dtype == torch.bfloat16 and INTERPRETED_BF16:  # truncations, and a difference's cancellation
        assert (diff <= 2 ** -6 * want.float().abs().max()).all()
        return
    ulp = want.float().abs() * (2 ** -7 if got.dtype == torch.bfloat16 else 2 ** -10) + 1e-6
    assert (diff <= 2 * ulp).all()
    assert (diff > 0).float().mean() < 0.1


def _torch_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)  # layers/norm.py's reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 1000, 4096])
def test_rms_norm(dtype: torch.dtype, n: int) -> None:
    x, w = _rand(5, n, dtype=dtype), _rand(n, dtype=dtype, seed=1)
    _close(fused.rms_norm(x, w, 1e-5), _torch_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 576, 4096])  # 64: fewer elements than threads (fused.py's barrier)
def test_add_rms_norm_in_place(dtype: torch.dtype, n: int) -> None:
    x, r, w = _rand(7, n, dtype=dtype), _rand(7, n, dtype=dtype, seed=1), _rand(n, dtype=dtype, seed=2)
    total = x + r
    want = _torch_rms_norm(total, w, 1e-6)
    got = fused.rms_norm(x, w, 1e-6, r)
    assert got.data_ptr() == x.data_ptr()
    if dtype == torch.bfloat16 and INTERPRETED_BF16:
        _close(r, total)
    else:
        assert torch.equal(r, total)  # the residual stream: the rounded sum of two values, bit for bit
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 64), (32, 8, 128), (3, 1, 80), (4, 2, 16)])
def test_rotary_in_place_over_the_fused_qkv_output(dtype: torch.dtype, heads: int, kv_heads: int, d: int) -> None:
    if dtype == torch.bfloat16 and INTERPRETED_BF16:
        pytest.skip("the interpreter truncates bf16 conversions (errors up to 0.07 of the products seen): fp32 and "
                    "fp16 check the indexing here, CUDA checks bf16")
    t = 6
    qkv = _rand(t, (heads + 2 * kv_heads) * d, dtype=dtype)
    angles = _rand(t, 1, d // 2, dtype=torch.float32, seed=3) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d)
    want = apply_rotary(qk.clone(), cos, sin)
    # each output is a difference (or sum) of two products: the GPU's kernel may keep the products unrounded (seen on
    # an H100 for bf16 and fp16: outputs a unit of the products' last place from torch's, where they nearly cancel),
    # so the bound is on the products' size, not the output's
    x1, x2 = qk.float().abs().chunk(2, dim=-1)
    c, s = cos.float().abs(), sin.float().abs()
    terms = torch.cat((x1 * c + x2 * s, x2 * c + x1 * s), dim=-1)  # |x1 c| + |x2 s|, then |x2 c| + |x1 s|
    v_before = qkv[:, (heads + kv_heads) * d:].clone()
    got = fused.rotary_(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()
    unit = {torch.float32: 2 ** -22, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    assert ((got.float() - want.float()).abs() <= 2 * unit * terms + 1e-6).all()
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], v_before)  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [48, 1536, 3000])
def test_silu_mul(dtype: torch.dtype, n: int) -> None:
    x = _rand(4, 2 * n, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    _close(fused.silu_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_write_kv(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    t, kvh, d, heads = 5, 2, 64, 4
    qkv = _rand(t, (heads + 2 * kvh) * d, dtype=dtype)
    k = qkv[:, heads * d:(heads + kvh) * d].view(t, kvh, d)
    v = qkv[:, (heads + kvh) * d:].view(t, kvh, d)
    slots = torch.tensor([3, 17, 0, 30, 9], device=DEVICE)
    cache = torch.full((2, 4, 8, kvh, d), 7.0, dtype=cache_dtype, device=DEVICE)
    want = cache.clone()
    flat = want.view(2, -1, kvh, d)
    flat[0].index_copy_(0, slots, k.to(cache_dtype))
    flat[1].index_copy_(0, slots, v.to(cache_dtype))
    fused.write_kv(cache, k, v, slots)
    if dtype != cache_dtype and INTERPRETED_BF16:
        _close(cache, want)
    else:
        assert torch.equal(cache, want)


def test_fused_for_only_cuda_tensors_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused_for(torch.zeros(2, 2)) is None  # CPU tensors: native ops or torch's
    if torch.cuda.is_available():
        x = torch.zeros(2, 2, device="cuda")
        assert fused_for(x) is fused
        assert fused_for(x.long()) is None
        monkeypatch.setenv("LLMSERVE_FUSED_OPS", "0")
        assert fused_for(x) is None
