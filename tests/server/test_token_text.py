"""Single-token text and bytes (logprobs, TGI token details): bytes are exact for byte-level BPE, so
the bytes of a text's tokens join to its UTF-8 even where one token holds part of a character."""

from __future__ import annotations

from llmserve.serve.token_text import TokenText, _byte_decoder
from tests.tiny_models import tiny_tokenizer

TEXT = "Café ☕ in 東京, 1 + 1 = 2"


def test_byte_decoder_is_gpt2s_table() -> None:
    table = _byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["A"] == 65 and table["Ġ"] == 32 and table["Ċ"] == 10 and table["Ā"] == 0


def test_bytes_of_tokens_join_to_the_utf8_of_the_text() -> None:
    tok = tiny_tokenizer()
    tt = TokenText(tok)
    ids = tok.encode(TEXT)
    assert tt.byte_level
    assert b"".join(bytes(tt.bytes(i)) for i in ids) == TEXT.encode()
    partial = [i for i in ids if tt.text(i) == "\ufffd"]
    assert partial  # the CJK characters span several single-byte tokens of this tiny vocabulary
    assert all(len(tt.bytes(i)) == 1 and tt.bytes(i)[0] >= 0x80 for i in partial)


def test_special_tokens() -> None:
    tt = TokenText(tiny_tokenizer())
    assert (tt.text(2), tt.bytes(2), tt.is_special(2)) == ("<|im_end|>", list(b"<|im_end|>"), True)
    assert not tt.is_special(tiny_tokenizer().encode("The")[0])
