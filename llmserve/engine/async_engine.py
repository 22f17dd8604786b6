"""The engine behind the server: a background thread steps the engine; each request has its own
asyncio stream of outputs.

Threads: the engine (scheduler, KV bookkeeping, model) is touched only by the engine thread.
Callers on the event loop send commands (add, abort) through a thread-safe queue, and the engine
thread hands outputs back with `loop.call_soon_threadsafe`. Requests from all callers are batched
together by the one engine (continuous batching across HTTP requests).

Failure rules: a request the engine refuses raises in its caller only; an exception inside a step
aborts the requests of that step with the error (their blocks freed) and the loop goes on.

Structured output: a request's grammar is compiled on a worker thread before the request is queued
(a refused schema raises in its caller), so the engine thread finds it cached and a slow compile never
delays other requests' steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from llmserve.config import GenerationConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.output import SequenceOutput
from llmserve.engine.pooling import EmbedParams
from llmserve.errors import EngineDeadError
from llmserve.vl.inputs import MultiModalInputs

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    gen: GenerationConfig
    stream: _Stream
    session_id: str | None = None
    mm: MultiModalInputs | None = None  # a vision-language model's images
    adapter_name: str | None = None  # a loaded LoRA adapter (None: the base model)
    embed: EmbedParams | None = None  # an embedding request (gen is then unused)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread and resolve `future` (on `loop`) with its result."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    def resolve(self, engine: LLMEngine) -> None:
        try:
            result, error = self.fn(engine), None
        except Exception as e:
            result, error = None, e
        self.loop.call_soon_threadsafe(_settle, self.future, result, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up waiting
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: SequenceOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    prefix_hit_rate: float
    num_steps: int  # engine.step() calls so far
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = 0  # of those, found cached
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified, since start
    spec_accepted_tokens: int = 0  # of those, accepted
    spec_verify_steps: int = 0  # request-steps that verified drafts
    spec_emitted_tokens: int = 0  # tokens those steps emitted (accepted + 1 each)
    prefill_tokens: int = 0  # prompt tokens computed since start (cache, session and shared-prompt hits excluded)
    num_sessions: int = 0  # sessions keeping KV between turns
    session_blocks: int = 0  # KV blocks they hold (idle sessions; a running turn's are its own)
    session_hit_tokens: int = 0  # prompt tokens served from sessions, since start
    sessions_evicted: int = 0  # sessions evicted (count bound, TTL or memory), since start
    grammars_compiled: int = 0  # structured output: distinct grammars compiled, since start
    grammar_cache_hits: int = 0  # requests whose grammar was already compiled
    grammar_compile_seconds: float = 0.0  # total compile time
    # LoRA: sequences running / waiting per adapter name (the base model's are not counted), and max_loras (0: off)
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._num_steps = 0
        self._stats = self._read_stats()
        self.on_step: Callable[[list[SequenceOutput]], None] | None = None  # engine thread; for metrics
        self._stopping = False
        self._grammar_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-grammar")
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        return self._stats

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has stopped (shut down, or died)."""
        return self._thread.is_alive()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) run on the engine thread between steps (the only safe place to read the
        scheduler or the KV pool), e.g. `await ae.call(lambda e: e.kv.check_invariants())`."""
        if not self.is_alive:
            raise RuntimeError("the engine is not running")
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop, loop.create_future())
        self._commands.put(call)
        return await call.future

    async def generate(self, request_id: str, prompt_token_ids: list[int], gen: GenerationConfig,
                       session_id: str | None = None, mm: MultiModalInputs | None = None,
                       adapter_name: str | None = None) -> AsyncIterator[SequenceOutput]:
        """Outputs of every sequence of the request as they come; ends when all n have finished.
        Raises the engine's InvalidRequestError if the request is refused. Leaving the iteration
        early (client gone, task cancelled) aborts the request and frees its blocks (an aborted
        turn stores nothing in its session). `session_id`, `adapter_name`: see LLMEngine.add_request."""
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        await self.compile_grammar(gen)
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, prompt_token_ids, gen, stream, session_id, mm, adapter_name))
        unfinished = gen.n
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                unfinished -= item.finished
                yield item
        finally:
            if unfinished:
                self._commands.put(_Abort(request_id))

    async def embed(self, request_id: str, prompt_token_ids: list[int], params: EmbedParams | None = None,
                    adapter_name: str | None = None) -> SequenceOutput:
        """An embedding request (LLMEngine.add_embedding_request): its one output, with the vector. Raises the
        engine's InvalidRequestError if the request is refused; a caller that gives up waiting aborts it."""
        if self._stopping:
            raise RuntimeError("the engine is shutting down")
        stream = _Stream(asyncio.get_running_loop())
        self._commands.put(_Add(request_id, prompt_token_ids, GenerationConfig(), stream, adapter_name=adapter_name,
                                embed=params or EmbedParams()))
        done = False
        try:
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            done = item.finished
            return item
        finally:
            if not done:
                self._commands.put(_Abort(request_id))

    async def compile_grammar(self, gen: GenerationConfig) -> None:
        """Compile the request's grammar (if any, and not cached) off the engine thread; raises
        InvalidRequestError for a schema, regex or grammar that does not compile."""
        spec, grammars = gen.response_format, self.engine.grammars
        if spec is not None and not grammars.is_cached(spec):
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, grammars.compile, spec)

    def warm_up_grammars(self) -> None:
        """Read the vocabulary for structured output in the background (the first such request then waits less)."""
        self._grammar_pool.submit(self.engine.grammars.warm_up)

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left and stop the thread."""
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if not self._thread.is_alive():
            self.engine.close()

    # --- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            block = not self.engine.has_unfinished_requests()
            if not self._drain_commands(block):
                break
            if self.engine.has_unfinished_requests():
                if not self._step():
                    break
            else:  # step() expires idle sessions itself; an idle engine wakes twice a second for it
                self.engine.sessions.expire()
            self._stats = self._read_stats()
        for rid in list(self._streams):
            self._dispatch(self.engine.abort(rid))
        self._answer_leftover_commands()

    def _answer_leftover_commands(self) -> None:
        # Commands queued after the stop marker would otherwise leave their callers waiting forever.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Call):
                cmd.resolve(self.engine)
            elif isinstance(cmd, _Add):
                cmd.stream.put(RuntimeError("the engine is shutting down"))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; wait for one (at most 0.5 s) if `block`. False when asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            if cmd is None:
                return False
            self._apply(cmd)
            block = False

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Call):
            cmd.resolve(self.engine)
            return
        if isinstance(cmd, _Abort):
            self._dispatch(self.engine.abort(cmd.request_id))
            self._streams.pop(cmd.request_id, None)
            return
        try:
            if cmd.embed is not None:
                self.engine.add_embedding_request(cmd.request_id, cmd.prompt_token_ids, cmd.embed, cmd.adapter_name)
            else:
                self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.gen, cmd.session_id, cmd.mm,
                                        cmd.adapter_name)
        except Exception as e:  # refused: tell that caller only
            cmd.stream.put(e)
            return
        self._streams[cmd.request_id] = cmd.stream

    def _step(self) -> bool:
        """One engine step; False when the engine cannot go on (EngineDeadError): the thread then stops."""
        self._num_steps += 1
        try:
            outputs = self.engine.step()
        except Exception as e:
            fatal = isinstance(e, EngineDeadError)
            if fatal:
                logger.error("the engine cannot go on: %s", e)
                self._stopping = True
            else:
                logger.exception("engine step failed; aborting its requests")
            for rid, stream in list(self._streams.items()):
                if not fatal:
                    self.engine.abort(rid)
                stream.put(RuntimeError(f"the engine failed while running this request: {e}"))
            self._streams.clear()
            return not fatal
        if self.on_step is not None:
            self.on_step(outputs)
        self._dispatch(outputs)
        return True

    def _dispatch(self, outputs: list[SequenceOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        live = self.engine.live_request_ids()
        for rid in [r for r in self._streams if r not in live]:
            del self._streams[rid]

    def _read_stats(self) -> EngineStats:
        sched, kv, spec = self.engine.scheduler, self.engine.kv, self.engine.spec_stats
        sessions = self.engine.sessions.stats()
        grammars = self.engine.grammars.stats
        return EngineStats(len(sched.running), len(sched.waiting), kv.num_blocks,
                           kv.num_blocks - kv.num_free_blocks, kv.prefix_stats.hit_rate, self._num_steps,
                           kv.prefix_stats.queried_tokens, kv.prefix_stats.hit_tokens, spec.num_draft_tokens,
                           spec.num_accepted_tokens, spec.num_drafts, spec.num_emitted_tokens,
                           sched.num_prefill_tokens, sessions.num_sessions, sessions.num_blocks,
                           sessions.hit_tokens, sessions.num_evicted, grammars.compiled, grammars.cache_hits,
                           grammars.seconds, _per_adapter(sched.running), _per_adapter(sched.waiting),
                           self.engine.config.max_loras if self.engine.lora is not None else 0)


def _per_adapter(requests: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora is not None:
            counts[r.lora.name] = counts.get(r.lora.name, 0) + 1
    return counts
