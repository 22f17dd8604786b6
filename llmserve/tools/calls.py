"""What the output parsers hand back: tool calls, stream deltas, and the message they add up to.

A stream is a list of deltas in order: `ContentDelta` and `ReasoningDelta` carry text, `ToolCallDelta` a piece
of one call in OpenAI's streaming shape (the first delta of a call has its id and name, the next ones
argument text). `assemble` adds deltas up to the message a non-streamed response carries; the parsers'
whole-text results are defined as the assembly of their own streams, and tests check that every split of a
text into deltas assembles to the same message.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI's function.arguments

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of call number `index` (0-based within the response): the first piece has `id` and `name`
    (and arguments ""), the later ones `arguments` text to append."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


Delta = ContentDelta | ReasoningDelta | ToolCallDelta


class ParsedOutput(NamedTuple):
    """A whole response: reasoning_content, content (None when empty, as OpenAI's message.content beside
    tool_calls) and the calls in order."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class _Building:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


def assemble(deltas: Iterable[Delta]) -> ParsedOutput:
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[_Building] = []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif isinstance(d, ReasoningDelta):
            reasoning.append(d.text)
        else:
            if d.id is not None:
                assert d.index == len(calls), "a call's first delta comes in index order"
                calls.append(_Building(d.id, d.name or ""))
            calls[d.index].arguments.append(d.arguments)
    return ParsedOutput("".join(reasoning) or None, "".join(content) or None,
                        [ToolCall(c.id, c.name, "".join(c.arguments)) for c in calls])


def openai_call_id() -> str:
    """"call_" and 24 random hex digits, the shape of vLLM's (and OpenAI's) ids."""
    return "call_" + secrets.token_hex(12)


_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine random letters and digits: Mistral's chat templates refuse any other id when the call comes back in the
    conversation (mistral_common's rule, which vLLM follows for this parser)."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
