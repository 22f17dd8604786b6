"""One engine request as the routes see it: the async engine's outputs, plus the bookkeeping every
route needs (metrics, the finished-request log line, the in-flight set, errors as HTTP errors).

`open_request` primes the stream: it waits for the first output, so a request the engine refuses
becomes a 400 before any response header is sent, and a streamed response starts with real data.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from llmserve.config import GenerationConfig
from llmserve.engine.async_engine import AsyncEngine
from llmserve.engine.output import SequenceOutput
from llmserve.errors import EngineDeadError, InvalidRequestError
from llmserve.serve.errors import ApiError
from llmserve.serve.state import ServerState
from llmserve.vl.inputs import MultiModalInputs

logger = logging.getLogger("llmserve.serve")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    gen: GenerationConfig
    param_names: dict[str, str] = field(default_factory=dict)  # our field name -> the API's, for errors
    session_id: str | None = None  # keep/reuse this conversation's KV (engine/sessions.py)
    mm: MultiModalInputs | None = None  # the prompt's images (vl/prompt.py); None for text
    adapter: str | None = None  # the LoRA adapter the client named as its model (None: the base model)


async def open_request(state: ServerState, engine: AsyncEngine, req: EngineRequest) -> Primed:
    """The request's outputs, the first one already received. Raises ApiError (400 refused, 503 engine
    stopping) here rather than mid-stream. `aclose()` aborts the request (if it has not finished)."""
    outputs = _tracked(state, engine, req)
    try:
        first = await outputs.__anext__()
    except BaseException:
        await outputs.aclose()
        raise
    return Primed(first, outputs)


class Primed:
    """An output stream whose first item was already taken: it is yielded again first. Unlike a
    generator wrapping the stream, `aclose()` works before iteration started (a client that left
    before its response began must still have its request aborted)."""

    def __init__(self, first: SequenceOutput, rest: AsyncGenerator[SequenceOutput, None]) -> None:
        self._first: SequenceOutput | None = first
        self._rest = rest

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self) -> SequenceOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


async def _tracked(state: ServerState, engine: AsyncEngine, req: EngineRequest) -> AsyncIterator[SequenceOutput]:
    open_seqs, started = set(range(req.gen.n)), False
    span = state.tracer.start(req, state.model.name) if state.tracer is not None and state.model else None
    error: str | None = None
    state.in_flight.add(req.request_id)
    try:
        async with aclosing(engine.generate(req.request_id, req.prompt_token_ids, req.gen, req.session_id,
                                            req.mm, req.adapter)) as outputs:
            async for out in outputs:
                if not started:
                    started = True
                    state.metrics.on_started(out.num_prompt_tokens)
                state.metrics.on_output(out)
                if span is not None:
                    span.on_output(out)
                if out.finished:
                    open_seqs.discard(out.index)
                    _log_finished(out)
                yield out
    except InvalidRequestError as e:
        open_seqs.clear()  # refused: nothing ran (counted as rejected by the error handler)
        span = None  # and traced as nothing
        raise ApiError.from_invalid(e, req.param_names) from None
    except RuntimeError as e:  # the engine is stopping, or a step failed
        open_seqs.clear()
        # 503 where the request can be retried: a replica died (the others serve), or the engine is stopping
        status = 503 if isinstance(e, EngineDeadError) or not engine.is_alive or state.draining else 500
        error = str(e)
        raise ApiError(status, error) from None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if span is not None:
            span.end(error)
        state.in_flight.discard(req.request_id)
        if open_seqs:  # the client left (or the stream was closed) before these finished
            state.metrics.on_abandoned(len(open_seqs))
            logger.info("%s: client disconnected; aborted %d unfinished sequence(s)", req.request_id, len(open_seqs))


def _log_finished(out: SequenceOutput) -> None:
    t = out.times
    ttft = f"{t.first_token - t.arrival:.3f} s" if t and t.first_token is not None else "-"
    total = f"{t.finished - t.arrival:.3f} s" if t else "-"
    logger.info("%s#%d finished (%s): %d prompt + %d output tokens, TTFT %s, %s in all", out.request_id, out.index,
                out.finish_reason, out.num_prompt_tokens, out.num_output_tokens, ttft, total)
