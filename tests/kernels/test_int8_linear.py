"""Weight-only int8 linear layers: quantized per row, packed for kernels/cpu/packed_gemm.cpp where it runs, and every path
(the packed kernel, torch's int8 matmul, the dequantized matmul) against the dequantized weight."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.layers import linear as lin
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear, int8_linear, quantize_rows


def _layer(out_f: int, in_f: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    layer = Linear(in_f, out_f, bias=bias)
    layer.weight.data = torch.randn(out_f, in_f, generator=g)
    if bias:
        layer.bias.data = torch.randn(out_f, generator=g)
    return layer


def test_quantize_rows_rounds_each_row_to_its_own_scale() -> None:
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert torch.equal(q.abs().amax(dim=1), torch.full((6,), 127, dtype=torch.int8))  # each row's max
    torch.testing.assert_close(scale, w.abs().amax(dim=1) / 127)
    # round to nearest: every weight within half a step of its row's grid
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("packed", [True, False])
def test_quantize_int8_packs_where_the_kernel_runs(packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if packed and not native.int8w_usable():
        pytest.skip("the packed GEMM needs the extension and a CPU with AVX-512 or AVX2")
    monkeypatch.setattr(lin, "int8_packed_ok", lambda weight: packed)
    layer = _layer(37, 40, bias=False)
    q, _ = quantize_rows(layer.weight)
    layer.quantize_int8()
    assert layer.weight is None and (layer.int8_packed is not None) == packed and (layer.qweight is not None) != packed
    if packed:
        assert torch.equal(layer.int8_packed, native.w8a8_pack(q))
    else:
        assert torch.equal(layer.qweight, q)


# each side of the torch paths' thresholds, and of the packed kernel's widened path (96 rows)
@pytest.mark.parametrize("rows", [1, 5, lin.INT8PACK_MAX_ROWS, lin.INT8PACK_MAX_ROWS + 1, lin.FP32_COMPUTE_MIN_ROWS,
                                  130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False])
def test_every_path_agrees_with_the_dequantized_matmul(rows: int, dtype: torch.dtype, packed: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if packed and not native.int8w_usable():
        pytest.skip("the packed GEMM needs the extension and a CPU with AVX-512 or AVX2")
    monkeypatch.setattr(lin, "int8_packed_ok", lambda weight: packed)
    layer = _layer(96, 64, bias=True, seed=2)
    w = torch.mul(*(lambda q, s: (q.float(), s[:, None]))(*quantize_rows(layer.weight)))
    layer.quantize_int8()
    layer.bias.data = layer.bias.data.to(dtype)  # a bf16 model's bias is bf16
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = x.float() @ w.T + layer.bias.float()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = {torch.float32: (1e-4, 2e-3), torch.bfloat16: (2e-2, 1e-1)}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol[0], atol=tol[1])
    if not packed:  # the generic dequantizing path (what CUDA runs) gives the same
        generic = int8_linear(x.float().unsqueeze(0), layer.qweight, layer.scale, layer.bias.float())  # 3-d: generic
        torch.testing.assert_close(generic.squeeze(0), want, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("packed", [True, False])
def test_int8_embedding_looks_up_and_projects_the_same_rows(packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if packed and not native.int8w_usable():
        pytest.skip("the packed GEMM needs the extension and a CPU with AVX-512 or AVX2")
    import llmserve.layers.embedding as emb_module

    monkeypatch.setattr(emb_module, "int8_packed_ok", lambda weight: packed)
    emb = VocabEmbedding(50, 37)  # 50 rows: a partial last block of 16; 37 columns: a padded group of 4
    emb.weight.data = torch.randn(50, 37, generator=torch.Generator().manual_seed(4)).bfloat16()
    q, scale = quantize_rows(emb.weight)
    emb.quantize_int8()
    assert emb.weight is None and (emb.head_int8_packed is not None) == packed
    ids = torch.tensor([0, 15, 16, 49, 3, 3])
    assert torch.equal(emb(ids), (q[ids].float() * scale[ids, None]).bfloat16())
    hidden = torch.randn(4, 37).bfloat16()
    want = hidden.float() @ (q.float() * scale[:, None]).T
    torch.testing.assert_close(emb.logits(hidden), want, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_quantize_rows_gives_the_torch_bytes(dtype: torch.dtype) -> None:
    if native.load() is None:
        pytest.skip("needs the extension")
    g = torch.Generator().manual_seed(5)
    w = torch.randn(70, 301, generator=g) * torch.rand(70, 1, generator=g) * 3
    w[3] = 0  # an all-zero row: the 1e-12 floor
    w[4, :] = torch.arange(301) - 150.0  # max 150: many values land on exact half steps (ties round to even)
    w[5, :] = 1e-20  # tiny: the floor again, every value rounds to 0
    w = w.to(dtype)
    q, scale = native.quantize_rows_int8(w)
    q_ref, scale_ref = lin.quantize_rows_torch(w)
    assert torch.equal(scale, scale_ref) and torch.equal(q, q_ref)
    assert torch.equal(lin.quantize_rows(w)[0], q_ref)  # the layers use the native pass on CPU


@pytest.mark.skipif(not (native.int8w_a16_usable() and native.w8a8_amx_usable()), reason="needs VNNI and AMX-INT8")
@pytest.mark.parametrize("n, k", [(40, 64), (200, 576), (33, 1536), (96, 640), (64, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tiles_give_the_vnni_bits(n: int, k: int, dtype: torch.dtype) -> None:
    """int8w_gemm's 16-bit activations on AMX-INT8 tiles (each as a high and a low byte, two int8 products) sum the
    same int32 chunks as vpdpwssd: the same bits at every row count, with a bias, over partial blocks (n % 16), a last
    partial chunk of 256 columns (k = 640) and rows past a tile's 16; k = 100 (not a multiple of 64) stays on VNNI."""
    gen = torch.Generator().manual_seed(n + k)
    qweight, scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    packed = native.w8a8_pack(qweight)
    bias = torch.randn(n, generator=gen)
    for rows in (1, 15, 16, 17, 40, 300):
        x = (torch.randn(rows, k, generator=gen) * 4).to(dtype)
        x[0, :7] = 0
        vnni = native.int8w_gemm(x, packed, scale, bias, amx_rows=0)
        tiles = native.int8w_gemm(x, packed, scale, bias, amx_rows=1)
        assert torch.equal(vnni, tiles), (rows, (vnni.float() - tiles.float()).abs().max().item())
