"""vLLM's scoring routes over the served model's embeddings: POST /score (also /v1/score) and POST /rerank (also
/v1/rerank, and /v2/rerank in the shape Cohere's v2 client reads).

The served model is a bi-encoder here (its embeddings: engine/pooling.py), so a pair's score is the cosine
similarity of the two texts' embeddings, as vLLM scores with an embedding model (a cross-encoder's classification
head is not run). Every text is embedded once, in one batch of engine requests, however many pairs it is in.

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
from llmserve.serve.streaming import REQUEST_ID_HEADER, until_disconnected

router = APIRouter()
# errors in OpenAI's shape under /v1/, in TGI's elsewhere (errors.error_body), as on every route
_OPENAI, _TGI = error_responses(OpenAIError), error_responses(TgiError)


@router.post("/score", responses=_TGI)
@router.post("/v1/score", responses=_OPENAI)
async def score(body: ScoreRequest, request: Request) -> JSONResponse:
    first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not first or not second:
        raise ApiError(400, "text_1 and text_2 must each hold at least one text", param="text_1" if not first
                       else "text_2")
    if len(first) > 1 and len(second) > 1 and len(first) != len(second):
        raise ApiError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: lists are scored pairwise and "
                            "need one length (or send one text on either side)", param="text_2")
    rid, vectors, tokens = await _embed(request, body, first + second, "score")
    a, b = vectors[:len(first)], vectors[len(first):]
    n = max(len(first), len(second))
    scores = torch.nn.functional.cosine_similarity(a.expand(n, -1), b.expand(n, -1), dim=1)
    data = [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)]
    return JSONResponse({"id": rid, "object": "list", "created": int(time.time()), "model": body.model or _name(request),
                         "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                        headers={REQUEST_ID_HEADER: rid})


@router.post("/rerank", responses=_TGI)
@router.post("/v1/rerank", responses=_OPENAI)
@router.post("/v2/rerank", responses=_TGI)
async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
    docs = [d if isinstance(d, str) else _doc_text(d, i) for i, d in enumerate(body.documents)]
    if not docs:
        raise ApiError(400, "documents: give at least one document", param="documents")
    if body.top_n < 0:
        raise ApiError(400, f"top_n: must be >= 0 (0: every document), got {body.top_n}", param="top_n")
    rid, vectors, tokens = await _embed(request, body, [body.query, *docs], "rerank")
    scores = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:], dim=1).tolist()
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    top = order[:body.top_n] if body.top_n else order
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": docs[i]}} if body.return_documents else {})} for i in top]
    return JSONResponse({"id": rid, "model": body.model or _name(request), "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                         "meta": {"billed_units": {"search_units": 1}}}, headers={REQUEST_ID_HEADER: rid})


def _doc_text(doc: dict[str, Any], i: int) -> str:
    if set(doc) != {"text"} or not isinstance(doc["text"], str):
        raise ApiError(400, f"documents[{i}]: a document is a string or {{\"text\": \"...\"}}", param="documents")
    return doc["text"]


def _name(request: Request) -> str:
    return request.app.state.llm.model.name


async def _embed(request: Request, body: ScoreRequest | RerankRequest, texts: list[str],
                 prefix: str) -> tuple[str, torch.Tensor, int]:
    """(request id, the texts' embeddings [n, E] fp32, their tokens): each text its own engine request."""
    state, model = opened(request, body)
    adapter = check_model(model, body.model)
    with state.admit():
        ids = input_ids(model, texts, True, body.truncate_prompt_tokens, "texts")
        rid = new_request_id(prefix)
        outs = await until_disconnected(request, embed_all(state, [(f"{rid}-{i}", x) for i, x in enumerate(ids)],
                                                           EmbedParams(normalize=True), adapter))
    return rid, torch.tensor([o.embedding for o in outs]), sum(len(x) for x in ids)
