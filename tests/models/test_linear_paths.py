"""The dense Linear's CPU path without a measured kernel choice (tests/kernels/test_bf16_gemm.py has those): oneDNN-blocked
weights; and the fp32-compute policy the remaining fallbacks read (int8_linear's torch paths, torch's prefill SDPA)."""

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
def test_without_a_choice_weights_are_onednn_blocked_and_the_plain_one_freed(fp32_policy, bias: bool) -> None:
    """pack_for_cpu with no measured choice (a model the runner did not calibrate): one oneDNN copy, in any dtype.
    The bf16 kernels a choice picks are tested in tests/kernels/test_bf16_gemm.py."""
    fp32_policy(True)
    layer = _bf16_layer(bias)
    w = layer.weight.detach().float()
    layer.pack_for_cpu()
    assert layer.packed is not None and layer.weight is None and layer.matmul is None
    x = torch.randn(100, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = x.float() @ w.T + (layer.bias.float() if bias else 0)
    torch.testing.assert_close(layer(x).float(), want, rtol=1e-2, atol=1e-2)
    fp32 = Linear(96, 80)
    fp32.weight.data = torch.randn(80, 96)
    fp32.pack_for_cpu()  # an fp32 layer never keeps a second copy
    assert fp32.weight is None and fp32.packed is not None


def test_policy_follows_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMSERVE_BF16_FP32_COMPUTE", raising=False)
    for amx, expected in ((True, False), (False, True)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        cpu_features.fp32_compute_for_bf16.cache_clear()
        assert cpu_features.fp32_compute_for_bf16() is expected
    cpu_features.fp32_compute_for_bf16.cache_clear()
