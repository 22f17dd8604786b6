"""Qwen2-VL and Qwen2.5-VL: dynamic-resolution images placed by 3-D rotary positions (M-RoPE).

The image side is vlm.py's: transformers' own model class with a language model of no layers gives the features
(`get_image_features` over the processor's pixel_values and image_grid_thw, one feature row per merged patch). The
language model is our Qwen2 with `MRotaryEmbedding`: a token's rotary position has three rows (temporal, height,
width). Text has three equal rows; an image's placeholders run over its grid; text after an image continues from
the largest position + 1, so after the prompt every token sits at its sequence index + a per-request delta.

The positions are transformers' by construction: `mrope_positions` calls the model's own `get_rope_index` when the
processor prepares a prompt (vl/processor.py), and the request carries them (vl/inputs.MRopePositions); the runner
feeds them for every span it computes (worker/model_runner.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from llmserve.errors import InvalidRequestError
from llmserve.layers.rotary import MRotaryEmbedding, rope_config
from llmserve.models.llama import head_dim_of
from llmserve.models.qwen2 import Qwen2ForCausalLM
from llmserve.models.vlm import VisionLanguageModel
from llmserve.vl.inputs import MRopePositions


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    """Qwen2 over 3-row positions. positions [T] (three equal rows) or [3, T]; cos/sin keep their [T, 1, D/2] shape,
    so the attention layers and the native decoder stack run unchanged."""

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__(hf_config, dtype, device)
        with torch.device(device):
            self.model.rotary_emb = MRotaryEmbedding(head_dim_of(hf_config), rope_config(hf_config))


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2VLForConditionalGeneration and Qwen2_5_VLForConditionalGeneration (the vision tower is transformers')."""

    mrope = True  # the runner feeds 3-row positions (ModelRunner)

    def _language_model_class(self, text: Any) -> type[nn.Module]:
        text.architectures = ["Qwen2VLTextForCausalLM"]
        return Qwen2VLTextForCausalLM

    @staticmethod
    def _current_name(name: str) -> str:
        # transformers 4 (the hub's checkpoints): visual.*, model.* (the language model), lm_head.*
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model.") and not name.startswith(("model.language_model.", "model.visual.")):
            return "model.language_model." + name[len("model."):]
        return name

    def mrope_positions(self, processed: Mapping[str, torch.Tensor]) -> MRopePositions:
        """The 3-D rotary positions of one prompt, from the processor's output for it (input_ids [1, P],
        mm_token_type_ids [1, P], image_grid_thw [images, 3]): the model's own rope index, on the CPU."""
        if processed.get("mm_token_type_ids") is None or processed.get("image_grid_thw") is None:
            raise InvalidRequestError("the model's processor gave no mm_token_type_ids or image_grid_thw for the "
                                      "images: it does not match the model", param="messages")
        positions, deltas = self.vision.model.get_rope_index(
            processed["input_ids"], processed["mm_token_type_ids"], image_grid_thw=processed["image_grid_thw"])
        return MRopePositions(positions[:, 0].to("cpu", torch.long).contiguous(), int(deltas.reshape(-1)[0]))
