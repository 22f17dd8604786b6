"""vLLM's scoring routes over the served model's embeddings: POST /score (also /v1/score) and POST /rerank (also
/v1/rerank, and /v2/rerank in the shape Cohere's v2 client reads).

The served model is a bi-encoder here (its embeddings: engine/pooling.py), so a pair's score is the cosine
similarity of the two texts' embeddings, as vLLM scores with an embedding model (a cross-encoder's classification
head is not run). Every entry is embedded once, all in one batch of engine requests (a text sent twice
is embedded twice).

- /score: `text_1` and `text_2`, each a string or strings: one against each of the other's, or pairwise when both
  are lists of one length -> `{"data": [{"index", "object": "score", "score"}], "usage"}`.
- /rerank: `query` and `documents` (strings, or Cohere's `{"text": ...}`), `top_n` (0: all), `return_documents`
  -> `{"results": [{"index", "relevance_score", "document": {"text"}}], "usage"}`, best first.
Both take `truncate_prompt_tokens` (vLLM's: each text's last N tokens) and refuse other fields with a value. Errors
come in OpenAI's shape under /v1/ and in TGI's elsewhere, as on every route.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserve.engine.pooling import EmbedParams
from llmserve.serve.embedding_routes import embed_all, input_ids, opened
from llmserve.serve.errors import ApiError, OpenAIError, TgiError, error_responses
from llmserve.serve.generation import new_request_id
from llmserve.serve.openai_params import check_model
from llmserve.serve.protocol import RerankRequest, ScoreRequest
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.streaming import REQUEST_ID_HEADER, until_disconnected

router = APIRouter()
# errors in OpenAI's shape under /v1/, in TGI's elsewhere (errors.error_body), as on every route
_OPENAI, _TGI = error_responses(OpenAIError), error_responses(TgiError)


@router.post("/score", responses=_TGI)
@router.post("/v1/score", responses=_OPENAI)
async def score(body: ScoreRequest, request: Request) -> JSONResponse:
    state, model = opened(request, body)
    first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if len(first) > 1 and len(second) > 1 and len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: lists are scored pairwise and "
                            "need one length (or send one text on either side)", param="text_2")
    ids = [input_ids(model, texts, True, body.truncate_prompt_tokens, name)
           for texts, name in ((first, "text_1"), (second, "text_2"))]
    rid, vectors, tokens = await _embed(request, state, model, body, ids[0] + ids[1], "score")
    a, b = vectors[:len(first)], vectors[len(first):]
    n = max(len(first), len(second))
    scores = torch.nn.functional.cosine_similarity(a.expand(n, -1), b.expand(n, -1), dim=1)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": body.model or model.name,
                         "data": data, "usage": _usage(tokens)}, headers={REQUEST_ID_HEADER: rid})


@router.post("/rerank", responses=_TGI)
@router.post("/v1/rerank", responses=_OPENAI)
@router.post("/v2/rerank", responses=_TGI)
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    state, model = opened(request, body)
    docs = [d if isinstance(d, str) else _doc_text(d, i) for i, d in enumerate(body.documents)]
    ids = input_ids(model, body.query, True, body.truncate_prompt_tokens, "query")
    ids += input_ids(model, docs, True, body.truncate_prompt_tokens, "documents")
    rid, vectors, tokens = await _embed(request, state, model, body, ids, "rerank")
    scores = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:], dim=1).tolist()
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    top = order[:body.top_n] if body.top_n and body.top_n > 0 else order  # (vLLM's: 0 or less, every document)
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if body.return_documents is not False else {})} for i in top]
    return JSONResponse({"id": rid, "model": body.model or model.name, "results": results, "usage": _usage(tokens),
                         "meta": {"billed_units": {"search_units": 1}}}, headers={REQUEST_ID_HEADER: rid})


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens}


def _doc_text(doc: dict[str, Any], i: int) -> str:
    if set(doc) != {"text"} or not isinstance(doc["text"], str):
        raise ApiError(400, f"documents[{i}]: a document is a string or {{\"text\": \"...\"}}", param="documents")
    return doc["text"]


async def _embed(request: Request, state: ServerState, model: ServedModel, body: ScoreRequest | RerankRequest,
                 ids: list[list[int]], prefix: str) -> tuple[str, torch.Tensor, int]:
    """(request id, the texts' embeddings [n, E] fp32, their tokens): each entry its own engine request."""
    adapter = check_model(model, body.model)
    with state.admit():
        rid = new_request_id(prefix)
        outs = await until_disconnected(request, embed_all(state, [(f"{rid}-{i}", x) for i, x in enumerate(ids)],
                                                           EmbedParams(normalize=True), adapter))
    return rid, torch.tensor([o.embedding for o in outs]), sum(len(x) for x in ids)
