"""Tool calling and reasoning output: the request's tools (definitions.py), each model family's call syntax
parsed from its output, whole or streamed (hermes.py, llama3_json.py, mistral.py over parser.py), the parser
chosen by name or from the chat template (registry.py), grammars that force calls (grammar.py), the
<think> split (reasoning.py), and both together over one response (output.py)."""

from llmserve.tools.calls import (
    ContentDelta,
    Delta,
    ParsedOutput,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    assemble,
)
from llmserve.tools.definitions import Tool, ToolRequest, parse_tool_request
from llmserve.tools.grammar import auto_tool_grammar, forced_tool_grammar, tool_call_grammar
from llmserve.tools.output import OutputParser, OutputStream
from llmserve.tools.parser import ToolCallStream, ToolParser
from llmserve.tools.reasoning import REASONING_PARSERS, ReasoningParser, prompt_thinking, reasoning_parser
from llmserve.tools.registry import TOOL_PARSERS, detect_tool_parser, resolve_tool_parser, tool_parser

__all__ = [
    "REASONING_PARSERS", "TOOL_PARSERS", "ContentDelta", "Delta", "OutputParser", "OutputStream", "ParsedOutput",
    "ReasoningDelta", "ReasoningParser", "Tool", "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser",
    "ToolRequest", "assemble", "auto_tool_grammar", "detect_tool_parser", "forced_tool_grammar",
    "parse_tool_request", "prompt_thinking", "reasoning_parser", "resolve_tool_parser", "tool_call_grammar",
    "tool_parser",
]
