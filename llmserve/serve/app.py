"""The FastAPI app: OpenAI, TGI and ColossalAI routes, /health, /metrics, the chat page at GET /, and
optionally /debug/kv, behind API-key and CORS middleware.

`create_app(config, engine, model)` serves at once; `create_app(config)` answers 503 on the model
routes until `app.state.llm.attach(engine, model)` is called (server.py loads the model while the
app already listens, so health probes see "starting" rather than "connection refused"). Several
apps may share one AsyncEngine; each has its own limits, keys and metrics.
"""

from __future__ import annotations

import hmac
import os
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

import llmserve
from llmserve.engine.async_engine import AsyncEngine
from llmserve.serve import (
    anthropic_routes,
    colossal_routes,
    embedding_routes,
    lora_routes,
    openai_routes,
    responses_routes,
    score_routes,
    session_routes,
    tgi_routes,
    tokenize_routes,
)
from llmserve.serve.config import ServerConfig
from llmserve.serve.errors import TgiError, error_response, install_error_handlers
from llmserve.serve.state import ServedModel, ServerState
from llmserve.serve.tracing import TraceHeadersMiddleware, make_tracer

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
# Reachable without an API key: probes, and the chat page and its files (static; every call the
# page makes sends the key the user types in).
PUBLIC_ROUTES = {("GET", "/health"), ("GET", "/"), ("HEAD", "/"), ("GET", "/version")}
PUBLIC_PREFIX = "/static/"


def create_app(config: ServerConfig, engine: AsyncEngine | None = None, model: ServedModel | None = None,
               tracer_provider: TracerProvider | None = None) -> FastAPI:
    """`tracer_provider` traces requests through it (tests), whatever config.otlp_traces_endpoint says."""
    state = ServerState(config, make_tracer(config.otlp_traces_endpoint, tracer_provider))
    if engine is not None and model is not None:
        state.attach(engine, model)
    app = FastAPI(title="llmserve", version=llmserve.__version__,
                  description="OpenAI- and TGI-compatible text generation.")
    app.state.llm = state
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(responses_routes.router)  # OpenAI's Responses API, /v1/responses
    app.include_router(anthropic_routes.router)  # Anthropic's Messages API, /v1/messages
    app.include_router(session_routes.router)
    app.include_router(lora_routes.router)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.include_router(tgi_routes.router)
    app.include_router(colossal_routes.router)  # ColossalAI-Inference's /completion, /chat, /engine_check
    app.include_router(embedding_routes.router)  # OpenAI's /v1/embeddings
    app.include_router(score_routes.router)  # vLLM's /score and /rerank, over the embeddings
    app.include_router(tokenize_routes.router)  # vLLM's /tokenize, /detokenize, /version; TGI's /tokenize
    _add_service_routes(app, state)
    if state.tracer is not None:
        app.add_middleware(TraceHeadersMiddleware)
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)
    if config.allow_origins:  # added last: outermost, so preflight requests never meet the key check
        app.add_middleware(CORSMiddleware, allow_origins=config.allow_origins,
                           allow_credentials=config.allow_credentials, allow_methods=config.allow_methods,
                           allow_headers=config.allow_headers)
    return app


def _add_service_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_class=Response, responses={503: {"model": TgiError}})
    async def health() -> Response:
        if state.engine is None:
            return error_response("/health", 503, "the model is still loading")
        if not state.engine.is_alive:
            return error_response("/health", 503, "the engine thread has stopped")
        if state.draining:  # tell load balancers to stop sending traffic here
            return error_response("/health", 503, "the server is shutting down")
        replicas = getattr(state.engine, "replica_health", None)
        health = replicas() if replicas is not None else []
        if any(h != "ok" for h in health):
            # --dp: serving, with fewer replicas (a dead one is being started again)
            return JSONResponse({"status": "degraded", "replicas": health})
        return Response(status_code=200)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"), media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")

    if state.config.enable_debug_routes:
        @app.get("/debug/kv")
        async def debug_kv() -> JSONResponse:
            engine, _ = state.ready()
            return JSONResponse(await engine.call(kv_report))


def kv_report(engine: object) -> dict[str, object]:
    """KV-pool block counts, and whether its invariants hold (runs on the engine thread)."""
    kv = engine.kv  # type: ignore[attr-defined]
    try:
        kv.check_invariants()
        problem = None
    except AssertionError as e:
        problem = str(e) or "invariant violated"
    u = kv.usage()
    return {"total": u.total, "free": u.free, "cached": u.cached, "in_use": u.in_use,
            "invariants_ok": problem is None, "problem": problem,
            "unfinished_requests": engine.has_unfinished_requests()}  # type: ignore[attr-defined]


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) with KEY among the configured ones; 401 (in
    the route's API format) otherwise. Compared in constant time."""

    def __init__(self, app: ASGIApp, keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._public(scope) or self._ok(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(scope["path"], 401, "Incorrect or missing API key: send the header "
                                  "`Authorization: Bearer <key>` (or `x-api-key: <key>`).", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    @staticmethod
    def _public(scope: Scope) -> bool:
        method, path = scope["method"], scope["path"]
        return (method, path) in PUBLIC_ROUTES or (method in ("GET", "HEAD") and path.startswith(PUBLIC_PREFIX))

    def _ok(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":  # Anthropic's clients send the key as `x-api-key`
            token = headers.get(b"x-api-key", b"")
        token = token.strip()
        return bool(token) and any(hmac.compare_digest(token, k) for k in self.keys)

