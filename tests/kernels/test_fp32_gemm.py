"""fp32 GEMM on packed weights (kernels/cpu/packed_gemm.cpp, fp32_pack / fp32_gemm): an fp32 model's linears on CPUs
with AVX2 and FMA, where calibration measures it faster than oneDNN (kernels/calibrate.py, fp32_linear)."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native

pytestmark = pytest.mark.skipif(not native.fp32_gemm_usable(),
                                reason="fp32_gemm needs the extension and a CPU with AVX2 and FMA")


def _fma_in_order(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic, step by step: each output acc = fma(x[k], w[k], acc) for k = 0, 1, ... from 0, rounded
    to fp32 at every step, then + bias in fp32. An fp32 product is exact in fp64 and the sum is rounded to fp64 and then
    to fp32 (a double rounding that differs from one rounding only where the fp64 sum lands exactly on a midpoint of
    two fp32 values: fixed seeds make the comparison deterministic)."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    xd, wd = x.double(), w.double()
    for k in range(x.shape[1]):
        acc = (xd[:, k, None] * wd[None, :, k] + acc.double()).float()
    return acc if bias is None else acc + bias.float()


# every tile (1 row x 1-4 blocks, 2 x 1-2, 3-6 x 1), N not a multiple of 16, K of any width, more rows than a work
# chunk (240)
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (1, 5, 1), (1, 17, 40), (1, 20, 30), (1, 9, 32),
                                             (1, 33, 50), (2, 101, 33), (2, 64, 48), (2, 30, 16),
                                             (3, 1536, 20), (4, 37, 17), (5, 64, 16), (6, 7, 70), (13, 202, 100),
                                             (250, 70, 90)])
@pytest.mark.parametrize("bias", [False, True])
def test_each_output_is_the_in_order_fma_sum(rows: int, in_f: int, out_f: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + in_f)
    x = torch.randn(rows, in_f, generator=g)
    w = torch.randn(out_f, in_f, generator=g)
    b = torch.randn(out_f, generator=g) if bias else None
    got = native.fp32_gemm(x, native.fp32_pack(w), out_f, b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_f)
    assert torch.equal(got, _fma_in_order(x, w, b))


def test_exact_where_every_product_and_sum_is() -> None:
    """Small integers: every product and partial sum is exact in fp32, so the result is the integer product: each
    output reads its own weight row and every column of x, whatever tile it lands in."""
    g = torch.Generator().manual_seed(1)
    for rows, in_f, out_f in ((1, 300, 70), (2, 33, 130), (7, 129, 31), (241, 40, 18)):
        x = torch.randint(-8, 9, (rows, in_f), generator=g)
        w = torch.randint(-8, 9, (out_f, in_f), generator=g)
        b = torch.randint(-100, 100, (out_f,), generator=g)
        got = native.fp32_gemm(x.float(), native.fp32_pack(w.float()), out_f, b.double())
        assert torch.equal(got, (x @ w.T + b).float())


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    """The engine's tokens never depend on the batch: every row alone, and in batches cut at every tile size, gives
    the bits it gives in one batch of 300 rows (two work chunks)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 576, generator=g) * 0.05
    x = torch.randn(300, 576, generator=g)
    b = torch.randn(200, generator=g)
    packed = native.fp32_pack(w)
    whole = native.fp32_gemm(x, packed, 200, b)
    start = 0
    for size in (1, 2, 3, 4, 5, 6, 7, 12, 13, 30, 64, 153):
        assert torch.equal(native.fp32_gemm(x[start:start + size], packed, 200, b), whole[start:start + size]), size
        start += size
    assert start == 300


def test_pack_layout() -> None:
    """[ceil(N / 16), K, 16, 1]: block b, column k, lane r holds w[16 b + r, k]; zero past N."""
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    p = native.fp32_pack(w)
    assert p.shape == (2, 3, 16, 1) and p.dtype == torch.float32
    assert torch.equal(p[0, :, :, 0], w[:16].T)
    assert torch.equal(p[1, :, :4, 0], w[16:].T)
    assert not p[1, :, 4:].any()


def test_bad_arguments_are_refused() -> None:
    w = torch.randn(32, 8)
    packed = native.fp32_pack(w)
    with pytest.raises(RuntimeError, match="fp32_pack: weight must be fp32"):
        native.fp32_pack(w.bfloat16())
    with pytest.raises(RuntimeError, match="x must be fp32"):
        native.fp32_gemm(torch.randn(2, 8).bfloat16(), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.fp32_gemm(torch.randn(2, 9), packed, 32, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.fp32_gemm(torch.randn(2, 8), packed, 40, None)
    with pytest.raises(RuntimeError, match="packed must be fp32_pack"):
        native.fp32_gemm(torch.randn(2, 8), native.bf16_pack(w.bfloat16()) if native.packed_gemm_usable()
                         else torch.zeros(2, 4, 16, 2), 32, None)
    with pytest.raises(RuntimeError, match="bias"):
        native.fp32_gemm(torch.randn(2, 8), packed, 32, torch.zeros(31))
    assert native.fp32_gemm(torch.randn(0, 8), packed, 32, None).shape == (0, 32)
