"""Llama 3.1 / 3.2 / 3.3 (and 4) JSON tool calls (vLLM's `llama3_json`): the whole response is the call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after the `<|python_tag|>` token, several calls joined by ";" (`{...}; {...}`). Meta's templates ask
for "parameters"; "arguments" is taken too. The response is a call only if it starts with one (after
whitespace): a `{` later in prose is content, and so is a first object that is not a call (a JSON answer).
After the calls, anything but "; {call}" is content.
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
    load_json,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonScanner(Scanner):
    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"  # "start": nothing settled yet; "calls": after a call; "content": the rest is content

    def step(self, buf: str, final: bool) -> Step:
        if self._mode == "content":
            return Step(len(buf))
        j = skip_ws(buf, 0)
        if self._mode == "calls":
            if j:
                return Step(j)  # layout between calls: content the sink drops unless text follows
            if buf[0] != ";":
                return self._content(buf)
            return self._object(buf, skip_ws(buf, 1), final)
        rest = buf[j:]
        if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
            return self._content(buf) if final else WAIT
        if rest.startswith(PYTHON_TAG):
            j = skip_ws(buf, j + len(PYTHON_TAG))
        return self._object(buf, j, final)

    def _object(self, buf: str, p: int, final: bool) -> Step:
        if p == len(buf):
            return self._content(buf) if final else WAIT
        if buf[p] != "{":
            return self._content(buf)
        try:
            end = self.value_end(buf, p)
        except ValueError:
            return self._content(buf)
        if end is None:
            return self._content(buf) if final else WAIT
        call = call_from_object(load_json(buf[p:end]), ("parameters", "arguments"))
        if call is None:
            return self._content(buf)
        self._mode = "calls"
        return Step(end, (call,))

    def _content(self, buf: str) -> Step:
        self._mode = "content"
        return Step(len(buf))


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    trigger = '{"name": '
    separator = "; "

    def scanner(self) -> Scanner:
        return Llama3JsonScanner()

    def call_tag(self, tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
        # As Meta's template writes a call in the conversation: {"name": "f", "parameters": {...}}.
        return {"type": "tag", "begin": f'{{"name": {json.dumps(tool.name)}, "parameters": ',
                "content": arguments_format(schema), "end": "}"}
