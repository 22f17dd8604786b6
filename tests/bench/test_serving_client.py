"""The serving benchmark's client against a fake OpenAI-compatible streaming server (fake_openai.py):
what it sends, what it counts, and failures."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from llmserve.bench.datasets import synthetic_chat
from llmserve.bench.serving import ServingPlan, ServingRequest, run_serving, serving_requests
from llmserve.chat_template import ChatTemplate
from llmserve.cli import main
from tests.bench.fake_openai import FAILURE_BODY, MODEL, FakeOpenAIServer
from tests.tiny_models import tiny_tokenizer

REQUESTS = [ServingRequest(prompt=" ".join(["w"] * (i + 2)), prompt_tokens=100 + i, output_len=5) for i in range(6)]


def test_chat_with_usage_concurrency_and_failures() -> None:
    with FakeOpenAIServer(fail_every=3, delay_s=0.01) as server:
        plan = ServingPlan(base_url=server.base_url + "/v1", model="m", concurrency=2, ignore_eos=True,
                           api_key="sekret")
        r = asyncio.run(run_serving(plan, REQUESTS))
    posts = server.posts()
    assert len(posts) == 6 and server.max_in_flight <= 2
    assert {p.path for p in posts} == {"/v1/chat/completions"}
    assert {p.headers["authorization"] for p in posts} == {"Bearer sekret"}
    assert sorted(p.body["messages"][0]["content"] for p in posts) == sorted(q.prompt for q in REQUESTS)
    assert {json.dumps({k: v for k, v in p.body.items() if k != "messages"}) for p in posts} == {json.dumps(
        {"model": "m", "max_tokens": 5, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
         "ignore_eos": True})}
    # The 3rd and 6th POSTs got a 500; which prompts they carried depends on arrival order.
    assert (r.num_requests, r.completed, r.failed) == (6, 4, 2)
    assert r.first_error == "HTTP 500: " + json.dumps(FAILURE_BODY)
    failed_prompts = {posts[2].body["messages"][0]["content"], posts[5].body["messages"][0]["content"]}
    # usage: prompt_tokens = words of the prompt, completion_tokens = max_tokens.
    assert r.prompt_tokens == sum(len(q.prompt.split()) for q in REQUESTS if q.prompt not in failed_prompts)
    assert (r.output_tokens, r.output_tokens_source) == (4 * 5, "usage")
    assert r.ttft_ms.p50 <= r.e2e_ms.p50 and r.itl_ms is not None and r.tpot_ms is not None
    assert r.output_throughput == pytest.approx(20 / r.duration_s)


def test_completions_without_usage_counts_content_events() -> None:
    with FakeOpenAIServer(send_usage=False, tokens_per_event=2) as server:
        plan = ServingPlan(base_url=server.base_url, model="m", endpoint="completions", request_rate=500.0)
        r = asyncio.run(run_serving(plan, REQUESTS[:3]))
    assert [p.path for p in server.posts()] == ["/v1/completions"] * 3
    assert sorted(p.body["prompt"] for p in server.posts()) == sorted(q.prompt for q in REQUESTS[:3])
    assert all("ignore_eos" not in p.body for p in server.posts())
    assert (r.completed, r.failed, r.first_error) == (3, 0, None)
    # 5 tokens in events of 2: three content events each; prompt tokens are ours (100, 101, 102).
    assert (r.output_tokens, r.output_tokens_source, r.prompt_tokens) == (3 * math.ceil(5 / 2), "content events",
                                                                          303)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_every_request() -> None:
    plan = ServingPlan(base_url=f"http://127.0.0.1:{_free_port()}", model="m", concurrency=1)
    r = asyncio.run(run_serving(plan, REQUESTS[:2]))
    assert (r.completed, r.failed, r.output_tokens, r.ttft_ms) == (0, 2, 0, None)
    assert r.first_error.startswith("ConnectError")


def test_cli_synthetic_workload_asks_the_model_name_and_sends_sized_prompts(
        tiny_model_dir: Callable[[str], str], capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = tiny_model_dir("llama")
    with FakeOpenAIServer(send_usage=False, tokens_per_event=1) as server:
        rc = main(["bench", "serving", "--base-url", server.base_url, "--tokenizer", model_dir, "--num-prompts", "4",
                   "--input-len", "20:30", "--output-len", "6", "--concurrency", "2", "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    tok = tiny_tokenizer()
    expected = serving_requests(synthetic_chat(tok, ChatTemplate(tok), 4, (20, 30), 6), tok, "chat")
    assert rc == 0
    assert [(s.method, s.path) for s in server.seen] == [("GET", "/v1/models")] + [("POST", "/v1/chat/completions")] * 4
    assert sorted(p.body["messages"][0]["content"] for p in server.posts()) == sorted(q.prompt for q in expected)
    assert {(p.body["model"], p.body["max_tokens"], p.body["ignore_eos"]) for p in server.posts()} == {(MODEL, 6, True)}
    assert (out["model"], out["completed"], out["failed"], out["concurrency"]) == (MODEL, 4, 0, 2)
    assert (out["output_tokens"], out["output_tokens_source"]) == (24, "content events")
    assert out["prompt_tokens"] == sum(q.prompt_tokens for q in expected)
    assert all(20 <= q.prompt_tokens for q in expected)
    assert set(out["ttft_ms"]) == {"mean", "p50", "p90", "p99"}


def test_cli_reports_an_unreachable_models_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serving", "--base-url", f"http://127.0.0.1:{_free_port()}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("llmserve: error: cannot read the served model from http://127.0.0.1:")
    assert "name the model with --model" in err


def test_cli_sharegpt_dataset_over_completions(tiny_model_dir: Callable[[str], str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    convs = [
        {"conversations": [{"from": "human", "value": "What is the capital of France?"},
                           {"from": "gpt", "value": "The capital of France is Paris."}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},  # no reply: skipped
        {"conversations": [{"from": "human", "value": "lazy dog " * 300},  # over max_model_len 512: skipped
                           {"from": "gpt", "value": "ok"}]},
        {"conversations": [{"from": "human", "value": "Hello world"}, {"from": "gpt", "value": "The quick brown fox"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    tok = tiny_tokenizer()
    with FakeOpenAIServer() as server:
        rc = main(["bench", "serving", "--base-url", server.base_url, "--tokenizer", tiny_model_dir("llama"),
                   "--dataset", str(path), "--endpoint", "completions", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and (out["num_requests"], out["completed"]) == (2, 2)
    template = ChatTemplate(tok)
    sent = {p.body["prompt"]: p.body["max_tokens"] for p in server.posts()}
    # The completions endpoint gets our templated prompt as text; max_tokens is the reply's length.
    assert sent == {template.messages_to_prompt([{"role": "user", "content": q}]): len(tok.encode(a))
                    for q, a in [("What is the capital of France?", "The capital of France is Paris."),
                                 ("Hello world", "The quick brown fox")]}
    assert out["output_tokens"] == sum(sent.values())
