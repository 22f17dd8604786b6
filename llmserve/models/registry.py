"""HF `architectures[0]` name -> our model class (imported lazily, on first use)."""

from __future__ import annotations

import importlib

from torch import nn

from llmserve.errors import ModelLoadError

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llmserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llmserve.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llmserve.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("llmserve.models.qwen3", "Qwen3ForCausalLM"),
}

# config.model_type -> architecture, for configs that carry no `architectures` (GGUF-derived ones).
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str | None) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ModelLoadError(f"model architecture {architecture!r} (config.json 'architectures') is not "
                             f"supported; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
