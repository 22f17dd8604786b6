"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items.

A request is turned into the chat request it amounts to (responses_input.py) and runs the chat route's steps
(template, tools, grammar, sampling; the same refusals); the answer comes back as a Response or its events
(responses_output.py). With `store` (OpenAI's default) the response is kept in memory (`ResponseStore`, the
newest --responses-store-size of them) so that GET reads it back and `previous_response_id` continues its
conversation; they are lost when the server stops.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from llmserve.engine.output import SequenceOutput
from llmserve.serve.chat_tools import ChatOutput, chat_output, chat_tool_request
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
    Deltas,
    EventWriter,
    item_id,
    items_as_message,
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


def _renamed(e: ApiError, conv: Conversation | None = None) -> ApiError:
    """A refusal from the chat path, naming the field as this API spells it: `messages[3]` is the input item it
    came from (or the instructions, or the earlier conversation), and function tools are flat (`tools[1].name`
    where the chat says `tools[1].function.name`)."""
    name = _NAMES.get(e.param or "", e.param)
    message = e.message
    for old, new in _NAMES.items():
        if message.startswith(old):
            message = new + message[len(old):]
            break
    if conv is not None:
        message = re.sub(r"\binput\[(\d+)\]", lambda m: conv.where(int(m.group(1))), message)
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
        conv = None
        try:
            conv = conversation(body, history)
            conv, prompt = await until_disconnected(request, _fitting(state, model, body, conv))
            max_tokens = check_prompt_length(model, len(prompt.token_ids), body.max_output_tokens, "messages")
            tools = chat_tool_request(model, conv.chat)
            output = chat_output(model, tools, prompt.text)
            if output.parser is not None and logprobs_wanted(body):
                raise ApiError(400, "include: output_text logprobs are given for plain text answers; with tools in "
                                    "play or a reasoning parser, the chat completions API gives each token's",
                               param="include")
            gen = chat_generation_config(model, conv.chat, max_tokens, output)
        except ApiError as e:
            raise _renamed(e, conv) from None
        rid = new_request_id("resp").replace("-", "_")
        req = EngineRequest(rid, prompt.token_ids, gen, _ENGINE_NAMES, session_id=session_id_of(conv.chat),
                            mm=prompt.mm, adapter=adapter)
        outputs = await until_disconnected(request, open_request(state, engine, req))
        reply = _Reply(state, model, req, body, conv, output)
        if body.stream:
            return SSEResponse(reply.stream(outputs), on_close=permit.hand_over(), request_id=rid, source=outputs)
        return JSONResponse(await until_disconnected(request, reply.collect(outputs)),
                            headers={REQUEST_ID_HEADER: rid})


async def _fitting(state: ServerState, model: ServedModel, body: ResponsesRequest,
                   conv: Conversation) -> tuple[Conversation, ChatPrompt]:
    """The conversation and its rendered prompt. With truncation "auto", the fewest oldest turns left out for the
    prompt to leave room for an answer (of max_output_tokens where set), as OpenAI truncates: whole turns, so that
    the prompt opens with a user message and no tool result loses its call; found by bisection (a few renders,
    not one per message). When even the last turn does not fit, the length check refuses it, naming the input."""
    async def render(c: Conversation) -> ChatPrompt:
        return await chat_prompt(model, c.chat, chat_tool_request(model, c.chat), state.image_limits)

    prompt = await render(conv)
    room = min(model.session_len, model.kv_tokens) - (body.max_output_tokens or 1)
    if body.truncation != "auto" or len(prompt.token_ids) <= room:
        return conv, prompt
    starts = conv.turn_starts()[1:]
    lo, hi = 0, len(starts) - 1  # the first start whose prompt fits is in starts[lo:hi + 1] (or none does)
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = conv.starting_at(starts[mid])
        candidate_prompt = await render(candidate)
        if len(candidate_prompt.token_ids) <= room:
            best, hi = (candidate, candidate_prompt), mid - 1
        else:
            lo = mid + 1
    if best is not None:
        return best
    last = conv.starting_at(starts[-1]) if starts else conv
    return last, await render(last)


class _Reply:
    def __init__(self, state: ServerState, model: ServedModel, req: EngineRequest, body: ResponsesRequest,
                 conv: Conversation, output: ChatOutput) -> None:
        self.state, self.model, self.req, self.body, self.conv = state, model, req, body, conv
        self.output = output
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

    def _usage(self, num_output: int, cached: int, reasoning: str) -> dict[str, Any]:
        reasoning_tokens = len(self.model.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return response_usage(len(self.req.prompt_token_ids), num_output, cached, reasoning_tokens)

    def _writer(self) -> EventWriter:
        return EventWriter(lambda status, items: self.envelope(status, items), self.with_logprobs)

    def _end(self, writer: EventWriter, finish_reason: str | None, tokens: int, cached: int,
             error: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The final response and the last events; the response stored (store=true) unless it failed, before the
        last event goes out (a client may leave as soon as it has it)."""
        if error is None and finish_reason == "abort":  # the server stopping, or the output could not go on
            error = {"code": "server_error", "message": "the generation was aborted before it finished"}
        status = "failed" if error else "incomplete" if finish_reason == "length" else "completed"
        response = self.envelope(status, [], self._usage(tokens, cached, writer.reasoning), error)
        events = writer.finish(status, response)
        response["store"] = status != "failed" and self.body.store and self._store(response)
        return response, events

    def _store(self, response: dict[str, Any]) -> bool:
        """The whole conversation is kept (what truncation left out of this prompt too): a later request
        truncates for itself."""
        conv = self.conv
        input_items = [{"id": item_id(_ID_PREFIXES.get(it["type"], "item")), **it}
                       for it in _input_items(self.body.input)]
        return self.state.responses.put(response["id"], StoredResponse(
            response, conv.history + conv.messages + [items_as_message(response["output"])], input_items))

    async def collect(self, outputs: AsyncIterator[SequenceOutput]) -> dict[str, Any]:
        choice = Choice(0)
        async with aclosing(outputs):
            async for out in outputs:
                choice.add(out)
        writer = self._writer()
        if self.with_logprobs:
            writer.pending_logprobs = response_logprobs(self.model.token_text, choice.logprobs)
        writer.feed(Deltas(self.output).feed(choice.text, True))  # the same items as streamed, events unsent
        return self._end(writer, choice.finish_reason, choice.num_tokens, choice.cached)[0]

    async def stream(self, outputs: AsyncIterator[SequenceOutput]) -> AsyncIterator[str]:
        writer, deltas = self._writer(), Deltas(self.output)
        for event in writer.start():
            yield _sse(event)
        tokens = cached = 0
        finish_reason, error = None, None
        try:
            async with aclosing(outputs):
                async for out in outputs:
                    tokens, cached = out.num_output_tokens, out.num_cached_tokens
                    if self.with_logprobs:
                        writer.pending_logprobs += response_logprobs(self.model.token_text, out.new_logprobs)
                    for event in writer.feed(deltas.feed(out.new_text, out.finished)):
                        yield _sse(event)
                    if out.finished:
                        finish_reason = out.finish_reason
        except ApiError as e:
            error = {"code": "server_error", "message": e.message}
        for event in self._end(writer, finish_reason, tokens, cached, error)[1]:
            yield _sse(event)


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as items, as GET .../input_items lists them and OpenAI writes them: a string is one user message,
    a message's string content one text part (output_text for the assistant's, input_text for the others')."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    listed = []
    for it in items:
        it = {"type": "message", **it} if "type" not in it else dict(it)
        if it["type"] == "message" and isinstance(it.get("content"), str):
            kind = "output_text" if it.get("role") == "assistant" else "input_text"
            it["content"] = [{"type": kind, "text": it["content"]}]
        listed.append(it)
    return listed


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
