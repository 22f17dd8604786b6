"""ColossalAI-Inference's routes, in the shapes of its `colossalai.inference.server.api_server`:

- `POST /completion` `{"prompt": str, "stream": ...}` -> `{"request_id": int, "text": str}`; the prompt is raw text,
  tokenized with the tokenizer's special tokens (no chat template);
- `POST /chat` `{"messages": [...], "stream": ...}` -> `{"role": "assistant", "text": str}`, through the chat template;
- `GET /engine_check` -> `{"status": "Running"}` (`"Error"` while the engine is loading, stopped or draining; 200
  either way, as ColossalAI answers), and `GET /ping` -> `{"status": "Healthy"}`.

`stream` (and chat's `echo`) is a boolean or the string "true"/"false" in any case, as ColossalAI lowercases it.
Generation parameters sit beside them, under transformers' GenerationConfig names, with ColossalAI's defaults:
greedy unless `do_sample` (then temperature 1.0, top_k 50, top_p 1.0), max_new_tokens 128 (its server's
--max_output_len; when the prompt leaves less room, what fits); the model's generation_config.json is not applied.
`max_length` (prompt plus output) stands in for max_new_tokens when that is not sent, as in transformers.

Streaming, in ColossalAI's framing, token by token here where ColossalAI sends the whole answer in one piece:
- /completion: JSON objects each ended by "\\0" (its media type says text/event-stream), each carrying the text so far,
  so the last is exactly the non-streamed body;
- /chat: server-sent events `data: {"index":0,"message":{"role":"assistant"}}`, then (echo) the last assistant
  message, then `data: {"content": <new text>}` per step, then `data: [DONE]`.

Refused with a 400 (`{"error", "error_type"}`, errors.py's format for non-/v1 routes) where ColossalAI would crash or
silently ignore: unknown fields (ColossalAI drops any that are not GenerationConfig attributes), a sampling knob
that would change sampling sent without do_sample (transformers ignores it), num_beams > 1 and no_repeat_ngram_size
> 0 (not implemented), n > 1, and add_generation_prompt false: the template always opens the assistant's turn here
(ColossalAI renders without it by default and answers in the last message's role, i.e. the model continues the
user's turn); to continue a message, send it as the last, assistant, message.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from llmserve.config import GenerationConfig, max_new_tokens_within
from llmserve.engine.output import SequenceOutput
from llmserve.errors import InvalidRequestError
from llmserve.serve.errors import ApiError, TgiError, error_body, error_responses
from llmserve.serve.generation import EngineRequest, Primed, open_request
from llmserve.serve.openai_params import check_prompt_length, completion_prompts
from llmserve.serve.protocol import BODY_SCHEMA_EXTRA, NON_EMPTY, unknown_fields
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import MAY_STREAM, REQUEST_ID_HEADER, SSEResponse, sse_event, until_disconnected

router = APIRouter(responses=error_responses(TgiError))
DEFAULT_MAX_NEW_TOKENS = 128  # ColossalAI's api_server --max_output_len
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # its InferenceConfig's
ROLE = "assistant"  # its --response-role default
# ColossalAI numbers requests 1, 2, ... Process-wide, not per app: apps sharing one engine need distinct request ids.
_numbers = itertools.count(1)


class _Job(NamedTuple):
    number: int  # ColossalAI's request_id
    req: EngineRequest


class _Body(BaseModel):
    # unknown fields kept, to be refused by name
    model_config = ConfigDict(strict=True, extra="allow", json_schema_extra=BODY_SCHEMA_EXTRA)


class _GenerationFields(_Body):
    """The transformers GenerationConfig attributes ColossalAI's server copies from the body, that llmserve takes."""

    stream: bool | str = False
    max_new_tokens: int | None = None
    max_length: int | None = None
    min_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    num_beams: int | None = None
    no_repeat_ngram_size: int | None = None


class CompletionBody(_GenerationFields):
    prompt: str = NON_EMPTY


class ChatBody(_GenerationFields):
    # checked by the chat template (chat_template._check_messages)
    messages: list[dict[str, Any]] = Field(json_schema_extra={"minItems": 1, "items": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]}, "content": {"type": "string"}}}})
    add_generation_prompt: bool | None = None
    echo: bool | str = False
    n: int = 1


@router.get("/engine_check")
async def engine_check(request: Request) -> JSONResponse:
    state: ServerState = request.app.state.llm
    running = state.engine is not None and state.engine.is_alive and not state.draining
    return JSONResponse({"status": "Running" if running else "Error"})


@router.get("/ping")
async def ping() -> JSONResponse:
    return JSONResponse({"status": "Healthy"})


@router.post("/completion", responses=MAY_STREAM)
async def completion(body: CompletionBody, request: Request) -> Response:
    state: ServerState = request.app.state.llm
    engine, model = state.ready()
    with state.admit() as permit:
        stream = _flag(body.stream, "stream")
        _refuse_unsupported(body)
        if not body.prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        job = _job(model, body, completion_prompts(model, body.prompt)[0].token_ids, "prompt")
        outputs = await until_disconnected(request, open_request(state, engine, job.req))
        if stream:
            return SSEResponse(_completion_stream(job.number, outputs), on_close=permit.hand_over(),
                               request_id=job.req.request_id, source=outputs)
        text = await until_disconnected(request, _collect(outputs))
        return JSONResponse({"request_id": job.number, "text": text}, headers={REQUEST_ID_HEADER: job.req.request_id})


@router.post("/chat", responses=MAY_STREAM)
async def chat(body: ChatBody, request: Request) -> Response:
    state: ServerState = request.app.state.llm
    engine, model = state.ready()
    with state.admit() as permit:
        stream, echo = _flag(body.stream, "stream"), _flag(body.echo, "echo")
        _refuse_unsupported(body)
        if body.n != 1:
            raise ApiError(400, f"n: only 1 is supported (one answer per request), got {body.n}", param="n")
        if body.add_generation_prompt is False:
            raise ApiError(400, "add_generation_prompt: false is not supported: the chat template always opens the "
                                "assistant's turn; to continue a message, send it as the last message, with role "
                                "assistant", param="add_generation_prompt")
        try:
            text = model.chat_template.messages_to_prompt(body.messages)
        except InvalidRequestError as e:
            raise ApiError.from_invalid(e) from None
        # The template writes the special tokens (BOS included) itself.
        req = _job(model, body, model.tokenizer.encode(text, add_special_tokens=False), "messages").req
        last = body.messages[-1]
        prefix = (last.get("content") or "") if echo and last.get("role") == ROLE else ""
        outputs = await until_disconnected(request, open_request(state, engine, req))
        if stream:
            return SSEResponse(_chat_stream(prefix, outputs), on_close=permit.hand_over(),
                               request_id=req.request_id, source=outputs)
        answer = await until_disconnected(request, _collect(outputs))
        return JSONResponse({"role": ROLE, "text": prefix + answer}, headers={REQUEST_ID_HEADER: req.request_id})


def _flag(value: bool | str, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ApiError(400, f"{name}: must be true or false (a boolean, or the string \"true\" or \"false\"), got "
                        f"{value!r}", param=name)


def _refuse_unsupported(body: _GenerationFields) -> None:
    unknown = unknown_fields(body)
    if unknown:
        taken = ", ".join(sorted(type(body).model_fields))
        raise ApiError(400, f"{unknown[0]}: unknown field; llmserve does not know what it asks for, so it refuses it "
                            f"rather than ignore it (the fields this route takes: {taken})", param=unknown[0])
    if body.num_beams not in (None, 1):
        raise ApiError(400, f"num_beams: beam search is not offered on this route, got {body.num_beams} (the OpenAI "
                            "route /v1/completions has use_beam_search)", param="num_beams")
    if body.no_repeat_ngram_size not in (None, 0):
        raise ApiError(400, "no_repeat_ngram_size: not supported (repetition_penalty is)", param="no_repeat_ngram_size")
    if not body.do_sample:
        for name, default in SAMPLING_DEFAULTS.items():
            value = getattr(body, name)
            if value is not None and value != default and not (name == "temperature" and value == 0):
                raise ApiError(400, f"{name}: only used when sampling; send \"do_sample\": true (without it the "
                                    "answer is greedy, as in ColossalAI)", param=name)


def _job(model: ServedModel, body: _GenerationFields, prompt_ids: list[int], what: str) -> _Job:
    """The engine request and its number; 400 for a prompt that does not fit or a bad parameter."""
    room = check_prompt_length(model, len(prompt_ids), None, what)
    if body.max_new_tokens is not None:
        max_new = body.max_new_tokens
    elif body.max_length is not None:
        subject, note = ("the prompt", "") if what == "prompt" else ("the chat", " (the chat template's tokens included)")
        try:
            max_new = max_new_tokens_within(body.max_length, len(prompt_ids), subject, note)
        except InvalidRequestError as e:
            raise ApiError.from_invalid(e) from None
    else:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
    sampling = {name: getattr(body, name) if getattr(body, name) is not None else default
                for name, default in SAMPLING_DEFAULTS.items()} if body.do_sample else {"temperature": 0.0}
    try:
        gen = GenerationConfig(**{**SAMPLING_DEFAULTS, **sampling}, max_new_tokens=max_new,
                               min_new_tokens=body.min_new_tokens or 0,
                               repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty)
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e) from None
    number = next(_numbers)
    names = {"max_new_tokens": "max_length"} if body.max_new_tokens is None and body.max_length is not None else {}
    return _Job(number, EngineRequest(f"colossal-{number}", prompt_ids, gen, names))


def _checked(out: SequenceOutput) -> SequenceOutput:
    if out.finish_reason == "abort":
        raise ApiError(503, "the request was aborted before it finished (the server is shutting down)")
    return out


async def _collect(outputs: Primed) -> str:
    async with aclosing(outputs):
        return "".join([_checked(out).new_text async for out in outputs])


async def _completion_stream(number: int, outputs: Primed) -> AsyncIterator[str]:
    text, sent = "", False
    try:
        async with aclosing(outputs):
            async for out in outputs:
                text += _checked(out).new_text
                if out.new_text or (out.finished and not sent):  # an empty answer still gets its one object
                    sent = True
                    yield json.dumps({"request_id": number, "text": text}) + "\0"
    except ApiError as e:
        yield json.dumps(error_body("/completion", e.status, e.message)) + "\0"


async def _chat_stream(prefix: str, outputs: Primed) -> AsyncIterator[str]:
    yield sse_event({"index": 0, "message": {"role": ROLE}})
    if prefix:
        yield sse_event({"index": 0, "message": {"content": prefix}})
    try:
        async with aclosing(outputs):
            async for out in outputs:
                if _checked(out).new_text:
                    yield sse_event({"content": out.new_text})
    except ApiError as e:
        yield sse_event(error_body("/chat", e.status, e.message))
    yield "data: [DONE]\n\n"
