"""kernels/triton/qblock.py (CUDA's GEMM over block-quantized weights) against the torch reference (the weight
dequantized, one matmul), and BlockWeight.linear's choice of it.

On CUDA it runs compiled; without CUDA under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported) on CPU tensors, which checks the same byte order, nibble shifts, group scales, masks and split-K sums.
The interpreter rounds fp32 to bf16 by truncation (CUDA rounds to nearest), hence bf16's looser tolerance.
Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from llmserve.kernels.triton import qblock  # noqa: E402
from llmserve.layers import quant_blocks as qb  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (bits, group, zero, mins, scale dtype): GGUF Q4_0 and Q8_0 (zero points, fp16 scales), AWQ 4-bit / group 64 and
# GPTQ 8-bit / group 128 (fp32 mins)
FORMATS = {
    "q4_0": (4, 32, 8, False, torch.float16),
    "awq4_g64": (4, 64, 0, True, torch.float32),
    "q8_0": (8, 32, 128, False, torch.float16),
    "gptq8_g128": (8, 128, 0, True, torch.float32),
}
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # |y - reference| / |reference|


def _weight(fmt: str, n: int, k: int, seed: int = 0, perm: bool = False) -> qb.BlockWeight:
    bits, group, zero, mins, dtype = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.002).to(dtype)
    m = (torch.randn(n, k // group, generator=gen) * 0.05).to(dtype) if mins else None
    order = torch.randperm(k, generator=gen) if perm else None
    return qb.BlockWeight(qb.BlockTensor(codes, scales, m, bits, group, zero, order), DEVICE)


def _check(w: qb.BlockWeight, m: int, dtype: torch.dtype, bias: bool, splits: int | None = None,
           seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, w.k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(w.n, generator=gen).to(DEVICE) if bias else None
    got = qblock.qblock_linear(w.gather(x), w, b, splits)
    want = qb.reference_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, w.n)
    assert torch.isfinite(got).all()
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_reference(fmt: str, m: int, dtype: torch.dtype) -> None:
    """n = 40: two and a half tiles of 16 rows, under one 64-row program (masked rows); M = 33: a tail of a 64-row
    tile; a bias where M != 5."""
    _check(_weight(fmt, 40, 256), m, dtype, bias=m != 5)


@pytest.mark.parametrize("fmt", ["q4_0", "gptq8_g128"])
@pytest.mark.parametrize("m, splits", [(1, 2), (5, 3), (1, 16)])
def test_split_k(fmt: str, m: int, splits: int) -> None:
    """k split over programs (decode), partial sums added with the bias after; 16 asks for more splits than k has
    steps, which the plan caps."""
    _check(_weight(fmt, 24, 512, seed=2), m, torch.float16, bias=True, splits=splits)


def test_prefill_tiles_and_fp32() -> None:
    """M = 130: 128-row tiles with BLOCK_K 64 (two programs over M, one a tail of 2 rows), n = 200 over two 128-row
    programs; and fp32 x (IEEE products, no TF32)."""
    w = _weight("awq4_g64", 200, 256, seed=3)
    _check(w, 130, torch.bfloat16, bias=True)
    _check(w, 7, torch.float32, bias=True)


@pytest.mark.parametrize("fmt", ["awq4_g64", "q8_0"])
def test_act_order_gathered_x(fmt: str) -> None:
    """Codes stored in another column order (GPTQ act-order): x gathered by perm, then the kernel, equals the
    reference over the weight in its own order."""
    _check(_weight(fmt, 40, 256, seed=4, perm=True), 5, torch.float16, bias=False)


def test_plan() -> None:
    cpu = torch.device("cpu")
    assert qblock.plan(1, 4096, 4096, 128, cpu) == qblock.Plan(16, 64, 128, 1, 4, 4)  # one "SM": no split
    assert qblock.plan(1, 4096, 4096, 32, cpu, splits=5).block_k == 32
    # 8 steps asked into 3 splits: 3 steps each, so 3 splits (no empty one); more splits than steps: one a step
    assert qblock.plan(1, 64, 256, 32, cpu, splits=3).splits == 3
    assert qblock.plan(1, 64, 256, 32, cpu, splits=100).splits == 8
    assert qblock.plan(1, 64, 256, 32, cpu, splits=6).splits == 4  # ceil(8 / 6) = 2 steps each: 4 splits
    big = qblock.plan(1000, 4096, 4096, 128, cpu)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps) == (128, 128, 64, 8)
    if CUDA:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert qblock.plan(1, 4096, 4096, 128, DEVICE).splits == min(16, 32, -(-2 * sms // 64))


def test_linear_runs_it_only_on_cuda(monkeypatch) -> None:
    """BlockWeight.linear: the Triton kernel for CUDA weights, unless LLMSERVE_QBLOCK_TRITON=0 pins the reference;
    never for CPU weights."""
    # (the CPU weight without the CPU extension: on a GPU machine its build ran past the test's 60 s on an H100;
    # whether Triton serves a weight does not depend on it)
    monkeypatch.setattr(qb.native, "load", lambda: None)
    monkeypatch.setattr(qb.native, "qblock_usable", lambda: False)
    assert _weight_on("cpu").triton is None
    monkeypatch.undo()
    if not CUDA:
        return
    assert _weight_on("cuda").triton is qblock.qblock_linear
    monkeypatch.setenv("LLMSERVE_QBLOCK_TRITON", "0")
    assert _weight_on("cuda").triton is None


def _weight_on(device: str) -> qb.BlockWeight:
    codes = torch.zeros(16, 64, dtype=torch.uint8)
    return qb.BlockWeight(qb.BlockTensor(codes, torch.ones(16, 2), None, 4, 32, 8), device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k, m", [(4104, 4096, 1), (1000, 2048, 7), (4096, 1024, 300), (136, 8192, 2)])
def test_cuda_shapes_through_linear(fmt: str, n: int, k: int, m: int, monkeypatch) -> None:
    """Model-sized shapes on CUDA through BlockWeight.linear (the default split-K choice), against the reference
    path pinned by LLMSERVE_QBLOCK_TRITON=0, in bf16 and fp16."""
    w = _weight(fmt, n, k, seed=5)
    assert w.triton is not None
    monkeypatch.setenv("LLMSERVE_QBLOCK_TRITON", "0")
    ref = _weight(fmt, n, k, seed=5)
    assert ref.triton is None
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, m, k, device=DEVICE).to(dtype)
        bias = torch.randn(n, device=DEVICE, dtype=dtype)
        got, want = w.linear(x, bias), ref.linear(x, bias)
        assert got.shape == (2, m, n) and got.dtype == dtype
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < TOL[dtype], err


@pytest.mark.skipif(CUDA, reason="on CUDA tests/models/test_awq_gptq.py runs the model compiled")
@pytest.mark.parametrize("method, act_order, dtype", [("awq", False, "float16"), ("gptq", True, "bfloat16")])
def test_model_end_to_end_in_the_interpreter(method: str, act_order: bool, dtype: str, tmp_path, monkeypatch) -> None:
    """A tiny AWQ / act-order GPTQ model with every linear on the kernel (CPU weights routed to it as CUDA ones
    would be, the native kernel off): a prefill and a decode step within 6% of transformers' logits, as the CPU
    paths are held in tests/models/test_awq_gptq.py."""
    from llmserve.config import EngineConfig
    from llmserve.kernels import native
    from llmserve.models import load_model
    from tests.models.test_awq_gptq import IDS, write_checkpoint
    from tests.tiny_models import PagedRunner, hf_logits

    monkeypatch.setattr(native, "qblock_usable", lambda: False)
    monkeypatch.setattr(qb, "_triton_linear", lambda device: qblock.qblock_linear)
    directory, hf = write_checkpoint(tmp_path, method, act_order=act_order)
    lm = load_model(directory, EngineConfig(dtype=dtype, device="cpu"))
    real_plan, rows = qblock.plan, []
    monkeypatch.setattr(qblock, "plan", lambda m, *a, **kw: rows.append(m) or real_plan(m, *a, **kw))
    runner = PagedRunner(lm.model)
    ours = torch.cat([runner.step([(0, IDS)])[0], runner.step([(0, [5])])[0]])
    theirs = torch.cat([hf_logits(hf, IDS), hf_logits(hf, IDS + [5])[-1:]])
    assert (ours - theirs).abs().max().item() <= 0.06 * theirs.abs().max().item()
    assert len(IDS) in rows and 1 in rows  # the prefill's and the decode's rows went through the kernel
