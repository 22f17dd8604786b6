"""A fake OpenAI-compatible streaming server for the serving benchmark's tests: a raw asyncio HTTP/1.1
server on 127.0.0.1 in its own thread, so the benchmark is tested against known chunks and not
against our own server.

For a request with max_tokens N it streams, `delay_s` apart: a role-only chunk (no content), then N
tokens as content events of `tokens_per_event` tokens each ("t0 t1 ", ...), a finish chunk, a usage
chunk {prompt_tokens: words in the prompt, completion_tokens: N} when the client asks for usage and
`send_usage` is set, then [DONE]. Every `fail_every`-th POST (1-based) gets a 500 instead.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

MODEL = "fake-model"
MAX_MODEL_LEN = 512
FAILURE_BODY = {"error": {"message": "fake failure", "type": "server_error", "code": 500}}


@dataclass
class SeenRequest:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: dict[str, Any] | None


@dataclass
class FakeOpenAIServer:
    tokens_per_event: int = 2
    send_usage: bool = True
    fail_every: int | None = None
    delay_s: float = 0.002
    seen: list[SeenRequest] = field(default_factory=list)
    max_in_flight: int = 0
    port: int = 0
    _posts: int = 0
    _in_flight: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def posts(self) -> list[SeenRequest]:
        return [r for r in self.seen if r.method == "POST"]

    def __enter__(self) -> FakeOpenAIServer:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        start = asyncio.start_server(self._handle, "127.0.0.1", 0)
        self._server = asyncio.run_coroutine_threadsafe(start, self._loop).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    # --- one connection, one request (the responses say Connection: close) ----------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            seen = await _read_request(reader)
            self.seen.append(seen)
            if seen.method == "GET" and seen.path == "/v1/models":
                await _send_json(writer, 200, {"object": "list", "data": [
                    {"id": MODEL, "object": "model", "max_model_len": MAX_MODEL_LEN}]})
            elif seen.method == "POST" and seen.path in ("/v1/chat/completions", "/v1/completions"):
                await self._complete(writer, seen)
            else:
                await _send_json(writer, 404, {"error": {"message": f"no route {seen.path}"}})
        finally:
            writer.close()

    async def _complete(self, writer: asyncio.StreamWriter, seen: SeenRequest) -> None:
        self._posts += 1
        if self.fail_every and self._posts % self.fail_every == 0:
            await _send_json(writer, 500, FAILURE_BODY)
            return
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            for event in self._events(seen):
                writer.write(f"data: {json.dumps(event)}\n\n".encode())
                await writer.drain()
                await asyncio.sleep(self.delay_s)
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        finally:
            self._in_flight -= 1

    def _events(self, seen: SeenRequest) -> list[dict[str, Any]]:
        body = seen.body or {}
        chat = seen.path == "/v1/chat/completions"
        n = body["max_tokens"]

        def chunk(content: str | None, finish: str | None = None) -> dict[str, Any]:
            choice = ({"index": 0, "delta": {} if content is None else {"content": content}} if chat
                      else {"index": 0, "text": content or ""})
            return {"id": "x", "model": MODEL, "choices": [{**choice, "finish_reason": finish}]}

        events = [{"id": "x", "model": MODEL, "choices": [{"index": 0, "delta": {"role": "assistant"},
                                                           "finish_reason": None}]}] if chat else []
        for first in range(0, n, self.tokens_per_event):
            events.append(chunk("".join(f"t{i} " for i in range(first, min(n, first + self.tokens_per_event)))))
        events.append(chunk(None if chat else "", "length"))
        if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]
            words = len(prompt.split())
            events.append({"id": "x", "model": MODEL, "choices": [],
                           "usage": {"prompt_tokens": words, "completion_tokens": n, "total_tokens": words + n}})
        return events


async def _read_request(reader: asyncio.StreamReader) -> SeenRequest:
    method, path, _ = (await reader.readline()).decode().split(" ", 2)
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    raw = await reader.readexactly(int(headers.get("content-length", 0)))
    return SeenRequest(method, path, headers, json.loads(raw) if raw else None)


async def _send_json(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    reason = {200: "OK", 404: "Not Found", 500: "Internal Server Error"}[status]
    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)
    await writer.drain()
