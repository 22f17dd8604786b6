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
    "Gemma2ForCausalLM": ("llmserve.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("llmserve.models.gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("llmserve.models.phi3", "Phi3ForCausalLM"),
    "InternLM3ForCausalLM": ("llmserve.models.internlm3", "InternLM3ForCausalLM"),
    # mixture of experts: routed experts grouped by expert (models/moe.py)
    "MixtralForCausalLM": ("llmserve.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("llmserve.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("llmserve.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    # vision-language models: transformers' vision side, our language model (models/vlm.py)
    "LlavaForConditionalGeneration": ("llmserve.models.vlm", "VisionLanguageModel"),
    "LlavaNextForConditionalGeneration": ("llmserve.models.vlm", "VisionLanguageModel"),
    "InternVLForConditionalGeneration": ("llmserve.models.vlm", "VisionLanguageModel"),
    "Idefics3ForConditionalGeneration": ("llmserve.models.vlm", "VisionLanguageModel"),
    "SmolVLMForConditionalGeneration": ("llmserve.models.vlm", "VisionLanguageModel"),
    # M-RoPE: 3-D rotary positions (models/qwen2_vl.py)
    "Qwen2VLForConditionalGeneration": ("llmserve.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("llmserve.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
}
_VISION_MODULES = ("llmserve.models.vlm", "llmserve.models.qwen2_vl")

# config.model_type -> architecture, for configs that carry no `architectures` (GGUF-derived ones).
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def is_vision_language(architecture: str | None) -> bool:
    return architecture in _MODELS and _MODELS[architecture][0] in _VISION_MODULES


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str | None) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ModelLoadError(f"model architecture {architecture!r} (config.json 'architectures') is not "
                             f"supported; supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
