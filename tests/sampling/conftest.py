"""The sampler's token choice has two paths on CPU: the native kernel (kernels/cpu/sampling.cpp) and the torch
reference (LLMSERVE_SAMPLER=torch). Modules that test the sampler's behaviour run on both (sampler_path, in
tests/conftest.py); torch_sampler keeps a module on the torch path."""

from __future__ import annotations

import pytest


@pytest.fixture
def torch_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMSERVE_SAMPLER", "torch")
