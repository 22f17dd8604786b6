"""kernels/triton/int8.py (CUDA's GEMM over weight-only int8 weights, `--quantization int8`) against the exact product
x @ (q * s)^T in fp32, and int8_linear's choice of it.

On CUDA it runs compiled; without CUDA under Triton's interpreter (TRITON_INTERPRET=1, set here before triton is
imported) on CPU tensors, which checks the tiles' addressing, the k tail's masks, the row scales and split-K sums.
The interpreter rounds fp32 to bf16 by truncation (CUDA rounds to nearest), hence bf16's looser tolerance.
Skipped without triton.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from llmserve.kernels.triton import int8 as tint8  # noqa: E402
from llmserve.layers import linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}  # |y - exact| / |exact|


def _weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [n, k] over the whole range (-127..127, as quantize_rows makes them) and fp32 row scales."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(n, generator=gen) * 0.02 + 0.001
    return q.to(DEVICE), s.to(DEVICE)


def _exact(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x.double(), q.double()) * s.double()
    return y if bias is None else y + bias.double()


def _check(n: int, k: int, m: int, dtype: torch.dtype, bias: bool, splits: int | None = None, seed: int = 1,
           lead: tuple[int, ...] = ()) -> None:
    q, s = _weight(n, k, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(*lead, m, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    got = tint8.int8_linear(x, q, s, b, splits)
    want = _exact(x, q, s, b)
    assert got.dtype == dtype and got.shape == (*lead, m, n)
    assert torch.isfinite(got).all()
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k", [256, 200])
def test_kernel_matches_the_exact_product(m: int, dtype: torch.dtype, k: int) -> None:
    """n = 40 under one 64-row program (masked rows); M = 33 a tail of a 64-row tile; k = 200 ends in a partial
    step of 72 columns (masked); a bias where M != 5."""
    _check(40, k, m, dtype, bias=m != 5)


@pytest.mark.parametrize("m, splits, k", [(1, 2, 512), (5, 3, 512), (1, 16, 512), (3, 3, 300)])
def test_split_k(m: int, splits: int, k: int) -> None:
    """k split over programs (decode), partial sums added with the bias after; 16 asks for more splits than k has
    steps, which the plan caps; k = 300: the last split's last step is partial."""
    _check(24, k, m, torch.float16, bias=True, splits=splits, seed=2)


def test_prefill_tiles_fp32_and_leading_dims() -> None:
    """M = 130: 128-row tiles with BLOCK_K 64 (a tail of 2 rows), n = 200 over two 128-row programs; fp32 x (IEEE
    products, no TF32); x with leading dimensions."""
    _check(200, 256, 130, torch.bfloat16, bias=True, seed=3)
    _check(72, 160, 7, torch.float32, bias=True, seed=4)
    _check(48, 128, 3, torch.float16, bias=False, seed=5, lead=(2,))


def test_no_rows() -> None:
    q, s = _weight(16, 64)
    assert tint8.int8_linear(torch.empty(0, 64, device=DEVICE), q, s, None).shape == (0, 16)


def test_plan() -> None:
    cpu = torch.device("cpu")
    assert tint8.plan(1, 4096, 4096, cpu) == tint8.Plan(16, 64, 128, 1, 4, 4)  # one "SM": no split
    assert tint8.plan(1, 64, 1024, cpu, splits=3).splits == 3  # 8 steps: 3, 3, 2
    assert tint8.plan(1, 64, 1024, cpu, splits=100).splits == 8  # one split a step at most
    assert tint8.plan(1, 64, 1000, cpu, splits=100).splits == 8  # the partial last step is a step
    big = tint8.plan(1000, 4096, 4096, cpu)
    assert (big.block_m, big.block_n, big.block_k, big.num_warps) == (128, 128, 64, 8)
    if CUDA:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert tint8.plan(1, 4096, 4096, DEVICE).splits == min(16, 32, -(-2 * sms // 64))


def test_int8_linear_runs_it_only_on_cuda(monkeypatch) -> None:
    """layers/linear.py's int8_linear: the Triton kernel for x on CUDA, unless LLMSERVE_INT8_TRITON=0 pins torch's
    path; never for x on a CPU."""
    assert linear._triton_int8_linear(torch.device("cpu")) is None
    # (the kernel is not monkeypatched here: the import is cached, and later tests would get the stand-in)
    assert linear._triton_int8_linear(torch.device("cuda")) is tint8.int8_linear and linear.int8_triton_runs()
    monkeypatch.setenv("LLMSERVE_INT8_TRITON", "0")
    assert linear._triton_int8_linear(torch.device("cuda")) is None and not linear.int8_triton_runs()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("n, k, m", [(4096, 4096, 1), (28672, 4096, 7), (4096, 14336, 64), (1000, 2048, 100)])
def test_cuda_shapes_through_int8_linear(n: int, k: int, m: int, monkeypatch) -> None:
    """Llama-3-8B's shapes on CUDA through int8_linear (the default split-K choice; 2 x m rows, under
    INT8_TRITON_MAX_ROWS), against the exact product and against torch's path (LLMSERVE_INT8_TRITON=0, which rounds
    q * s to x's dtype first), in bf16 and fp16."""
    q, s = _weight(n, k, seed=6)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, m, k, device=DEVICE).to(dtype)
        bias = torch.randn(n, device=DEVICE, dtype=dtype)
        got = linear.int8_linear(x, q, s, bias)
        monkeypatch.setenv("LLMSERVE_INT8_TRITON", "0")
        torch_path = linear.int8_linear(x, q, s, bias)
        monkeypatch.delenv("LLMSERVE_INT8_TRITON")
        want = _exact(x, q, s, bias)
        assert got.shape == (2, m, n) and got.dtype == dtype
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < TOL[dtype], err
        err_torch = ((torch_path.double() - want).norm() / want.norm()).item()
        assert err < 2 * err_torch + 1e-3, (err, err_torch)


def test_large_batches_take_the_dense_gemm(monkeypatch) -> None:
    """From INT8_TRITON_MAX_ROWS rows int8_linear dequantizes into the dense GEMM (torch's path), below it the kernel
    (routed here as for CUDA)."""
    used = []
    monkeypatch.setattr(linear, "_triton_int8_linear", lambda device: lambda *a: used.append(a[0].shape) or 0)
    q, s = _weight(16, 64)
    for rows in (1, linear.INT8_TRITON_MAX_ROWS - 1, linear.INT8_TRITON_MAX_ROWS, 1000):
        y = linear.int8_linear(torch.randn(rows, 64, device=DEVICE), q, s, None)
    assert used == [(1, 64), (linear.INT8_TRITON_MAX_ROWS - 1, 64)] and y.shape == (1000, 16)


@pytest.mark.skipif(CUDA, reason="on CUDA tests/gpu/test_cuda_graphs.py runs an int8 model compiled")
def test_int8_model_in_the_interpreter(tiny_model_dir, monkeypatch) -> None:
    """A tiny llama with `quantization="int8"` whose linears and LM head run the kernel (CPU tensors routed to it as
    CUDA ones would be; the packed CPU kernel off): a prefill and two decode steps give torch's int8 path's logits
    (fp32, so both are the exact product within fp32 rounding)."""
    from llmserve.config import EngineConfig
    from llmserve.layers import embedding
    from llmserve.models import load_model
    from tests.tiny_models import PagedRunner

    monkeypatch.setattr(linear, "int8_packed_ok", lambda weight: False)
    monkeypatch.setattr(embedding, "int8_packed_ok", lambda weight: False)
    ids = [5, 17, 99, 3, 42, 7, 250]
    logits = []
    real_plan = tint8.plan
    for kernel in (True, False):
        monkeypatch.setattr(linear, "_triton_int8_linear",
                            (lambda device: tint8.int8_linear) if kernel else (lambda device: None))
        rows: list[int] = []
        monkeypatch.setattr(tint8, "plan", lambda m, *a, rows=rows, **kw: rows.append(m) or real_plan(m, *a, **kw))
        lm = load_model(tiny_model_dir("llama"), EngineConfig(dtype="float32", device="cpu", quantization="int8"))
        assert all(m.qweight is not None for m in lm.model.modules() if isinstance(m, linear.Linear))
        runner = PagedRunner(lm.model)
        logits.append(torch.cat([runner.step([(0, ids)])[0], runner.step([(0, [11])])[0],
                                 runner.step([(0, [12])])[0]]))
        assert (len(ids) in rows and 1 in rows) == kernel  # the prefill's and the decodes' rows ran the kernel
    ours, torch_path = logits
    assert (ours - torch_path).abs().max().item() <= 1e-4 * torch_path.abs().max().item()
