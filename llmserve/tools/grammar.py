"""Grammars that make the model call tools, in its family's syntax (xgrammar structural tags).

    required     one call of any allowed tool (several, joined as the family joins them, with
                 parallel_tool_calls), arguments matching that tool's parameters schema (even for a tool
                 that says `strict: false`: a call we force may as well be a valid one)
    a function   exactly one call of it
    auto         free text, unconstrained (vLLM's behaviour), unless a tool asks for `strict` adherence or
                 tool_choice narrows the tools with allowed_tools: then the text stays free but once the model
                 opens a call (the family's trigger, e.g. `<tool_call>`) it must finish a call of an allowed
                 tool, its arguments matching the tool's schema (any JSON object for a tool that says
                 `strict: false`, as xgrammar's own tool grammars do). SGLang constrains strict tools the same way.
    none         no grammar

Why `auto` is not always constrained: a grammar costs a mask on every token of what is mostly free text, and
a trigger written in prose or in reasoning (a model explaining `<tool_call>`) would be forced into a call;
OpenAI's `strict` is the client's way to ask for the schema, and allowed_tools a promise only a grammar keeps.

With a reasoning parser, a reasoning block comes first and is free text (`<think>` ... `</think>`, the opening
tag left out where the prompt already opened it), so forcing a call never stops a reasoning model thinking.
"""

from __future__ import annotations

from typing import Any

from llmserve.structured.spec import StructuredOutput, structural_tag
from llmserve.tools.definitions import ToolRequest
from llmserve.tools.parser import ToolParser
from llmserve.tools.reasoning import END_THINK, THINK, ReasoningParser

ANY_OBJECT: dict[str, Any] = {"type": "object"}
PARAM = "tools"  # the request field a grammar error names (a parameters schema xgrammar cannot compile)


def tool_call_grammar(parser: ToolParser, request: ToolRequest, reasoning: ReasoningParser | None = None,
                      thinking: bool | None = None) -> StructuredOutput | None:
    """The grammar a request's tool_choice asks for, or None where the model writes freely."""
    if request.mode in ("required", "function"):
        return forced_tool_grammar(parser, request, reasoning, thinking)
    if request.mode == "auto" and (any(t.strict for t in request.allowed_tools)
                                   or len(request.allowed) < len(request.tools)):
        return auto_tool_grammar(parser, request, reasoning, thinking)
    return None


def forced_tool_grammar(parser: ToolParser, request: ToolRequest, reasoning: ReasoningParser | None = None,
                        thinking: bool | None = None) -> StructuredOutput:
    tools = request.allowed_tools
    assert request.mode in ("required", "function") and tools
    tags = [parser.call_tag(t, t.schema) for t in tools]
    if request.mode == "required" and request.parallel_tool_calls:
        calls: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": parser.separator,
                                 "at_least_one": True}
    elif len(tags) == 1:
        calls = tags[0]
    else:
        calls = {"type": "or", "elements": tags}
    return _structural_tag(parser.forced_body(calls), reasoning, thinking)


def auto_tool_grammar(parser: ToolParser, request: ToolRequest, reasoning: ReasoningParser | None = None,
                      thinking: bool | None = None) -> StructuredOutput:
    tags = [parser.auto_tag(t, ANY_OBJECT if t.strict is False else t.schema) for t in request.allowed_tools]
    body = {"type": "triggered_tags", "triggers": [parser.trigger], "tags": tags,
            "stop_after_first": not request.parallel_tool_calls}
    return _structural_tag(body, reasoning, thinking)


def _structural_tag(body: dict[str, Any], reasoning: ReasoningParser | None,
                    thinking: bool | None) -> StructuredOutput:
    if reasoning is not None and thinking is not False:
        inside = reasoning.starts_in_reasoning if thinking is None else True
        think = {"type": "tag", "begin": "" if inside else THINK, "content": {"type": "any_text"}, "end": END_THINK}
        # "\n\n" after </think>: what Qwen3 and DeepSeek-R1 write before the answer
        body = {"type": "sequence", "elements": [think, {"type": "const_string", "value": "\n\n"}, body]}
    return structural_tag({"type": "structural_tag", "format": body}, PARAM)
