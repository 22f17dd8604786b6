"""LoRA adapters (PEFT checkpoints) served over one base model, mixed in one batch (see manager.py)."""

from llmserve.lora.adapter import AdapterError, LoRAAdapter, read_adapter
from llmserve.lora.manager import LoRAManager

__all__ = ["AdapterError", "LoRAAdapter", "LoRAManager", "read_adapter"]
