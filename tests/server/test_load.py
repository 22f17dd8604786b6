"""Load: 64 concurrent streaming clients get complete, correct answers (each equal to the greedy
answer of the same request sent alone) while 16 more leave mid-stream; afterwards no KV block is in
use, the pool's invariants hold, and /metrics adds up. Once on the Python layers (fp32), once in the
native decoder stack (bf16, w8a8), whose steps run without the GIL beside the server's event loop, and once with
async scheduling (the next decode step launched before this one's tokens are read)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.server.harness import EngineHandle, RunningServer, wait_until

NUM_CLIENTS = 64
NUM_LEAVERS = 16
WORDS = ["Paris", "fox", "tiny", "cache", "model", "world", "capital", "quick"]


def _request(i: int) -> dict[str, Any]:
    # Different prompts and lengths, so sequences join and leave the batch at different steps.
    content = f"{WORDS[i % 8]} {WORDS[(i // 8) % 8]} number {i}"
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 8 + (i % 5) * 8}


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], leave_after: int | None = None) -> dict:
    text, finish, usage, chunks = "", None, None, 0
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = _counts(chunk["usage"])
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return {"left_after": chunks}  # leaving the block closes the connection mid-stream
    return {"text": text, "finish_reason": finish, "usage": usage}


def _counts(usage: dict[str, Any]) -> dict[str, Any]:
    """The usage without prompt_tokens_details: the prompts sent together find the blocks the references left in
    the prefix cache."""
    details = usage.pop("prompt_tokens_details")
    assert 0 <= details["cached_tokens"] < usage["prompt_tokens"]
    return usage


async def _run_all(url: str) -> tuple[list[dict], list[dict]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + NUM_LEAVERS + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        leaver_body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Never stop talking."}],
                       "temperature": 0, "max_tokens": 200, "ignore_eos": True}
        tasks = [_stream(client, url, _request(i)) for i in range(NUM_CLIENTS)]
        tasks += [_stream(client, url, leaver_body, leave_after=3 + i % 4) for i in range(NUM_LEAVERS)]
        results = await asyncio.gather(*tasks)
    return results[:NUM_CLIENTS], results[NUM_CLIENTS:]


def test_64_streams_with_16_leavers(server: RunningServer, tiny: EngineHandle) -> None:
    _check_load(server, tiny)


def test_64_streams_with_16_leavers_in_the_decoder_stack(stack_server: RunningServer, stack_tiny: EngineHandle) -> None:
    _check_load(stack_server, stack_tiny)
    assert stack_tiny.call(lambda e: e.runner.model.model._stack is not None)  # the steps ran in the stack


def test_64_streams_with_16_leavers_with_async_scheduling(async_server: RunningServer,
                                                          async_tiny: EngineHandle) -> None:
    """Leavers abort requests whose next step is already launched, or (where they arrive while a step is in flight,
    as the timing has it) whose prompt it computes; the answers and the pool must not notice."""
    from tests.engine.test_async_scheduling import Ahead

    ahead = async_tiny.call(Ahead)
    _check_load(async_server, async_tiny)
    assert ahead.count > 50  # steps launched ahead, with the previous step's tokens unread


def _check_load(server: RunningServer, tiny: EngineHandle) -> None:
    alone = []
    for i in range(NUM_CLIENTS):  # reference: one at a time
        r = httpx.post(server.url + "/v1/chat/completions", json=_request(i), timeout=60).json()
        alone.append({"text": r["choices"][0]["message"]["content"], "finish_reason": r["choices"][0]["finish_reason"],
                      "usage": _counts(r["usage"])})
    before = {reason: server.metric("llmserve:request_success_total", finished_reason=reason)
              for reason in ("stop", "length", "abort")}
    prompt_tokens = server.metric("llmserve:prompt_tokens_total")
    steps = tiny.engine.stats.num_steps

    together, leavers = asyncio.run(_run_all(server.url))

    assert together == alone  # same text, finish reason and usage as when sent alone
    assert all(leaver["left_after"] >= 3 for leaver in leavers)
    report = wait_until(lambda: (lambda r: r if r["in_use"] == 0 and not r["unfinished_requests"] else None)(
        server.kv()), what="every KV block to be released")
    assert report["invariants_ok"] and report["free"] + report["cached"] == report["total"] == 512
    assert server.state.num_active == 0 and not server.state.in_flight

    finished = {reason: server.metric("llmserve:request_success_total", finished_reason=reason) - before[reason]
                for reason in ("stop", "length", "abort")}
    expected = {"stop": 0, "length": 0, "abort": NUM_LEAVERS}
    for a in alone:
        expected[a["finish_reason"]] += 1
    assert finished == expected
    leaver_prompt = len(tiny.tokenizer.apply_chat_template([{"role": "user", "content": "Never stop talking."}],
                                                           add_generation_prompt=True, tokenize=True, return_dict=False))
    assert server.metric("llmserve:prompt_tokens_total") - prompt_tokens == \
        sum(a["usage"]["prompt_tokens"] for a in alone) + NUM_LEAVERS * leaver_prompt
    # Continuous batching across connections: far fewer engine steps than tokens generated.
    generated = sum(a["usage"]["completion_tokens"] for a in alone)
    assert tiny.engine.stats.num_steps - steps < generated / 4
