"""The served model's tokenizer over HTTP: vLLM's POST /tokenize and /detokenize (also under /v1/, as SGLang serves
them), TGI's POST /tokenize, and vLLM's GET /version. Nothing here runs the model.

- vLLM's /tokenize: a prompt, `{"prompt": "...", "add_special_tokens": true}`, or a chat, `{"messages": [...],
  "tools": [...], "chat_template_kwargs": {...}}` (special tokens not added: the template writes them) ->
  `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with `return_token_strs`). A chat renders as
  /v1/chat/completions renders it, so `count` is that route's `usage.prompt_tokens` for the same messages: the
  assistant's turn opened after a user's message, a last assistant message closed, or left open with
  `continue_final_message` (`add_generation_prompt` asking otherwise is refused, not ignored).
- TGI's /tokenize: `{"inputs": "...", "parameters": {...}}` -> `[{"id", "text", "start", "stop"}]`, each token with
  its characters in `inputs` (special tokens the tokenizer adds, such as BOS, have none: their text is the token's
  own; a Python tokenizer, which has no offsets, gives each token's text and span in the ids decoded up to it). `parameters.truncate` keeps the last that many tokens, as /generate does; the other parameters change no
  tokens.
- /detokenize: `{"tokens": [...]}` -> `{"prompt": text}` (special tokens kept).
- /version: `{"version": ...}`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

import llmserve
from llmserve.serve.chat_tools import chat_tool_request
from llmserve.serve.errors import ApiError, OpenAIError, TgiError, error_responses
from llmserve.serve.openai_params import chat_prompt, chat_request, check_model, legacy_functions
from llmserve.serve.state import ServedModel, ServerState

router = APIRouter()
# errors in OpenAI's shape under /v1/, in TGI's elsewhere (errors.error_body)
_OPENAI, _TGI = error_responses(OpenAIError), error_responses(TgiError)


class TokenizeRequest(BaseModel):
    """vLLM's two bodies and TGI's, told apart by which of prompt, messages and inputs they carry."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None  # vLLM, a prompt
    messages: list[dict[str, Any]] | None = None  # vLLM, a chat
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    inputs: str | None = None  # TGI
    parameters: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def _model(request: Request) -> tuple[ServerState, ServedModel]:
    state: ServerState = request.app.state.llm
    return state, state.ready()[1]


@router.post("/tokenize", responses=_TGI)
@router.post("/v1/tokenize", responses=_OPENAI)
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    state, model = _model(request)
    given = [name for name in ("prompt", "messages", "inputs") if getattr(body, name) is not None]
    if len(given) != 1:
        raise ApiError(400, "send one of prompt (text), messages (a chat) or inputs (TGI's body), got "
                            f"{' and '.join(given) or 'none'}", param="prompt")
    check_model(model, body.model)
    if body.inputs is not None:
        return JSONResponse(_tgi_tokens(model, body))
    tok = model.tokenizer
    if body.prompt is not None:
        _only_for_chat(body)
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        ids = await _chat_tokens(state, model, body)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.session_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return JSONResponse(out)


def _only_for_chat(body: TokenizeRequest) -> None:
    for name in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name}: only for a chat (messages), not a prompt", param=name)


async def _chat_tokens(state: ServerState, model: ServedModel, body: TokenizeRequest) -> list[int]:
    req = chat_request({"messages": body.messages, "tools": body.tools,
                        "chat_template_kwargs": body.chat_template_kwargs,
                        "continue_final_message": bool(body.continue_final_message)})
    if not req.messages:
        raise ApiError(400, "messages: at least one message is needed", param="messages")
    legacy_functions(req)  # a history in the deprecated functions API, rendered as the chat route renders it
    opens = req.messages[-1].role != "assistant"  # as the chat route renders (chat_template.py)
    if body.add_generation_prompt is not None and body.add_generation_prompt != opens:
        raise ApiError(400, "add_generation_prompt: the chat template opens the assistant's turn unless the last "
                            "message is the assistant's (then it closes it, or with continue_final_message leaves it "
                            f"open); this chat ends with a {req.messages[-1].role} message",
                       param="add_generation_prompt")
    prompt = await chat_prompt(model, req, chat_tool_request(model, req), state.image_limits)
    if not body.add_special_tokens:
        return prompt.token_ids
    if prompt.mm is not None:
        raise ApiError(400, "add_special_tokens: not with images (their placeholders are expanded in the prompt's "
                            "tokens)", param="add_special_tokens")
    return model.tokenizer.encode(prompt.text, add_special_tokens=True)


def _tgi_tokens(model: ServedModel, body: TokenizeRequest) -> list[dict[str, Any]]:
    extra = sorted(set(body.model_fields_set) - {"inputs", "parameters", "model"})
    if extra:
        raise ApiError(400, f"{extra[0]}: not a field of TGI's tokenize body (inputs, parameters)", param=extra[0])
    truncate = (body.parameters or {}).get("truncate")
    if truncate is not None and (not isinstance(truncate, int) or isinstance(truncate, bool) or truncate < 1):
        raise ApiError(400, f"`truncate` must be a positive integer, got {truncate!r}", param="truncate")
    tok = model.tokenizer
    if tok.is_fast:
        enc = tok(body.inputs, return_offsets_mapping=True)
        ids, spans = enc["input_ids"], enc["offset_mapping"]
        names = tok.convert_ids_to_tokens(ids)
        texts = [body.inputs[a:b] if b > a else name for (a, b), name in zip(spans, names, strict=True)]
    else:  # a Python tokenizer has no offsets: each token's text and span in the ids decoded up to it
        ids = tok.encode(body.inputs)
        decoded = [tok.decode(ids[:i + 1], clean_up_tokenization_spaces=False) for i in range(len(ids))]
        ends = [len(d) for d in decoded]
        spans = list(zip([0, *ends[:-1]], ends))
        texts = [d[a:b] for d, (a, b) in zip(decoded, spans, strict=True)]
    out = [{"id": i, "text": t, "start": a, "stop": b} for i, t, (a, b) in zip(ids, texts, spans, strict=True)]
    return out[-truncate:] if truncate is not None else out


@router.post("/detokenize", responses=_TGI)
@router.post("/v1/detokenize", responses=_OPENAI)
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    _, model = _model(request)
    check_model(model, body.model)
    vocab = len(model.tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise ApiError(400, f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", param="tokens")
    return JSONResponse({"prompt": model.tokenizer.decode(body.tokens)})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": llmserve.__version__})
