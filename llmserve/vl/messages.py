"""Prompts with images, in the shapes users send them, made into one form: chat messages whose content is a list of
{"type": "text", "text": ...} and {"type": "image"} parts (what the processors' chat templates read), and the images
in the order of their parts.

Taken: LMDeploy's `(text, image)` and `(text, [images])` tuples (the images go before the text, or where the text
holds `IMAGE_TOKEN`), and OpenAI / GPT-4V messages with `image_url` parts (a URL, `data:` URL or, where allowed,
`file://`), LMDeploy's `image_data` parts (a PIL image) and transformers' `image` parts (`image`, `url` or `path`).
And TGI's raw text with markdown images, `![](url)` (`markdown_images`).
"""

from __future__ import annotations

import re
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.vl.constants import IMAGE_TOKEN
from llmserve.vl.image import OFFLINE, ImageLimits, load_image

Messages = list[dict[str, Any]]


def tuple_to_messages(prompt: tuple, param: str = "prompts") -> Messages:
    """LMDeploy's (text, image) or (text, [images]) as one user message."""
    if len(prompt) != 2 or not isinstance(prompt[0], str):
        raise InvalidRequestError(f"{param}: a tuple prompt must be (text, image) or (text, [images]), got a tuple "
                                  f"of {len(prompt)} item(s)", param=param)
    text, images = prompt
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    parts: list[dict[str, Any]] = []
    if IMAGE_TOKEN in text:
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise InvalidRequestError(f"{param}: the text holds {IMAGE_TOKEN} {len(pieces) - 1} time(s) for "
                                      f"{len(images)} image(s)", param=param)
        for i, piece in enumerate(pieces):
            if piece:
                parts.append({"type": "text", "text": piece})
            if i < len(images):
                parts.append({"type": "image", "image": images[i]})
    else:
        parts = [{"type": "image", "image": img} for img in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def has_images(messages: Messages) -> bool:
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in _IMAGE_TYPES for p in m["content"])
               for m in messages)


def extract_images(messages: Messages, limits: ImageLimits = OFFLINE, load: bool = True
                   ) -> tuple[Messages, list[Any]]:
    """(messages with image parts as {"type": "image"} and text parts as {"type": "text"}, the images in order).
    Messages whose content is a string are unchanged. load=False: the image parts' sources, not loaded."""
    out: Messages = []
    images: list[Any] = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"{where}.text must be a string", param="messages")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _IMAGE_TYPES:
                source = _image_source(part, where)
                images.append(load_image(source, limits, param=where) if load else source)
                parts.append({"type": "image"})
            else:
                raise InvalidRequestError(f"{where}: a content part must be of type text, image_url, image_data or "
                                          f"image, got {kind!r}", param="messages")
        out.append({**m, "content": parts})
    return out, images


def text_only(messages: Messages) -> Messages:
    """Messages whose content lists hold text parts only, with each list joined into one string (a text model's
    template takes strings). Image parts are refused."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]: this model takes text only, got a "
                                              f"{kind!r} part", param="messages")
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        out.append(m)
    return out


_IMAGE_TYPES = ("image_url", "image_data", "image")
_MARKDOWN_IMAGE = re.compile(r"!\[\]\(([^)]*)\)")  # TGI's router's pattern: an empty alt text, no ')' in the URL


def markdown_images(text: str) -> tuple[list[str], list[str]]:
    """TGI's images in raw text, `![](url)`: (the text around them, one piece more than there are images; the
    URLs in order)."""
    pieces = _MARKDOWN_IMAGE.split(text)  # (one group: text, url, text, ..., text)
    return pieces[0::2], pieces[1::2]


def _image_source(part: dict[str, Any], where: str) -> Any:
    kind = part["type"]
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise InvalidRequestError(f'{where}: an image_url part is {{"type": "image_url", "image_url": {{"url": '
                                      '"..."}}', param="messages")
        return url
    if kind == "image_data":
        value = part.get("image_data")
        data = value.get("data") if isinstance(value, dict) else value
        if data is None:
            raise InvalidRequestError(f'{where}: an image_data part is {{"type": "image_data", "image_data": '
                                      '{"data": <PIL image>}}', param="messages")
        return data
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    raise InvalidRequestError(f"{where}: an image part carries no image (give 'image', 'url' or 'path')",
                              param="messages")
