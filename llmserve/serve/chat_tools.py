"""A chat request's tools and reasoning, between the request and the response (docs/tools.md).

Before generation: `chat_tool_request` checks tools / tool_choice / parallel_tool_calls (400s naming the field);
the tools reach the chat template (openai_params.chat_prompt); `chat_output` then reads the rendered prompt (does
it open or close the reasoning?) and decides the grammar that forces calls and the parser for the answer.
After: each choice's text goes through its own `ChoiceOutput` (the reasoning parser, then the tool-call parser),
whole (`message`) or as OpenAI's delta fields (`delta`), which add up to the same message.

Without tools in play and without --reasoning-parser, a choice's text is its content, as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.serve.errors import ApiError
from llmserve.serve.protocol import ChatCompletionRequest
from llmserve.serve.state import ServedModel
from llmserve.structured.spec import StructuredOutput
from llmserve.tools import (
    ContentDelta,
    Delta,
    OutputParser,
    OutputStream,
    ReasoningDelta,
    ToolCallDelta,
    ToolRequest,
    parse_tool_request,
    prompt_thinking,
    tool_call_grammar,
)
from llmserve.tools.registry import TOOL_PARSERS


def chat_tool_request(model: ServedModel, req: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools, or None when it has none; a ToolRequest in mode "none" shows the template nothing."""
    try:
        tools = parse_tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from None
    if tools is not None and tools.mode != "none" and model.tool_parser is None:
        raise ApiError(400, "tools: this model's chat template takes tools but writes calls in a format llmserve "
                            "cannot tell, so its calls could not be read back; start the server with "
                            f"--tool-call-parser ({', '.join(TOOL_PARSERS)})", param="tools")
    return tools


@dataclass(frozen=True)
class ChatOutput:
    """What the answer of one chat request is made of, for all its choices."""

    parser: OutputParser | None  # None: the text is the content, as it comes
    grammar: StructuredOutput | None  # the calls tool_choice forces (or a strict tool's schema)
    # parallel_tool_calls=false: one call at most. The grammar keeps that promise where there is one; under
    # unconstrained `auto` a model may still write several, and only the first is kept.
    max_calls: int | None
    has_reasoning: bool  # --reasoning-parser: messages carry reasoning_content (null when there is none)
    legacy: bool = False  # the deprecated functions API: the call as `function_call`, finish_reason "function_call"

    @property
    def uses_tools(self) -> bool:
        return self.parser is not None and self.parser.tools is not None

    def constraint(self, structured: StructuredOutput | None) -> StructuredOutput | None:
        """The grammar for the engine: the tools', or the request's response_format (or guided_*), not both."""
        if self.grammar is not None and structured is not None:
            raise ApiError(400, f"{structured.param} and tool_choice both constrain the output (tool_choice "
                                "\"required\", a named function or a strict tool make the calls follow a grammar): "
                                "send one", param=structured.param)
        return self.grammar or structured


PLAIN = ChatOutput(None, None, None, False)


def chat_output(model: ServedModel, tools: ToolRequest | None, prompt: str) -> ChatOutput:
    """`prompt`: the rendered chat prompt, which says whether the answer starts inside the reasoning."""
    active = tools if tools is not None and tools.mode != "none" else None
    if active is None and model.reasoning is None:
        return PLAIN
    thinking = prompt_thinking(prompt) if model.reasoning is not None else None
    parser = OutputParser(model.reasoning, model.tool_parser if active else None, thinking)
    if active is None or model.tool_parser is None:
        return ChatOutput(parser, None, None, model.reasoning is not None)
    grammar = tool_call_grammar(model.tool_parser, active, model.reasoning, thinking)
    return ChatOutput(parser, grammar, None if active.parallel_tool_calls else 1, model.reasoning is not None)


class ChoiceOutput:
    """One choice's text -> its message or its deltas. Use either `message` (whole) or `delta` (streamed)."""

    def __init__(self, output: ChatOutput) -> None:
        self._output = output
        self._stream: OutputStream | None = output.parser.stream() if output.parser is not None else None
        self._calls = 0  # calls handed out so far (after the max_calls cut)

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as OpenAI's message: content null beside tool calls (as OpenAI's), "" otherwise."""
        if self._output.parser is None:
            return {"role": "assistant", "content": text}
        parsed = self._output.parser.parse(text)
        calls = parsed.tool_calls[:self._output.max_calls]
        self._calls = len(calls)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content if calls else parsed.content or ""}
        if self._output.has_reasoning:
            message["reasoning_content"] = parsed.reasoning
        if calls and self._output.legacy:
            message["function_call"] = calls[0].to_openai()["function"]
        elif calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields for the next piece of text ({} when nothing is settled yet); `final` on the last piece
        settles what the parsers held back."""
        if self._stream is None:
            return {"content": text} if text else {}
        deltas = self._stream.feed(text) if text else []
        if final:
            deltas += self._stream.finish()
        return self._fields(deltas)

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" for an answer that made calls and ended by itself (not cut by max_tokens or aborted)."""
        if reason == "stop" and self._calls:
            return "function_call" if self._output.legacy else "tool_calls"
        return reason

    def _fields(self, deltas: list[Delta]) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
        content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
        calls = self._call_entries([d for d in deltas if isinstance(d, ToolCallDelta)])
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        if calls and self._output.legacy:  # one call (parallel_tool_calls false): its name first, then its arguments
            function = {k: v for k, v in calls[0]["function"].items() if k == "arguments" or "id" in calls[0]}
            fields["function_call"] = function
        elif calls:
            fields["tool_calls"] = calls
        return fields

    def _call_entries(self, deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
        """OpenAI's tool_calls delta entries, the pieces of one call merged (a call comes whole: its id and name,
        then its arguments, in the same step); calls past max_calls dropped."""
        limit = self._output.max_calls
        entries: list[dict[str, Any]] = []
        for d in deltas:
            if limit is not None and d.index >= limit:
                continue
            if d.id is None and entries and entries[-1]["index"] == d.index:
                entries[-1]["function"]["arguments"] += d.arguments
                continue
            entries.append(d.to_openai())
            if d.id is not None:
                self._calls += 1
        return entries
