"""Choosing a model's tool-call parser: by vLLM's name (`--tool-call-parser`), or from its chat template, whose
text shows how it writes calls back into the conversation."""

from __future__ import annotations

import re

from llmserve.errors import InvalidRequestError
from llmserve.tools.hermes import HermesParser
from llmserve.tools.llama3_json import PYTHON_TAG, Llama3JsonParser
from llmserve.tools.mistral import ARGS, MARKER, MistralParser
from llmserve.tools.parser import ToolParser

# vLLM's names; llama4_json is vLLM's second name for the same parser (Llama 4 writes the same JSON calls).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def tool_parser(name: str, chat_template: str | None = None) -> ToolParser:
    """The parser called `name`; the template, if given, picks the Mistral variant that forced calls are written in."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise InvalidRequestError(f"tool_call_parser: unknown parser {name!r}; choose one of "
                                  f"{', '.join(TOOL_PARSERS)}", param="tool_call_parser")
    if cls is MistralParser:
        return MistralParser(args_marker=chat_template is not None and ARGS in chat_template)
    return cls()


def detect_tool_parser(chat_template: str) -> str | None:
    """The parser whose markers the template writes, or None (a template without tool calls, or an unknown format).

    Mistral's `[TOOL_CALLS]` is checked first, then Hermes/Qwen's `<tool_call>`, then Llama 3's `<|python_tag|>`
    or its instruction to answer with {"name": ..., "parameters": ...} (Llama 3.2's template has no python tag)."""
    if MARKER in chat_template:
        return "mistral"
    if "<tool_call>" in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template or ('"parameters": ' in chat_template and "<|start_header_id|>" in chat_template):
        return "llama3_json"
    return None


def resolve_tool_parser(name: str | None, chat_template: str) -> ToolParser:
    """`name` if given; else the template's format; else Hermes, the format that chat_template.py describes tools in
    for a template that shows the model none."""
    if name is not None:
        return tool_parser(name, chat_template)
    detected = detect_tool_parser(chat_template)
    if detected is not None:
        return tool_parser(detected, chat_template)
    if template_supports_tools(chat_template):
        raise InvalidRequestError("tool_call_parser: the chat template takes tools but writes calls in a format "
                                  f"llmserve cannot tell; name one of {', '.join(TOOL_PARSERS)}",
                                  param="tool_call_parser")
    return HermesParser()


def template_supports_tools(chat_template: str) -> bool:
    """Whether the template reads `tools` at all (one that does not would drop them without a word)."""
    return re.search(r"\btools\b", chat_template) is not None
