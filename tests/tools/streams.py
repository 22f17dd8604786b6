"""Feeding a parser a text in pieces, and comparing results without the random call ids."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any

from llmserve.tools.calls import Delta, ParsedOutput, assemble


def feed_pieces(stream: Any, pieces: Iterable[str]) -> list[Delta]:
    """`stream`: a ToolCallStream, ReasoningStream or OutputStream."""
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += stream.feed(piece)
    return deltas + stream.finish()


def without_ids(result: ParsedOutput) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    return result.reasoning, result.content, [(c.name, c.arguments) for c in result.tool_calls]


def splits(text: str, seed: int = 0, random_splits: int = 20) -> Iterable[list[str]]:
    """Every two-piece split, one character at a time, and random splits into several pieces."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(random_splits):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def assert_streams_reassemble(make_stream: Callable[[], Any], text: str, expected: ParsedOutput) -> None:
    """Every split of `text` streams to deltas that assemble to `expected` (ids aside), each call's first delta
    carrying its id and name and no delta being empty."""
    for pieces in splits(text):
        deltas = feed_pieces(make_stream(), pieces)
        assert without_ids(assemble(deltas)) == without_ids(expected), pieces
        assert all(getattr(d, "text", "x") for d in deltas), deltas
