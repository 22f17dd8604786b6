"""vLLM's /score and /rerank over the served model's embeddings (tiny llama): a pair's score is the cosine similarity
of the texts' embeddings as /v1/embeddings gives them; rerank orders documents by it, best first; refusals in
OpenAI's error shape."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.server.harness import RunningServer

QUERY = "What is the capital of France?"
DOCS = ["The capital of France is Paris.", "Models run over flat tokens.", "Paris", "A paged KV cache."]


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": "tiny-llama", **body}, timeout=60)


def embeddings(server: RunningServer, texts: list[str]) -> torch.Tensor:
    r = post(server, "/v1/embeddings", {"input": texts, "encoding_format": "float"})
    return torch.tensor([d["embedding"] for d in r.json()["data"]])


def cosine(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_one_against_many_and_pairwise(server: RunningServer, path: str) -> None:
    e = embeddings(server, [QUERY, *DOCS])
    r = post(server, path, {"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["data"][0]["object"] == "score"
    assert [d["score"] for d in body["data"]] == pytest.approx(cosine(e[:1], e[1:]), abs=2e-3)
    assert body["usage"]["prompt_tokens"] == sum(len(x) for x in _ids(server, [QUERY, *DOCS]))
    pairs = post(server, path, {"text_1": DOCS[:2], "text_2": DOCS[2:]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(cosine(e[1:3], e[3:5]), abs=2e-3)
    many = post(server, path, {"text_1": DOCS, "text_2": QUERY}).json()  # one text on either side
    assert [d["score"] for d in many["data"]] == pytest.approx([d["score"] for d in body["data"]], abs=2e-3)


def _ids(server: RunningServer, texts: list[str]) -> list[list[int]]:
    return [httpx.post(server.url + "/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_score(server: RunningServer, path: str) -> None:
    scores = [d["score"] for d in post(server, "/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]]
    r = post(server, path, {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -scores[i])
    assert [x["relevance_score"] for x in results] == pytest.approx(sorted(scores, reverse=True), abs=2e-3)
    assert [x["document"]["text"] for x in results] == [DOCS[x["index"]] for x in results]
    top = post(server, path, {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                              "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in results[:2]] and "document" not in top[0]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ""}, "text_2"),
    ("/v1/score", {"text_1": "a", "text_2": "b", "softmax": True}, "softmax"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": "x" * 2000, "documents": DOCS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", "x" * 2000]}, "documents"),
])
def test_refusals(server: RunningServer, path: str, body: dict, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert server.kv()["in_use"] == 0


def test_a_truncation_past_any_length_keeps_everything(server: RunningServer) -> None:
    """(found by the fuzzer: the tokenizer overflowed on it, a 500)"""
    body = {"text_1": "a cat", "text_2": ["a dog", "a car"]}
    whole = post(server, "/v1/score", body)
    huge = post(server, "/v1/score", {**body, "truncate_prompt_tokens": 10**30})
    assert huge.status_code == 200, huge.text
    assert [d["score"] for d in huge.json()["data"]] == [d["score"] for d in whole.json()["data"]]


def test_root_routes_answer_errors_in_tgi_shape(server: RunningServer) -> None:
    """As every route outside /v1/ (docs/serving.md): the message, and TGI's error_type."""
    r = post(server, "/rerank", {"query": QUERY, "documents": ["a", "x" * 2000]})
    assert r.status_code == 400 and "documents[1]" in r.json()["error"] and r.json()["error_type"]


def test_rerank_defaults_as_vllms(server: RunningServer) -> None:
    """top_n 0, negative or null: every document; return_documents null: returned."""
    for top_n in (0, -1, None):
        got = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": top_n,
                                          "return_documents": None}).json()
        assert len(got["results"]) == 4 and "document" in got["results"][0]
        assert got["usage"]["completion_tokens"] == 0
