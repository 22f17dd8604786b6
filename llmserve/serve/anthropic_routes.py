"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens, as Anthropic's clients (its SDK,
and tools built on it) call them; errors in Anthropic's shape (serve/errors.py), the key as `x-api-key` or a bearer
token (app.py).

A request runs as the chat request it amounts to (anthropic_input.py); the answer's parts, in the order the model
wrote them (the chat's parsers: `Deltas`), become content blocks (`thinking`, `text`, `tool_use`), whole or as
Anthropic's events: `message_start`, per block `content_block_start`, its deltas (`text_delta`, `thinking_delta`,
`input_json_delta`) and `content_block_stop`, then `message_delta` (stop_reason, usage) and `message_stop`.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmserve.engine.output import SequenceOutput
from llmserve.serve.anthropic_input import Conversation, check_fields, conversation
from llmserve.serve.chat_tools import ChatOutput, chat_output, chat_tool_request
from llmserve.serve.errors import ApiError, anthropic_error, error_responses
from llmserve.serve.generation import EngineRequest, new_request_id, open_request
from llmserve.serve.openai_params import (
    PARAM_NAMES,
    chat_generation_config,
    chat_prompt,
    check_model,
    check_prompt_length,
    session_id_of,
)
from llmserve.serve.protocol import (
    AnthropicCountTokensRequest,
    AnthropicMessagesRequest,
    refuse_unknown_fields,
)
from llmserve.serve.responses_output import Deltas
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import MAY_STREAM, REQUEST_ID_HEADER, SSEResponse, until_disconnected
from llmserve.tools import ContentDelta, Delta, ReasoningDelta, ToolCallDelta


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: str
    error: AnthropicErrorDetail


router = APIRouter(responses=error_responses(AnthropicError))
# The chat's field names -> this API's, for the chat path's refusals.
_NAMES = {"max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "stop": "stop_sequences",
          "response_format": "output_config.format", "reasoning_effort": "output_config.effort",
          "continue_final_message": "messages", "tool_choice": "tool_choice", "tools": "tools"}
_ENGINE_NAMES = {**PARAM_NAMES, "max_new_tokens": "max_tokens", "stop_words": "stop_sequences",
                 "response_format": "output_config.format"}


def _state(request: Request) -> ServerState:
    return request.app.state.llm


def _renamed(e: ApiError, body: AnthropicMessagesRequest | AnthropicCountTokensRequest,
             conv: Conversation | None) -> ApiError:
    """A refusal from the chat path in this API's names: `messages[3]` is the request message it came from, the
    chat_template_kwargs a thinking setting made are `thinking`, and tools are flat (`tools[1].name`)."""
    names = {**_NAMES, "chat_template_kwargs": "thinking" if body.thinking is not None else "chat_template_kwargs"}
    name = names.get(e.param or "", e.param)
    message = e.message
    for old, new in names.items():
        if message.startswith(old + ":") or message.startswith(old + " "):
            message = new + message[len(old):]
            break
    if body.thinking is not None and message.startswith("chat_template_kwargs.enable_thinking"):
        message = "thinking" + message[len("chat_template_kwargs.enable_thinking"):]
    if conv is not None:
        # the chat's content parts are not the request's blocks (tool results move out, text parts join): name the
        # request's message only
        message = re.sub(r"\bmessages\[(\d+)\](\.content\[\d+\])?", lambda m: conv.where(int(m.group(1))),
                         message)
    message = message.replace("a 'image_url' part", "an image block")
    if name in ("tools", "tool_choice"):
        message = message.replace(".function.", ".")
    return ApiError(e.status, message, name, e.code)


async def _prompt(state: ServerState, model: ServedModel,
                  body: AnthropicMessagesRequest | AnthropicCountTokensRequest) -> tuple[Conversation, Any, Any]:
    conv = None
    try:
        conv = conversation(body)
        tools = chat_tool_request(model, conv.chat)
        return conv, tools, await chat_prompt(model, conv.chat, tools, state.image_limits)
    except ApiError as e:
        raise _renamed(e, body, conv) from None


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: AnthropicCountTokensRequest, request: Request) -> JSONResponse:
    state = _state(request)
    _, model = state.ready()
    check_model(model, body.model)
    refuse_unknown_fields(body)
    _, _, prompt = await until_disconnected(request, _prompt(state, model, body))
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


@router.post("/v1/messages", responses=MAY_STREAM)
async def create_message(body: AnthropicMessagesRequest, request: Request) -> Response:
    state = _state(request)
    engine, model = state.ready()
    adapter = check_model(model, body.model)
    with state.admit() as permit:
        check_fields(body)
        conv, tools, prompt = await until_disconnected(request, _prompt(state, model, body))
        try:
            max_tokens = check_prompt_length(model, len(prompt.token_ids), body.max_tokens, "messages")
            output = chat_output(model, tools, prompt.text)
            gen = chat_generation_config(model, conv.chat, max_tokens, output)
        except ApiError as e:
            raise _renamed(e, body, conv) from None
        rid = new_request_id("msg").replace("-", "_")
        req = EngineRequest(rid, prompt.token_ids, gen, _ENGINE_NAMES, session_id=session_id_of(conv.chat),
                            mm=prompt.mm, adapter=adapter)
        outputs = await until_disconnected(request, open_request(state, engine, req))
        reply = _Reply(model, req, output)
        if body.stream:
            return SSEResponse(reply.stream(outputs), on_close=permit.hand_over(), request_id=rid, source=outputs)
        return JSONResponse(await until_disconnected(request, reply.collect(outputs)),
                            headers={REQUEST_ID_HEADER: rid})


class BlockWriter:
    """An answer's parts -> content blocks and the events that build them, in order (one block open at a time). A
    whole message is written by the same writer, its events unsent, so both have the same blocks."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []  # closed blocks, in order
        self._open: dict[str, Any] | None = None
        self._arguments = ""  # the open tool_use block's input so far, as JSON text

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": d.text}, "thinking", d.text)
            elif isinstance(d, ContentDelta):
                events += self._delta("text", {"type": "text_delta", "text": d.text}, "text", d.text)
            else:
                events += self._call(d)
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _delta(self, kind: str, delta: dict[str, Any], key: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            self._open = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": len(self.blocks), "content_block": dict(self._open)})
        self._open[key] += text
        if text:
            events.append({"type": "content_block_delta", "index": len(self.blocks), "delta": delta})
        return events

    def _call(self, d: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if d.id is not None:
            events += self._close()
            self._open = {"type": "tool_use", "id": d.id, "name": d.name or "", "input": {}}
            self._arguments = ""
            events.append({"type": "content_block_start", "index": len(self.blocks), "content_block": dict(self._open)})
        if d.arguments and self._open is not None and self._open["type"] == "tool_use":
            self._arguments += d.arguments
            events.append({"type": "content_block_delta", "index": len(self.blocks),
                           "delta": {"type": "input_json_delta", "partial_json": d.arguments}})
        return events

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            block["input"] = json.loads(self._arguments) if self._arguments.strip() else {}
        self.blocks.append(block)
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


class _Reply:
    def __init__(self, model: ServedModel, req: EngineRequest, output: ChatOutput) -> None:
        self.model, self.req, self.output = model, req, output

    def _stop(self, writer: BlockWriter, finish_reason: str | None,
              stop: str | int | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) in Anthropic's terms."""
        if finish_reason == "abort":
            raise ApiError(500, "the generation was aborted before it finished (the server is stopping, or the "
                                "output could not go on)")
        if finish_reason == "length":
            return "max_tokens", None
        if writer.called:
            return "tool_use", None
        if isinstance(stop, str):
            return "stop_sequence", stop
        return "end_turn", None

    def _usage(self, output_tokens: int, cached: int) -> dict[str, Any]:
        """Anthropic's split: input_tokens are the ones computed, cache reads apart (their sum is the prompt)."""
        return {"input_tokens": len(self.req.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output_tokens}

    def _message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.req.request_id, "type": "message", "role": "assistant",
                "model": self.req.adapter or self.model.name, "content": content, "stop_reason": stop[0],
                "stop_sequence": stop[1], "usage": usage}

    async def collect(self, outputs: AsyncIterator[SequenceOutput]) -> dict[str, Any]:
        text, tokens, cached, finish, stop = "", 0, 0, None, None
        async with aclosing(outputs):
            async for out in outputs:
                text += out.new_text
                tokens, cached = out.num_output_tokens, out.num_cached_tokens
                if out.finished:
                    finish, stop = out.finish_reason, out.stop_reason
        writer = BlockWriter()
        writer.feed(Deltas(self.output).feed(text, True))
        writer.finish()
        return self._message(writer.blocks, self._stop(writer, finish, stop), self._usage(tokens, cached))

    async def stream(self, outputs: AsyncIterator[SequenceOutput]) -> AsyncIterator[str]:
        writer, deltas = BlockWriter(), Deltas(self.output)
        tokens, started = 0, False
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    if not started:  # the first output says how much of the prompt came from the cache
                        started = True
                        yield _sse({"type": "message_start", "message": self._message(
                            [], (None, None), self._usage(0, out.num_cached_tokens))})
                    tokens = out.num_output_tokens
                    events = writer.feed(deltas.feed(out.new_text, out.finished))
                    if out.finished:
                        events += writer.finish()
                        stop = self._stop(writer, out.finish_reason, out.stop_reason)
                        events += [{"type": "message_delta", "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                    "usage": {"output_tokens": tokens}}, {"type": "message_stop"}]
                    for event in events:
                        yield _sse(event)
        except ApiError as e:
            yield _sse(anthropic_error(e.status, e.message))


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
