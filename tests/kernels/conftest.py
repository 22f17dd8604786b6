"""Fixtures of the kernel-choice tests (test_calibrate.py, test_fp32_linear_choice.py)."""

from __future__ import annotations

import pytest

from llmserve.kernels import calibrate, choice


@pytest.fixture
def fresh_tuning_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cached or remembered choice, and no pins from the environment: each test measures (or fakes) its own."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibrate.ENV, raising=False)
    monkeypatch.setattr(choice, "_measured", {})
