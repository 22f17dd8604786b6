"""A client that leaves has its request aborted and its KV blocks freed before the engine's next step.

To make "before the next step" exact, the engine thread is parked while the client disconnects
(blocked in the `on_step` hook right after a step, or in a blocking `AsyncEngine.call`): no step
can run until it is released, and the abort the server queues on disconnect must be applied
ahead of any further step.
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.harness import EngineHandle, RunningServer, parked_after_tokens, parked_engine, wait_until

LONG = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 200,
        "temperature": 0, "ignore_eos": True}
ROUTES = {"chat": ("/v1/chat/completions", LONG),
          "responses": ("/v1/responses", {"model": "tiny-llama", "input": "Count to a thousand.",
                                          "max_output_tokens": 200, "temperature": 0, "ignore_eos": True})}


@pytest.mark.parametrize("route", list(ROUTES))
def test_stream_disconnect_frees_blocks_before_the_next_step(server: RunningServer, tiny: EngineHandle,
                                                             route: str) -> None:
    path, body = ROUTES[route]
    aborts = server.metric("llmserve:request_success_total", finished_reason="abort")
    client = httpx.Client(timeout=60)
    with parked_after_tokens(tiny) as parked:
        response = client.send(client.build_request("POST", server.url + path, json={**body, "stream": True}),
                               stream=True)
        assert response.status_code == 200
        assert parked.wait(30), "the request never reached its third token"
        # Parked after a step: the request is running, holds blocks and has 197 tokens to go. The stats
        # snapshot is from before the step we are parked in.
        steps = tiny.engine.stats.num_steps + 1
        assert tiny.engine.stats.kv_blocks_in_use > 0 and len(server.state.in_flight) == 1
        response.close()
        client.close()
        # The server notices the disconnect on its own (the engine is parked) and queues the abort.
        wait_until(lambda: not server.state.in_flight, what="the server to notice the disconnect")
    report = server.kv()  # runs on the engine thread, after the queued abort
    assert (report["in_use"], report["invariants_ok"], report["unfinished_requests"]) == (0, True, False)
    assert tiny.engine.stats.num_steps == steps  # the parked step ended; no other ran before the free
    assert server.metric("llmserve:request_success_total", finished_reason="abort") == aborts + 1
    assert server.state.num_active == 0


@pytest.mark.parametrize("route", list(ROUTES))
def test_non_streamed_request_is_aborted_when_its_client_leaves(server: RunningServer, tiny: EngineHandle,
                                                                route: str) -> None:
    path, body = ROUTES[route]
    aborts = server.metric("llmserve:request_success_total", finished_reason="abort")
    with parked_engine(tiny):
        steps = tiny.engine.stats.num_steps
        try:  # the answer cannot come while the engine is parked: the client gives up
            httpx.post(server.url + path, json=body, timeout=0.5)
        except httpx.ReadTimeout:
            pass
        wait_until(lambda: not server.state.in_flight, what="the server to notice the disconnect")
    report = server.kv()
    assert (report["in_use"], report["invariants_ok"], report["unfinished_requests"]) == (0, True, False)
    assert tiny.engine.stats.num_steps == steps  # added and aborted without ever running
    assert server.metric("llmserve:request_success_total", finished_reason="abort") == aborts + 1
    assert server.state.num_active == 0
