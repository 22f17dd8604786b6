"""Real servers for tests: uvicorn on 127.0.0.1, a random free port, in a thread of the test process.

The socket is bound here (port 0) and handed to uvicorn, so there is no window in which another
process could take the port. Running in-process lets several apps share one engine (a strict app
with API keys and a concurrency limit of 1 beside the default one) and lets tests look at the app's
state; the engine itself is still only touched by its own thread (`AsyncEngine.call`).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from llmserve.api import default_generation_config
from llmserve.config import EngineConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.llm_engine import LLMEngine
from llmserve.models.loader import load_model
from llmserve.serve.app import create_app
from llmserve.serve.config import ServerConfig
from llmserve.serve.state import ServedModel, ServerState


@dataclass
class RunningServer:
    url: str
    app: FastAPI

    @property
    def state(self) -> ServerState:
        return self.app.state.llm

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when absent), e.g. metric("llmserve:request_success_total", finished_reason="stop")."""
        text = httpx.get(self.url + "/metrics", headers=self.headers).text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def kv(self) -> dict:
        """The engine's KV report (GET /debug/kv: in_use, invariants_ok, unfinished_requests, ...)."""
        return httpx.get(self.url + "/debug/kv", headers=self.headers).json()

    @property
    def headers(self) -> dict[str, str]:
        keys = self.state.config.api_keys
        return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


@dataclass
class EngineHandle:
    engine: AsyncEngine
    model: ServedModel

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    def call(self, fn: Any) -> Any:
        """fn(engine) on the engine thread, from synchronous test code."""
        return asyncio.run(self.engine.call(fn))


@contextmanager
def engine_for(model: str | None, name: str | None = None, **engine_kwargs: Any) -> Iterator[EngineHandle]:
    config = EngineConfig(**{"dtype": "float32", **engine_kwargs})
    loaded = load_model(model, config)
    llm = LLMEngine(loaded, config)
    engine = AsyncEngine(llm)
    try:
        yield EngineHandle(engine, ServedModel.of(llm, default_generation_config(loaded), name))
    finally:
        engine.shutdown()


@contextmanager
def serve_in_thread(app: FastAPI) -> Iterator[RunningServer]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@contextmanager
def running_server(handle: EngineHandle | None, **config: Any) -> Iterator[RunningServer]:
    app = create_app(ServerConfig(**config), handle.engine if handle else None, handle.model if handle else None)
    with serve_in_thread(app) as server:
        yield server


def wait_until(predicate: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll `predicate()` until it returns something truthy (a bound on waiting, not a timing check)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last value {value!r}")
        time.sleep(0.02)


@contextmanager
def parked_after_tokens(handle: EngineHandle, num_tokens: int = 3) -> Iterator[threading.Event]:
    """Park the engine thread right after the first step in which a sequence has `num_tokens` outputs,
    until the block exits. Yields the event set once it is parked."""
    parked, release = threading.Event(), threading.Event()

    def park(outputs: list) -> None:  # engine thread, right after a step
        if not parked.is_set() and any(o.num_output_tokens >= num_tokens for o in outputs):
            parked.set()
            release.wait(60)

    handle.engine.on_step = park
    try:
        yield parked
    finally:
        release.set()
        handle.engine.on_step = None


@contextmanager
def parked_engine(handle: EngineHandle) -> Iterator[None]:
    """The engine thread blocked between two steps for the duration of the block."""
    parked, release = threading.Event(), threading.Event()

    def park(engine: object) -> None:
        parked.set()
        release.wait(60)

    thread = threading.Thread(target=handle.call, args=(park,))
    thread.start()
    assert parked.wait(30), "the engine thread never picked up the call"
    try:
        yield
    finally:
        release.set()
        thread.join()
