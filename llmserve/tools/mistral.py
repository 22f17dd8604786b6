"""Mistral tool calls (vLLM's `mistral`), after the `[TOOL_CALLS]` token, in the three shapes Mistral's
tokenizer versions write:

    [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": {"a": 2}}]   (v3: 7B v0.3, Nemo)
    [TOOL_CALLS]add{"a": 1}[TOOL_CALLS]mul{"a": 2}                                                  (v11)
    [TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]mul[ARGS]{"a": 2}                                      (v13: Small 3.2, Devstral)

Text before the first `[TOOL_CALLS]` is content. `[TOOL_CALLS]` is a special token in Mistral's tokenizers: the
output must be decoded with special tokens kept, or the parser never sees it. Call ids are nine letters and
digits (mistral_common's rule, which the templates enforce when the call comes back in the conversation).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from llmserve.tools.calls import mistral_call_id
from llmserve.tools.definitions import Tool
from llmserve.tools.parser import (
    WAIT,
    Call,
    Scanner,
    Step,
    ToolParser,
    arguments_format,
    call_from_object,
    content_up_to,
    load_json,
    skip_ws,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


class MistralScanner(Scanner):
    def step(self, buf: str, final: bool) -> Step:
        found = content_up_to(buf, MARKER, final)
        return found if found.consumed or not buf.startswith(MARKER) else self._calls(buf, final)

    def _calls(self, buf: str, final: bool) -> Step:
        not_calls = Step(len(MARKER))
        p = skip_ws(buf, len(MARKER))
        if p == len(buf):
            return not_calls if final else WAIT
        name = None
        if buf[p] not in "[{":  # v11 / v13: the name, then [ARGS] (v13), then the arguments object
            m = _NAME.match(buf, p)
            if m is None:
                return not_calls
            name, p = m.group(), m.end()
            if buf.startswith(ARGS, p):
                p += len(ARGS)
            elif p == len(buf) or (ARGS.startswith(buf[p:]) and not final):
                return not_calls if final else WAIT
            if p == len(buf):
                return not_calls if final else WAIT
            if buf[p] != "{":
                return not_calls
        try:
            end = self.value_end(buf, p)
        except ValueError:
            return not_calls
        if end is None:
            return not_calls if final else WAIT
        calls = _calls_from(load_json(buf[p:end]), name)
        return Step(end, calls) if calls else not_calls


def _calls_from(value: Any, name: str | None) -> tuple[Call, ...] | None:
    if name is not None:
        objects = [{"name": name, "arguments": value}]
    elif isinstance(value, list):
        objects = value
    else:
        objects = [value]
    calls = [call_from_object(o, ("arguments",)) for o in objects]
    if not calls or any(c is None for c in calls):
        return None
    return tuple(c for c in calls if c is not None)


class MistralParser(ToolParser):
    """`args_marker`: forced calls are written as v13 does (`[TOOL_CALLS]name[ARGS]{...}`) rather than as v3's
    JSON list; chosen from the chat template (parsing takes every shape either way)."""

    name = "mistral"
    trigger = MARKER
    separator = ", "
    default_id = staticmethod(mistral_call_id)

    def __init__(self, args_marker: bool = False, new_id: Callable[[], str] | None = None) -> None:
        super().__init__(new_id)
        self.args_marker = args_marker
        if args_marker:
            self.separator = ""

    def scanner(self) -> Scanner:
        return MistralScanner()

    def call_tag(self, tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
        content = arguments_format(schema)
        if self.args_marker:
            return {"type": "tag", "begin": f"{MARKER}{tool.name}{ARGS}", "content": content, "end": ""}
        return {"type": "tag", "begin": f'{{"name": {json.dumps(tool.name)}, "arguments": ', "content": content,
                "end": "}"}

    def forced_body(self, calls: dict[str, Any]) -> dict[str, Any]:
        if self.args_marker:
            return calls
        return {"type": "sequence", "elements": [{"type": "const_string", "value": MARKER + "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}

    def auto_tag(self, tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
        tag = self.call_tag(tool, schema)
        if self.args_marker:
            return tag
        return {**tag, "begin": MARKER + "[" + tag["begin"], "end": "}]"}
