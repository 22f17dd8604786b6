"""Fixtures of the kernel-choice tests (test_calibrate.py, test_fp32_linear_choice.py, test_qblock_choice.py)."""

from __future__ import annotations

import pytest

from llmserve.kernels import calibrate, choice


@pytest.fixture
def fresh_tuning_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cached or remembered choice, and no pins from the environment: each test measures (or fakes) its own."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibrate.ENV, raising=False)
    monkeypatch.setattr(choice, "_measured", {})


@pytest.fixture
def q4_1_gguf(tmp_path) -> str:
    """A tiny Llama as a Q4_1 GGUF: in bf16 its linears, embedding and LM head all run on their blocks (no bf16 weight)."""
    import gguf

    from tests.tiny_models import make_hf_model, write_tiny_gguf

    hf = make_hf_model("llama", vocab_size=300, hidden_size=64, intermediate_size=128)
    return write_tiny_gguf(hf, tmp_path / "tiny.Q4_1.gguf", gguf.GGMLQuantizationType.Q4_1)
