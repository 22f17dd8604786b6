"""Weight-only int8 GEMM (kernels/cpu/packed_gemm.cpp, int8w_gemm): x in fp32/bf16 times int8 weights packed by w8a8_pack,
times a per-row scale; x quantized to int16 per row and summed in int32 (a16: VNNI on AVX-512, vpmaddwd on AVX2-only
CPUs, the same bits), or kept in fp32 and summed by FMAs (AVX-512); and the w8a8 LM head that uses it."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.layers.linear import quantize_rows

pytestmark = pytest.mark.skipif(not native.int8w_usable(),
                                reason="the packed GEMM needs the extension and a CPU with AVX-512 or AVX2")

# 16-bit activations: VNNI on AVX-512 CPUs, and the only path on CPUs with AVX2 but not AVX-512
A16_RUNS = native.int8w_a16_usable() or not native.packed_gemm_usable()
PATHS = [pytest.param(False, marks=pytest.mark.skipif(not native.packed_gemm_usable(),
                                                      reason="fp32 activations need AVX-512")),
         pytest.param(True, marks=pytest.mark.skipif(not A16_RUNS, reason="16-bit activations need AVX512-VNNI "
                                                                          "on a CPU with AVX-512"))]


def _exact(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = (x.double() @ q.double().T) * scale.double()
    return y + bias.double() if bias is not None else y


def _quantized_a16(x: torch.Tensor) -> torch.Tensor:
    """x as the a16 path sees it: each row rounded to int16 steps of its max |x| / 32767 (half to even)."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / 32767
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(xf / s).clamp(-32767, 32767).double() * s.double())


# every register tile shape (1-6 rows by 1-4 blocks), K not a multiple of 4 (a padded group), N not a multiple of
# 16, more rows than a work chunk (240), and chunks of >= 24 rows (weights widened once per chunk)
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (2, 101, 33), (3, 1536, 576), (4, 37, 17), (5, 64, 16),
                                             (6, 7, 70), (13, 202, 100), (40, 130, 50), (130, 576, 260),
                                             (487, 70, 90)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("a16", PATHS)
def test_kernel_is_the_exact_product_rounded_once(rows: int, in_f: int, out_f: int, dtype: torch.dtype,
                                                  bias: bool, a16: bool) -> None:
    g = torch.Generator().manual_seed(rows + in_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    x[0, 0] = 40.0  # an outlier column sets the row's int16 step
    q, scale = quantize_rows(torch.randn(out_f, in_f, generator=g))
    b = torch.randn(out_f, generator=g) if bias else None
    got = native.int8w_gemm(x, native.w8a8_pack(q), scale, b, a16=a16)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    # a16: exact int32 sums of the int16-rounded x; fp32: fp32 products and sums (another order than the double
    # reference); then one rounding to x's dtype
    want = _exact(_quantized_a16(x) if a16 else x, q, scale, b)
    tol = dict(rtol=2e-5, atol=2e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    if a16:  # and within the int16 rounding's bound of the product of x itself: half a step per column
        step = x.float().abs().amax(dim=1).double() / 32767
        bound = 0.5 * step[:, None] * (q.double().abs() * scale.double()[:, None]).sum(1)[None, :]
        exact = _exact(x, q, scale, b)
        assert ((got.double() - exact).abs() <= bound + tol["rtol"] * exact.abs() + tol["atol"]).all()


def _a16_bits(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The a16 path's result, bit for bit, in torch: x rounded to int16 per row (fp32 division, half to even), each
    256-column chunk's exact integer sum converted to fp32, the chunks added in fp32 in column order, then * x's
    scale, * the weight's scale, + bias (fp32, no fused multiply-add), rounded once to x's dtype."""
    xf = x.float()
    s = xf.abs().amax(dim=1) / 32767
    s = torch.where(s > 0, s, torch.ones_like(s))
    xq = torch.round(xf / s[:, None]).clamp(-32767, 32767).double()
    acc = None
    for c0 in range(0, x.shape[1], 256):  # each chunk's sum is an integer below 2^31: exact in double
        c = (xq[:, c0:c0 + 256] @ q[:, c0:c0 + 256].double().T).float()
        acc = c if acc is None else acc + c
    y = acc * s[:, None] * scale
    return (y + bias.float() if bias is not None else y).to(x.dtype)


# the paths that quantize x to int16 on this machine: VNNI (1; AMX-INT8 tiles from 16 rows where the CPU has them) on
# AVX-512 CPUs, and the AVX2 one (2), which any CPU with AVX2 runs
A16_PATHS = ([1] if native.int8w_a16_usable() else []) + ([2] if native.int8w_usable() else [])


@pytest.mark.skipif(not A16_PATHS, reason="16-bit activations need AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (2, 101, 33), (3, 1536, 576), (5, 7, 70), (7, 100, 40),
                                             (40, 640, 50), (487, 70, 90)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a16_bits_are_the_reference_steps(rows: int, in_f: int, out_f: int, dtype: torch.dtype) -> None:
    """Every 16-bit path (VNNI, AMX-INT8 tiles, AVX2's vpmaddwd) gives exactly _a16_bits: so the int8 linears of a
    model quantized with --quantization int8 compute the same on an AVX2-only CPU as on a Xeon, at any batch (tiles of
    1-4 rows by 1-2 blocks, a padded last group, 100 columns: a last piece of 4 in the AVX2 quantizer, N past a block,
    chunks of 256 columns, 40 rows of 640 columns: AMX-INT8's tiles where the CPU has them)."""
    g = torch.Generator().manual_seed(rows * 7 + in_f)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    x[-1, -1] = -33.0
    q, scale = quantize_rows(torch.randn(out_f, in_f, generator=g))
    b = torch.randn(out_f, generator=g)
    packed = native.w8a8_pack(q)
    for bias in (None, b):
        want = _a16_bits(x, q, scale, bias)
        for path in A16_PATHS:
            assert torch.equal(native.int8w_gemm(x, packed, scale, bias, a16=path), want), path


@pytest.mark.skipif(native.packed_gemm_usable(), reason="a CPU with AVX2 but not AVX-512")
def test_avx2_refuses_fp32_activations() -> None:
    q, scale = quantize_rows(torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="a16=0.*AVX-512"):
        native.int8w_gemm(torch.zeros(1, 16), native.w8a8_pack(q), scale, None, a16=False)


@pytest.mark.skipif(not A16_RUNS, reason="16-bit activations need AVX512-VNNI on a CPU with AVX-512")
@pytest.mark.parametrize("rows", [3, 30])  # weights widened per register tile, and once per chunk of rows
def test_a16_int32_sums_do_not_overflow(rows: int) -> None:
    """Every product at its largest, all of one sign, over 4,100 columns: 4,100 * 127 * 32,767 is 8x int32's range, so
    the sums must be carried in fp32 between 256-column chunks."""
    k = 4100
    x = torch.full((rows, k), 2.5)
    q = torch.full((20, k), 127, dtype=torch.int8)
    q[1] = -127
    scale = torch.full((20,), 0.01)
    got = native.int8w_gemm(x, native.w8a8_pack(q), scale, None, a16=True)
    want = _exact(x, q, scale, None)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("a16", PATHS)
def test_rows_do_not_depend_on_each_other(a16: bool) -> None:
    """300 rows run chunks of 150 and 30 rows one chunk (both with the weights widened once per chunk), one row the
    smallest tile (widening in registers): the same sums in the same order, so a request's logits do not depend on its
    batch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 1100, generator=g).bfloat16()  # 1,100 columns: three int32 chunks on the a16 path
    q, scale = quantize_rows(torch.randn(50, 1100, generator=g))
    packed = native.w8a8_pack(q)
    full = native.int8w_gemm(x, packed, scale, None, a16=a16)
    for i in (0, 151, 299):
        assert torch.equal(native.int8w_gemm(x[i:i + 1], packed, scale, None, a16=a16)[0], full[i])
    assert torch.equal(native.int8w_gemm(x[:30], packed, scale, None, a16=a16), full[:30])


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
        assert head.head_int8_packed is not None and head.matmul is None and head.packed is None
        # the lookup of a tied table keeps the plain weight; an untied head drops it
        assert (head.weight is not None) == (model.lm_head is None)
        hidden = torch.randn(3, model.config.hidden_size).bfloat16()
        ids = torch.arange(head.vocab_size)  # every row, unpacked: block n // 16, lane n % 16
        w = head.head_int8_packed[ids // 16, :, ids % 16].flatten(1)[:, :head.hidden_size].float() * head.scale[:, None]
        torch.testing.assert_close(head.logits(hidden), (hidden.float() @ w.T).bfloat16().float(), rtol=2e-2, atol=5e-2)
        out = pipe([{"input_ids": [5, 6, 7]}], max_new_tokens=4, ignore_eos=True, temperature=0, do_preprocess=False)
        assert len(out[0].token_ids) == 4
