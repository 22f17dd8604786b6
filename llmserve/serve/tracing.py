"""OpenTelemetry tracing (--otlp-traces-endpoint): one span per engine request, as vLLM makes them.

The span is named "llm_request" (kind SERVER), its parent is the incoming W3C `traceparent` (and
`tracestate`) header, and its attributes follow the GenAI semantic conventions with vLLM's
additions (`gen_ai.request.id`, `gen_ai.latency.*`, seconds). A completions request with several
prompts runs one engine request per prompt, so it makes one span per prompt.

What ends a span: the last sequence finishing; the client leaving (finish reason "abort" for the
unfinished sequences); the engine failing (status ERROR). The span is written whole when the
request ends, with the time it reached the engine as its start; a request the engine refuses (a
400) writes none, and requests the routes refuse (400, 404, 429) never get this far.

The OpenTelemetry SDK and exporters (llmserve[tracing]) are imported only when a tracer is made:
without the flag the server never imports them (FastAPI itself imports opentelemetry-api, a
dependency of it, and traces HTTP requests only if a global tracer provider is set, which this
module never does).
"""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve.engine.output import RequestTimes, SequenceOutput
from llmserve.errors import LLMServeError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from llmserve.serve.generation import EngineRequest

SPAN_NAME = "llm_request"
TRACE_HEADERS = (b"traceparent", b"tracestate")
# The trace headers of the HTTP request being handled, set by TraceHeadersMiddleware; tasks the
# route starts (the engine request's) copy the context, so they see their own request's headers.
_incoming_headers: ContextVar[dict[str, str] | None] = ContextVar("llmserve_trace_headers", default=None)


class TracingUnavailableError(LLMServeError):
    """--otlp-traces-endpoint without the OpenTelemetry packages."""


class TraceHeadersMiddleware:
    """Keeps the request's W3C trace-context headers where RequestTracer.start finds them."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k in TRACE_HEADERS}
            _incoming_headers.set(headers or None)
        await self.app(scope, receive, send)


class RequestTracer:
    """Makes the spans of one app. `owned`: the provider was made here (from the endpoint) and is
    shut down (its last spans flushed) with the server."""

    def __init__(self, provider: TracerProvider, owned: bool = False) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        import llmserve

        self.provider, self.owned = provider, owned
        self._tracer = provider.get_tracer("llmserve", llmserve.__version__)
        self._propagator = TraceContextTextMapPropagator()

    def start(self, req: EngineRequest, model_name: str) -> RequestSpan:
        """Called as the engine request is submitted (in the HTTP request's context)."""
        parent = self._propagator.extract(_incoming_headers.get() or {})
        return RequestSpan(self._tracer, parent, req, model_name)

    def shutdown(self) -> None:
        if self.owned:
            self.provider.shutdown()


def make_tracer(endpoint: str | None, provider: TracerProvider | None = None) -> RequestTracer | None:
    """The app's tracer: over `provider` (tests: the SDK's in-memory exporter), else exporting to
    `endpoint` over OTLP, else None (no tracing, nothing imported)."""
    if provider is not None:
        return RequestTracer(provider)
    if endpoint is None:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise TracingUnavailableError(f"--otlp-traces-endpoint needs OpenTelemetry ({e}): pip install "
                                      "'llmserve[tracing]'") from None
    provider = TracerProvider(resource=Resource.create({"service.name": "llmserve"}))  # OTEL_SERVICE_NAME wins
    provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
    return RequestTracer(provider, owned=True)


def _otlp_exporter(endpoint: str) -> Any:
    """gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says http/protobuf (as vLLM chooses)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        else:
            raise TracingUnavailableError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: give grpc or "
                                          "http/protobuf")
    except ImportError as e:
        raise TracingUnavailableError(f"--otlp-traces-endpoint needs the OTLP exporter ({e}): pip install "
                                      "'llmserve[tracing]'") from None
    return OTLPSpanExporter(endpoint=endpoint)


class RequestSpan:
    """One engine request's span. Outputs are noted as they pass; the span is written when it ends."""

    def __init__(self, tracer: Any, parent: Any, req: EngineRequest, model_name: str) -> None:
        self._tracer, self._parent = tracer, parent
        self._start_ns = time.time_ns()  # the SDK's clock (the engine's RequestTimes are monotonic)
        g = req.gen
        self._attributes: dict[str, Any] = {
            "gen_ai.request.id": req.request_id, "gen_ai.response.model": model_name,
            "gen_ai.request.max_tokens": g.max_new_tokens, "gen_ai.request.temperature": g.temperature,
            "gen_ai.request.top_p": g.top_p, "gen_ai.request.n": g.n,
            "gen_ai.usage.prompt_tokens": len(req.prompt_token_ids)}
        self._last: dict[int, SequenceOutput] = {}  # each sequence's latest output
        self._n = g.n

    def on_output(self, out: SequenceOutput) -> None:
        self._last[out.index] = out

    def end(self, error: str | None = None) -> None:
        """The request is over: finished, abandoned by its client, or failed with `error`."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        span = self._tracer.start_span(SPAN_NAME, context=self._parent, kind=SpanKind.SERVER,
                                       start_time=self._start_ns, attributes=self._attributes)
        outs = [self._last.get(i) for i in range(self._n)]
        span.set_attribute("gen_ai.usage.completion_tokens", sum(o.num_output_tokens for o in outs if o))
        span.set_attribute("gen_ai.response.finish_reasons",
                           [o.finish_reason if o and o.finished else "abort" for o in outs])
        span.set_attributes(_latencies([o.times for o in outs if o and o.times]))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()


def _latencies(times: list[RequestTimes]) -> dict[str, float]:
    """vLLM's gen_ai.latency.* in seconds, over the request's finished sequences (first scheduled and
    first token: the earliest of them; finished: the last)."""
    if not times:
        return {}
    arrival, finished = min(t.arrival for t in times), max(t.finished for t in times)
    lat = {"gen_ai.latency.e2e": finished - arrival}
    scheduled = min((t.first_scheduled for t in times if t.first_scheduled is not None), default=None)
    first_token = min((t.first_token for t in times if t.first_token is not None), default=None)
    if scheduled is not None:
        lat["gen_ai.latency.time_in_queue"] = scheduled - arrival
        lat["gen_ai.latency.time_in_model_inference"] = finished - scheduled
    if first_token is not None:
        lat["gen_ai.latency.time_to_first_token"] = first_token - arrival
        lat["gen_ai.latency.time_in_model_decode"] = finished - first_token
        if scheduled is not None:
            lat["gen_ai.latency.time_in_model_prefill"] = first_token - scheduled
    return lat
