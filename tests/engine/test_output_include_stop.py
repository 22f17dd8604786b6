"""Stop strings kept in the output (include_stop_str_in_output, TGI's behaviour) need no held-back
text: every chunk is emitted as it comes, and the match still spans token boundaries."""

from __future__ import annotations

from llmserve.engine.output import IncrementalDetokenizer
from tests.tiny_models import tiny_tokenizer

TEXT = "The capital of France is Paris."


def _run(stop: str, include_stop: bool) -> tuple[list[str], str | None]:
    tok = tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, [1], True, [stop], include_stop=include_stop)
    emitted = []
    for t in tok.encode(TEXT):
        emitted.append(detok.add(t))
        if detok.stop_hit:
            break
    return emitted, detok.stop_hit


def test_kept_stop_string_streams_every_chunk_at_once() -> None:
    tok = tiny_tokenizer()
    pieces = [tok.decode([t]) for t in tok.encode(TEXT)]
    emitted, hit = _run("France is", include_stop=True)
    assert hit == "France is"
    assert "".join(emitted) == "The capital of France is"
    # Nothing held back: each token's text comes out with that token (the last one cut after the stop).
    assert emitted[:-1] == pieces[:len(emitted) - 1]


def test_cut_stop_string_holds_back_what_could_start_it() -> None:
    emitted, hit = _run("France is", include_stop=False)
    assert hit == "France is" and "".join(emitted) == "The capital of "
    # Up to 8 characters (len(stop) - 1) wait for the next token, so no step emits "Fr..." early.
    assert all(not "".join(emitted[:i + 1]).endswith(("F", "Fr", "Fra")) for i in range(len(emitted)))
