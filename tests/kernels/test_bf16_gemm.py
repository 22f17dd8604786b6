"""bf16 GEMM (kernels/cpu/packed_gemm.cpp, amx_gemm.cpp), by fp32 FMAs, AVX512-BF16 dot products and AMX tiles over the
same packed weight: the fp32-summed product rounded once to bf16, at any batch size, and the layers that use it
(MeasuredMatmul, whichever kernel the measured choice gives each batch size)."""

from __future__ import annotations

import pytest
import torch

from llmserve.kernels import native
from llmserve.kernels.choice import OpChoice, pinned
from llmserve.layers.embedding import VocabEmbedding
from llmserve.layers.linear import Linear

pytestmark = pytest.mark.skipif(not native.packed_gemm_usable(),
                                reason="the bf16 GEMM needs the extension and a CPU with AVX-512")
# fma: fp32 FMAs (every AVX-512 CPU); dot: vdpbf16ps (CPUs with AVX512-BF16); amx: AMX tiles (AMX-BF16, K % 32 == 0)
PATHS = ["fma", pytest.param("dot", marks=pytest.mark.skipif(not native.bf16_dot_usable(),
                                                             reason="the dot path needs AVX512-BF16")),
         pytest.param("amx", marks=pytest.mark.skipif(not native.amx_usable(), reason="the amx path needs AMX-BF16"))]


def _ulps_apart(got: torch.Tensor, want_fp32: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps (at the wanted value's magnitude) got is from the exact fp32 sum."""
    step = want_fp32.abs().clamp(min=1e-30) * 2.0 ** -7
    return (got.float() - want_fp32).abs() / step


# every register tile shape (1-6 rows by 1-4 blocks of 16 outputs), K odd (a padded pair), N not a multiple of 16,
# and more rows than one work chunk (240); amx (K a multiple of 32): one and two A tiles, full and partial, an odd
# number of blocks, more rows than its chunk (256), more than two chunks (its work items then go chunk by chunk), and
# groups of 8 block pairs with an odd block in the last (1,100 rows by 1,000 outputs), and those groups pair by pair
# with a partial last row unit (100 rows)
@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (2, 100, 33), (3, 1536, 576), (4, 37, 17), (5, 64, 16),
                                             (6, 7, 70), (13, 200, 100), (64, 576, 1030), (487, 70, 90),
                                             (17, 96, 48), (33, 64, 40), (100, 64, 1000), (487, 96, 90),
                                             (777, 96, 90), (1100, 64, 1000)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", PATHS)
def test_kernel_is_the_fp32_sum_rounded_to_bf16(rows: int, in_f: int, out_f: int, bias: bool, kernel: str) -> None:
    if kernel == "amx" and in_f % 32:
        pytest.skip("amx takes whole tiles of 32 columns")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_f, generator=g).bfloat16()
    w = torch.randn(out_f, in_f, generator=g).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    packed = native.bf16_pack(w)
    assert packed.shape == (-(-out_f // 16), -(-in_f // 2), 16, 2)
    got = native.bf16_gemm(x, packed, out_f, b, kernel)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_f)
    want = x.float() @ w.float().T + (b.float() if bias else 0)  # products of bf16 are exact in fp32
    # one rounding to bf16 (half a step), plus fp32 sums in another order; far from a bf16 matmul's own error
    assert (_ulps_apart(got, want) <= 0.51).float().mean() > 0.99
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("kernel", PATHS)
def test_no_rows(kernel: str) -> None:
    got = native.bf16_gemm(torch.empty(0, 32).bfloat16(), native.bf16_pack(torch.randn(8, 32).bfloat16()), 8, None,
                           kernel)
    assert got.shape == (0, 8) and got.dtype == torch.bfloat16


def test_pack_layout() -> None:
    w = torch.arange(20 * 5, dtype=torch.float32).reshape(20, 5).bfloat16()
    padded = torch.zeros(32, 6).bfloat16()
    padded[:20, :5] = w
    assert torch.equal(native.bf16_pack(w), padded.view(2, 16, 3, 2).transpose(1, 2))


@pytest.mark.parametrize("kernel", PATHS)
def test_rows_do_not_depend_on_each_other(kernel: str) -> None:
    """Each output is summed over k in order whatever tile computes it (300 rows: chunks of 150 on the widened path;
    one row: registers only; amx: a row in a full tile, a partial one, the first or second A tile; 64 and 100 rows:
    its items pair by pair, each pair's row units together; 800 rows: its work items chunk by chunk), so a request's
    logits do not depend on its batch."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(800, 320, generator=g).bfloat16(), torch.randn(50, 320, generator=g).bfloat16()
    packed = native.bf16_pack(w)
    for rows in (64, 100, 300, 800):
        together = native.bf16_gemm(x[:rows], packed, 50, None, kernel)
        alone = torch.cat([native.bf16_gemm(x[i:i + 1], packed, 50, None, kernel) for i in range(0, rows, 37)])
        assert torch.equal(together[::37], alone)
        cuts = ((0, 5), (5, 40), (40, rows))
        pieces = torch.cat([native.bf16_gemm(x[a:b], packed, 50, None, kernel) for a, b in cuts])
        assert torch.equal(together, pieces)


def test_refuses_what_it_cannot_take() -> None:
    packed = native.bf16_pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(RuntimeError, match="x must be bf16"):
        native.bf16_gemm(torch.randn(1, 16), packed, 8, None)
    with pytest.raises(RuntimeError, match="does not fit"):
        native.bf16_gemm(torch.randn(1, 18).bfloat16(), packed, 8, None)
    with pytest.raises(RuntimeError, match="bf16_pack"):
        native.bf16_gemm(torch.randn(1, 16).bfloat16(), torch.randn(8, 16).bfloat16(), 8, None)
    if native.amx_usable():
        with pytest.raises(RuntimeError, match="multiple of 32"):
            native.bf16_gemm(torch.randn(1, 16).bfloat16(), packed, 8, None, "amx")


def _kernels_here() -> list[str]:
    from llmserve.kernels.calibrate import BF16_LINEAR, available

    return list(available(BF16_LINEAR))


@pytest.mark.parametrize("kernel", ["fma", "dot", "amx", "onednn", "fp32"])
@pytest.mark.parametrize("rows", [1, 5, 96, 300])
def test_linear_and_lm_head_run_the_chosen_kernel_and_keep_only_its_form(kernel: str, rows: int) -> None:
    if kernel not in _kernels_here():
        pytest.skip(f"{kernel} does not run on this machine")
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 40, bias=True)
    layer.weight.data, layer.bias.data = torch.randn(40, 96, generator=g).bfloat16(), torch.randn(40).bfloat16()
    w = layer.weight.detach().float()
    layer.pack_for_cpu(pinned(kernel))
    m = layer.matmul
    assert m is not None and layer.weight is None and layer.packed is None
    # only the form the choice reads: fma, dot and amx share the packed layout
    assert m.weight.dim() == (4 if kernel in native.BF16_PATHS else 2) and m.kernel == kernel
    x = torch.randn(2, rows, 96, generator=g).bfloat16()  # 3-d through forward
    got = layer(x)
    assert got.shape == (2, rows, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), x.float() @ w.T + layer.bias.float(), rtol=8e-3, atol=1e-2)

    head = VocabEmbedding(300, 64)
    head.weight.data = torch.randn(300, 64, generator=g).bfloat16()
    table = head.weight.detach().float()
    head.pack_for_cpu(keep_plain=True, choice=pinned(kernel))  # tied: the lookup keeps the plain table
    assert head.matmul is not None and head.packed is None and head.weight is not None
    h = torch.randn(rows, 64, generator=g).bfloat16()
    logits = head.logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 300)
    assert torch.equal(logits, logits.bfloat16().float())  # the bf16 matmul's output, as HF's lm_head
    torch.testing.assert_close(logits, h.float() @ table.T, rtol=8e-3, atol=1e-2)


@pytest.mark.parametrize("kernel", ["fma", "dot", "amx", "onednn", "fp32"])
def test_one_kernel_runs_every_batch_size(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chosen kernel takes one row and 600 alike (a request's tokens must not depend on its batch); the decoder
    stack is told whether it can run the layer."""
    if kernel not in _kernels_here():
        pytest.skip(f"{kernel} does not run on this machine")
    from llmserve.layers import linear as lin

    layer = Linear(32, 16)
    layer.weight.data = torch.randn(16, 32).bfloat16()
    layer.pack_for_cpu(OpChoice(kernel))
    ran: list[str] = []
    gemm, onednn, fp32 = native.bf16_gemm, lin.onednn_linear, lin.fp32_linear
    monkeypatch.setattr(native, "bf16_gemm", lambda *a: ran.append(a[4]) or gemm(*a))
    monkeypatch.setattr(lin, "onednn_linear", lambda *a: ran.append("onednn") or onednn(*a))
    monkeypatch.setattr(lin, "fp32_linear", lambda *a: ran.append("fp32") or fp32(*a))
    for rows in (1, 4, 5, 600):
        layer(torch.randn(rows, 32).bfloat16())
    assert ran == [kernel] * 4
    assert layer.matmul.packed == (kernel in native.BF16_PATHS)
    layer.pack_for_cpu()  # a second call is a no-op: the plain weight is gone
    assert layer.matmul.kernel == kernel


def test_dot_refuses_where_the_cpu_lacks_it() -> None:
    if native.bf16_dot_usable():
        pytest.skip("this CPU has AVX512-BF16")
    packed = native.bf16_pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(RuntimeError, match="AVX512-BF16"):
        native.bf16_gemm(torch.randn(1, 16).bfloat16(), packed, 8, None, "dot")


@pytest.mark.skipif(not native.amx_usable(), reason="the amx path needs AMX-BF16")
@pytest.mark.parametrize("rows", [1, 17, 40, 100, 300, 1100])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_gate_up_is_silu_mul_of_the_gemm(rows: int, bias: bool) -> None:
    """glu: silu(gate) * up in the amx GEMM's epilogue (the decoder stack's MLP), bit for bit silu_mul of the plain
    GEMM's bf16 output; I = 48 (three blocks: an odd count of pairs) and 400 (groups of 8 pairs, a partial last)."""
    for i in (48, 400):
        g = torch.Generator().manual_seed(rows + i)
        x = (torch.randn(rows, 96, generator=g) * 2).bfloat16()
        w = torch.randn(2 * i, 96, generator=g).bfloat16()
        b = torch.randn(2 * i, generator=g) if bias else None
        packed = native.bf16_pack(w)
        got = native.bf16_gemm(x, packed, 2 * i, b, "amx", glu=True)
        assert got.shape == (rows, i) and got.dtype == torch.bfloat16
        assert torch.equal(got, native.silu_mul(native.bf16_gemm(x, packed, 2 * i, b, "amx")))


@pytest.mark.skipif(not native.amx_usable(), reason="the amx path needs AMX-BF16")
@pytest.mark.parametrize("rows", [1, 40, 600])
def test_amx_rounds_denormals_and_nans_as_the_other_paths(rows: int) -> None:
    """The amx epilogue rounds a row's 32 outputs with one vcvtne2ps2bf16 where the CPU has AVX512-BF16, an instruction
    that reads denormals as zero and keeps a NaN's sign: rows holding either are rounded as before, so every output's
    bits are the fma path's (x zero: each output is its bias exactly, rounded once), torch's for the denormals."""
    special = torch.tensor([1e-39, -3e-39, 2e-45, float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0,
                            -0.0, 1.0, 3.4e38, -1.17e-38])
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(96, generator=g)
    bias[5:5 + special.numel()] = special  # the first pair of blocks: special; the other two: plain values
    x = torch.zeros(rows, 64).bfloat16()
    packed = native.bf16_pack(torch.randn(96, 64, generator=g).bfloat16())
    got, want = (native.bf16_gemm(x, packed, 96, bias, kernel).view(torch.int16) for kernel in ("amx", "fma"))
    assert torch.equal(got, want)
    finite = ~bias.isnan()
    exact = (torch.zeros(96) + bias)[finite]  # the sum's value: 0 + -0 is +0
    assert torch.equal(got[:, finite], exact.bfloat16().view(torch.int16).expand(rows, -1))
    assert (got[:, bias.isnan()] == 0x7FC0).all()  # every NaN as 0x7FC0, whatever its sign


def test_fused_gate_up_is_refused_off_the_amx_path() -> None:
    packed = native.bf16_pack(torch.randn(64, 32).bfloat16())
    with pytest.raises(RuntimeError, match="amx path only"):
        native.bf16_gemm(torch.randn(2, 32).bfloat16(), packed, 64, None, "fma", glu=True)
    if native.amx_usable():
        with pytest.raises(RuntimeError, match="a multiple of 16"):
            native.bf16_gemm(torch.randn(2, 32).bfloat16(), native.bf16_pack(torch.randn(40, 32).bfloat16()), 40,
                             None, "amx", glu=True)
