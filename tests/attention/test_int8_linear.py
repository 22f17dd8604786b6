"""Weight-only int8 linear: the native kernel and every fallback path against the dequantized matmul."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention import native
from llmserve.layers import linear as lin
from llmserve.layers.linear import Linear, int8_linear


def _layer(out_f: int, in_f: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(in_f, out_f, bias=bias)
    layer.weight.data = torch.randn(out_f, in_f, generator=g)
    if bias:
        layer.bias.data = torch.randn(out_f, generator=g)
    return layer


def test_quantize_int8_rounds_each_row_to_its_own_scale() -> None:
    layer = _layer(6, 40, bias=False)
    w = layer.weight.detach().clone()
    layer.quantize_int8()
    assert layer.weight is None and layer.qweight.dtype == torch.int8 and layer.scale.dtype == torch.float32
    assert torch.equal(layer.qweight.abs().amax(dim=1), torch.full((6,), 127, dtype=torch.int8))  # each row's max
    torch.testing.assert_close(layer.scale, w.abs().amax(dim=1) / 127)
    # round to nearest: every weight within half a step of its row's grid
    assert ((layer.qweight.float() * layer.scale[:, None] - w).abs() <= layer.scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 5])  # 3, 5: a pass with one row of x after pairs
@pytest.mark.parametrize("in_f", [576, 40])  # 40: masked tails after the 32- and 16-wide bodies
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vnni", [True, False])  # False: the fp32 kernel of AVX-512 CPUs without VNNI
def test_native_kernel_equals_the_dequantized_matmul(rows: int, in_f: int, bias: bool, vnni: bool) -> None:
    if native.load() is None or not native._module.int8_linear_supported():
        pytest.skip("the native int8 kernel needs the extension and a CPU with AVX-512 (F, BW, VL)")
    layer = _layer(37, in_f, bias)  # 37 rows: a partial last block of output rows
    layer.quantize_int8()
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(1))
    w = layer.qweight.float() * layer.scale[:, None]
    want = x @ w.T + (layer.bias if bias else 0)
    got = native._module.int8_linear(x, layer.qweight, layer.scale, layer.bias, vnni)
    # With VNNI each row of x is rounded to int16 (its max |x| -> 32767): at most half a step per
    # element, so |error| <= half a step times sum |w| per output, plus fp32 slack.
    bound = x.abs().amax(dim=1, keepdim=True) / 32767 / 2 * w.abs().sum(dim=1) + 1e-4
    assert ((got - want).abs() <= bound).all()
    got_bf16 = native._module.int8_linear(x.bfloat16(), layer.qweight, layer.scale, layer.bias, vnni)
    assert got_bf16.dtype == torch.bfloat16
    want_bf16 = x.bfloat16().float() @ (layer.qweight.float() * layer.scale[:, None]).T + (layer.bias if bias else 0)
    torch.testing.assert_close(got_bf16.float(), want_bf16, rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("rows", [1, lin.INT8_KERNEL_MAX_ROWS, lin.INT8_KERNEL_MAX_ROWS + 1, lin.INT8PACK_MAX_ROWS,
                                  lin.INT8PACK_MAX_ROWS + 1, lin.FP32_COMPUTE_MIN_ROWS])  # each side of the thresholds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_agrees_with_the_dequantized_matmul(rows: int, dtype: torch.dtype) -> None:
    layer = _layer(96, 64, bias=True, seed=2)
    layer.quantize_int8()
    layer.bias.data = layer.bias.data.to(dtype)  # a bf16 model's bias is bf16
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    w = layer.qweight.float() * layer.scale[:, None]
    want = x.float() @ w.T + layer.bias.float()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = {torch.float32: (1e-4, 2e-3), torch.bfloat16: (2e-2, 1e-1)}[dtype]  # fp32: int16 x in the kernel
    torch.testing.assert_close(got.float(), want, rtol=tol[0], atol=tol[1])
    # the generic dequantizing path (what CUDA, and CPUs without the kernel, run) gives the same
    generic = int8_linear(x.float().unsqueeze(0), layer.qweight, layer.scale, layer.bias.float())  # 3-d: generic
    torch.testing.assert_close(generic.squeeze(0), want, rtol=tol[0], atol=tol[1])
