"""bf16 matrix-vector linear (csrc/bf16_linear.cpp): the fp32-summed product rounded to bf16, and the layers
that route decode-sized batches to it."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention import native
from llmserve.layers import linear as lin
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear

pytestmark = pytest.mark.skipif(not native.bf16_linear_usable(),
                                reason="the bf16 kernel needs the extension and a CPU with AVX512-BF16")


def _ulps_apart(got: torch.Tensor, want_fp32: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps (at the wanted value's magnitude) got is from the exact fp32 sum."""
    step = want_fp32.abs().clamp(min=1e-30) * 2.0 ** -7
    return (got.float() - want_fp32).abs() / step


@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (2, 100, 33), (3, 1536, 576), (4, 37, 17), (5, 64, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_fp32_sum_rounded_to_bf16(rows: int, in_f: int, out_f: int, bias: bool) -> None:
    # Tails: K not a multiple of 32, N not a multiple of 16; 3 and 5 rows: a one-row pass after pairs.
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    got = native.bf16_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
    want = x.float() @ w.float().T + (b.float() if bias else 0)  # products of bf16 are exact in fp32
    # one rounding to bf16 (half a step), plus fp32 sums in another order; far from a bf16 matmul's own error
    assert (_ulps_apart(got, want) <= 0.51).float().mean() > 0.99
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


def test_rows_do_not_depend_on_each_other() -> None:
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(4, 300, generator=g).bfloat16(), torch.randn(50, 300, generator=g).bfloat16()
    together = native.bf16_linear(x, w, None)
    for i in range(4):
        assert torch.equal(together[i], native.bf16_linear(x[i:i + 1], w, None)[0])


def test_refuses_what_it_cannot_take() -> None:
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="x must be bf16"):
        native.bf16_linear(torch.randn(1, 16), w, None)
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        native.bf16_linear(torch.randn(1, 16).bfloat16(), w.t().contiguous().t(), None)


@pytest.mark.parametrize("rows", [1, lin.BF16_GEMV_MAX_ROWS, lin.BF16_GEMV_MAX_ROWS + 1])
def test_linear_routes_few_rows_to_the_kernel(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = Linear(96, 40, bias=True)
    g = torch.Generator().manual_seed(0)
    layer.weight.data, layer.bias.data = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(40).bfloat16()
    layer.pack_for_cpu()
    if layer.weight is None:
        pytest.skip("this CPU frees the plain bf16 weight (AMX): the kernel has nothing to read")
    calls = []
    monkeypatch.setattr(native, "bf16_linear", lambda *a: calls.append(a) or native._module.bf16_linear(*a))
    x = torch.randn(rows, 96, generator=g).bfloat16()
    got = layer(x)
    assert len(calls) == (rows <= lin.BF16_GEMV_MAX_ROWS)
    torch.testing.assert_close(got.float(), x.float() @ layer.weight.float().T + layer.bias.float(),
                               rtol=8e-3, atol=1e-2)


def test_tied_lm_head_uses_the_kernel_for_a_decode_row(monkeypatch: pytest.MonkeyPatch) -> None:
    emb = VocabEmbedding(300, 64)
    emb.weight.data = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    emb.pack_for_cpu(keep_plain=True)
    calls = []
    monkeypatch.setattr(native, "bf16_linear", lambda *a: calls.append(a) or native._module.bf16_linear(*a))
    h = torch.randn(1, 64).bfloat16()
    logits = emb.logits(h)
    assert calls and logits.dtype == torch.float32 and logits.shape == (1, 300)
    torch.testing.assert_close(logits, (h.float() @ emb.weight.float().T), rtol=8e-3, atol=1e-2)
