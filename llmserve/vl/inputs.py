"""A request's images as the engine carries them: where each image's features go in the prompt, and what the vision
encoder takes to compute them.

The prompt holds one placeholder token per feature row (the processor expanded each image into them). The language
model's input at placeholder position `positions[j]` is the image's feature row j instead of the token's embedding;
nothing else about the prompt is special. For the caches, a placeholder is not its token id (every image's
placeholders have the same id) but a key derived from the image's content hash and j: `key_ids` is the prompt with
those keys in place, and the prefix cache and sessions compare it, so the same text with different images never
shares KV, and the same image and text do.

M-RoPE models (Qwen2-VL) place tokens by 3-D rotary positions (`MRopePositions`): computed once per prompt by the
model's own transformers rope index, carried here, and read by the runner for every span it computes.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class ImageItem:
    key: str  # content hash (vl.image.image_hash)
    positions: list[int]  # sorted prompt positions of its placeholders: feature row j goes to positions[j]
    inputs: dict[str, Any]  # the processor's tensors for this image alone: the vision encoder's input

    def rows_in(self, lo: int, hi: int) -> tuple[int, int]:
        """The feature rows [j0, j1) whose positions fall in [lo, hi)."""
        return bisect.bisect_left(self.positions, lo), bisect.bisect_left(self.positions, hi)


@dataclass(frozen=True, eq=False)
class MRopePositions:
    """A prompt's 3-D rotary positions. Prompt token i is at prompt[:, i]; every later token (generated, or a draft)
    continues from the prompt's largest position: sequence index i is at i + delta in all three rows. A position
    depends only on the tokens up to it (the rope index runs left to right), so a cached prefix's positions are
    those any prompt that shares it computes."""

    prompt: torch.Tensor  # [3, P] int64 on the CPU: temporal, height, width
    delta: int  # max(prompt) + 1 - P (<= 0: an image takes fewer positions than placeholders)


@dataclass(eq=False)
class MultiModalInputs:
    images: list[ImageItem]
    mrope: MRopePositions | None = None  # M-RoPE models only
    _keys: dict[int, list[int]] = field(default_factory=dict, repr=False)  # image index -> its rows' cache keys

    @property
    def num_images(self) -> int:
        return len(self.images)

    def _row_keys(self, index: int) -> list[int]:
        keys = self._keys.get(index)
        if keys is None:
            item = self.images[index]
            # negative, so never a real token id; distinct per image and row
            keys = self._keys[index] = [-1 - int.from_bytes(hashlib.blake2b(f"{item.key}:{j}".encode(),
                                                                            digest_size=7).digest(), "little")
                                        for j in range(len(item.positions))]
        return keys

    def key_ids(self, token_ids: list[int], lo: int, hi: int) -> list[int]:
        """token_ids[lo:hi] with each placeholder replaced by its image's key for that row."""
        out = token_ids[lo:hi]
        for i, item in enumerate(self.images):
            j0, j1 = item.rows_in(lo, hi)
            if j0 < j1:
                keys = self._row_keys(i)
                for j in range(j0, j1):
                    out[item.positions[j] - lo] = keys[j]
        return out
