"""Hermes 2 Pro / Qwen2.5 / Qwen3 tool calls (vLLM's `hermes`):

    Let me look that up.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Any number of calls, each one JSON object between the tags (Qwen's template writes them this way; Hermes also
puts "arguments" first). A call cut off before `</tool_call>` (the model stopped there) still counts when its
JSON is complete. A `<tool_call>` not followed by such an object is content, as is `</tool_call>` alone.
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.tools.definitions import Tool
from llmserve.tools.parser import (
    WAIT,
    Scanner,
    Step,
    ToolParser,
    arguments_format,
    call_from_object,
    content_up_to,
    load_json,
    skip_ws,
)

START, END = "<tool_call>", "</tool_call>"


class HermesScanner(Scanner):
    def step(self, buf: str, final: bool) -> Step:
        found = content_up_to(buf, START, final)
        return found if found.consumed or not buf.startswith(START) else self._call(buf, final)

    def _call(self, buf: str, final: bool) -> Step:
        not_a_call = Step(len(START))  # the tag is content; scanning goes on after it
        j = skip_ws(buf, len(START))
        if j == len(buf):
            return not_a_call if final else WAIT
        if buf[j] != "{":
            return not_a_call
        try:
            end = self.value_end(buf, j)
        except ValueError:
            return not_a_call
        if end is None:
            return not_a_call if final else WAIT
        k = skip_ws(buf, end)
        rest = buf[k:]
        if rest.startswith(END):
            close = k + len(END)
        elif END.startswith(rest):  # nothing or part of the end tag so far
            if not final:
                return WAIT
            close = len(buf)  # the output ended there: the call is complete without its tag
        else:
            return not_a_call
        call = call_from_object(load_json(buf[j:end]))
        return Step(close, (call,)) if call else not_a_call


class HermesParser(ToolParser):
    name = "hermes"
    trigger = START
    separator = "\n"

    def scanner(self) -> Scanner:
        return HermesScanner()

    def call_tag(self, tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
        # Exactly what Qwen2.5's template writes for a call in the conversation.
        return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
                "content": arguments_format(schema), "end": f"}}\n{END}"}
