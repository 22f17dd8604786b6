"""Tiny PEFT LoRA adapters over the tiny random models of tests/tiny_models.py, and their transformers + PEFT
reference outputs."""

from __future__ import annotations

import json
import os
from functools import cache
from typing import Any

import torch

# name -> LoraConfig arguments. Random, non-zero A and B (init_lora_weights=False); each adapter adapts different
# modules, with its own rank and scaling, so one adapter's update landing on another's rows would show.
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=4, use_rslora=True, alpha_pattern={"down_proj": 16},
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=2, lora_alpha=6, rank_pattern={"gate_proj": 3}, target_modules=["o_proj", "gate_proj",
                                                                                   "down_proj"]),
}


def make_adapter(model_dir: str, out_dir: str, seed: int, **lora: Any) -> str:
    """Save a PEFT adapter of random weights for the checkpoint at model_dir; returns out_dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora))
    with torch.no_grad():  # larger than PEFT's random init, so every adapter moves the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape) * 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


def edit_config(adapter_dir: str, **changes: Any) -> None:
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


@cache
def _peft_model(model_dir: str, adapter_dir: str | None) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(model_dir: str, adapter_dir: str | None, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers + PEFT's greedy continuation (the adapter unmerged, as PEFT runs it)."""
    model = _peft_model(model_dir, adapter_dir)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                         dtype=torch.long),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
