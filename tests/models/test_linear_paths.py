"""The dense Linear's CPU paths without the native bf16 GEMM (tests/attention/test_bf16_gemm.py has that one):
oneDNN-blocked weights, and bf16 matmuls widened to fp32 from FP32_COMPUTE_MIN_ROWS rows on CPUs without AMX."""

from __future__ import annotations

import pytest
import torch

from llmserve import cpu_features
from llmserve.kernels import native
from llmserve.layers import linear as lin
from llmserve.layers.linear import Linear


def _bf16_layer(bias: bool) -> Linear:
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 80, bias=bias)
    layer.weight.data = torch.randn(80, 96, generator=g).bfloat16()
    if bias:
        layer.bias.data = torch.randn(80, generator=g).bfloat16()
    return layer


@pytest.fixture
def fp32_policy(monkeypatch: pytest.MonkeyPatch):
    """Set the fp32-compute policy for one test (it is cached per process), with the native bf16 GEMM unavailable
    (as where the extension does not build): the paths under test are the fallbacks."""
    monkeypatch.setattr(native, "packed_gemm_usable", lambda: False)

    def set_policy(on: bool) -> None:
        monkeypatch.setenv("LLMSERVE_BF16_FP32_COMPUTE", "1" if on else "0")
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
        cpu_features.fp32_compute_for_bf16.cache_clear()

    yield set_policy
    cpu_features.fp32_compute_for_bf16.cache_clear()


@pytest.mark.skipif(not lin.onednn_available(torch.device("cpu"), torch.bfloat16), reason="needs oneDNN bf16")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 95, 96, 300])  # each side of FP32_COMPUTE_MIN_ROWS
def test_bf16_paths_agree_with_the_fp32_product(fp32_policy, bias: bool, rows: int) -> None:
    fp32_policy(True)
    layer = _bf16_layer(bias)
    w = layer.weight.detach().float()
    b = layer.bias.detach().float() if bias else 0
    layer.pack_for_cpu()
    assert layer.packed is not None and layer.weight is not None  # kept for the fp32 path
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    want = x.float() @ w.T + b  # exact products, fp32 sums: both paths round this once to bf16
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    if rows >= lin.FP32_COMPUTE_MIN_ROWS:  # the fp32 path: exactly torch's fp32 matmul, rounded once
        fp32 = torch.nn.functional.linear(x.float(), w, layer.bias.float() if bias else None)
        assert torch.equal(got, fp32.bfloat16())


def test_without_the_policy_the_plain_weight_is_freed(fp32_policy) -> None:
    fp32_policy(False)
    layer = _bf16_layer(bias=False)
    layer.pack_for_cpu()
    assert layer.packed is not None and layer.weight is None
    fp32 = Linear(96, 80)
    fp32.weight.data = torch.randn(80, 96)
    fp32_policy(True)
    fp32.pack_for_cpu()  # an fp32 layer never keeps a second copy
    assert fp32.weight is None


def test_policy_follows_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMSERVE_BF16_FP32_COMPUTE", raising=False)
    for amx, expected in ((True, False), (False, True)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        cpu_features.fp32_compute_for_bf16.cache_clear()
        assert cpu_features.fp32_compute_for_bf16() is expected
    cpu_features.fp32_compute_for_bf16.cache_clear()
