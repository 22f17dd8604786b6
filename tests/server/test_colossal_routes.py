"""ColossalAI-Inference's routes (seed 003): its README's curl calls sent unchanged to a real server, answers
compared with the OpenAI routes' greedy answers on the same engine, its streaming framings, and every refusal as a
400 in the `{"error", "error_type"}` format."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.harness import (
    EngineHandle,
    RunningServer,
    parked_after_tokens,
    parked_engine,
    running_server,
    wait_until,
)

# The seed's examples, verbatim.
SEED_COMPLETION = {"prompt": "hello, who are you? "}
SEED_CHAT = {"messages": [{"role": "system", "content": "you are a helpful assistant"},
                          {"role": "user", "content": "what is 1+1?"}]}


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def _openai_completion(server: RunningServer, prompt: str, max_tokens: int) -> str:
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _openai_chat(server: RunningServer, messages: list[dict[str, str]], max_tokens: int) -> str:
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _sse_data(text: str) -> list[str]:
    events = text.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), text
    return [e[len("data: "):] for e in events[:-1]]


def test_seed_completion_is_the_greedy_answer_of_128_tokens(server: RunningServer) -> None:
    r = _post(server, "/completion", SEED_COMPLETION)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"request_id", "text"} and isinstance(body["request_id"], int)
    assert body["text"] == _openai_completion(server, SEED_COMPLETION["prompt"], 128)
    # ColossalAI's own README sends stream as the string "False"; numbers count up per request.
    again = _post(server, "/completion", {**SEED_COMPLETION, "stream": "False"}).json()
    assert again["text"] == body["text"] and again["request_id"] > body["request_id"]


@pytest.mark.parametrize("stream", [True, "true", "True"])
def test_streamed_completion_sends_the_text_so_far_in_nul_ended_json(server: RunningServer, stream: Any) -> None:
    full = _post(server, "/completion", SEED_COMPLETION).json()["text"]
    r = _post(server, "/completion", {**SEED_COMPLETION, "stream": stream})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    pieces = r.text.split("\0")
    assert pieces[-1] == ""  # every object ends with NUL
    objects = [json.loads(p) for p in pieces[:-1]]
    assert len(objects) > 1 and len({o["request_id"] for o in objects}) == 1
    texts = [o["text"] for o in objects]
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == full  # the last object is the non-streamed body


def test_seed_chat_answers_as_the_assistant(server: RunningServer) -> None:
    r = _post(server, "/chat", SEED_CHAT)
    assert r.status_code == 200, r.text
    assert r.json() == {"role": "assistant", "text": _openai_chat(server, SEED_CHAT["messages"], 128)}
    explicit = _post(server, "/chat", {**SEED_CHAT, "add_generation_prompt": True, "stream": "false"})
    assert explicit.json() == r.json()


def test_streamed_chat_sends_the_role_then_deltas_then_done(server: RunningServer) -> None:
    full = _post(server, "/chat", {**SEED_CHAT, "max_new_tokens": 12}).json()["text"]
    r = _post(server, "/chat", {**SEED_CHAT, "max_new_tokens": 12, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = _sse_data(r.text)
    assert data[0] == '{"index":0,"message":{"role":"assistant"}}' and data[-1] == "[DONE]"
    deltas = [json.loads(d) for d in data[1:-1]]
    assert deltas and all(set(d) == {"content"} for d in deltas)
    assert "".join(d["content"] for d in deltas) == full


def test_chat_echo_puts_the_assistant_message_before_its_continuation(server: RunningServer) -> None:
    messages = [{"role": "user", "content": "what is 1+1?"}, {"role": "assistant", "content": "The answer is"}]
    continuation = _openai_chat(server, messages, 8)
    r = _post(server, "/chat", {"messages": messages, "echo": "true", "max_new_tokens": 8})
    assert r.json() == {"role": "assistant", "text": "The answer is" + continuation}
    data = _sse_data(_post(server, "/chat", {"messages": messages, "echo": True, "max_new_tokens": 8,
                                             "stream": True}).text)
    assert data[:2] == ['{"index":0,"message":{"role":"assistant"}}',
                        '{"index":0,"message":{"content":"The answer is"}}']
    assert "".join(json.loads(d)["content"] for d in data[2:-1]) == continuation
    # echo of a user message: ColossalAI echoes only a message in the answer's role
    assert _post(server, "/chat", {"messages": messages[:1], "echo": True, "max_new_tokens": 8}).json()["text"] == \
        _openai_chat(server, messages[:1], 8)


def test_generation_parameters(server: RunningServer, tiny: EngineHandle) -> None:
    prompt = SEED_COMPLETION["prompt"]
    n = len(tiny.tokenizer.encode(prompt))
    five = _openai_completion(server, prompt, 5)
    assert _post(server, "/completion", {"prompt": prompt, "max_new_tokens": 5}).json()["text"] == five
    assert _post(server, "/completion", {"prompt": prompt, "max_length": n + 5}).json()["text"] == five
    # max_new_tokens wins over max_length, as in transformers
    assert _post(server, "/completion", {"prompt": prompt, "max_new_tokens": 5, "max_length": n + 50}).json()["text"] \
        == five
    # sampling restricted to the most likely token is the greedy answer
    sampled = _post(server, "/completion", {"prompt": prompt, "max_new_tokens": 5, "do_sample": True, "top_k": 1,
                                            "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.0})
    assert sampled.json()["text"] == five
    # the neutral values of the sampling knobs change nothing without do_sample, so they are accepted
    neutral = {"prompt": prompt, "max_new_tokens": 5, "do_sample": False, "temperature": 1.0, "top_k": 50,
               "top_p": 1.0, "num_beams": 1, "no_repeat_ngram_size": 0}
    assert _post(server, "/completion", neutral).json()["text"] == five
    # what the model's generation_config.json says (do_sample, temperature 0.6) is not applied: greedy by default
    assert _post(server, "/completion", {"prompt": prompt, "max_new_tokens": 5}).json()["text"] == five


def test_default_max_new_tokens_is_what_fits_when_128_does_not(server: RunningServer, tiny: EngineHandle) -> None:
    prompt = "hello " * 40
    n = len(tiny.tokenizer.encode(prompt))
    assert 128 + n > 256 > n
    r = _post(server, "/completion", {"prompt": prompt})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == _openai_completion(server, prompt, 256 - n)


def test_engine_check_and_ping(server: RunningServer) -> None:
    assert httpx.get(server.url + "/engine_check").json() == {"status": "Running"}
    assert httpx.get(server.url + "/ping").json() == {"status": "Healthy"}
    with running_server(None) as loading:  # no engine attached yet
        r = httpx.get(loading.url + "/engine_check")
        assert (r.status_code, r.json()) == (200, {"status": "Error"})
        r = httpx.post(loading.url + "/completion", json=SEED_COMPLETION)
        assert (r.status_code, r.json()) == (503, {"error": "the model is still loading; retry in a few seconds",
                                                   "error_type": "unavailable"})


HI = {"messages": [{"role": "user", "content": "hi"}]}
BAD = [
    ("/completion", {"prompt": 5}, "prompt: Input should be a valid string (got 5)"),
    ("/completion", {"prompt": ""}, "prompt: must not be empty"),
    ("/completion", {"prompt": "hi", "stream": "maybe"},
     "stream: must be true or false (a boolean, or the string \"true\" or \"false\"), got 'maybe'"),
    ("/completion", {"prompt": "hi", "stream": 1}, "stream"),
    ("/completion", {"prompt": "hi", "max_new_tokens": 0}, "max_new_tokens: must be >= 1, got 0"),
    ("/completion", {"prompt": "hi", "max_new_tokens": "5"}, "max_new_tokens: Input should be a valid integer"),
    ("/completion", {"prompt": "hi", "max_new_tokens": 300},
     "the prompt has 2 tokens and max_new_tokens is 300: together 302, over the session length of 256 tokens; "
     "shorten the prompt or lower max_new_tokens"),
    ("/completion", {"prompt": "word " * 300}, "This model's maximum context length is 256 tokens, and the prompt "
                                               "has 901 tokens: shorten it."),
    ("/completion", {"prompt": "hi", "max_length": 2}, "max_length: 2 counts the prompt's tokens too (the output gets "
     "max_length minus them), and the prompt is already 2 tokens long: send a max_length above 2, or max_new_tokens "
     "to bound the output alone"),
    ("/completion", {"prompt": "hi", "min_new_tokens": -1}, "min_new_tokens: must be in [0, max_new_tokens=128], "
                                                            "got -1"),
    ("/completion", {"prompt": "hi", "do_sample": True, "temperature": -1}, "temperature: must be >= 0, got -1"),
    ("/completion", {"prompt": "hi", "do_sample": True, "top_p": 2}, "top_p: must be in (0, 1], got 2"),
    ("/completion", {"prompt": "hi", "do_sample": True, "top_k": -5}, "top_k: must be >= 0"),
    ("/completion", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty: must be > 0, got 0"),
    ("/completion", {"prompt": "hi", "temperature": 0.5}, "temperature: only used when sampling; send \"do_sample\": "
                                                          "true (without it the answer is greedy, as in ColossalAI)"),
    ("/completion", {"prompt": "hi", "top_k": 5}, "top_k: only used when sampling"),
    ("/completion", {"prompt": "hi", "num_beams": 2}, "num_beams: beam search is not offered on this route"),
    ("/completion", {"prompt": "hi", "no_repeat_ngram_size": 3}, "no_repeat_ngram_size: not supported"),
    ("/completion", {"prompt": "hi", "seed": 1}, "seed: unknown field; llmserve does not know what it asks for"),
    ("/chat", {"messages": []}, "messages must be a non-empty list of {'role', 'content'} objects"),
    ("/chat", {"messages": "hi"}, "messages: Input should be a valid list (got 'hi')"),
    ("/chat", {"messages": [{"role": "bot", "content": "x"}]},
     "messages[0].role must be system, user, assistant or tool, got 'bot'"),
    ("/chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ("/chat", {**HI, "add_generation_prompt": False}, "add_generation_prompt: false is not supported"),
    ("/chat", {**HI, "n": 2}, "n: only 1 is supported (one answer per request), got 2"),
    ("/chat", {**HI, "max_length": 3}, "max_length: 3 counts the prompt's tokens too (the output gets max_length minus "
     "them), and the chat is already 18 tokens long (the chat template's tokens included): send a max_length above 18, "
     "or max_new_tokens to bound the output alone"),
    ("/chat", {**HI, "echo": "yes"}, "echo: must be true or false"),
    ("/chat", {**HI, "conversation": HI["messages"]}, "conversation: unknown field"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD, ids=[f"{p}:{','.join(b)}" for p, b, _ in BAD])
def test_bad_input_is_a_400_saying_what_to_change(server: RunningServer, path: str, body: dict[str, Any],
                                                  message: str) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error", "error_type"} and r.json()["error_type"] == "validation"
    assert r.json()["error"].startswith(message)


def test_a_body_that_is_not_json_is_a_400(server: RunningServer) -> None:
    r = httpx.post(server.url + "/chat", content=b"{not json", headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error_type"]) == (400, "validation")
    assert r.json()["error"].startswith("the body is not valid JSON")


def test_stream_disconnect_aborts_the_request(server: RunningServer, tiny: EngineHandle) -> None:
    aborts = server.metric("llmserve:request_success_total", finished_reason="abort")
    client = httpx.Client(timeout=60)
    with parked_after_tokens(tiny) as parked:
        response = client.send(client.build_request("POST", server.url + "/completion", json={
            **SEED_COMPLETION, "max_new_tokens": 200, "stream": True}), stream=True)
        assert response.status_code == 200
        assert parked.wait(30), "the request never reached its third token"
        assert len(server.state.in_flight) == 1
        response.close()
        client.close()
        wait_until(lambda: not server.state.in_flight, what="the server to notice the disconnect")
    report = server.kv()
    assert (report["in_use"], report["invariants_ok"], report["unfinished_requests"]) == (0, True, False)
    assert server.metric("llmserve:request_success_total", finished_reason="abort") == aborts + 1
    assert server.state.num_active == 0


def test_non_streamed_chat_is_aborted_when_its_client_leaves(server: RunningServer, tiny: EngineHandle) -> None:
    aborts = server.metric("llmserve:request_success_total", finished_reason="abort")
    with parked_engine(tiny):
        try:  # the answer cannot come while the engine is parked: the client gives up
            httpx.post(server.url + "/chat", json=SEED_CHAT, timeout=0.5)
        except httpx.ReadTimeout:
            pass
        wait_until(lambda: not server.state.in_flight, what="the server to notice the disconnect")
    report = server.kv()
    assert (report["in_use"], report["invariants_ok"], report["unfinished_requests"]) == (0, True, False)
    assert server.metric("llmserve:request_success_total", finished_reason="abort") == aborts + 1
    assert server.state.num_active == 0
