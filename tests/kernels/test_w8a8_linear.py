"""W8A8 linear (kernels/cpu/w8a8_linear.cpp): bit for bit what the same arithmetic gives in torch ops, and close to
the float matmul it approximates."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.layers.linear import Linear, quantize_rows
from tests.kernels.test_int8_linear import _layer as float_layer

pytestmark = pytest.mark.skipif(not native.w8a8_usable(),
                                reason="the w8a8 kernel needs the extension and a CPU with AVX-512 and VNNI")


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in torch ops, in its order: per-row asymmetric int8 x (range through 0,
    round half to even on x * (1 / s)), the exact int32 product, then (acc - zp * wsum) * (s * w_scale) + bias."""
    xf = x.float()
    lo, hi = xf.amin(dim=1).clamp(max=0), xf.amax(dim=1).clamp(min=0)
    s = (hi - lo) / 255
    s = torch.where(s > 0, s, torch.ones_like(s))
    inv = 1 / s
    zp = torch.round(-lo * inv).int() - 128
    xq = (torch.round(xf * inv[:, None]).int() + zp[:, None]).clamp(-128, 127).to(torch.int8)
    acc = torch._int_mm(xq, qweight.t())
    y = (acc - zp[:, None] * wsum[None, :]).float() * (s[:, None] * scale[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _layer(out_f: int, in_f: int, bias: bool, seed: int = 0) -> Linear:
    """A quantized layer; .qweight is set back (the layer itself keeps only the packed copy) for the reference."""
    layer = float_layer(out_f, in_f, bias, seed)
    qweight, _ = quantize_rows(layer.weight)
    layer.quantize_w8a8()
    layer.qweight = qweight
    return layer


def test_quantize_w8a8_keeps_packed_int8_weights_and_their_row_sums() -> None:
    layer = float_layer(20, 41, bias=True, seed=0)
    qweight, scale = quantize_rows(layer.weight)
    layer.quantize_w8a8()
    assert layer.weight is None and layer.qweight is None and torch.equal(layer.scale, scale)
    assert layer.wsum.dtype == torch.int32 and torch.equal(layer.wsum, qweight.sum(dim=1, dtype=torch.int32))
    # [ceil(20/16), ceil(41/4), 16, 4]: block b, group g holds rows 16b..16b+15, columns 4g..4g+3; zeros past the ends
    packed = layer.int8_packed
    assert packed.shape == (2, 11, 16, 4) and packed.dtype == torch.int8
    padded = torch.zeros(32, 44, dtype=torch.int8)
    padded[:20, :41] = qweight
    assert torch.equal(packed, padded.view(2, 16, 11, 4).transpose(1, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (3, 13, 7), (2, 100, 33), (8, 1000, 17), (9, 64, 16),
                                             (64, 576, 1030), (17, 1536, 40), (130, 40, 33), (487, 70, 90),
                                             (31, 200, 50), (33, 128, 16), (300, 576, 48)])
# every register tile shape (1-6 rows of x by 1-4 blocks of 16), K not a multiple of 4, N not of 16, and more
# rows than one work chunk (240) in balanced chunks; on the AMX tiles (amx_rows=1, where the CPU has them): units of
# 1-32 rows by one or two blocks, more rows than one work item (256), K < 64 (VNNI alone) and columns past the last
# whole 64 (summed by VNNI into the tiles' sums)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amx_rows", [0, 1])  # VNNI alone; the tiles at every row count
def test_kernel_is_bit_exact_with_its_torch_arithmetic(dtype: torch.dtype, rows: int, in_f: int, out_f: int,
                                                       bias: bool, amx_rows: int) -> None:
    layer = _layer(out_f, in_f, bias, seed=rows)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(rows, in_f, generator=g) * 3 + 0.5).to(dtype)  # off-centre: zero points not -0
    got = native.w8a8_linear(x, layer.int8_packed, layer.scale, layer.wsum, layer.bias, amx_rows)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    assert torch.equal(got, reference(x, layer.qweight, layer.scale, layer.wsum, layer.bias))


@pytest.mark.skipif(not native.w8a8_amx_usable(), reason="needs AMX-INT8")
def test_the_tiles_give_vnnis_bits_at_every_row_count() -> None:
    """The AMX-INT8 tiles and the VNNI kernel sum the same int32 products and rescale them alike: equal outputs for
    every row count from 1 to 70 (every unit shape of the tiles, with and without a second block)."""
    for out_f in (16, 40):
        layer = _layer(out_f, 192, bias=True, seed=out_f)
        x = torch.randn(70, 192, generator=torch.Generator().manual_seed(2)).bfloat16()
        for rows in range(1, 71):
            tiles = native.w8a8_linear(x[:rows], layer.int8_packed, layer.scale, layer.wsum, layer.bias, 1)
            vnni = native.w8a8_linear(x[:rows], layer.int8_packed, layer.scale, layer.wsum, layer.bias, 0)
            assert torch.equal(tiles, vnni), (out_f, rows)


def test_no_rows() -> None:
    layer = _layer(20, 40, bias=True)
    got = native.w8a8_linear(torch.empty(0, 40), layer.int8_packed, layer.scale, layer.wsum, layer.bias)
    assert got.shape == (0, 20) and got.dtype == torch.float32


def test_wrong_packed_weight_is_refused() -> None:
    layer = _layer(20, 40, bias=False)
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.w8a8_linear(x[:, :36], layer.int8_packed, layer.scale, layer.wsum, None)  # 36 columns, packed for 40
    with pytest.raises(RuntimeError, match="w8a8_pack"):
        native.w8a8_linear(x, layer.qweight, layer.scale, layer.wsum, None)  # the plain [N, K] weight


def test_edge_rows_zero_positive_negative_and_huge() -> None:
    layer = _layer(48, 64, bias=True)
    x = torch.stack([torch.zeros(64), torch.rand(64) + 1, -torch.rand(64) - 1, torch.full((64,), 3.0),
                     torch.randn(64) * 1e30])
    got = native.w8a8_linear(x, layer.int8_packed, layer.scale, layer.wsum, layer.bias)
    assert torch.equal(got, reference(x, layer.qweight, layer.scale, layer.wsum, layer.bias))
    torch.testing.assert_close(got[0], layer.bias)  # an all-zero row is exactly zero before the bias
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("rows", [1, 9, 40])  # one register tile and two; AMX tiles where the CPU has them
def test_exact_up_to_the_longest_rows_int32_holds(rows: int) -> None:
    # A constant positive row quantizes to 127 everywhere with zero point -128: every (xq - zp) * w is
    # 255 * 127, and over 66,000 columns their sum, 2,137,410,000, is just inside int32. One column more
    # than the kernel allows is refused rather than wrapped.
    k = 66_000
    qweight = torch.full((16, k), 127, dtype=torch.int8)
    qweight[1::2] = -127
    scale, wsum = torch.full((16,), 1e-9), qweight.sum(dim=1, dtype=torch.int32)
    x = torch.full((rows, k), 2.0)
    got = native.w8a8_linear(x, native.w8a8_pack(qweight), scale, wsum, None)
    assert torch.equal(got, reference(x, qweight, scale, wsum, None))
    want = 2.0 * 127 * k * 1e-9  # x . w * scale, exactly representable after quantization here
    torch.testing.assert_close(got, torch.tensor([want, -want] * 8).expand(rows, 16))
    with pytest.raises(RuntimeError, match="at most 66311"):
        native.w8a8_linear(torch.ones(1, 66_312), native.w8a8_pack(torch.ones(2, 66_312, dtype=torch.int8)), scale[:2],
                           wsum[:2], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_close_to_the_float_matmul_and_through_the_layer(dtype: torch.dtype) -> None:
    layer = _layer(96, 256, bias=True, seed=3)
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(4)).to(dtype)  # 3-d through forward
    got = layer(x)
    assert got.shape == (2, 5, 96) and got.dtype == dtype
    want = x.float() @ (layer.qweight.float() * layer.scale[:, None]).T + layer.bias
    # x rounds to half a step of its row's range / 255 per element: |error| <= step / 2 * sum |w|
    step = (x.float().amax(-1, keepdim=True).clamp(min=0) - x.float().amin(-1, keepdim=True).clamp(max=0)) / 255
    bound = step / 2 * (layer.qweight.float() * layer.scale[:, None]).abs().sum(dim=1) + 0.05
    assert ((got.float() - want).abs() <= bound).all()
    assert (got.float() - want).abs().mean() < 0.1 * want.abs().mean()


@pytest.mark.parametrize("rows", [9, 40])  # 40: together on AMX tiles (from 16 rows) where the CPU has them
def test_rows_do_not_depend_on_each_other(rows: int) -> None:
    """Each row has its own scale and zero point: a request's result does not depend on its batch (nor on the kernel
    its batch's size takes)."""
    layer = _layer(64, 128, bias=False)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    together = native.w8a8_linear(x, layer.int8_packed, layer.scale, layer.wsum, None, 16)
    alone = torch.cat([native.w8a8_linear(x[i:i + 1], layer.int8_packed, layer.scale, layer.wsum, None, 16)
                       for i in range(rows)])
    assert torch.equal(together, alone)
