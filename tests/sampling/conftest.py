"""The sampler's token choice has two paths on CPU: the native kernel (attention/csrc/sampling.cpp) and the torch
reference (LLMSERVE_SAMPLER=torch). Modules that test the sampler's behaviour run on both."""

from __future__ import annotations

import pytest

from llmserve.attention import native


@pytest.fixture(params=["native", "torch"])
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        if not native.sampling_usable():
            pytest.skip("the sampler takes the native kernel only where it builds and the CPU has AVX-512")
        monkeypatch.delenv("LLMSERVE_SAMPLER", raising=False)
    else:
        monkeypatch.setenv("LLMSERVE_SAMPLER", "torch")
    return request.param


@pytest.fixture
def torch_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_SAMPLER", "torch")
