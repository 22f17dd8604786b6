"""OpenAI's POST /v1/embeddings (also at /embeddings, as vLLM serves it), with vLLM's extra fields.

`input`: a string, strings, token ids or lists of token ids (up to 2,048 inputs, as OpenAI allows), each embedded as
its own engine request (engine/pooling.py), all batched together by the engine. Text is tokenized as it is, with the
tokenizer's special tokens (`add_special_tokens`, vLLM's, default true); no chat template. `encoding_format`:
"float" (lists) or "base64" (little-endian float32, as OpenAI's client asks for by default and decodes itself).
`dimensions`: Matryoshka truncation for models trained for it, refused for others (vLLM's rule). vLLM's
`truncate_prompt_tokens` keeps an input's last k tokens (-1: the model's context), `normalize` overrides the model's
L2 normalization. Any other field with a value is refused, never ignored.

The answer: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage":
{"prompt_tokens", "total_tokens"}} (and vLLM's "id" and "created"). A client that leaves aborts every input's
request.

Also Text Embeddings Inference's POST /embed (`tei_embed`), for clients written against TEI, errors in its
(TGI's) shape.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from llmserve.engine.output import SequenceOutput
from llmserve.engine.pooling import EmbedParams
from llmserve.errors import EngineDeadError, InvalidRequestError
from llmserve.serve.errors import ApiError, OpenAIError, TgiError, error_responses
from llmserve.serve.generation import new_request_id
from llmserve.serve.openai_params import check_model
from llmserve.serve.protocol import EmbeddingRequest, TeiEmbedRequest, unknown_fields
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import REQUEST_ID_HEADER, until_disconnected

router = APIRouter(responses=error_responses(OpenAIError))

MAX_INPUTS = 2048  # OpenAI's limit on one request's inputs


@router.post("/v1/embeddings")
@router.post("/embeddings", include_in_schema=False)
async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
    state, model = opened(request, body)
    adapter = check_model(model, body.model)
    with state.admit():
        inputs = input_ids(model, body.input, body.add_special_tokens, body.truncate_prompt_tokens)
        rid = new_request_id("embd")
        ids = [f"{rid}-{i}" for i in range(len(inputs))]
        params = EmbedParams(body.dimensions, body.normalize)
        outs = await until_disconnected(request, embed_all(state, list(zip(ids, inputs)), params, adapter))
    data = [{"object": "embedding", "index": i, "embedding": _encoded(out.embedding, body.encoding_format)}
            for i, out in enumerate(outs)]
    tokens = sum(len(x) for x in inputs)
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": body.model or model.name,
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                        headers={REQUEST_ID_HEADER: rid})


def opened(request: Request, body: BaseModel) -> tuple[ServerState, ServedModel]:
    """The server's state and model for a pooling route's body: 503 while loading or stopping, 400 for a field the
    body does not declare that carries a value."""
    state: ServerState = request.app.state.llm
    _, model = state.ready()
    unknown = unknown_fields(body)
    if unknown:
        raise ApiError(400, f"{unknown[0]}: unknown field; llmserve refuses it rather than ignore it (the fields this "
                            "route takes are listed in docs/serving.md)", param=unknown[0])
    return state, model


def input_ids(model: ServedModel, raw: str | list, add_special_tokens: bool, truncate: int | None,
              param: str = "input", keep_first: bool = False, truncate_field: str = "truncate_prompt_tokens"
              ) -> list[list[int]]:
    """Every input's token ids (`raw`: a string, strings, token ids or lists of them), checked for count and length.
    `truncate`: at most that many tokens (-1: the context), the last ones (the first with keep_first); text is cut by
    the tokenizer, which keeps the special tokens it adds (an embedder's closing EOS, which LAST pooling reads), as vLLM
    and TEI truncate. Errors name `param` and the input's index in it."""
    items: list[Any] = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else list(raw)
    if not items:
        raise ApiError(400, f"{param}: must not be empty", param=param)
    if len(items) > MAX_INPUTS:
        raise ApiError(400, f"{param}: at most {MAX_INPUTS} inputs in one request, got {len(items)}", param=param)
    if any(isinstance(x, str) and not x for x in items):  # (a tokenizer that adds BOS would make it one token)
        raise ApiError(400, f"{param}: an input is an empty string", param=param)
    keep = None
    if truncate is not None:
        keep = model.session_len if truncate == -1 else min(truncate, 2**31 - 1)  # (the tokenizer's bound; the same)
        if keep < 1:
            raise ApiError(400, f"{truncate_field}: must be -1 (the model's context) or >= 1, got {truncate}",
                           param=truncate_field)
    out = [_tokens(model.tokenizer, x, add_special_tokens, keep, keep_first) if isinstance(x, str)
           else list(x)[:keep] if keep_first else list(x)[-(keep or len(x)):] for x in items]
    for i, x in enumerate(out):
        where = param if len(items) == 1 else f"{param}[{i}]"
        if not x:
            raise ApiError(400, f"{where}: no tokens", param=param)
        if len(x) > model.session_len:
            raise ApiError(400, f"This model's maximum context length is {model.session_len} tokens, and {where} "
                                f"has {len(x)} tokens: shorten it, or set {truncate_field}.", param=param,
                           code="context_length_exceeded")
    return out


def _tokens(tok: Any, text: str, add_special_tokens: bool, keep: int | None, keep_first: bool) -> list[int]:
    if keep is None:
        return tok.encode(text, add_special_tokens=add_special_tokens)
    side = tok.truncation_side
    tok.truncation_side = "right" if keep_first else "left"  # (set and put back with no await between)
    try:
        return tok(text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)["input_ids"]
    finally:
        tok.truncation_side = side


@router.post("/embed", responses=error_responses(TgiError))
async def tei_embed(body: TeiEmbedRequest, request: Request) -> JSONResponse:
    """Text Embeddings Inference's /embed: `{"inputs": "..." or [...], "normalize": true, "truncate": false,
    "truncation_direction": "Right", "prompt_name": null, "dimensions": null}` -> a list of vectors. `prompt_name`
    prepends the checkpoint's sentence-transformers prompt of that name; `truncate` cuts an input to the context, at
    its end (Right) or start (Left)."""
    state, model = opened(request, body)
    engine, _ = state.ready()
    texts = [body.inputs] if isinstance(body.inputs, str) else list(body.inputs)
    if body.prompt_name is not None:
        prompts = dict(engine.engine.pooler.prompts)
        if body.prompt_name not in prompts:
            raise ApiError(400, f"prompt_name: {body.prompt_name!r} is not one of the model's prompts "
                                f"({', '.join(prompts) or 'it has none: config_sentence_transformers.json'})",
                           param="prompt_name")
        texts = [prompts[body.prompt_name] + t for t in texts]
    with state.admit():
        inputs = input_ids(model, texts, True, -1 if body.truncate else None, "inputs",
                           keep_first=body.truncation_direction.lower() == "right", truncate_field="truncate")
        rid = new_request_id("embed")
        outs = await until_disconnected(request, embed_all(
            state, [(f"{rid}-{i}", x) for i, x in enumerate(inputs)], EmbedParams(body.dimensions, body.normalize),
            None))
    return JSONResponse([o.embedding for o in outs], headers={REQUEST_ID_HEADER: rid})


async def embed_all(state: ServerState, inputs: list[tuple[str, list[int]]], params: EmbedParams,
                     adapter: str | None) -> list[SequenceOutput]:
    """Every input's embedding, run together; a refusal or a cancelled wait (client gone) aborts the rest."""
    engine, _ = state.ready()
    tasks = [asyncio.ensure_future(engine.embed(rid, ids, params, adapter)) for rid, ids in inputs]
    state.in_flight.update(rid for rid, _ in inputs)
    try:
        outs = list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:  # the client left: its unfinished inputs are aborted below
        state.metrics.on_abandoned(sum(not t.done() or t.cancelled() for t in tasks))
        raise
    except InvalidRequestError as e:
        raise ApiError.from_invalid(e, {"prompt": "input"}) from None
    except RuntimeError as e:  # the engine is stopping, or a step failed
        status = 503 if isinstance(e, EngineDeadError) or not engine.is_alive or state.draining else 500
        raise ApiError(status, str(e)) from None
    finally:
        for t in tasks:
            t.cancel()  # (done ones ignore it; the others abort their request)
        await asyncio.gather(*tasks, return_exceptions=True)
        state.in_flight.difference_update(rid for rid, _ in inputs)
    for out in outs:
        if out.embedding is None:  # aborted inside the engine: the server is stopping (abort_all)
            status = 503 if state.draining or not engine.is_alive else 500
            raise ApiError(status, f"{out.request_id}: the input was not embedded ({out.finish_reason})")
        state.metrics.on_embedded(out.num_prompt_tokens)
    return outs


def _encoded(vector: list[float] | None, encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector  # type: ignore[return-value]
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
