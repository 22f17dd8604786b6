"""Vision-language models: transformers' vision tower and projector, our language model.

The language model is ours (llama.py and its family, with every engine feature: the paged cache, the native
kernels, quantization), built from the checkpoint's text config. The image side reuses the upstream code, as LMDeploy
does: the model's own transformers class, instantiated with a language model of no layers (its memory is a few
parameters), loaded with the checkpoint's vision weights, and asked for `get_image_features`. So the features are
transformers' by construction, for every family it implements that way (LLaVA, LLaVA-NeXT, InternVL, Idefics3,
SmolVLM).

The engine calls `embed_images` for the images a step needs: a batched encoder pass over those not in the encoder
cache (keyed by the image's content hash, bounded in bytes), then the features go into the flat token batch at the
images' placeholder positions (`forward(..., embeds=(rows, values))`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from llmserve.attention import AttentionMetadata
from llmserve.errors import ModelLoadError
from llmserve.kernels.choice import ChoiceTable
from llmserve.vl.inputs import ImageItem

log = logging.getLogger(__name__)

# HF architecture -> the name of the language model's module inside `model` (transformers 5 layout).
VISION_ARCHITECTURES = {
    "LlavaForConditionalGeneration": "language_model",
    "LlavaNextForConditionalGeneration": "language_model",
    "InternVLForConditionalGeneration": "language_model",
    "Idefics3ForConditionalGeneration": "text_model",
    "SmolVLMForConditionalGeneration": "text_model",
    "Qwen2VLForConditionalGeneration": "language_model",  # models/qwen2_vl.py
    "Qwen2_5_VLForConditionalGeneration": "language_model",
}

# Checkpoints saved by transformers 4 (most on the hub) name the parts without the `model.` parent: renamed on load.
_LEGACY_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("image_newline", "model.image_newline"),
)

DEFAULT_ENCODER_CACHE_BYTES = 256 * 1024 * 1024


@dataclass
class EncoderStats:
    images_encoded: int = 0
    cache_hits: int = 0
    encode_seconds: float = 0.0


class VisionLanguageModel(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        arch = hf_config.architectures[0]
        self.config = hf_config
        self.text_config = text = hf_config.get_text_config()
        if getattr(hf_config, "tie_word_embeddings", None) is not None:  # the whole model's setting rules (InternVL)
            text.tie_word_embeddings = hf_config.tie_word_embeddings
        self.language_model = self._language_model_class(text)(text, dtype, device)
        self.lm_name = VISION_ARCHITECTURES[arch]
        self.image_token_id = int(getattr(hf_config, "image_token_id", None)
                                  if getattr(hf_config, "image_token_id", None) is not None
                                  else hf_config.image_token_index)
        self.vision = _vision_model(hf_config, arch, dtype, device)
        self.dtype, self.device = dtype, torch.device(device)
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_cache_bytes = DEFAULT_ENCODER_CACHE_BYTES
        self.max_batch_size = 8  # images per encoder pass (EngineConfig.vision_max_batch_size)
        self._cached_bytes = 0
        self.encoder_stats = EncoderStats()

    def _language_model_class(self, text: Any) -> type[nn.Module]:
        """Our class of the checkpoint's language model (the text config's architecture or model type)."""
        from llmserve.models.registry import MODEL_TYPES, get_model_class

        text_arch = (getattr(text, "architectures", None) or [MODEL_TYPES.get(text.model_type)])[0]
        if text_arch not in MODEL_TYPES.values():
            raise ModelLoadError(f"{self.config.architectures[0]}: its language model {text.model_type!r} is not one "
                                 f"llmserve implements (supported: {', '.join(sorted(MODEL_TYPES))})")
        text.architectures = [text_arch]
        return get_model_class(text_arch)

    # --- the language model's interface, as the runner uses it -----------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.language_model(input_ids, positions, meta, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[Any]:
        return self.language_model.attention_layers()

    def pack_for_cpu(self, choices: ChoiceTable | None = None) -> None:
        self.language_model.pack_for_cpu(choices)

    def quantize(self, method: str) -> None:
        """The language model only; the vision tower keeps the model dtype."""
        self.language_model.quantize(method)

    @torch.no_grad()
    def init_dummy_weights(self, std: float, seed: int = 0) -> None:
        self.language_model.init_dummy_weights(std, seed)
        generator = torch.Generator(device=self.device).manual_seed(seed + 1)
        for name, param in self.vision.named_parameters():
            if param.dim() == 1:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
            else:
                param.normal_(0.0, std, generator=generator)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        lm_prefix = f"model.{self.lm_name}."
        # (the stub language model's few parameters are not the checkpoint's: the checkpoint's go to ours)
        vision_params = {n: p for n, p in self.vision.named_parameters() if not n.startswith(lm_prefix)}
        vision_buffers = {n: b for n, b in self.vision.named_buffers() if not n.startswith(lm_prefix)}
        seen: set[str] = set()

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                name = self._current_name(raw)
                if name.startswith(lm_prefix):
                    yield "model." + name[len(lm_prefix):], tensor
                elif name.startswith("lm_head."):
                    yield name, tensor
                elif name in vision_params or name in vision_buffers:
                    if name in seen:
                        raise ModelLoadError(f"tensor {raw!r} appears more than once in the checkpoint")
                    target = vision_params.get(name, vision_buffers.get(name))
                    if target.shape != tensor.shape:
                        raise ModelLoadError(f"tensor {raw!r} has shape {tuple(tensor.shape)}, the model "
                                             f"{tuple(target.shape)}: config.json does not match the weights")
                    with torch.no_grad():
                        target.copy_(tensor)
                    seen.add(name)
                else:
                    raise ModelLoadError(f"unexpected tensor {raw!r} in the checkpoint: {self.config.architectures[0]}"
                                         " has no such parameter (does config.json match the weights?)")

        self.language_model.load_weights(text_weights())
        missing = sorted(set(vision_params) - seen)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ModelLoadError(f"checkpoint is missing vision tensor(s): {shown}")

    def fused_name(self, name: str) -> tuple[str, str | None]:
        """A checkpoint name of the language model's part -> (our parameter's name, the shard it fills), as the
        language model maps it (LoRA adapters read this: llmserve/lora). Other parts keep their name, which names no
        adaptable layer of ours."""
        name = self._current_name(name)
        lm_prefix = f"model.{self.lm_name}."
        if name.startswith(lm_prefix):
            target, shard = self.language_model.fused_name("model." + name[len(lm_prefix):])
            return "language_model." + target, shard
        return name, None

    # --- images -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed_images(self, items: list[ImageItem]) -> list[torch.Tensor]:
        """Each item's features [len(item.positions), hidden], in the language model's dtype: from the encoder cache,
        or computed in one batched pass per group of same-shaped inputs."""
        features: dict[str, torch.Tensor] = {}  # content hash -> features
        todo: dict[str, ImageItem] = {}  # content hash -> an item to encode (one per image, repeats share it)
        for item in items:
            if item.key in features or item.key in todo:
                continue
            hit = self.encoder_cache.get(item.key)
            if hit is not None:
                self.encoder_cache.move_to_end(item.key)
                self.encoder_stats.cache_hits += 1
                features[item.key] = hit
            else:
                todo[item.key] = item
        start = time.perf_counter()
        groups: dict[tuple, list[ImageItem]] = {}
        for item in todo.values():
            shapes = tuple((k, tuple(v.shape)) for k, v in sorted(item.inputs.items()) if torch.is_tensor(v))
            groups.setdefault(shapes, []).append(item)
        passes = [members[k:k + self.max_batch_size] for members in groups.values()
                  for k in range(0, len(members), self.max_batch_size)]
        for members in passes:
            for item, feats in zip(members, self._encode(members)):
                if feats.shape[0] != len(item.positions):
                    raise RuntimeError(f"the vision encoder gave {feats.shape[0]} feature rows for an image the "
                                       f"processor expanded into {len(item.positions)} placeholder tokens")
                features[item.key] = feats
                self._remember(item.key, feats)
        if todo:
            self.encoder_stats.images_encoded += len(todo)
            self.encoder_stats.encode_seconds += time.perf_counter() - start
        return [features[item.key] for item in items]

    def _encode(self, items: list[ImageItem]) -> list[torch.Tensor]:
        keys = [k for k, v in items[0].inputs.items() if torch.is_tensor(v)]
        batch = {k: torch.cat([it.inputs[k] for it in items]).to(self.device) for k in keys}
        if "pixel_values" in batch and batch["pixel_values"].is_floating_point():
            batch["pixel_values"] = batch["pixel_values"].to(self.dtype)
        feats = self.vision.get_image_features(**batch, **self._feature_kwargs()).pooler_output
        hidden = self.text_config.hidden_size
        if isinstance(feats, (list, tuple)) and len(feats) == len(items):
            per_item = list(feats)
        elif torch.is_tensor(feats) and feats.shape[0] == batch["pixel_values"].shape[0]:
            # one row per tile (InternVL): each item's tiles
            per_item = list(torch.split(feats, [it.inputs["pixel_values"].shape[0] for it in items]))
        else:
            raise RuntimeError(f"unexpected image features from {type(self.vision).__name__}: {type(feats).__name__}")
        return [f.reshape(-1, hidden).to(self.dtype) for f in per_item]

    @staticmethod
    def _current_name(name: str) -> str:
        """A checkpoint tensor's name in the transformers 5 layout (transformers 4's renamed)."""
        return _current_name(name)

    def _feature_kwargs(self) -> dict[str, Any]:
        kwargs = {}
        for key in ("vision_feature_layer", "vision_feature_select_strategy"):
            if hasattr(self.config, key):
                kwargs[key] = getattr(self.config, key)
        return kwargs

    def _remember(self, key: str, feats: torch.Tensor) -> None:
        size = feats.numel() * feats.element_size()
        if size > self.encoder_cache_bytes:
            return
        self.encoder_cache[key] = feats
        self._cached_bytes += size
        while self._cached_bytes > self.encoder_cache_bytes:
            _, old = self.encoder_cache.popitem(last=False)
            self._cached_bytes -= old.numel() * old.element_size()


def _current_name(name: str) -> str:
    for old, new in _LEGACY_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _vision_model(hf_config: Any, arch: str, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """transformers' own model class with a language model of no layers and a one-token vocabulary: its vision
    tower, projector and get_image_features, at a few parameters' cost for the rest."""
    import transformers
    from transformers.initialization import no_init_weights

    cfg = copy.deepcopy(hf_config)
    text = cfg.get_text_config()
    text.num_hidden_layers = 0
    text.vocab_size = 1
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = []
    if hasattr(text, "max_window_layers"):
        text.max_window_layers = 0
    cfg._attn_implementation = "sdpa"
    cls = getattr(transformers, arch)
    with no_init_weights(), torch.device(device):
        model = cls(cfg)
    model.lm_head = None  # (its one-token head is not used)
    return model.to(dtype).eval()
