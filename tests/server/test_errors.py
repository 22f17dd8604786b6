"""Every error a client can cause, over raw HTTP: exact status and body in the API's own format
(OpenAI's on /v1, TGI's elsewhere), each followed by a request that succeeds (the server keeps
serving)."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.server.conftest import API_KEYS
from tests.server.harness import EngineHandle, RunningServer, running_server, wait_until

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Hello"}]


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny-llama", "messages": MSG, "max_tokens": 4, **fields}


def _assert_serving(server: RunningServer) -> None:
    r = httpx.post(server.url + CHAT, json=_chat(temperature=0), headers=server.headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(server.url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                   headers=server.headers)
    assert r.status_code == 200, r.text


def _openai_error(r: httpx.Response, status: int, param: str | None, fragment: str, code: str | None = None,
                  type_: str = "invalid_request_error") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == (type_, param, code)
    assert fragment in err["message"], err["message"]


OPENAI_400 = [
    (CHAT, _chat(temperature="hot"), "temperature", "temperature: Input should be a valid number (got 'hot')"),
    (CHAT, _chat(n=True), "n", "n: Input should be a valid integer"),
    (CHAT, _chat(max_tokens="4"), "max_tokens", "max_tokens: Input should be a valid integer"),
    (CHAT, {"model": "tiny-llama"}, "messages", "messages: Field required"),
    (CHAT, _chat(messages=[{"role": "wizard", "content": "hi"}]), "messages", "messages.0.role"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages",
     "messages[0].content[0]: this model takes text only, got a 'image_url' part"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]), "messages",
     "messages[0].content[0]: a content part is of type text or image_url; got a 'input_audio' part"),
    # found by the fuzzer (test_fuzz.py): a 500 (KeyError) in the text-only templates' tool-call rendering
    (CHAT, _chat(messages=[{"role": "system", "content": "Be brief", "tool_calls": [{"x": 1}]}, *MSG]), "messages",
     "messages[0].tool_calls: only an assistant message makes tool calls; this one's role is system"),
    (CHAT, _chat(temperature=-1), "temperature", "temperature: must be >= 0, got -1"),
    (CHAT, _chat(top_p=1.5), "top_p", "top_p: must be in (0, 1], got 1.5"),
    (CHAT, _chat(max_tokens=0), "max_tokens", "max_tokens: must be >= 1, got 0"),
    (CHAT, _chat(n=0), "n", "n: must be >= 1, got 0"),
    (CHAT, _chat(presence_penalty=3), "presence_penalty", "must be in [-2, 2], got 3"),
    # found by the fuzzer: a seed past 64 bits raised in the engine loop (a 500 on TGI's /generate_stream)
    (CHAT, _chat(seed=2 ** 64), "seed", "seed: must be a 64-bit integer (in [-2**63, 2**64)), got 18446744073709551616"),
    (CHAT, _chat(logprobs=True, top_logprobs=30), "top_logprobs", "must be in [0, 20], got 30"),
    (CHAT, _chat(top_logprobs=2), "top_logprobs", "requires logprobs to be true"),
    (CHAT, _chat(n=3, best_of=2), "best_of", "best_of: must be >= n (3), got 2"),
    (CHAT, _chat(n=3, best_of=2, use_beam_search=True), "best_of", "best_of: must be >= n (3), got 2"),
    (CHAT, _chat(use_beam_search=True, logprobs=True), "top_logprobs", "is not supported with beam search"),
    (CHAT, _chat(use_beam_search=True, early_stopping="soon"), "early_stopping", "early_stopping"),
    (CHAT, _chat(best_of=129), "best_of", "best_of: must be <= 128, got 129"),
    (CHAT, _chat(stream_options={"include_usage": True}), "stream_options", "only allowed when stream is true"),
    (CHAT, _chat(stop=["ok", ""]), "stop", "must not contain empty strings"),
    (CHAT, _chat(logit_bias={"abc": 1}), "logit_bias", "keys must be token ids, got 'abc'"),
    (CHAT, _chat(logit_bias={"5": 300}), "logit_bias", "values must be in [-100, 100]"),
    # Refused by the engine itself (after the request was queued): still a 400 before any output.
    (CHAT, _chat(logit_bias={"100000": 5}), "logit_bias", "token id 100000 is not in the vocabulary [0, 320)"),
    ("/v1/completions", {"prompt": [999999], "max_tokens": 2}, "prompt", "token id 999999 is not in the vocabulary"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt", "prompt: must not be empty"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n", "n: must be <= 128, got 129"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix", "suffix: not supported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs: must be in [0, 20], got 21"),
]


@pytest.mark.parametrize("path,body,param,fragment", OPENAI_400, ids=[f"{i}-{c[2]}" for i, c in enumerate(OPENAI_400)])
def test_openai_400(server: RunningServer, path: str, body: dict[str, Any], param: str, fragment: str) -> None:
    _openai_error(httpx.post(server.url + path, json=body), 400, param, fragment)
    _assert_serving(server)


def test_one_refused_prompt_of_several_aborts_the_others(server: RunningServer) -> None:
    body = {"prompt": [[5, 6, 7], [999999]], "max_tokens": 50, "ignore_eos": True}
    _openai_error(httpx.post(server.url + "/v1/completions", json=body), 400, "prompt",
                  "token id 999999 is not in the vocabulary")
    assert not server.state.in_flight
    wait_until(lambda: server.kv()["in_use"] == 0, what="blocks freed")
    _assert_serving(server)


def test_malformed_json_is_400(server: RunningServer) -> None:
    r = httpx.post(server.url + CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    _openai_error(r, 400, None, "the body is not valid JSON")
    _assert_serving(server)


def test_prompt_over_the_context_says_the_limit_and_the_count(server: RunningServer, tiny: EngineHandle) -> None:
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 40}]
    count = len(tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    assert count > 256
    r = httpx.post(server.url + CHAT, json={"messages": messages})
    _openai_error(r, 400, "messages", f"maximum context length is 256 tokens, and the messages have {count} tokens",
                  code="context_length_exceeded")
    short = [{"role": "user", "content": "Hello"}]
    count = len(tiny.tokenizer.apply_chat_template(short, add_generation_prompt=True, tokenize=True, return_dict=False))
    r = httpx.post(server.url + CHAT, json={"messages": short, "max_tokens": 250})
    _openai_error(r, 400, "max_tokens", f"maximum context length is 256 tokens. However, you requested {count + 250} "
                  f"tokens ({count} in the messages, 250 for the completion)", code="context_length_exceeded")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": list(range(3, 259)), "max_tokens": 1})
    _openai_error(r, 400, "prompt", "the prompt has 256 tokens", code="context_length_exceeded")
    _assert_serving(server)


def test_unknown_model_is_404(server: RunningServer) -> None:
    r = httpx.post(server.url + CHAT, json=_chat(model="gpt-5"))
    _openai_error(r, 404, "model", "The model `gpt-5` does not exist", code="model_not_found")
    _assert_serving(server)


def test_unknown_route_is_404_in_the_routes_format(server: RunningServer) -> None:
    _openai_error(httpx.get(server.url + "/v1/nothing"), 404, None, "Not Found")
    r = httpx.get(server.url + "/nothing")
    assert r.status_code == 404 and r.json() == {"error": "Not Found", "error_type": "not_found"}
    _assert_serving(server)


TGI_400 = [
    ({"inputs": "Hi", "parameters": {"typical_p": 1.5}}, "typical_p: must be in (0, 1], got 1.5"),
    ({"inputs": "Hi", "parameters": {"max_new_tokens": "x"}}, "parameters.max_new_tokens: Input should be a valid "
                                                              "integer (got 'x')"),
    ({"inputs": "", "parameters": {}}, "`inputs` cannot be empty"),
    ({"parameters": {}}, "inputs: Field required"),
    ({"inputs": "Hi", "parameters": {"temperature": -1.0}}, "temperature: must be >= 0"),
    ({"inputs": "Hi", "parameters": {"best_of": 2}}, "`best_of`: you must use sampling when `best_of` is > 1"),
    ({"inputs": "Hi", "parameters": {"best_of": 2, "do_sample": True, "seed": 3}},
     "`seed`: must not be set when `best_of` > 1"),
    ({"inputs": "Hi", "parameters": {"best_of": 17, "do_sample": True}}, "`best_of`: must be > 0 and <= 16. Given: 17"),
    ({"inputs": "Hi", "parameters": {"best_of": 0}}, "`best_of`: must be > 0 and <= 16. Given: 0"),
    ({"inputs": "Hi", "parameters": {"watermark": "yes"}}, "parameters.watermark: Input should be a valid boolean"),
    ({"inputs": "Hi", "parameters": {"max_new_tokens": 300}}, "`inputs` tokens + `max_new_tokens` must be <= 256. "
                                                              "Given: 2 `inputs` tokens and 300 `max_new_tokens`"),
    ({"inputs": "The quick brown fox jumps over the lazy dog. " * 40}, "`inputs` must have less than 256 tokens. "
                                                                      "Given: 1360"),
]


@pytest.mark.parametrize("body,message", TGI_400, ids=[str(i) for i in range(len(TGI_400))])
def test_tgi_400(server: RunningServer, tiny: EngineHandle, body: dict[str, Any], message: str) -> None:
    if "inputs" in body and len(body["inputs"]) > 100:
        assert len(tiny.tokenizer.encode(body["inputs"])) == 1360  # the count the message must give
    r = httpx.post(server.url + "/generate", json=body)
    assert r.status_code == 400 and r.json() == {"error": r.json()["error"], "error_type": "validation"}
    assert message in r.json()["error"]
    _assert_serving(server)


@pytest.mark.parametrize("parameters", [{"decoder_input_details": True}, {"best_of": 2, "do_sample": True}])
def test_tgi_streams_refuse_what_tgi_refuses(server: RunningServer, parameters: dict[str, Any]) -> None:
    r = httpx.post(server.url + "/generate_stream", json={"inputs": "Hi", "parameters": parameters})
    assert r.status_code == 400 and "not supported when streaming" in r.json()["error"]
    _assert_serving(server)


def test_api_keys(strict_server: RunningServer) -> None:
    url = strict_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEYS[0]}):
        _openai_error(httpx.get(url + "/v1/models", headers=headers), 401, None, "Incorrect or missing API key",
                      code="invalid_api_key")
        r = httpx.post(url + "/generate", json={"inputs": "Hi"}, headers=headers)
        assert r.status_code == 401 and r.json()["error_type"] == "authentication"
        assert httpx.get(url + "/metrics", headers=headers).status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    assert httpx.get(url + "/").status_code == 200  # nor the chat page (its API calls do)
    for key in API_KEYS:
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny-llama"
    _assert_serving(strict_server)


def test_concurrency_limit_is_429_until_a_slot_frees(strict_server: RunningServer, tiny: EngineHandle) -> None:
    url, headers = strict_server.url, strict_server.headers
    rejected_before = strict_server.metric("llmserve:requests_rejected_total", status="429")
    # Park the engine thread, so the one admitted request cannot finish while we knock.
    gate = threading.Event()
    parked = threading.Thread(target=tiny.call, args=(lambda engine: gate.wait(30),))
    parked.start()
    first: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: first.append(
        httpx.post(url + CHAT, json=_chat(temperature=0), headers=headers, timeout=60)))
    holder.start()
    try:
        wait_until(lambda: strict_server.state.num_active == 1, what="the first request to take the slot")
        _openai_error(httpx.post(url + CHAT, json=_chat(), headers=headers), 429, None,
                      "at its limit of 1 concurrent requests", code="rate_limit_exceeded", type_="rate_limit_exceeded")
        r = httpx.post(url + "/generate", json={"inputs": "Hi"}, headers=headers)
        assert r.status_code == 429 and r.json()["error_type"] == "overloaded"
        assert httpx.get(url + "/health").status_code == 200  # only generation requests count
    finally:
        gate.set()
        parked.join()
        holder.join()
    assert first[0].status_code == 200 and first[0].json()["usage"]["completion_tokens"] == 4
    assert strict_server.state.num_active == 0
    assert strict_server.metric("llmserve:requests_rejected_total", status="429") == rejected_before + 2
    _assert_serving(strict_server)


def test_503_while_loading_then_serving(tiny: EngineHandle) -> None:
    with running_server(None) as loading:
        r = httpx.get(loading.url + "/health")
        assert r.status_code == 503 and r.json() == {"error": "the model is still loading", "error_type": "unavailable"}
        _openai_error(httpx.post(loading.url + CHAT, json=_chat()), 503, None, "the model is still loading",
                      type_="service_unavailable")
        r = httpx.post(loading.url + "/generate", json={"inputs": "Hi"})
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
        assert loading.metric("llmserve:requests_rejected_total", status="503") == 2
        loading.state.attach(tiny.engine, tiny.model)  # what server.py's loader thread does
        assert httpx.get(loading.url + "/health").status_code == 200
        _assert_serving(loading)
        loading.state.draining = True  # what SIGTERM does
        assert httpx.get(loading.url + "/health").status_code == 503  # load balancers: stop sending here
        _openai_error(httpx.post(loading.url + CHAT, json=_chat()), 503, None, "the server is shutting down",
                      type_="service_unavailable")
