"""Model code (Llama family) and loading: local HF directories, hub ids, GGUF files, the embedded default."""

from llmserve.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from llmserve.models.registry import get_model_class, supported_architectures

__all__ = ["LoadedModel", "get_model_class", "load_model", "resolve_device", "resolve_dtype",
           "supported_architectures"]
