"""Tool-call parsing shared by every model family: one incremental machine, fed text deltas, that hands back
content and whole tool calls; the whole-text parse is the same machine fed everything at once.

A family supplies a scanner: `step(buf, final)` looks at the start of the text not yet settled and answers how
much of it is settled now (`Step.consumed`) and whether those characters are content or a group of calls; 0
means "wait for more text" (never when `final`). Decisions depend only on the characters present, so every
split of a text into deltas settles the same pieces, which is what makes a stream reassemble exactly to the
non-streamed result.

A call is handed on only once its text is complete and parses (`{"name": ..., "arguments": {...}}`); until
then it is held back, and text that could still become a call marker (`<tool_c`) is held back too. Why not
stream the arguments as they come, as vLLM does: a call that turns out malformed (or a JSON answer that only
looked like one) cannot be taken back from a stream, and the client would get a call the non-streamed
response does not have. So a call arrives as two deltas, id and name, then its arguments in one piece.

Whitespace next to calls is layout (Qwen writes "\\n" between `</tool_call>` and the next `<tool_call>`): it is
held until what follows is known, dropped before a call and after the last one, and kept inside content and in
responses without calls.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from llmserve.tools.calls import ContentDelta, Delta, ParsedOutput, ToolCallDelta, assemble, openai_call_id
from llmserve.tools.definitions import Tool

Call = tuple[str, str]  # (name, arguments as JSON text)


class Step(NamedTuple):
    consumed: int  # characters settled from the start of the buffer; 0: wait for more text
    calls: tuple[Call, ...] | None = None  # None: the consumed characters are content


WAIT = Step(0)


class Scanner(ABC):
    def __init__(self) -> None:
        self._json = JsonEnd()

    @abstractmethod
    def step(self, buf: str, final: bool) -> Step: ...

    def value_end(self, buf: str, start: int) -> int | None:
        """json_value_end, resumed where the last call for this `start` stopped: while a scanner waits the buffer
        only grows, so a long call is scanned once, not once per delta."""
        return self._json.find(buf, start)

    def settled(self) -> None:
        """The stream took `consumed` characters off the buffer: positions remembered in it are stale."""
        self._json = JsonEnd()


class ToolParser(ABC):
    name: ClassVar[str]
    # Grammar pieces (tools/grammar.py): calls written freely start with `trigger`; several forced calls are
    # joined by `separator`.
    trigger: str
    separator: str

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self.new_id = new_id or self.default_id

    default_id: ClassVar[Callable[[], str]] = staticmethod(openai_call_id)

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return assemble(stream.feed(text) + stream.finish())

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.scanner(), self.new_id)

    @abstractmethod
    def scanner(self) -> Scanner: ...

    @abstractmethod
    def call_tag(self, tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
        """xgrammar's tag format for one call of `tool` whose arguments match `schema`."""

    def forced_body(self, calls: dict[str, Any]) -> dict[str, Any]:
        """The output of a forced response around `calls` (one call, a choice of calls, or several)."""
        return calls

    def auto_tag(self, tool: Tool, schema: dict[str, Any]) -> dict[str, Any]:
        """A call as it starts in free text (begins with `trigger`)."""
        return self.call_tag(tool, schema)


# Consecutive whitespace characters a forced call's arguments may hold between JSON tokens. JSON allows any amount,
# and a model that prefers whitespace (small or random ones do) would write it until max_tokens, never finishing the
# call; 16 still takes arguments indented a few levels deep. xgrammar recommends such a bound for tool arguments.
MAX_ARGUMENT_WHITESPACE = 16


def arguments_format(schema: dict[str, Any]) -> dict[str, Any]:
    """xgrammar's format for a call's arguments: JSON matching `schema`, in the schema's key order."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE}


class ToolCallStream:
    def __init__(self, scanner: Scanner, new_id: Callable[[], str]) -> None:
        self._scanner = scanner
        self._new_id = new_id
        self._buf = ""
        self._sink = _ContentSink()
        self.num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[Delta]:
        """The end of the output: what was held back is settled (a partial marker is content)."""
        out = self._drain(final=True)
        return out + self._sink.finish()

    def _drain(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while self._buf:
            step = self._scanner.step(self._buf, final)
            if not step.consumed:
                assert not final, "a scanner settles everything at the end"
                break
            text, self._buf = self._buf[:step.consumed], self._buf[step.consumed:]
            self._scanner.settled()
            if step.calls is None:
                out += self._sink.add(text)
                continue
            self._sink.call()
            for name, arguments in step.calls:
                out += [ToolCallDelta(self.num_calls, "", self._new_id(), name), ToolCallDelta(self.num_calls, arguments)]
                self.num_calls += 1
        return out


class _ContentSink:
    """Content with its trailing whitespace held back until the next content (kept), call (dropped) or the end
    (kept only if no call was made)."""

    def __init__(self) -> None:
        self._held = ""
        self._called = False

    def add(self, text: str) -> list[Delta]:
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body):]
        return [ContentDelta(body)] if body else []

    def call(self) -> None:
        self._held, self._called = "", True

    def finish(self) -> list[Delta]:
        held, self._held = self._held, ""
        return [ContentDelta(held)] if held and not self._called else []


def content_up_to(buf: str, marker: str, final: bool) -> Step:
    """Content until `marker` (found at 0: the caller's turn); without it, all but a tail that may begin it."""
    i = buf.find(marker)
    if i >= 0:
        return Step(i)
    return Step(len(buf) if final else len(buf) - partial_suffix(buf, marker))


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


# Outside strings: a bracket, a quote opening a string, or a run of anything else. Inside a string: everything up
# to its closing quote or the end, whole escapes only (a trailing backslash waits for the character it escapes).
_OUTSIDE = re.compile(r'[{}\[\]"]|[^"{}\[\]]+')
_IN_STRING = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*', re.S)
_CLOSER = {"{": "}", "[": "]"}


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the object or array starting at text[start], by its brackets outside strings; None while
    it is unfinished. ValueError for mismatched brackets. Whether it is valid JSON is json.loads' question."""
    return JsonEnd().find(text, start)


class JsonEnd:
    """json_value_end that keeps its place between calls on a growing text (for one `start`), so each character
    is looked at once however many deltas the value arrives in."""

    def __init__(self) -> None:
        self._start = -1
        self._pos = 0
        self._stack: list[str] = []  # the closing bracket each open one needs
        self._in_string = False
        self._end: int | None = None

    def find(self, text: str, start: int) -> int | None:
        if start != self._start:
            self._start, self._pos, self._stack, self._in_string, self._end = start, start, [], False, None
        stack = self._stack
        while self._end is None and self._pos < len(text):
            if self._in_string:
                self._pos = _IN_STRING.match(text, self._pos).end()  # type: ignore[union-attr]  (matches "")
                if self._pos == len(text) or text[self._pos] != '"':
                    return None
                self._pos += 1
                self._in_string = False
                continue
            m = _OUTSIDE.match(text, self._pos)
            assert m is not None  # the pattern takes any character
            piece = m.group()
            self._pos = m.end()
            if piece == '"':
                self._in_string = True
            elif piece in _CLOSER:
                stack.append(_CLOSER[piece])
            elif piece in ("}", "]"):
                if not stack or stack.pop() != piece:
                    raise ValueError("mismatched bracket")
                if not stack:
                    self._end = self._pos
            elif not stack:
                raise ValueError("not an object or array")
        return self._end


_INVALID = object()


def load_json(text: str) -> Any:
    """json.loads, or _INVALID. strict=False: raw control characters inside strings are taken (models write literal
    newlines in code arguments, and xgrammar's bounded-length strings allow them); the arguments are re-encoded."""
    try:
        return json.loads(text, strict=False)
    except (ValueError, RecursionError):
        return _INVALID


def call_from_object(obj: Any, argument_keys: tuple[str, ...] = ("arguments", "parameters")) -> Call | None:
    """(name, arguments JSON) from {"name": str, "arguments": {...}}; None if it is not that shape. The arguments
    may also come as a JSON string holding the object (some models encode them), or be left out (no arguments)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    present = [k for k in argument_keys if k in obj]
    if not isinstance(name, str) or not name or len(present) > 1:
        return None
    arguments = obj[present[0]] if present else {}
    if isinstance(arguments, str):
        arguments = load_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)
