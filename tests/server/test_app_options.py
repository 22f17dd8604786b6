"""What the server exposes besides generation: /metrics' families, CORS only when asked for, the chat
page and its files, /debug/kv only when enabled."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from tests.server.harness import EngineHandle, RunningServer, engine_for, running_server

METRIC_FAMILIES = {
    "llmserve:request_success_total": "counter", "llmserve:requests_rejected_total": "counter",
    "llmserve:prompt_tokens_total": "counter", "llmserve:generation_tokens_total": "counter",
    "llmserve:time_to_first_token_seconds": "histogram", "llmserve:time_per_output_token_seconds": "histogram",
    "llmserve:e2e_request_latency_seconds": "histogram", "llmserve:request_queue_time_seconds": "histogram",
    "llmserve:request_prompt_tokens": "histogram", "llmserve:request_generation_tokens": "histogram",
    "llmserve:num_requests_running": "gauge", "llmserve:num_requests_waiting": "gauge",
    "llmserve:kv_cache_usage_perc": "gauge", "llmserve:kv_cache_blocks_total": "gauge",
    "llmserve:prefix_cache_hit_rate": "gauge",
    "llmserve:prefix_cache_queries_total": "counter", "llmserve:prefix_cache_hits_total": "counter",
    "llmserve:spec_decode_num_draft_tokens_total": "counter", "llmserve:spec_decode_num_accepted_tokens_total": "counter",
    "llmserve:spec_decode_num_drafts_total": "counter", "llmserve:spec_decode_num_emitted_tokens_total": "counter",
    "llmserve:num_sessions": "gauge", "llmserve:session_kv_blocks": "gauge",
    "llmserve:prompt_tokens_computed_total": "counter", "llmserve:session_hit_tokens_total": "counter",
    "llmserve:sessions_evicted_total": "counter",
}


def test_metrics_families_and_one_request_counted(server: RunningServer) -> None:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    types = {line.split()[2]: line.split()[3] for line in r.text.splitlines() if line.startswith("# TYPE")}
    assert METRIC_FAMILIES.items() <= types.items()
    assert "_created" not in r.text
    assert server.metric("llmserve:kv_cache_blocks_total") == 512

    def counts() -> list[float]:
        return [server.metric("llmserve:request_success_total", finished_reason="length"),
                server.metric("llmserve:generation_tokens_total"), server.metric("llmserve:prompt_tokens_total"),
                server.metric("llmserve:time_to_first_token_seconds_count"),
                server.metric("llmserve:time_per_output_token_seconds_count"),
                server.metric("llmserve:e2e_request_latency_seconds_count"),
                server.metric("llmserve:request_queue_time_seconds_count")]

    before = counts()
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "n": 2, "temperature": 0, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    # Per sequence (n = 2): two finishes, 12 tokens, one prompt of 3 tokens.
    assert [a - b for a, b in zip(counts(), before)] == [2, 12, 3, 2, 2, 2, 2]


def test_cors_only_for_configured_origins(server: RunningServer, tiny: EngineHandle) -> None:
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers  # default: no cross-origin access
    with running_server(tiny, allow_origins=["http://localhost:3000"], api_keys=["k"]) as cors:
        r = httpx.options(cors.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200  # answered before the API-key check: browsers send no key here
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.get(cors.url + "/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = httpx.options(cors.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_chat_page_and_its_files(server: RunningServer) -> None:
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<html" in page.text.lower()
    for src in re.findall(r'(?:src|href)="(static/[^"]+)"', page.text):  # every file the page names is served
        assert httpx.get(f"{server.url}/{src}").status_code == 200, src


def test_debug_kv_is_off_by_default(tiny: EngineHandle) -> None:
    with running_server(tiny) as plain:
        assert httpx.get(plain.url + "/debug/kv").status_code == 404


def test_request_id_header_and_one_log_line_per_finished_sequence(server: RunningServer,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
            "temperature": 0, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="llmserve.serve"):
        r = httpx.post(server.url + "/v1/chat/completions", json=body)
    rid = r.json()["id"]
    assert r.headers["x-request-id"] == rid
    prompt = r.json()["usage"]["prompt_tokens"]
    lines = sorted(m for m in caplog.messages if m.startswith(rid))
    assert [re.sub(r"TTFT [0-9.]+ s, [0-9.]+ s in all", "TTFT t, d", m) for m in lines] == \
        [f"{rid}#{i} finished (length): {prompt} prompt + 4 output tokens, TTFT t, d" for i in (0, 1)]
    with httpx.stream("POST", server.url + "/generate_stream", json={"inputs": "Hi"}) as s:
        assert s.headers["x-request-id"].startswith("generate-")


def test_prefix_cache_counters_expose_the_engine_token_counts() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from llmserve.engine.async_engine import EngineStats
    from llmserve.serve.metrics import _EngineGauges

    registry = CollectorRegistry()
    registry.register(_EngineGauges(lambda: EngineStats(1, 0, 8, 2, 0.5, 3, prefix_queried_tokens=100,
                                                        prefix_hit_tokens=50)))
    lines = generate_latest(registry).decode().splitlines()
    assert "llmserve:prefix_cache_queries_total 100.0" in lines
    assert "llmserve:prefix_cache_hits_total 50.0" in lines
    assert "llmserve:prefix_cache_hit_rate 0.5" in lines


def test_session_metrics_expose_the_engine_counts() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from llmserve.engine.async_engine import EngineStats
    from llmserve.serve.metrics import _EngineGauges

    registry = CollectorRegistry()
    registry.register(_EngineGauges(lambda: EngineStats(1, 0, 8, 2, 0.5, 3, prefill_tokens=70, num_sessions=4,
                                                        session_blocks=6, session_hit_tokens=30,
                                                        sessions_evicted=2)))
    lines = generate_latest(registry).decode().splitlines()
    for line in ("llmserve:num_sessions 4.0", "llmserve:session_kv_blocks 6.0",
                 "llmserve:prompt_tokens_computed_total 70.0", "llmserve:session_hit_tokens_total 30.0",
                 "llmserve:sessions_evicted_total 2.0"):
        assert line in lines


def test_speculative_server_same_answers_and_acceptance_metrics(server: RunningServer, tiny_model_dir) -> None:
    """An n-gram speculating server answers greedy requests exactly as the plain one, streamed or
    not, and /metrics counts its drafts."""
    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    plain = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["text"]
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", num_blocks=64, block_size=16,
                    speculative_method="ngram", prompt_lookup_min=1) as handle, running_server(handle) as spec:
        assert httpx.post(spec.url + "/v1/completions", json=body).json()["choices"][0]["text"] == plain
        streamed = ""
        with httpx.stream("POST", spec.url + "/v1/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == plain
        drafts = spec.metric("llmserve:spec_decode_num_draft_tokens_total")
        accepted = spec.metric("llmserve:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 <= accepted <= drafts  # acceptance itself: tests/engine/test_speculative.py
        assert spec.metric("llmserve:spec_decode_num_emitted_tokens_total") == \
            accepted + spec.metric("llmserve:spec_decode_num_drafts_total")
