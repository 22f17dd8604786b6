"""SSEResponse and the stream helpers at the ASGI level: whatever way the client leaves, the engine
stream under the response is closed (which aborts its request) and the concurrency slot returned."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from llmserve.serve.generation import Primed
from llmserve.serve.streaming import SSEResponse, merge

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "POST", "path": "/v1/completions"}


def _engine_stream(log: list[str], name: str = "s", n: int = 3) -> AsyncIterator[Any]:
    async def gen() -> AsyncIterator[Any]:
        try:
            for i in range(n):
                yield f"{name}{i}"
                await asyncio.sleep(0)
        finally:
            log.append(f"closed {name}")
    return gen()


async def _primed(log: list[str]) -> Primed:
    rest = _engine_stream(log)
    return Primed(await rest.__anext__(), rest)  # type: ignore[arg-type]


def _response(primed: Primed, log: list[str]) -> SSEResponse:
    async def body() -> AsyncIterator[str]:
        async for item in primed:
            yield f"data: {item}\n\n"
    return SSEResponse(body(), on_close=lambda: log.append("slot released"), source=primed)


def test_client_gone_before_the_body_starts() -> None:
    async def scenario() -> list[str]:
        log: list[str] = []
        primed = await _primed(log)

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            raise OSError("connection reset")

        await _response(primed, log)(SCOPE, receive, send)
        return log

    assert asyncio.run(scenario()) == ["closed s", "slot released"]


def test_client_gone_mid_stream() -> None:
    async def scenario() -> tuple[list[str], list[dict]]:
        log: list[str] = []
        sent: list[dict] = []
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if len(sent) == 2:  # headers and one event written: the client hangs up
                gone.set()
                await asyncio.sleep(1)  # the write blocks; the disconnect must win

        await _response(await _primed(log), log)(SCOPE, receive, send)
        return log, sent

    log, sent = asyncio.run(scenario())
    assert log == ["closed s", "slot released"]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_complete_stream() -> None:
    async def scenario() -> tuple[list[str], list[bytes]]:
        log: list[str] = []
        bodies: list[bytes] = []

        async def receive() -> dict:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                bodies.append(message["body"])

        await _response(await _primed(log), log)(SCOPE, receive, send)
        return log, bodies

    log, bodies = asyncio.run(scenario())
    assert bodies == [b"data: s0\n\n", b"data: s1\n\n", b"data: s2\n\n", b""]
    assert log == ["closed s", "slot released"]


def test_merge_interleaves_and_closing_it_closes_every_stream() -> None:
    async def scenario() -> tuple[list[tuple[int, str]], list[str]]:
        log: list[str] = []
        merged = merge([_engine_stream(log, "a", 2), _engine_stream(log, "b", 50)])
        items = []
        async for i, item in merged:
            items.append((i, item))
            if len(items) == 4:
                break
        await merged.aclose()  # type: ignore[attr-defined]
        return items, sorted(log)

    items, log = asyncio.run(scenario())
    assert sorted(x for x in items if x[0] == 0) == [(0, "a0"), (0, "a1")]
    assert [x for x in items if x[0] == 1] == [(1, f"b{k}") for k in range(len(items) - 2)]
    assert log == ["closed a", "closed b"]
