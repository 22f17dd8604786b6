"""The native fused rotary and add+RMSNorm ops against the torch layers they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import native
from llmserve.layers.activation import SiluAndMul
from llmserve.layers.norm import RMSNorm
from llmserve.layers.rotary import apply_rotary, rotate_


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    if native.load() is None:
        pytest.skip("native CPU kernels did not build on this machine (see the warning log)")


def _cos_sin(t: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.arange(t, dtype=torch.float32)[:, None] * (0.5 ** torch.arange(d // 2, dtype=torch.float32))
    return ang.cos().to(dtype).unsqueeze(1), ang.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80])  # 80: half of a head is not a whole number of 16-lane vectors
def test_rotary_in_place_on_a_strided_qkv_view_equals_apply_rotary(dtype: torch.dtype, d: int) -> None:
    t, h, kvh = 37, 9, 3
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=torch.Generator().manual_seed(0)).to(dtype)
    cos, sin = _cos_sin(t, d, dtype)
    qk = qkv[:, :(h + kvh) * d].view(t, h + kvh, d)
    want = apply_rotary(qk.clone(), cos, sin)
    v_before = qkv[:, (h + kvh) * d:].clone()
    got = rotate_(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # op-by-op rounding as torch: identical
    assert torch.equal(qkv[:, (h + kvh) * d:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("e", [576, 100])  # 100: a masked tail after the 16-lane body
def test_add_rms_norm_in_place_equals_the_torch_layer(dtype: torch.dtype, e: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(e, 1e-5)
    norm.weight.data = torch.randn(e, generator=g).to(dtype)
    x, residual = (torch.randn(21, e, generator=g).to(dtype) for _ in range(2))
    monkeypatch.setenv("LLMSERVE_FUSED_OPS", "0")
    want_x, want_res = norm(x.clone(), residual.clone())
    monkeypatch.setenv("LLMSERVE_FUSED_OPS", "1")
    got_x, got_res = norm(x, residual)
    assert got_x.data_ptr() == x.data_ptr() and got_res.data_ptr() == residual.data_ptr()  # in place
    assert torch.equal(got_res, want_res)
    # fp32 sums in another order: within an ulp or two of the reference (one bf16 ulp at worst)
    tol = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (8e-3, 1e-2)}[dtype]
    torch.testing.assert_close(got_x, want_x, rtol=tol[0], atol=tol[1])


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit but for NaNs, which need only sit in the same places (torch's own ops do not agree on a NaN's
    sign: a -NaN element stays one through its bf16 multiplications, where its conversions give +NaN)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_bf16_roundings_keep_torchs_bits_on_denormals_nans_and_infs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AVX512-BF16 CPUs the bf16 ops round two vectors at a time with vcvtne2ps2bf16, which reads denormals as zero
    and keeps a NaN's sign and payload; rows holding those take the integer rounding, so the bits stay torch's."""
    g = torch.Generator().manual_seed(3)
    t, h, d, e = 6, 4, 64, 576
    tiny, neg_nan = 2.0 ** -130, -float("nan")  # a denormal fp32 sum or product; a NaN with its sign bit set
    qkv = torch.randn(t, (h + 2) * d, generator=g).bfloat16()
    qkv[1, :d] = tiny  # its products with cos/sin are denormal
    qkv[2, 5], qkv[3, 7], qkv[4, 40] = neg_nan, float("inf"), -float("inf")
    cos, sin = _cos_sin(t, d, torch.bfloat16)
    qk = qkv[:, :(h + 1) * d].view(t, h + 1, d)
    want = apply_rotary(qk.clone(), cos, sin)
    assert _same_bits(rotate_(qk, cos, sin), want)
    norm = RMSNorm(e, 1e-5)
    norm.weight.data = torch.randn(e, generator=g).bfloat16()
    x, residual = (torch.randn(t, e, generator=g).bfloat16() for _ in range(2))
    x[0], residual[0] = tiny, tiny  # a denormal sum for every element of the row
    x[1, 100], x[2, 200], residual[3, 300] = neg_nan, float("inf"), 2.0 ** -140
    monkeypatch.setenv("LLMSERVE_FUSED_OPS", "0")
    want_x, want_res = norm(x.clone(), residual.clone())
    monkeypatch.setenv("LLMSERVE_FUSED_OPS", "1")
    got_x, got_res = norm(x, residual)
    assert _same_bits(got_res, want_res)
    assert _same_bits(got_x[:3], want_x[:3])  # a row of denormal sums, of a NaN, of an inf: exact
    torch.testing.assert_close(got_x, want_x, rtol=8e-3, atol=1e-2, equal_nan=True)


def test_fused_ops_refuse_other_dtypes() -> None:
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        native.rotary_(x, torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))


def _gate_up(t: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(t, 2 * i, generator=torch.Generator().manual_seed(2)) * 4
    # the edges of the exp: saturation both ways, zeros of both signs, a NaN
    x[0, :8] = torch.tensor([-100.0, -88.0, -20.0, -0.0, 0.0, 20.0, 100.0, float("nan")])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("i", [1536, 100])  # 100: a masked tail after the 16-lane body
@pytest.mark.parametrize("t", [1, 67])  # 67 rows: several threads' chunks
def test_silu_mul_equals_torch(dtype: torch.dtype, i: int, t: int) -> None:
    x = _gate_up(t, i, dtype)
    want = F.silu(x[:, :i]) * x[:, i:]
    got = native.silu_mul(x)
    assert got.shape == (t, i) and got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    # exp within ~2 ulp of torch's: fp32 a few ulp apart; bf16 / fp16 the same after rounding, or one ulp of the
    # rounded silu apart (times up)
    tol = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1.6e-2, 1e-5), torch.float16: (2e-3, 1e-5)}[dtype]
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1], equal_nan=True)
    if dtype != torch.float32:
        # rounded as torch rounds: nearly always the very bits (the edge values aside)
        assert (got[:, 8:] == want[:, 8:]).float().mean() > 0.99


def test_silu_and_mul_layer_takes_the_native_op_and_keeps_the_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _gate_up(6, 40, torch.bfloat16).view(2, 3, 80)
    monkeypatch.setenv("LLMSERVE_FUSED_OPS", "0")
    want = SiluAndMul()(x)
    monkeypatch.setenv("LLMSERVE_FUSED_OPS", "1")
    calls = []
    real = native.silu_mul
    monkeypatch.setattr(native, "silu_mul", lambda t: calls.append(t.shape) or real(t))
    got = SiluAndMul()(x)
    assert calls == [(6, 80)] and got.shape == (2, 3, 40)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5, equal_nan=True)
    strided = torch.cat([x, x], dim=-1)[..., :80]  # not contiguous: the torch path, the same values
    torch.testing.assert_close(SiluAndMul()(strided), want, rtol=0, atol=0, equal_nan=True)
    assert len(calls) == 1


def test_silu_mul_refuses_bad_input() -> None:
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        native.silu_mul(torch.zeros(4, 7))
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        native.silu_mul(torch.zeros(8, 4).t())
    with pytest.raises(RuntimeError, match="float32, bfloat16 and float16"):
        native.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
