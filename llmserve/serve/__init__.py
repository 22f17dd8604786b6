"""The HTTP server: OpenAI- and TGI-compatible routes over the async engine, Prometheus metrics,
and the web chat page. `create_app` builds the app; `server.serve` runs `llmserve serve`.

`create_app` is imported lazily: the CLI reads `llmserve.serve.config` to build its flags, and
`llmserve --help` should not pay for torch and FastAPI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from llmserve.serve.app import create_app

        return create_app
    if name == "ServerConfig":
        from llmserve.serve.config import ServerConfig

        return ServerConfig
    raise AttributeError(f"module 'llmserve.serve' has no attribute {name!r}")
