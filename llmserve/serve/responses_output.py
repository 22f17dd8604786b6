"""A Responses API answer: the Response object and, streamed, its events (docs/serving.md, "Responses API").

The text goes through the chat's parsers (reasoning and tool calls split off: `Deltas`); its parts become output
items in the order the model wrote them: a `reasoning` item (content `reasoning_text`), a `message` (one
`output_text` part), a `function_call` per call, and a message after a call if the model wrote text there. Streamed, each item opens with
`response.output_item.added`, grows by its deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`), and closes with its `.done` events and `response.output_item.done`
before the next opens; the stream starts with `response.created` and `response.in_progress` and ends with
`response.completed` (`response.incomplete` when max_output_tokens cut it, `response.failed` when a step failed).
Every event carries its `sequence_number`. What the events add up to is the Response a non-streamed request gets.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmserve.sampling.logprobs import TokenLogprobs
from llmserve.serve.chat_tools import ChatOutput
from llmserve.serve.token_text import TokenText
from llmserve.tools import ContentDelta, Delta, OutputStream, ReasoningDelta, ToolCallDelta


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def response_logprobs(tt: TokenText, lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
    """output_text.logprobs: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    return [{"token": tt.text(lp.token_id), "logprob": lp.logprob, "bytes": tt.bytes(lp.token_id),
             "top_logprobs": [{"token": tt.text(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in lp.top]}
            for lp in lps]


def response_usage(input_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def message_item(iid: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": iid, "type": "message", "status": status, "role": "assistant", "content": [part]}


def reasoning_item(iid: str, text: str, status: str) -> dict[str, Any]:
    return {"id": iid, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": iid, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def items_as_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items as the assistant message the conversation continues from (previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for it in items:
        if it["type"] == "reasoning":
            message["reasoning_content"] = message.get("reasoning_content", "") + it["content"][0]["text"]
        elif it["type"] == "message":
            message["content"] += it["content"][0]["text"]
        else:
            message.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}})
    return message


class Deltas:
    """An answer's text -> its parts in the order the model wrote them (the chat's parsers: reasoning split off,
    tool calls read; ChatOutput), calls past max_calls dropped. Whole or streamed, the same parts."""

    def __init__(self, output: ChatOutput) -> None:
        self._stream: OutputStream | None = output.parser.stream() if output.parser is not None else None
        self._max_calls = output.max_calls

    def feed(self, text: str, final: bool) -> list[Delta]:
        if self._stream is None:
            return [ContentDelta(text)] if text else []
        deltas = self._stream.feed(text) if text else []
        if final:
            deltas += self._stream.finish()
        limit = self._max_calls
        return [d for d in deltas if not (isinstance(d, ToolCallDelta) and limit is not None and d.index >= limit)]


@dataclass
class _Open:
    """The output item being streamed."""

    kind: str  # "reasoning" | "message" | "function_call"
    index: int  # its output_index
    iid: str
    text: str = ""  # reasoning or message text, or a call's arguments so far
    call_id: str = ""
    name: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class EventWriter:
    """An answer's parts (`Deltas`) -> the Responses stream's events, in order, numbered, and the output items they
    add up to (`items`, after `finish`): a whole response is written by the same writer, its events unsent.
    `snapshot(status, output)` gives the response object the lifecycle events carry."""

    def __init__(self, snapshot: Callable[[str, list[dict[str, Any]]], dict[str, Any]], with_logprobs: bool) -> None:
        self._snapshot = snapshot
        self._with_logprobs = with_logprobs
        self._seq = 0
        self._open: _Open | None = None
        self.items: list[dict[str, Any]] = []  # the items closed so far
        self.reasoning = ""  # all reasoning text, for the usage's reasoning_tokens
        self.pending_logprobs: list[dict[str, Any]] = []  # logprobs of tokens whose text has not come yet
        self.answered = False  # a message or a call was opened: the answer has more than reasoning

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        return [self.event("response.created", response=self._snapshot("in_progress", [])),
                self.event("response.in_progress", response=self._snapshot("in_progress", []))]

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """The events of the next pieces of the answer, in the order the model wrote them."""
        events: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                events += self._text("reasoning", d.text)
            elif isinstance(d, ContentDelta):
                events += self._text("message", d.text)
            elif d.id is not None:  # a new call: its id and name, then its arguments
                events += self._close()
                self._open = _Open("function_call", len(self.items), item_id("fc"), call_id=d.id, name=d.name or "")
                self.answered = True
                events.append(self.event("response.output_item.added", output_index=self._open.index,
                                         item=call_item(self._open.iid, d.id, self._open.name, "", "in_progress")))
            if isinstance(d, ToolCallDelta) and d.arguments and self._open is not None:
                self._open.text += d.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open.iid,
                                         output_index=self._open.index, delta=d.arguments))
        return events

    def finish(self, status: str, response: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open item (a message even when nothing was written, as a whole response has one) and end
        with the lifecycle event of `status` ("completed", "incomplete", "failed") carrying `response`."""
        events = []
        if self.pending_logprobs or not self.answered:  # a message even when empty (as a whole response has), and
            events += self._text("message", "")  # the last tokens' logprobs (their text held back, then dropped)
        events += self._close("completed" if status == "completed" else "incomplete")
        response["output"] = self.items
        return events + [self.event(f"response.{status}", response=response)]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            self._open = _Open(kind, len(self.items), item_id("rs" if kind == "reasoning" else "msg"))
            self.answered = self.answered or kind == "message"
            events += self._added(self._open)
        o = self._open
        o.text += text
        if kind == "reasoning":
            self.reasoning += text
            if text:
                events.append(self.event("response.reasoning_text.delta", item_id=o.iid, output_index=o.index,
                                         content_index=0, delta=text))
        elif text or self.pending_logprobs:
            lps, self.pending_logprobs = self.pending_logprobs, []
            o.logprobs += lps
            events.append(self.event("response.output_text.delta", item_id=o.iid, output_index=o.index,
                                     content_index=0, delta=text, logprobs=lps))
        return events

    def _added(self, o: _Open) -> list[dict[str, Any]]:
        if o.kind == "reasoning":
            item = {"id": o.iid, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": o.iid, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=o.index, item=item),
                self.event("response.content_part.added", item_id=o.iid, output_index=o.index, content_index=0,
                           part=part)]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        o, self._open = self._open, None
        if o is None:
            return []
        at = {"item_id": o.iid, "output_index": o.index}
        if o.kind == "function_call":
            item = call_item(o.iid, o.call_id, o.name, o.text, status)
            events = [self.event("response.function_call_arguments.done", **at, name=o.name, arguments=o.text)]
        elif o.kind == "reasoning":
            item = reasoning_item(o.iid, o.text, status)
            events = [self.event("response.reasoning_text.done", **at, content_index=0, text=o.text),
                      self.event("response.content_part.done", **at, content_index=0, part=item["content"][0])]
        else:
            item = message_item(o.iid, o.text, o.logprobs if self._with_logprobs else None, status)
            events = [self.event("response.output_text.done", **at, content_index=0, text=o.text,
                                 logprobs=o.logprobs),
                      self.event("response.content_part.done", **at, content_index=0, part=item["content"][0])]
        self.items.append(item)
        return events + [self.event("response.output_item.done", output_index=o.index, item=item)]
