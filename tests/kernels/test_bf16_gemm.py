"""bf16 GEMM (kernels/cpu/packed_gemm.cpp): the fp32-summed product rounded once to bf16, at any batch size, and the layers
that use it (bf16 weights on a CPU with AVX-512 and no AMX)."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear, bf16_gemm_ok

pytestmark = pytest.mark.skipif(not native.packed_gemm_usable(),
                                reason="the bf16 GEMM needs the extension and a CPU with AVX-512")


def _ulps_apart(got: torch.Tensor, want_fp32: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps (at the wanted value's magnitude) got is from the exact fp32 sum."""
    step = want_fp32.abs().clamp(min=1e-30) * 2.0 ** -7
    return (got.float() - want_fp32).abs() / step


# every register tile shape (1-6 rows by 1-4 blocks of 16 outputs), K odd (a padded pair), N not a multiple of 16,
# and more rows than one work chunk (240)
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (2, 100, 33), (3, 1536, 576), (4, 37, 17), (5, 64, 16),
                                             (6, 7, 70), (13, 200, 100), (64, 576, 1030), (487, 70, 90)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_fp32_sum_rounded_to_bf16(rows: int, in_f: int, out_f: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    packed = native.bf16_pack(w)
    assert packed.shape == (-(-out_f // 16), -(-in_f // 2), 16, 2)
    got = native.bf16_gemm(x, packed, out_f, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
    want = x.float() @ w.float().T + (b.float() if bias else 0)  # products of bf16 are exact in fp32
    # one rounding to bf16 (half a step), plus fp32 sums in another order; far from a bf16 matmul's own error
    assert (_ulps_apart(got, want) <= 0.51).float().mean() > 0.99
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


def test_no_rows() -> None:
    got = native.bf16_gemm(torch.empty(0, 16).bfloat16(), native.bf16_pack(torch.randn(8, 16).bfloat16()), 8, None)
    assert got.shape == (0, 8) and got.dtype == torch.bfloat16


def test_pack_layout() -> None:
    w = torch.arange(20 * 5, dtype=torch.float32).reshape(20, 5).bfloat16()
    padded = torch.zeros(32, 6).bfloat16()
    padded[:20, :5] = w
    assert torch.equal(native.bf16_pack(w), padded.view(2, 16, 3, 2).transpose(1, 2))


def test_rows_do_not_depend_on_each_other() -> None:
    """Each output is summed over k in order whatever tile computes it (300 rows: chunks of 150 on the widened path;
    one row: registers only), so a request's logits do not depend on its batch."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(300, 300, generator=g).bfloat16(), torch.randn(50, 300, generator=g).bfloat16()
    packed = native.bf16_pack(w)
    together = native.bf16_gemm(x, packed, 50, None)
    alone = torch.cat([native.bf16_gemm(x[i:i + 1], packed, 50, None) for i in range(0, 300, 37)])
    assert torch.equal(together[::37], alone)


def test_refuses_what_it_cannot_take() -> None:
    packed = native.bf16_pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x must be bf16"):
        native.bf16_gemm(torch.randn(1, 16), packed, 8, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.bf16_gemm(torch.randn(1, 18).bfloat16(), packed, 8, None)
    with pytest.raises(RuntimeError, match="bf16_pack"):
        native.bf16_gemm(torch.randn(1, 16).bfloat16(), torch.randn(8, 16).bfloat16(), 8, None)


@pytest.mark.parametrize("rows", [1, 5, 96, 300])
def test_linear_and_lm_head_use_it_and_keep_one_copy(rows: int) -> None:
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 40, bias=True)
    layer.weight.data, layer.bias.data = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(40).bfloat16()
    if not bf16_gemm_ok(layer.weight):
        pytest.skip("this CPU has AMX: bf16 weights stay with oneDNN")
    w = layer.weight.detach().float()
    layer.pack_for_cpu()
    assert layer.bf16_packed is not None and layer.weight is None and layer.packed is None
    x = torch.randn(2, rows, 96, generator=g).bfloat16()  # 3-d through forward
    got = layer(x)
    assert got.shape == (2, rows, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ w.T + layer.bias.float(), rtol=8e-3, atol=1e-2)

    head = VocabEmbedding(300, 64)
    head.weight.data = torch.randn(300, 64, generator=g).bfloat16()
    table = head.weight.detach().float()
    head.pack_for_cpu(keep_plain=True)  # tied: the lookup keeps the plain table
    assert head.bf16_packed is not None and head.packed is None and head.weight is not None
    h = torch.randn(rows, 64, generator=g).bfloat16()
    logits = head.logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 300)
    assert torch.equal(logits, logits.bfloat16().float())  # the bf16 matmul's output, as HF's lm_head
    torch.testing.assert_close(logits, h.float() @ table.T, rtol=8e-3, atol=1e-2)
