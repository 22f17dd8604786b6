"""The text and bytes of single tokens, for logprobs and TGI token details.

A token's text is `decode([id])` (special tokens kept), which shows U+FFFD for a token holding part
of a multi-byte character; its bytes are exact: for byte-level BPE vocabularies (GPT-2, Llama 3,
SmolLM2, Qwen) the token string is mapped back through GPT-2's byte-to-character table, so the
bytes of consecutive tokens concatenate to the UTF-8 of the text. Results are cached per id.
"""

from __future__ import annotations

from functools import cache
from typing import Any


@cache
def _byte_decoder() -> dict[str, int]:
    # GPT-2's bytes_to_unicode, inverted: printable bytes map to themselves, the others to 256+.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._raw_bytes(token_id)
        return raw

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def _raw_bytes(self, token_id: int) -> list[int]:
        if self.byte_level and token_id not in self.special_ids:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            if isinstance(piece, str) and all(c in table for c in piece):
                return [table[c] for c in piece]
        return list(self.text(token_id).encode("utf-8"))
