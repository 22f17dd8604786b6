"""The LoRA tests' base model and adapters (tests/lora/adapters.py), made once per session."""

from __future__ import annotations

import pytest

from tests.lora.adapters import ADAPTERS, make_adapter


@pytest.fixture(scope="session")
def base_dir(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def adapter_dirs(base_dir, tmp_path_factory) -> dict[str, str]:
    """Every adapter of ADAPTERS, saved by PEFT for the tiny llama."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(base_dir, str(root / name), seed=i, **lora)
            for i, (name, lora) in enumerate(ADAPTERS.items())}
