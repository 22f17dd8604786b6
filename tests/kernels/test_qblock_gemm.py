"""kernels/cpu/qblock_gemm.cpp against torch, for 4-, 5-, 6- and 8-bit codes in groups of 16, 32 and 64: the packed
layout (native packing = torch packing, the high-bit planes where the header says, unpacking = the codes, row
lookups), the int8-activation product (VNNI, or AVX2's maddubs kernel) against the same arithmetic in float64, the
FMA path (AVX-512) against fp32, both against the unquantized-activation product, a row's result independent of its
batch, and the AVX2 kernel's bits equal to VNNI's where a CPU has both."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.layers import quant_blocks as qb

pytestmark = pytest.mark.skipif(not native.qblock_usable(), reason="needs the native kernels (AVX-512, or AVX2)")

# (bits, group, zero, mins, scale dtype): Q4_0, Q4_1, Q8_0, AWQ/GPTQ-like (group 64, fp32 mins), Q5_K, Q6_K, and
# groups of 16 with fp16 scales (widened at packing) and with mins
FORMATS = {
    "q4_0": (4, 32, 8, False, torch.float16),
    "q4_1": (4, 32, 0, True, torch.float16),
    "q8_0": (8, 32, 128, False, torch.float16),
    "g64": (4, 64, 0, True, torch.float32),
    "q5_k": (5, 32, 0, True, torch.float32),
    "q6_k": (6, 16, 32, False, torch.float32),
    "g16_q4": (4, 16, 8, False, torch.float16),
    "g16_q5_mins": (5, 16, 0, True, torch.float32),
}


def _weight(fmt: str, n: int, k: int, seed: int = 0) -> qb.BlockTensor:
    bits, group, zero, mins, dtype = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).to(dtype)
    m = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype) if mins else None
    return qb.BlockTensor(codes, scales, m, bits, group, zero)


def _int8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The VNNI path's arithmetic in float64: x rounded per block of 32 to int8 (max |x| / 127, half to even)."""
    xb = x.double().reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(dim=2, keepdim=True) / 127
    xq = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1)), 0) * d
    return xq.reshape(x.shape) @ w.double().T


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", [(37, 64), (96, 256)])
def test_packing_round_trips(fmt: str, n: int, k: int) -> None:
    t = _weight(fmt, n, k)
    w = qb.BlockWeight(t)
    assert torch.equal(qb.unpack_codes(w.codes, t.bits)[:n], t.codes)
    assert torch.equal(w.dequantize()[:n], t.dequantize())
    ids = torch.tensor([n - 1, 0, 17, 5])
    assert torch.equal(w.rows(ids), t.dequantize()[ids])


@pytest.mark.parametrize("fmt", FORMATS)
def test_native_row_lookup_equals_the_torch_one(fmt: str) -> None:
    """An embedding lookup on the blocks (qblock_rows): every row of a partial last tile, repeats, any order, bit for
    bit the torch ops' values (BlockWeight.rows without the native weight); ids outside the table refused."""
    n, k = 53, 192
    w = qb.BlockWeight(_weight(fmt, n, k))
    ids = torch.cat([torch.arange(n).flip(0), torch.tensor([0, 52, 52, 16, 15])])
    got = w.rows(ids)
    handle, w.native = w.native, None
    want = w.rows(ids)
    w.native = handle
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for bad in (n, -1):
        with pytest.raises(RuntimeError, match="outside"):
            native.qblock_rows(w.native, torch.tensor([0, bad]))


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_native_packing_equals_torch(bits: int, monkeypatch) -> None:
    codes = torch.randint(0, 2 ** bits, (37, 96), dtype=torch.uint8)
    native_packed = qb.pack_codes(codes, bits)
    monkeypatch.setattr(native, "load", lambda: None)
    assert torch.equal(native_packed, qb.pack_codes(codes, bits))


@pytest.mark.parametrize("bits, column, byte, value", [
    (5, 4 * 5 + 2, 256 + 4 * 3 + 2, 1 << 5),  # vector 5's high bit: bit 5 of the plane
    (6, 4 * 6 + 1, 320 + 4 * 3 + 1, 3 << 4),  # vector 6 = 4 * 1 + 2: bits 4-5 of the plane's second vector
])
def test_high_bits_sit_where_the_header_says(bits: int, column: int, byte: int, value: int) -> None:
    codes = torch.zeros(16, 32, dtype=torch.uint8)
    codes[3, column] = 2 ** bits - 16  # high bits only (row 3: lane 3)
    expected = torch.zeros(1, 1, bits * 64, dtype=torch.uint8)
    expected[0, 0, byte] = value
    assert torch.equal(qb.pack_codes(codes, bits), expected)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(fmt: str, m: int, dtype: torch.dtype) -> None:
    n, k = 53, 192  # odd n: a partial tile
    t = _weight(fmt, n, k)
    w = qb.BlockWeight(t)
    dense = t.dequantize()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n)
    exact = x.double() @ dense.double().T + bias.double()
    scale = exact.abs().max().item()
    y = native.qblock_linear(x, w.native, bias, vnni=True) if native.qblock_int8_usable() else None
    if y is not None:
        # int8 activations: the same arithmetic in float64 to fp32 rounding (bf16 output: its rounding)...
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(y.double(), _int8_reference(x, dense) + bias.double(), atol=tol * scale, rtol=0)
        # ... within 2% of the largest output from the unquantized product
        assert (y.double() - exact).abs().max().item() <= 0.02 * scale
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert native.qblock_fma_usable()  # (wherever the kernel runs: AVX-512, or AVX2 and FMA)
    y_fma = native.qblock_linear(x, w.native, bias, vnni=False)
    torch.testing.assert_close(y_fma.double(), exact, atol=tol * scale, rtol=0)
    # the torch reference (CUDA's path): the dequantized weight in one matmul
    torch.testing.assert_close(qb.reference_linear(x, w, bias).double(), exact, atol=tol * scale, rtol=0)


@pytest.mark.parametrize("vnni", [True, False])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q5_k", "q6_k"])
def test_rows_do_not_depend_on_the_batch(fmt: str, vnni: bool) -> None:
    if vnni and not native.qblock_int8_usable():
        pytest.skip("no int8 kernel here")
    w = qb.BlockWeight(_weight(fmt, 80, 160))
    x = torch.randn(64, 160).bfloat16()
    whole = native.qblock_linear(x, w.native, None, vnni=vnni)
    for rows in ([0], [5, 6, 7], list(range(13, 30))):
        assert torch.equal(native.qblock_linear(x[rows], w.native, None, vnni=vnni), whole[rows])


def _avx2_cases(fmt: str, dtype: torch.dtype):
    """(weight, its BlockWeight, bias, x, whether its codes are all at their largest) for the AVX2 kernels' tests: a
    last tile of 5 outputs (one half of 8 lanes), 53 and 600 outputs, rows 1-2 (the streaming tiles), 3, 17 and 300
    (register tiles of 4, partial ones, more than one 240-row chunk); random codes and codes at their largest."""
    for n, k, rows in [(5, 64, (1, 3)), (53, 192, (1, 2, 3, 17)), (600, 256, (300,))]:
        t = _weight(fmt, n, k, seed=n)
        extreme = _weight(fmt, n, k, seed=n)
        extreme.codes.fill_(2 ** t.bits - 1)
        for tensor in (t, extreme):
            w = qb.BlockWeight(tensor)
            bias = torch.randn(n)
            for m in rows:
                yield tensor, w, bias, torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype), \
                    tensor is extreme


@pytest.mark.skipif(not native.qblock_avx2_usable(), reason="needs AVX2")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_kernel_gives_the_int8_arithmetic(fmt: str, dtype: torch.dtype) -> None:
    """The AVX2 kernel (vnni=3; the int8 path of CPUs without AVX-512): exact int32 block sums (vpmaddubsw's int16
    steps never saturate: 4-bit codes eight products a sum, 5-bit four, 6-bit two, 8-bit codes as two nibbles) and
    tile_vnni's fp32 steps. Where VNNI runs too, every output is its bit for bit; everywhere, the float64 arithmetic to
    fp32 rounding, and a row's result does not depend on its batch. Shapes: a last tile of 5 outputs (one half of 8
    lanes), 53 and 600 outputs, rows 1-2 (the streaming tiles), 3, 17 and 300 (register tiles of 4, partial ones,
    more than one 240-row chunk); codes at their extremes (the largest int16 sums) and random."""
    for tensor, w, bias, x, extreme in _avx2_cases(fmt, dtype):
        if extreme:  # rows of activations all 127 or all -127 after rounding: the largest sums
            x = torch.ones_like(x)
            x[1::2] = -1
        y = native.qblock_linear(x, w.native, bias, vnni=3)
        if native.qblock_vnni_usable():
            assert torch.equal(y, native.qblock_linear(x, w.native, bias, vnni=2)), (fmt, w.n, x.shape[0])
        want = _int8_reference(x, tensor.dequantize()) + bias.double()
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(y.double(), want, atol=tol * want.abs().max().item(), rtol=0)
        assert torch.equal(native.qblock_linear(x[-1:], w.native, bias, vnni=3), y[-1:])


@pytest.mark.skipif(not native.qblock_avx2_usable(), reason="needs AVX2")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_fma_kernel_gives_the_fp32_arithmetic(fmt: str, dtype: torch.dtype) -> None:
    """The AVX2 FMA kernel (vnni=4; vnni=0 on CPUs without AVX-512): x unrounded, fp32 FMAs on the widened codes in
    tile_fma's order. Where AVX-512 runs too, every output is its FMA kernel's bit for bit; everywhere, the float64
    product of x and the dequantized weight to fp32 rounding, and a row's result does not depend on its batch. The
    shapes of test_avx2_kernel_gives_the_int8_arithmetic, codes at their largest and random."""
    avx512 = native.packed_gemm_usable()
    for tensor, w, bias, x, _ in _avx2_cases(fmt, dtype):
        y = native.qblock_linear(x, w.native, bias, vnni=4)
        if avx512:  # (vnni=0 runs the AVX-512 kernel there, this one elsewhere)
            assert torch.equal(y, native.qblock_linear(x, w.native, bias, vnni=0)), (fmt, w.n, x.shape[0])
        want = x.double() @ tensor.dequantize().double().T + bias.double()
        tol = 2e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(y.double(), want, atol=tol * want.abs().max().item(), rtol=0)
        assert torch.equal(native.qblock_linear(x[-1:], w.native, bias, vnni=4), y[-1:])


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "g16_q5_mins"])
def test_the_weights_measured_path_runs_by_default(fmt: str) -> None:
    """QBlockWeight.fma (set from calibration's blocks_fma): the default call (vnni=None) runs fp32 FMAs on the codes,
    else int8 activations where they run; an explicit vnni still chooses."""
    w = qb.BlockWeight(_weight(fmt, 40, 96))
    x = torch.randn(6, 96)
    fma = native.qblock_linear(x, w.native, None, vnni=0)
    int8 = native.qblock_linear(x, w.native, None, vnni=1) if native.qblock_int8_usable() else fma
    assert w.native.fma is False
    assert torch.equal(native.qblock_linear(x, w.native, None), int8)
    w.native.fma = True
    assert torch.equal(native.qblock_linear(x, w.native, None), fma)
    if native.qblock_int8_usable():
        assert not torch.equal(fma, int8)  # (two numerics: x rounded to int8 per block, or not)
        assert torch.equal(native.qblock_linear(x, w.native, None, vnni=1), int8)


@pytest.mark.skipif(not native.qblock_amx8_usable(), reason="needs AMX-INT8")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_int8_tiles_give_the_vnni_kernels_bits(fmt: str, dtype: torch.dtype) -> None:
    """From 16 rows, int8 activations run on AMX-INT8 tiles (groups of 32 and more; group 16 stays on VNNI): exact
    int32 block sums and the same fp32 operations, so every output equals VNNI's bit for bit (vnni=2 keeps VNNI).
    Shapes: a partial last row tile (17, 40), more than two chunks of 256 rows (1,100: items chunk by chunk), and 600
    outputs (groups of 8 tiles, a partial last group, a partial last tile); with a bias."""
    for n, k, rows in [(53, 192, (16, 17, 40)), (600, 256, (300, 1100))]:
        w = qb.BlockWeight(_weight(fmt, n, k, seed=n))
        bias = torch.randn(n)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            assert torch.equal(native.qblock_linear(x, w.native, bias, vnni=1),
                               native.qblock_linear(x, w.native, bias, vnni=2))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_widened_once_per_work_unit_give_the_same_bits(fmt: str, dtype: torch.dtype) -> None:
    """From the weight's wide_rows rows, the VNNI kernel widens each work unit's codes once and its register tiles load
    them (8-bit codes have nothing to widen): every output equals the unpacking kernel's bit for bit. Shapes: partial
    row tiles (1, 3, 17), more than one 240-row chunk (500), 53 and 600 outputs (a partial last tile; groups of three
    tiles and a partial one); with a bias, and on VNNI alone (vnni=2) where AMX-INT8 would take the larger batches."""
    if not native.qblock_vnni_usable():
        pytest.skip("no AVX512-VNNI")
    for n, k, rows in [(53, 192, (1, 3, 17)), (600, 256, (40, 500))]:
        t = _weight(fmt, n, k, seed=n)
        w = qb.BlockWeight(t)
        assert w.native.wide_rows == 2 ** 62  # never, until calibration measures it
        bias = torch.randn(n)
        for m in rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            for vnni in (1, 2):
                w.native.wide_rows = 2 ** 62
                unpacked = native.qblock_linear(x, w.native, bias, vnni=vnni)
                w.native.wide_rows = 1
                assert torch.equal(native.qblock_linear(x, w.native, bias, vnni=vnni), unpacked), (n, m, vnni)
    # (and those are the int8 arithmetic's: the last shape, 500 rows, against float64)
    torch.testing.assert_close(unpacked.double(), _int8_reference(x, t.dequantize()) + bias.double(),
                               atol=8e-3 * unpacked.abs().max().item(), rtol=0)


def test_concat_unifies_zero_points_exactly() -> None:
    a, b = _weight("q4_0", 16, 64), _weight("q4_1", 20, 64, seed=1)
    both = qb.concat([a, b])
    assert both.mins is not None and both.mins.dtype == torch.float32
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = _weight("q8_0", 16, 64)  # another bit width: the 4-bit codes widen to 8, exactly
    mixed = qb.concat([a, c])
    assert mixed.bits == 8 and torch.equal(mixed.dequantize(), torch.cat([a.dequantize(), c.dequantize()]))
    with pytest.raises(ValueError, match="different columns"):
        qb.concat([a, _weight("q4_0", 16, 96)])


def test_bad_shapes_are_refused() -> None:
    t = _weight("q4_1", 16, 64)
    with pytest.raises(ValueError, match="a multiple of 32"):
        qb.BlockWeight(qb.BlockTensor(t.codes[:, :48], t.scales[:, :1], t.mins[:, :1], 4, 48))
    with pytest.raises(ValueError, match="the group 16 or a multiple of 32"):
        qb.BlockWeight(qb.BlockTensor(t.codes, t.scales[:, :1], t.mins[:, :1], 4, 8))
    g16 = qb.BlockWeight(_weight("g16_q4", 16, 64))
    assert g16.scales.dtype == torch.float32
    with pytest.raises(RuntimeError, match="group 16 takes fp32 scales"):
        native.qblock_weight(g16.codes, g16.scales.half(), None, 16, 64, 4, 16, 8)
    with pytest.raises(RuntimeError, match="4-, 5-, 6- or 8-bit"):
        native.qblock_weight(g16.codes, g16.scales, None, 16, 64, 7, 16, 8)
    w = qb.BlockWeight(t)
    with pytest.raises(RuntimeError, match="columns"):
        native.qblock_linear(torch.randn(2, 96), w.native, None)
