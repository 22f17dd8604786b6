"""Schemathesis over the server's own OpenAPI schema (every route, bodies generated from the pydantic models,
valid and invalid), against a real uvicorn server on a tiny model: no 5xx, answers (errors included, in each
API's own error shape) as the schema declares them, no request past REQUEST_TIMEOUT_S; afterwards no KV block
is held and the server still answers.

LLMSERVE_FUZZ_EXAMPLES sets the generated examples per route (default 20, for CI: with schemathesis's coverage
cases about 2,400 requests, 40 s on 2 cores); 200 sends about 3,900. What it found is kept as focused tests in
test_errors.py.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from llmserve.serve.app import create_app
from llmserve.serve.config import ServerConfig
from tests.server.conftest import TINY_ENGINE
from tests.server.harness import EngineHandle, RunningServer, engine_for, running_server, wait_until

EXAMPLES = int(os.environ.get("LLMSERVE_FUZZ_EXAMPLES", "20"))
REQUEST_TIMEOUT_S = 60  # a hang, not a slow answer: the tiny model's longest (256 tokens, n=128) takes seconds
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
# The schema as the server serves it at /openapi.json (an app without a model has the same routes).
schema = schemathesis.openapi.from_dict(create_app(ServerConfig(enable_debug_routes=True)).openapi())
statuses: Counter[tuple[str, int]] = Counter()  # (route, status) over the run, printed at the end


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model_dir: Callable[[str], str]) -> Iterator[EngineHandle]:
    # Its own engine: the fuzzer opens sessions and fills the prefix cache, which other modules' tests must not see.
    with engine_for(tiny_model_dir("llama"), name="tiny-llama", **TINY_ENGINE) as handle:
        yield handle


@pytest.fixture(scope="module")
def fuzz_server(fuzz_engine: EngineHandle) -> Iterator[RunningServer]:
    with running_server(fuzz_engine, enable_debug_routes=True) as s:
        yield s


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
def test_fuzz(case: schemathesis.Case, fuzz_server: RunningServer) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S)
    statuses[(f"{case.method} {case.path}", response.status_code)] += 1
    case.validate_response(response, checks=CHECKS)


@pytest.mark.slow
def test_after_fuzzing_no_block_is_held_and_the_server_serves(fuzz_server: RunningServer,
                                                              fuzz_engine: EngineHandle) -> None:
    print("\n".join(f"{route}: {status} x{n}" for (route, status), n in sorted(statuses.items())))
    wait_until(lambda: not fuzz_server.kv()["unfinished_requests"], what="the engine to drain")
    held = fuzz_engine.call(lambda e: e.kv.num_held_blocks)  # kept by idle sessions the fuzzer opened

    def evict_sessions(engine: object) -> None:
        while engine.sessions.evict_lru():  # type: ignore[attr-defined]
            pass

    report = fuzz_server.kv()
    assert report["invariants_ok"], report["problem"]
    assert report["in_use"] == held
    fuzz_engine.call(evict_sessions)
    report = fuzz_server.kv()
    assert (report["in_use"], report["invariants_ok"]) == (0, True)
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
