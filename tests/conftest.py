"""Fixtures shared by every test directory."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmserve.kernels import native
from tests.tiny_models import tiny_model_dir  # noqa: F401  (registers the session fixture)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """tiny_vlm_dir(arch) -> a saved tiny vision-language checkpoint with its processor (tests/tiny_vlms.py), made
    once per session."""
    from tests.tiny_vlms import make_tiny_vlm

    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_tiny_vlm(arch, tmp_path_factory.mktemp(f"tiny-vlm-{arch}"))
        return made[arch]

    return get


@pytest.fixture(params=["native", "torch"])
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The sampler on both of its CPU paths: the native kernels (kernels/cpu/sampling.cpp, AVX-512 CPUs) and the
    torch reference (LLMSERVE_SAMPLER=torch)."""
    if request.param == "native":
        if not native.sampling_usable():
            pytest.skip("the sampler takes the native kernel only where it builds and the CPU has AVX-512")
        monkeypatch.delenv("LLMSERVE_SAMPLER", raising=False)
    else:
        monkeypatch.setenv("LLMSERVE_SAMPLER", "torch")
    return request.param
