"""Weight-only int8 GEMM (csrc/packed_gemm.cpp, int8w_gemm): x in fp32/bf16 times int8 weights packed by w8a8_pack,
times a per-row scale, summed in fp32; and the w8a8 LM head that uses it."""

from __future__ import annotations

import pytest
import torch

from llmserve.attention import native
from llmserve.layers.linear import quantize_rows

pytestmark = pytest.mark.skipif(not native.packed_gemm_usable(),
                                reason="the packed GEMM needs the extension and a CPU with AVX-512")


def _exact(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = (x.double() @ q.double().T) * scale.double()
    return y + bias.double() if bias is not None else y


# every register tile shape (1-6 rows by 1-4 blocks), K not a multiple of 4 (a padded group), N not a multiple of
# 16, more rows than a work chunk (240), and chunks of >= 24 rows (weights widened once per chunk)
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (2, 101, 33), (3, 1536, 576), (4, 37, 17), (5, 64, 16),
                                             (6, 7, 70), (13, 202, 100), (40, 130, 50), (130, 576, 260),
                                             (487, 70, 90)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_the_exact_product_rounded_once(rows: int, in_f: int, out_f: int, dtype: torch.dtype,
                                                  bias: bool) -> None:
    g = torch.Generator().manual_seed(rows + in_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    q, scale = quantize_rows(torch.randn(out_f, in_f, generator=g))
    b = torch.randn(out_f, generator=g) if bias else None
    got = native.int8w_gemm(x, native.w8a8_pack(q), scale, b)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    want = _exact(x, q, scale, b)
    # fp32 products and sums (another order than the double reference), then one rounding to x's dtype
    tol = dict(rtol=2e-5, atol=2e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)


def test_rows_do_not_depend_on_each_other() -> None:
    """300 rows run chunks of 150 and 30 rows one chunk on the widened path, one row the registers-only tile: the same
    sums in the same order, so a request's logits do not depend on its batch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 300, generator=g).bfloat16()
    q, scale = quantize_rows(torch.randn(50, 300, generator=g))
    packed = native.w8a8_pack(q)
    full = native.int8w_gemm(x, packed, scale, None)
    for i in (0, 151, 299):
        assert torch.equal(native.int8w_gemm(x[i:i + 1], packed, scale, None)[0], full[i])
    assert torch.equal(native.int8w_gemm(x[:30], packed, scale, None), full[:30])


def test_no_rows_and_refusals() -> None:
    q, scale = quantize_rows(torch.randn(8, 16))
    packed = native.w8a8_pack(q)
    assert native.int8w_gemm(torch.empty(0, 16), packed, scale, None).shape == (0, 8)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        native.int8w_gemm(torch.zeros(1, 16, dtype=torch.float16), packed, scale, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.int8w_gemm(torch.zeros(1, 20), packed, scale, None)
    with pytest.raises(RuntimeError, match="w8a8_pack's"):
        native.int8w_gemm(torch.zeros(1, 16), native.bf16_pack(torch.randn(8, 16).bfloat16()), scale, None)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        native.int8w_gemm(torch.zeros(1, 16), packed, scale.double(), None)
    with pytest.raises(RuntimeError, match="bias"):
        native.int8w_gemm(torch.zeros(1, 16), packed, scale, torch.zeros(7))


@pytest.mark.skipif(not native.w8a8_usable(), reason="w8a8 needs a CPU with AVX-512 and VNNI")
@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_w8a8_lm_head_is_weight_only_int8(tiny_model_dir, arch: str) -> None:
    from llmserve import EngineConfig, pipeline

    with pipeline(tiny_model_dir(arch), backend_config=EngineConfig(dtype="bfloat16", quantization="w8a8",
                                                                     num_blocks=32)) as pipe:
        model = pipe.engine.runner.model
        head = model.model.embed_tokens if model.lm_head is None else model.lm_head
        assert head.head_int8_packed is not None and head.bf16_packed is None and head.packed is None
        # the lookup of a tied table keeps the plain weight; an untied head drops it
        assert (head.weight is not None) == (model.lm_head is None)
        hidden = torch.randn(3, model.config.hidden_size).bfloat16()
        ids = torch.arange(head.vocab_size)  # every row, unpacked: block n // 16, lane n % 16
        w = head.head_int8_packed[ids // 16, :, ids % 16].flatten(1)[:, :head.hidden_size].float() * head.scale[:, None]
        torch.testing.assert_close(head.logits(hidden), (hidden.float() @ w.T).bfloat16().float(), rtol=2e-2, atol=5e-2)
        out = pipe([{"input_ids": [5, 6, 7]}], max_new_tokens=4, ignore_eos=True, temperature=0, do_preprocess=False)
        assert len(out[0].token_ids) == 4
