"""Settings of the HTTP server (not of the engine). Each field's help text feeds `llmserve serve --help`;
flag names follow LMDeploy's `api_server` (`--server-name`, `--server-port`, `--api-keys`, CORS) and
TGI's launcher (`--max-concurrent-requests`); vLLM's `--host` and `--port` are aliases."""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmserve.config import _check, _f
from llmserve.tools.reasoning import REASONING_PARSERS
from llmserve.tools.registry import TOOL_PARSERS
from llmserve.vl.image import FETCH_TIMEOUT_S, MAX_DOWNLOAD_BYTES


@dataclass
class ServerConfig:
    server_name: str = _f("127.0.0.1", "Address to listen on. The default only accepts connections from this "
                                       "machine (LMDeploy's default is 0.0.0.0); give 0.0.0.0 to serve the network.",
                          aliases=("--host",))
    server_port: int = _f(23333, "Port to listen on.", aliases=("--port",))
    model_name: str | None = _f(None, "Name the model is served under (the `model` field of requests and "
                                      "/v1/models). Default: the hub id, directory name or GGUF file stem.")
    api_keys: list[str] | None = _f(None, "Accepted API keys: requests must send `Authorization: Bearer KEY` "
                                          "(every route but /health and the chat page). Default: no key needed.")
    allow_origins: list[str] | None = _f(None, "CORS: origins allowed to call the API from a browser, e.g. "
                                               "http://localhost:3000 or '*'. Default: none (same origin only).")
    allow_credentials: bool = _f(False, "CORS: allow cookies and Authorization headers cross-origin.")
    allow_methods: list[str] = _f(["*"], "CORS: allowed methods.")
    allow_headers: list[str] = _f(["*"], "CORS: allowed headers.")
    max_concurrent_requests: int = _f(128, "Generation requests in flight at once; more are refused with 429 "
                                           "(backpressure, as TGI's flag of the same name).")
    shutdown_timeout: float = _f(5.0, "On SIGINT/SIGTERM, seconds in-flight requests may take to finish before "
                                      "they are aborted.")
    enable_debug_routes: bool = _f(False, "Serve GET /debug/kv (KV-pool block counts and an invariant check).")
    tool_call_parser: str | None = _f(None, "How the model writes tool calls (vLLM's names): hermes (Hermes, Qwen2.5, "
                                            "Qwen3), llama3_json (Llama 3.x, also llama4_json), mistral. Default: "
                                            "read from the chat template; hermes for a template without tools. "
                                            "See docs/tools.md.")
    reasoning_parser: str | None = _f(None, "Split <think>...</think> off each chat answer into `reasoning_content`: "
                                            "qwen3 (the model writes both tags) or deepseek_r1 (the prompt opens "
                                            "the reasoning). Default: none, the text is all content.")
    allowed_local_media_path: str | None = _f(None, "Vision-language models: image_url parts may name files "
                                                    "(file:///path) under this directory, and nowhere else (vLLM's "
                                                    "flag). Default: none, file:// URLs are refused.")
    image_fetch_timeout: float = _f(FETCH_TIMEOUT_S, "Vision-language models: seconds an http(s) image may take to "
                                                     "download, connection to last byte (vLLM's "
                                                     "VLLM_IMAGE_FETCH_TIMEOUT); a slower one is refused with 400.")
    max_image_bytes: int = _f(MAX_DOWNLOAD_BYTES, "Vision-language models: the largest image a request may carry, in "
                                                  "bytes: a download, a data: URL's payload or a file (the pixel "
                                                  "limit is --max-image-pixels).")
    ssl: bool = _f(False, "Serve HTTPS with the certificate and key named by the environment variables "
                          "SSL_CERTFILE and SSL_KEYFILE (LMDeploy's flag); --ssl-certfile/--ssl-keyfile win over them.")
    ssl_certfile: str | None = _f(None, "Serve HTTPS with this PEM certificate (chain); implies --ssl. Checked "
                                        "before the model loads.")
    ssl_keyfile: str | None = _f(None, "The PEM private key of --ssl-certfile (unencrypted). Default: the key is "
                                       "in the certificate file.")
    otlp_traces_endpoint: str | None = _f(None, "Send an OpenTelemetry span per request (vLLM's llm_request, GenAI "
                                                "attributes; parent from the traceparent header) to this OTLP "
                                                "collector, e.g. http://localhost:4317 (gRPC; "
                                                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf for HTTP). Needs "
                                                "llmserve[tracing].")
    responses_store_size: int = _f(1000, "The Responses API: how many responses (store=true, OpenAI's default) "
                                         "are kept in memory to be read back (GET /v1/responses/{id}) and "
                                         "continued (previous_response_id); the oldest go first, and all are lost "
                                         "when the server stops. 0 keeps none.")
    access_log: bool = _f(False, "Log every HTTP request (uvicorn's access log); finished generations are "
                                 "logged either way.")

    def __post_init__(self) -> None:
        _check(0 <= self.server_port <= 65535, "server_port", f"must be in [0, 65535], got {self.server_port}")
        _check(self.max_concurrent_requests >= 1, "max_concurrent_requests",
               f"must be >= 1, got {self.max_concurrent_requests}")
        _check(self.responses_store_size >= 0, "responses_store_size",
               f"must be >= 0, got {self.responses_store_size}")
        _check(self.shutdown_timeout >= 0, "shutdown_timeout", f"must be >= 0, got {self.shutdown_timeout}")
        _check(not self.api_keys or all(self.api_keys), "api_keys", "must not contain empty keys")
        _check(self.tool_call_parser is None or self.tool_call_parser in TOOL_PARSERS, "tool_call_parser",
               f"unknown parser {self.tool_call_parser!r}; choose one of {', '.join(TOOL_PARSERS)}")
        _check(self.image_fetch_timeout > 0, "image_fetch_timeout", f"must be > 0, got {self.image_fetch_timeout}")
        _check(self.max_image_bytes >= 1, "max_image_bytes", f"must be >= 1, got {self.max_image_bytes}")
        _check(self.allowed_local_media_path is None or os.path.isdir(self.allowed_local_media_path),
               "allowed_local_media_path", f"{self.allowed_local_media_path!r} is not a directory")
        _check(self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSERS, "reasoning_parser",
               f"unknown parser {self.reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)}")
