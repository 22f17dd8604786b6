"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request is turned into the chat request it amounts to (responses_input.py) and runs the chat route's steps
(template, tools, grammar, sampling; the same refusals); the answer comes back as a Response or its events
(responses_output.py). With `store` (OpenAI's default) the response is kept in memory (`ResponseStore`, the
newest --responses-store-size of them) so that GET reads it back and `previous_response_id` continues its
conversation; they are lost when the server stops.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from llmserve.engine.output import SequenceOutput
from llmserve.serve.chat_tools import ChatOutput, ChoiceOutput, chat_output, chat_tool_request
from llmserve.serve.errors import ApiError, OpenAIError, error_responses
from llmserve.serve.generation import EngineRequest, new_request_id, open_request
from llmserve.serve.openai_format import Choice
from llmserve.serve.openai_params import (
    PARAM_NAMES,
    ChatPrompt,
    chat_generation_config,
    chat_prompt,
    check_model,
    check_prompt_length,
    session_id_of,
)
from llmserve.serve.protocol import ResponsesRequest
from llmserve.serve.response_store import StoredResponse
from llmserve.serve.responses_input import Conversation, check_fields, conversation, logprobs_wanted
from llmserve.serve.responses_output import (
    EventWriter,
    item_id,
    items_as_message,
    output_items,
    response_logprobs,
    response_usage,
)
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import MAY_STREAM, REQUEST_ID_HEADER, SSEResponse, until_disconnected

router = APIRouter(responses=error_responses(OpenAIError))
# The chat's field names -> this API's, for the chat path's refusals.
_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
          "response_format": "text.format", "messages": "input", "reasoning_effort": "reasoning.effort"}
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_ENGINE_NAMES = {**PARAM_NAMES, "max_new_tokens": "max_output_tokens", "logprobs": "top_logprobs",
                 "response_format": "text.format"}


def _state(request: Request) -> ServerState:
    return request.app.state.llm


def _renamed(e: ApiError) -> ApiError:
    """A refusal from the chat path, naming the field as this API spells it (its function tools are flat:
    `tools[1].name` where the chat says `tools[1].function.name`)."""
    name = _NAMES.get(e.param or "", e.param)
    message = e.message
    for old, new in _NAMES.items():
        if message.startswith(old):
            message = new + message[len(old):]
            break
    if name in ("tools", "tool_choice"):
        message = message.replace(".function.", ".").replace("tool_choice.allowed_tools.", "tool_choice.")
    message = message.replace("the messages have", "the input has").replace("in the messages", "in the input")
    return ApiError(e.status, message, name, e.code)


@router.post("/v1/responses", responses=MAY_STREAM)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = _state(request)
    engine, model = state.ready()
    adapter = check_model(model, body.model)
    with state.admit() as permit:
        check_fields(body)
        history = state.responses.get(body.previous_response_id, previous=True).messages \
            if body.previous_response_id is not None else []
        try:
            conv, prompt = await until_disconnected(request, _prompt(state, model, body, history))
            max_tokens = check_prompt_length(model, len(prompt.token_ids), body.max_output_tokens, "messages")
            tools = chat_tool_request(model, conv.chat)
            output = chat_output(model, tools, prompt.text)
            if output.parser is not None and logprobs_wanted(body):
                raise ApiError(400, "include: output_text logprobs are given for plain text answers; with tools in "
                                    "play or a reasoning parser, the chat completions API gives each token's",
                               param="include")
            gen = chat_generation_config(model, conv.chat, max_tokens, output)
        except ApiError as e:
            raise _renamed(e) from None
        rid = new_request_id("resp").replace("-", "_")
        req = EngineRequest(rid, prompt.token_ids, gen, _ENGINE_NAMES, session_id=session_id_of(conv.chat),
                            mm=prompt.mm, adapter=adapter)
        outputs = await until_disconnected(request, open_request(state, engine, req))
        reply = _Reply(state, model, req, body, conv, output)
        if body.stream:
            return SSEResponse(reply.stream(outputs), on_close=permit.hand_over(), request_id=rid, source=outputs)
        return JSONResponse(await until_disconnected(request, reply.collect(outputs)),
                            headers={REQUEST_ID_HEADER: rid})


async def _prompt(state: ServerState, model: ServedModel, body: ResponsesRequest,
                  history: list[dict[str, Any]]) -> tuple[Conversation, ChatPrompt]:
    """The conversation and its rendered prompt; with truncation "auto", the oldest messages left out until the
    prompt leaves room for an answer (of max_output_tokens where set), as OpenAI truncates."""
    conv: Conversation | None = conversation(body, history)
    room = min(model.session_len, model.kv_tokens) - (body.max_output_tokens or 1)
    while True:
        tools = chat_tool_request(model, conv.chat)
        prompt = await chat_prompt(model, conv.chat, tools, state.image_limits)
        if body.truncation != "auto" or len(prompt.token_ids) <= room:
            return conv, prompt
        shorter = conv.truncated()
        if shorter is None:
            return conv, prompt  # the length check refuses it, naming the input
        conv = shorter


class _Reply:
    def __init__(self, state: ServerState, model: ServedModel, req: EngineRequest, body: ResponsesRequest,
                 conv: Conversation, output: ChatOutput) -> None:
        self.state, self.model, self.req, self.body, self.conv = state, model, req, body, conv
        self.choice_output = ChoiceOutput(output)
        self.with_logprobs = logprobs_wanted(body)
        self.created = int(time.time())

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object; the request's settings echoed as they ran (temperature and top_p: the values used,
        the model's defaults where the request left them unset)."""
        b, gen = self.body, self.req.gen
        return {
            "id": self.req.request_id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "max_tool_calls": b.max_tool_calls, "model": self.req.adapter or self.model.name, "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False, "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "store": b.store and self.state.responses.capacity > 0, "temperature": gen.temperature, "text": {"format": (b.text or {}).get("format")
                                                                        or {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [], "top_logprobs": b.top_logprobs,
            "top_p": gen.top_p, "truncation": b.truncation or "disabled", "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }

    def _usage(self, num_output: int, cached: int, reasoning: str | None) -> dict[str, Any]:
        reasoning_tokens = len(self.model.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return response_usage(len(self.req.prompt_token_ids), num_output, cached, reasoning_tokens)

    def _finish(self, response: dict[str, Any]) -> dict[str, Any]:
        """Keep the response (store) and hand it on."""
        if self.body.store and response["status"] != "failed":
            conv = self.conv
            input_items = [{"id": item_id(_ID_PREFIXES.get(it["type"], "item")), **it}
                           for it in _input_items(self.body.input)]
            self.state.responses.put(response["id"], StoredResponse(
                response, (conv.history + conv.messages)[conv.dropped:] + [items_as_message(response["output"])],
                input_items))
        return response

    async def collect(self, outputs: AsyncIterator[SequenceOutput]) -> dict[str, Any]:
        choice = Choice(0)
        async with aclosing(outputs):
            async for out in outputs:
                choice.add(out)
        message = self.choice_output.message(choice.text)
        lps = response_logprobs(self.model.token_text, choice.logprobs) if self.with_logprobs else None
        cut = choice.finish_reason == "length"
        items = output_items(message, lps, cut)
        usage = self._usage(choice.num_tokens, choice.cached, message.get("reasoning_content"))
        return self._finish(self.envelope("incomplete" if cut else "completed", items, usage))

    async def stream(self, outputs: AsyncIterator[SequenceOutput]) -> AsyncIterator[str]:
        writer = EventWriter(lambda status, items: self.envelope(status, items), self.with_logprobs)
        for event in writer.start():
            yield _sse(event)
        tokens = cached = 0
        status, error = "completed", None
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    tokens, cached = out.num_output_tokens, out.num_cached_tokens
                    if self.with_logprobs:
                        writer.pending_logprobs += response_logprobs(self.model.token_text, out.new_logprobs)
                    for event in writer.feed(self.choice_output.delta(out.new_text, out.finished)):
                        yield _sse(event)
                    if out.finished and out.finish_reason == "length":
                        status = "incomplete"
        except ApiError as e:
            status, error = "failed", {"code": "server_error", "message": e.message}
        response = self.envelope(status, [], self._usage(tokens, cached, writer.reasoning), error)
        events = writer.finish(status, response)
        self._finish(response)  # stored before the last event is sent: a client may go as soon as it has it
        for event in events:
            yield _sse(event)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items (a string is one user message), as GET .../input_items lists them."""
    if isinstance(items, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    return [{"type": "message", **it} if "type" not in it else dict(it) for it in items]


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> JSONResponse:
    state = _state(request)
    state.ready()
    return JSONResponse(state.responses.get(response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    state = _state(request)
    state.ready()
    state.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                           order: str = Query("desc", pattern="^(asc|desc)$"),
                           after: str | None = None) -> JSONResponse:
    state = _state(request)
    state.ready()
    items = state.responses.get(response_id).input_items
    items = items[::-1] if order == "desc" else list(items)
    if after is not None:
        ids = [it["id"] for it in items]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
