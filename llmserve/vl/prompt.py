"""From a prompt with images to what the engine runs (token ids and the images' inputs): the steps the offline
pipeline, the server's routes and the CLI share.

The order matters to a server: `count_images` checks every part's shape and counts the images without fetching
anything, so a prompt with more images than allowed (or any image, for a text-only model) is refused before a byte
is downloaded. `render_images` and `raw_with_images` then load the images (downloads, file reads and decoding:
blocking, so the server runs them on a worker thread), put them where the prompt says, and run the model's
processor, which expands each image token into the image's placeholders.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from llmserve.chat_template import ChatTemplate, Messages
from llmserve.vl.image import ImageLimits, load_image
from llmserve.vl.inputs import MultiModalInputs
from llmserve.vl.messages import extract_images


class ImagePrompt(NamedTuple):
    text: str  # as rendered, one image token per image
    token_ids: list[int]  # the processor's: each image token expanded into its placeholders
    mm: MultiModalInputs | None


def count_images(messages: Messages) -> int:
    """The image parts in chat messages, their shapes checked (InvalidRequestError), nothing loaded."""
    return len(extract_images(messages, load=False)[1])


def render_images(messages: Messages, template: ChatTemplate, processor: Any, limits: ImageLimits,
                  tools: list[dict[str, Any]] | None = None, variables: dict[str, Any] | None = None) -> ImagePrompt:
    """Chat messages with image parts through the chat template and the processor (`processor`: a
    vl.processor.VLProcessor). Blocking: loads every image."""
    messages, images = extract_images(messages, limits)
    text = template.messages_to_prompt(messages, tools, variables)
    ids, mm = processor.prepare(text, images)
    return ImagePrompt(text, ids, mm)


def raw_with_images(text: str, sources: Sequence[Any], processor: Any, limits: ImageLimits,
                    params: Sequence[str]) -> ImagePrompt:
    """Raw text that holds the processor's image token once per image, where each goes (no chat template), and the
    images' sources (load_image's: URLs, paths, bytes, PIL images); params[k] names image k in errors. Blocking."""
    images = [load_image(source, limits, param) for source, param in zip(sources, params, strict=True)]
    ids, mm = processor.prepare(text, images)
    return ImagePrompt(text, ids, mm)
