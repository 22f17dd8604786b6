"""`session_id` on the OpenAI routes, through the official client against a real server: turn 2 of a
chat computes only the prompt tokens its session had not, and answers exactly as a request without a
session; two concurrent turns of one session are both correct; an aborted turn leaves nothing held;
DELETE /v1/sessions/{id} frees the KV; bad ids are 400s in OpenAI's format.

Its own engine (no prefix cache, 16-token blocks), so every reused token is the session's and the
counts are exact."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.server.harness import (
    EngineHandle,
    RunningServer,
    engine_for,
    parked_after_tokens,
    parked_engine,
    running_server,
    wait_until,
)

TURN1 = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"model": "tiny-llama", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def handle(tiny_model_dir: Callable[[str], str]) -> Iterator[EngineHandle]:
    # Prefix caching off: the counts below are what sessions alone save (caching is on by default).
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", num_blocks=64, block_size=16,
                    enable_prefix_caching=False) as h:
        yield h


@pytest.fixture(scope="module")
def server(handle: EngineHandle) -> Iterator[RunningServer]:
    with running_server(handle, enable_debug_routes=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def prompt_ids(handle: EngineHandle, messages: list[dict[str, str]]) -> list[int]:
    text = handle.model.chat_template.messages_to_prompt(messages)
    return handle.tokenizer.encode(text, add_special_tokens=False)


def counters(handle: EngineHandle) -> tuple[int, int]:
    """(prompt tokens computed, prompt tokens served from sessions) since start, read on the engine thread."""
    return handle.call(lambda e: (e.scheduler.num_prefill_tokens, e.sessions.hit_tokens))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def chat(client: openai.OpenAI, messages: list[dict[str, str]], session: str | int | None = None) -> str:
    extra = {"ignore_eos": True} | ({"session_id": session} if session is not None else {})
    return client.chat.completions.create(messages=messages, extra_body=extra, **GREEDY).choices[0].message.content


def close(server: RunningServer, session: str | int) -> httpx.Response:
    return httpx.delete(f"{server.url}/v1/sessions/{session}")


def test_turn2_computes_only_what_the_session_lacks_and_answers_as_without_a_session(
        client: openai.OpenAI, server: RunningServer, handle: EngineHandle) -> None:
    answer1 = chat(client, TURN1, session="conv-1")
    kept = handle.call(lambda e: e.sessions.token_ids("conv-1"))
    p1 = prompt_ids(handle, TURN1)
    assert len(kept) == len(p1) + 8 - 1 and kept[:len(p1)] == p1  # the last sampled token has no K/V
    # /metrics reads the engine's stats snapshot, taken just after the step that answered us.
    wait_until(lambda: (server.metric("llmserve:num_sessions"), server.metric("llmserve:session_kv_blocks"))
               == (1, -(-len(kept) // 16)), what="/metrics to show the session")

    turn2 = [*TURN1, {"role": "assistant", "content": answer1}, {"role": "user", "content": "And three more?"}]
    p2 = prompt_ids(handle, turn2)
    # The client sends text: the answer re-tokenizes as it may, so the session serves the common prefix.
    reused = common_prefix(kept, p2)
    assert reused >= len(p1)  # at least turn 1's prompt (the answer's text may re-tokenize differently)
    computed, hits = counters(handle)
    metric_computed = server.metric("llmserve:prompt_tokens_computed_total")
    with_session = chat(client, turn2, session="conv-1")
    computed2, hits2 = counters(handle)
    assert (computed2 - computed, hits2 - hits) == (len(p2) - reused, reused)
    wait_until(lambda: server.metric("llmserve:prompt_tokens_computed_total") == metric_computed + len(p2) - reused,
               what="/metrics to show the step")
    assert server.metric("llmserve:session_hit_tokens_total") == hits2  # same snapshot as the wait above

    without = chat(client, turn2)
    assert without == with_session
    assert counters(handle)[0] - computed2 == len(p2)  # no session, no prefix cache: all of it

    assert close(server, "conv-1").json() == {"id": "conv-1", "object": "session", "deleted": True}
    assert server.kv()["in_use"] == 0


def test_text_completions_with_an_integer_session_id(client: openai.OpenAI, server: RunningServer,
                                                     handle: EngineHandle) -> None:
    first = client.completions.create(prompt=[5, 6, 7, 8, 9], extra_body={"session_id": 42, "ignore_eos": True},
                                      **GREEDY)
    kept = handle.call(lambda e: e.sessions.token_ids("42"))
    assert len(kept) == 5 + 8 - 1
    prompt2 = kept + [10, 11, 12]
    computed, _ = counters(handle)
    second = client.completions.create(prompt=prompt2, extra_body={"session_id": "42"}, **GREEDY)  # the same session
    assert counters(handle)[0] - computed == 3
    assert second.choices[0].text == client.completions.create(prompt=prompt2, **GREEDY).choices[0].text
    assert first.usage.prompt_tokens == 5 and second.usage.prompt_tokens == 15  # usage counts the whole prompt
    assert close(server, 42).status_code == 200


def test_two_concurrent_turns_of_one_session_are_both_correct(client: openai.OpenAI, server: RunningServer,
                                                              handle: EngineHandle) -> None:
    answer1 = chat(client, TURN1, session="conv-2")
    turn2 = [*TURN1, {"role": "assistant", "content": answer1}, {"role": "user", "content": "Why?"}]
    expected = chat(client, turn2)
    reused = common_prefix(handle.call(lambda e: e.sessions.token_ids("conv-2")), prompt_ids(handle, turn2))
    assert reused > 0
    computed, hits = counters(handle)
    answers: list[str] = []
    # Both requests are queued while the engine is parked, so they are admitted in the same step: the
    # first takes the session, the second runs without it (a held session is never shared).
    threads = [threading.Thread(target=lambda: answers.append(chat(client, turn2, session="conv-2")))
               for _ in range(2)]
    with parked_engine(handle):
        for t in threads:
            t.start()
        wait_until(lambda: len(server.state.in_flight) == 2, what="both requests to reach the engine")
    for t in threads:
        t.join()
    assert answers == [expected, expected]
    computed2, hits2 = counters(handle)
    assert (hits2 - hits, computed2 - computed) == (reused, 2 * len(prompt_ids(handle, turn2)) - reused)
    assert close(server, "conv-2").status_code == 200
    report = server.kv()
    assert (report["in_use"], report["invariants_ok"]) == (0, True)


def test_an_aborted_turn_leaves_no_blocks_held(server: RunningServer, handle: EngineHandle) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    chat(client, TURN1, session="conv-3")
    held = server.kv()["in_use"]
    assert held > 0
    wait_until(lambda: server.metric("llmserve:session_kv_blocks") == held, what="/metrics to show the session")
    http = httpx.Client(timeout=60)
    body = {**GREEDY, "messages": TURN1, "max_tokens": 100, "ignore_eos": True, "stream": True, "session_id": "conv-3"}
    with parked_after_tokens(handle) as parked:
        response = http.send(http.build_request("POST", server.url + "/v1/chat/completions", json=body), stream=True)
        assert response.status_code == 200
        assert parked.wait(30), "the request never reached its third token"
        response.close()
        http.close()
        wait_until(lambda: not server.state.in_flight, what="the server to notice the disconnect")
    report = server.kv()
    # The turn had taken the session's blocks; aborted, it stores nothing and frees them all.
    assert (report["in_use"], report["invariants_ok"], report["unfinished_requests"]) == (0, True, False)
    assert close(server, "conv-3").status_code == 404


def test_closing_an_unknown_session_is_a_404_in_openai_format(server: RunningServer) -> None:
    rejected = server.metric("llmserve:requests_rejected_total", status="404")
    r = close(server, "nope")
    assert r.status_code == 404
    # not a refused generation request: the rejection counter is left alone
    assert server.metric("llmserve:requests_rejected_total", status="404") == rejected
    assert r.json() == {"error": {
        "message": "session 'nope' does not exist: never used, already closed, or evicted (requests with its id "
                   "still work; they prefill the whole history)",
        "type": "invalid_request_error", "param": "session_id", "code": "session_not_found"}}


def test_a_session_id_with_a_slash_can_be_closed(client: openai.OpenAI, server: RunningServer,
                                                 handle: EngineHandle) -> None:
    chat(client, TURN1, session="user/42")
    assert handle.call(lambda e: "user/42" in e.sessions)
    assert close(server, "user%2F42").json() == {"id": "user/42", "object": "session", "deleted": True}
    assert close(server, "user/42").status_code == 404  # gone; the plain path reaches the route too
    assert server.kv()["in_use"] == 0


def test_closing_a_session_where_sessions_are_off_says_so(tiny_model_dir: Callable[[str], str]) -> None:
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", num_blocks=16, block_size=16,
                    max_sessions=0) as h, running_server(h) as off:
        r = close(off, "conv")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert r.json()["error"]["message"].startswith("sessions are off on this server (llmserve serve "
                                                       "--max-sessions 0)")


@pytest.mark.parametrize("extra, message", [
    ({"session_id": 1.5}, "session_id"),
    ({"session_id": ["a"]}, "session_id"),
    ({"session_id": True}, "session_id"),
    ({"session_id": ""}, "session_id: expected a non-empty string of at most 256 characters, got ''"),
    ({"session_id": "x" * 257}, "session_id: expected a non-empty string of at most 256 characters, got a "
                                "257-character string"),
    ({"session_id": "s", "n": 2}, "session_id: a session continues one sequence; it cannot be combined with "
                                  "n > 1, best_of or beam search"),
])
def test_bad_session_ids_are_400s(server: RunningServer, extra: dict, message: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={**GREEDY, "messages": TURN1, **extra})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "session_id" and error["type"] == "invalid_request_error"
    assert error["message"].startswith(message)


def test_several_prompts_with_one_session_are_refused(server: RunningServer) -> None:
    r = httpx.post(server.url + "/v1/completions", json={**GREEDY, "prompt": ["a", "b"], "session_id": "s"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "session_id: a session continues one conversation; send one prompt, not 2"


def test_serve_cli_session_flags_reach_the_engine_config() -> None:
    from llmserve.cli import build_parser, dataclass_from_args
    from llmserve.config import EngineConfig

    args = build_parser().parse_args(["serve", "--max-sessions", "3", "--session-ttl", "2.5"])
    config = dataclass_from_args(EngineConfig, args)
    assert (config.max_sessions, config.session_ttl) == (3, 2.5)
