"""From a prompt with images to what the engine runs: token ids and the images' inputs (vl.inputs).

`VLProcessor` wraps the model's own transformers processor (AutoProcessor, loaded from the model directory), so the
token ids are exactly what transformers' processor makes of the same text and images: it expands each image token
of the rendered chat into the image's placeholders. Each image's encoder input is what the processor makes of that
image alone (cached by content hash), and its placeholder count there says which of the prompt's placeholders are
its own, in order.

M-RoPE models (Qwen2-VL) also need the prompt's 3-D rotary positions: `rope_index` (the model's
`mrope_positions`) computes them from the processor's output for the whole prompt.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.vl.hf_compat import without_video_processor
from llmserve.vl.image import image_hash
from llmserve.vl.inputs import ImageItem, MRopePositions, MultiModalInputs

RopeIndex = Callable[[Mapping[str, torch.Tensor]], MRopePositions]

_TEXT_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}
_PER_IMAGE_CACHE = 256  # images' processed inputs kept (by content hash)


class VLProcessor:
    def __init__(self, model_dir: str, image_token_id: int, trust_remote_code: bool = False,
                 rope_index: RopeIndex | None = None) -> None:
        from transformers import AutoProcessor

        try:
            with without_video_processor():
                self.processor = AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (ValueError, OSError, KeyError, TypeError, ImportError) as e:
            raise ModelLoadError(f"{model_dir}: cannot load the model's image processor ({type(e).__name__}: {e}); "
                                 "a vision-language model needs its processor files (processor_config.json or "
                                 "preprocessor_config.json)") from None
        self.tokenizer = self.processor.tokenizer
        self.image_token_id = image_token_id
        self.rope_index = rope_index
        self.image_token = getattr(self.processor, "image_token", None) or self.tokenizer.convert_ids_to_tokens(
            image_token_id)
        self.chat_template = getattr(self.processor, "chat_template", None)
        self._lock = threading.Lock()
        self._per_image: OrderedDict[str, tuple[dict[str, torch.Tensor], int]] = OrderedDict()

    def prepare(self, text: str, images: list[Any]) -> tuple[list[int], MultiModalInputs | None]:
        """Token ids of `text` (rendered, holding one image token per image where each goes) and its images."""
        if not images:
            return self.tokenizer.encode(text, add_special_tokens=False), None
        found = text.count(self.image_token)
        if found != len(images):
            raise InvalidRequestError(f"the prompt has {found} image placeholder(s) ({self.image_token!r}) for "
                                      f"{len(images)} image(s)", param="messages")
        try:
            out = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            raise InvalidRequestError(f"the model's processor refused the images: {e}", param="messages") from None
        ids = out["input_ids"][0].tolist()
        where = [p for p, t in enumerate(ids) if t == self.image_token_id]
        items, used = [], 0
        for img in images:
            key = image_hash(img)
            inputs, count = self._image_inputs(key, img)
            items.append(ImageItem(key, where[used:used + count], inputs))
            used += count
        if used != len(where):
            raise InvalidRequestError(f"the processor expanded the prompt into {len(where)} image placeholders, but "
                                      f"its images take {used} (is there an image token in the text itself?)",
                                      param="messages")
        return ids, MultiModalInputs(items, self.rope_index(out) if self.rope_index is not None else None)

    def _image_inputs(self, key: str, img: Any) -> tuple[dict[str, torch.Tensor], int]:
        with self._lock:
            hit = self._per_image.get(key)
            if hit is not None:
                self._per_image.move_to_end(key)
                return hit
        try:
            out = self.processor(text=[self.image_token], images=[img], return_tensors="pt", add_special_tokens=False)
        except (ValueError, TypeError, IndexError, RuntimeError) as e:
            raise InvalidRequestError(f"the model's processor refused an image: {e}", param="messages") from None
        count = int((out["input_ids"][0] == self.image_token_id).sum())
        inputs = {k: v for k, v in out.items() if k not in _TEXT_KEYS and torch.is_tensor(v)}
        with self._lock:
            self._per_image[key] = (inputs, count)
            while len(self._per_image) > _PER_IMAGE_CACHE:
                self._per_image.popitem(last=False)
        return inputs, count
