"""OpenTelemetry tracing (issue 24 §5): one "llm_request" span per engine request, child of the incoming
`traceparent`, with vLLM's GenAI attributes agreeing with the response's usage; spans go to the SDK's in-memory
exporter. A request refused with 400 makes no span; a client that leaves ends its span with finish reason "abort";
an engine failure marks it ERROR. Without --otlp-traces-endpoint neither the SDK nor an exporter is imported."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from llmserve.cli import main
from llmserve.config import GenerationConfig
from llmserve.serve.app import create_app
from llmserve.serve.config import ServerConfig
from llmserve.serve.generation import EngineRequest
from llmserve.serve.tracing import RequestTracer, make_tracer
from tests.server.harness import EngineHandle, RunningServer, parked_after_tokens, serve_in_thread, wait_until

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

TRACE_ID, PARENT_ID = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def _traceparent(trace_id: str = TRACE_ID) -> dict[str, str]:
    return {"traceparent": f"00-{trace_id}-{PARENT_ID}-01"}


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(tiny: EngineHandle, exporter: InMemorySpanExporter) -> Iterator[RunningServer]:
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with serve_in_thread(create_app(ServerConfig(), tiny.engine, tiny.model, tracer_provider=provider)) as s:
        yield s


def _span(exporter: InMemorySpanExporter, trace_id: str) -> sdk_trace.ReadableSpan:
    """The one span of this trace, once written (a stream's span ends just after its last chunk is sent)."""
    spans = wait_until(lambda: [s for s in exporter.get_finished_spans() if s.context.trace_id == int(trace_id, 16)],
                       what=f"the span of trace {trace_id}")
    assert len(spans) == 1, spans
    return spans[0]


def _check_latencies(attrs: dict) -> None:
    queue, ttft, e2e = (attrs[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e"))
    prefill, decode = attrs["gen_ai.latency.time_in_model_prefill"], attrs["gen_ai.latency.time_in_model_decode"]
    assert 0 <= queue <= ttft <= e2e
    assert queue + prefill == pytest.approx(ttft) and ttft + decode == pytest.approx(e2e)


def test_chat_span_is_a_child_of_traceparent_with_genai_attributes(traced: RunningServer,
                                                                    exporter: InMemorySpanExporter) -> None:
    client = openai.OpenAI(base_url=traced.url + "/v1", api_key="none")
    reply = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=3, temperature=0, top_p=0.5, extra_headers=_traceparent(),
                                           extra_body={"ignore_eos": True})
    span = _span(exporter, TRACE_ID)
    assert (span.name, span.kind, span.status.status_code) == ("llm_request", SpanKind.SERVER, StatusCode.UNSET)
    assert span.parent is not None and span.parent.span_id == int(PARENT_ID, 16) and span.parent.is_remote
    attrs = dict(span.attributes)
    assert {k: attrs[k] for k in ("gen_ai.request.id", "gen_ai.response.model", "gen_ai.request.max_tokens",
                                  "gen_ai.request.temperature", "gen_ai.request.top_p", "gen_ai.request.n",
                                  "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                                  "gen_ai.response.finish_reasons")} == {
        "gen_ai.request.id": reply.id, "gen_ai.response.model": "tiny-llama", "gen_ai.request.max_tokens": 3,
        "gen_ai.request.temperature": 0.0, "gen_ai.request.top_p": 0.5, "gen_ai.request.n": 1,
        "gen_ai.usage.prompt_tokens": reply.usage.prompt_tokens,
        "gen_ai.usage.completion_tokens": reply.usage.completion_tokens, "gen_ai.response.finish_reasons": ("length",)}
    _check_latencies(attrs)


def test_streamed_completion_with_two_samples(traced: RunningServer, exporter: InMemorySpanExporter) -> None:
    trace_id = "1" * 32
    client = openai.OpenAI(base_url=traced.url + "/v1", api_key="none")
    chunks = list(client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=4, n=2,
                                            temperature=1, seed=7, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_headers=_traceparent(trace_id), extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    attrs = dict(_span(exporter, trace_id).attributes)
    assert attrs["gen_ai.request.id"] == chunks[0].id
    assert (attrs["gen_ai.request.n"], attrs["gen_ai.response.finish_reasons"]) == (2, ("length", "length"))
    assert (attrs["gen_ai.usage.prompt_tokens"], attrs["gen_ai.usage.completion_tokens"]) == (
        usage.prompt_tokens, usage.completion_tokens) == (usage.prompt_tokens, 8)
    _check_latencies(attrs)


def test_tgi_generate_is_traced(traced: RunningServer, exporter: InMemorySpanExporter) -> None:
    trace_id = "2" * 32
    r = httpx.post(traced.url + "/generate", headers=_traceparent(trace_id), timeout=60,
                   json={"inputs": "Hello", "parameters": {"max_new_tokens": 2, "details": True}})
    assert r.status_code == 200
    attrs = dict(_span(exporter, trace_id).attributes)
    assert attrs["gen_ai.request.id"] == r.headers["x-request-id"]
    assert attrs["gen_ai.usage.completion_tokens"] == r.json()["details"]["generated_tokens"] == 2


def test_refused_request_makes_no_span(traced: RunningServer, exporter: InMemorySpanExporter) -> None:
    refused, ok = "3" * 32, "4" * 32
    body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(traced.url + "/v1/completions", json={**body, "temperature": -1}, headers=_traceparent(refused))
    assert r.status_code == 400
    assert httpx.post(traced.url + "/v1/completions", json=body, headers=_traceparent(ok)).status_code == 200
    _span(exporter, ok)  # written after any span the refused request would have made
    assert not [s for s in exporter.get_finished_spans() if s.context.trace_id == int(refused, 16)]


def test_client_that_leaves_ends_its_span_as_aborted(traced: RunningServer, tiny: EngineHandle,
                                                     exporter: InMemorySpanExporter) -> None:
    trace_id = "5" * 32
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 200,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client, parked_after_tokens(tiny) as parked:
        response = client.send(client.build_request("POST", traced.url + "/v1/chat/completions", json=body,
                                                    headers=_traceparent(trace_id)), stream=True)
        assert response.status_code == 200 and parked.wait(30)
        response.close()
    span = _span(exporter, trace_id)
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.status.status_code == StatusCode.UNSET


def test_failed_request_span_has_error_status(exporter: InMemorySpanExporter) -> None:
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    req = EngineRequest("cmpl-failed", [1, 2, 3], GenerationConfig(max_new_tokens=5))
    RequestTracer(provider).start(req, "m").end("the engine step failed")
    span = next(s for s in exporter.get_finished_spans() if s.attributes["gen_ai.request.id"] == "cmpl-failed")
    assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "the engine step failed")
    assert span.parent is None  # no traceparent: a trace of its own
    assert (span.attributes["gen_ai.usage.prompt_tokens"], span.attributes["gen_ai.usage.completion_tokens"],
            span.attributes["gen_ai.response.finish_reasons"]) == (3, 0, ("abort",))


def test_without_the_flag_the_sdk_is_never_imported() -> None:
    # FastAPI (0.165) requires and imports opentelemetry-api itself; the SDK and the exporters are ours to import.
    code = ("import sys\nfrom llmserve.serve.app import create_app\nfrom llmserve.serve.config import ServerConfig\n"
            "import llmserve.serve.server\napp = create_app(ServerConfig())\nassert app.state.llm.tracer is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]", out.stderr


def test_flag_without_the_packages_is_a_startup_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if llmserve[tracing] were not installed
    code = main(["serve", "--model", str(tmp_path / "no-model"), "--server-port", "0",
                 "--otlp-traces-endpoint", "http://127.0.0.1:4317"])
    assert code == 2
    err = capsys.readouterr().err
    assert "llmserve: error: --otlp-traces-endpoint needs OpenTelemetry" in err and "llmserve[tracing]" in err


def test_flag_makes_an_otlp_exporting_tracer() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    tracer = make_tracer("http://127.0.0.1:4317")
    assert tracer is not None and tracer.owned
    processor = tracer.provider._active_span_processor._span_processors[0]
    assert type(processor).__name__ == "BatchSpanProcessor"
    assert isinstance(processor._batch_processor._exporter, OTLPSpanExporter)
    tracer.shutdown()
