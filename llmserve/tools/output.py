"""A chat response's text -> reasoning_content, content and tool_calls, whole or as a stream of deltas: the
reasoning parser (if any) splits off the reasoning, and the content it leaves goes through the tool-call
parser (if the request has tools it may call)."""

from __future__ import annotations

from llmserve.tools.calls import ContentDelta, Delta, ParsedOutput, assemble
from llmserve.tools.parser import ToolCallStream, ToolParser
from llmserve.tools.reasoning import ReasoningParser, ReasoningStream


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 thinking: bool | None = None) -> None:
        """thinking: see ReasoningParser.stream (the route takes it from the prompt with `prompt_thinking`)."""
        self.reasoning = reasoning
        self.tools = tools
        self.thinking = thinking

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return assemble(stream.feed(text) + stream.finish())

    def stream(self) -> OutputStream:
        return OutputStream(self.reasoning.stream(self.thinking) if self.reasoning else None,
                            self.tools.stream() if self.tools else None)


class OutputStream:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def num_tool_calls(self) -> int:
        """Calls so far: a response that made any finishes with "tool_calls" (unless cut off by its length)."""
        return self._tools.num_calls if self._tools else 0

    def feed(self, text: str) -> list[Delta]:
        return self._route(self._reasoning.feed(text) if self._reasoning else [ContentDelta(text)])

    def finish(self) -> list[Delta]:
        out = self._route(self._reasoning.finish()) if self._reasoning else []
        return out + (self._tools.finish() if self._tools else [])

    def _route(self, deltas: list[Delta]) -> list[Delta]:
        if self._tools is None:
            return [d for d in deltas if not isinstance(d, ContentDelta) or d.text]
        out: list[Delta] = []
        for d in deltas:
            out += self._tools.feed(d.text) if isinstance(d, ContentDelta) else [d]
        return out
